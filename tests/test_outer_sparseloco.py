"""SparseLoCo (flat chunking) on 1, 2 and 4 workers against a plain single-process reference.

The workers run as threads of one process group (``testing.fake_group``); ``GLOO_JOBS`` also run on
2 real gloo processes (``multirank``). Per-tensor chunking (the default) has its own reference in
test_outer_sparseloco_tensor.py."""
from __future__ import annotations

import pytest
import torch

from megatron_sparseloco.compress import CodecConfig, decode, decode_dense, encode, payload_nbytes
from megatron_sparseloco.outer import ConfigError, build_outer_strategy
from megatron_sparseloco.outer.sparseloco import SparseLoCo, SparseLoCoConfig

from outer_testlib import SHAPES, assert_ranks_identical, drift, flat, job_runner, make_params

NUMEL = sum(torch.Size(s).numel() for s in SHAPES)  # 190
STEPS = 4
SMALL = dict(chunk=64, k=4, bucket_numel=150, chunking="flat")  # bucket rounds down to 128: buckets [0,128) and [128,190)

CONFIGS = {
    "base": dict(SMALL),
    "all": dict(SMALL, reduce="all"),
    "nesterov": dict(SMALL, lr=0.8, momentum=0.9, nesterov=True),
    "heavy": dict(SMALL, lr=0.8, momentum=0.5, ef_beta=0.5),
    "clip": dict(SMALL, peer_norm_clip=True),
    "bits4_groups": dict(SMALL, value_bits=4, quant_group_chunks=1, k=9),
    "entropy": dict(SMALL, index_coding="entropy"),
    "defaults": dict(chunking="flat"),
    "dense_raw": dict(chunk=64, k=64, value_bits=32, bucket_numel=128, chunking="flat", lr=1.0),
    "dense_q": dict(chunk=64, k=64, bucket_numel=128, chunking="flat"),
}


def _buckets(cfg: SparseLoCoConfig):
    b = cfg.effective_bucket_numel
    return [(s, min(NUMEL, s + b)) for s in range(0, NUMEL, b)]


# ---------------------------------------------------------------------------------- reference
def reference(world: int, steps: int, fields: dict, workers=None):
    """θ_outer after each step, and each step's payload sizes per worker, in plain dense torch."""
    workers = list(range(world)) if workers is None else workers
    W = len(workers)
    cfg = SparseLoCoConfig(**fields).validate()
    codec = cfg.codec()
    p = torch.nn.Parameter(flat(make_params(0)).clone())
    opt = torch.optim.SGD([p], lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.nesterov, foreach=False)
    errors = {r: torch.zeros(NUMEL) for r in workers}
    anchors, sizes = [], []
    for t in range(1, steps + 1):
        anchor = p.detach().clone()
        thetas = {r: anchor + flat(drift(r, t)) for r in workers}
        grad = torch.zeros(NUMEL)
        step_sizes = {r: [] for r in workers}
        for s, e in _buckets(cfg):
            dense, chosen = [], []
            for r in workers:
                delta = anchor[s:e] - thetas[r][s:e]
                errors[r][s:e] = cfg.ef_beta * errors[r][s:e] + delta
                payload = encode(errors[r][s:e].clone(), codec, "reference")
                step_sizes[r].append(payload.numel())
                sent = decode_dense(payload)
                errors[r][s:e] -= sent
                mask = torch.zeros(e - s, dtype=torch.bool)
                mask[decode(payload).indices] = True
                dense.append(sent)
                chosen.append(mask)
            if cfg.peer_norm_clip:
                norms = torch.stack([d.norm() for d in dense])
                med = norms.sort().values[(W - 1) // 2]  # lower median
                dense = [d * min(1.0, (med / n).item()) if n > 0 else d for d, n in zip(dense, norms)]
            total = torch.zeros(e - s)
            count = torch.zeros(e - s)
            for d, m in zip(dense, chosen):
                total = total + d
                count = count + m.float()
            grad[s:e] = total / count.clamp(min=1) if cfg.reduce == "contributors" else total / W
        p.grad = grad
        opt.step()
        anchors.append(p.detach().clone())
        sizes.append(step_sizes)
    return anchors, sizes


# ---------------------------------------------------------------------------------- runs
def _jobs(world: int) -> dict:
    jobs = {k: dict(name="sparseloco", config=c, steps=STEPS) for k, c in CONFIGS.items()}
    if world == 2:
        jobs.update({
            "self": dict(name="sparseloco", config=CONFIGS["nesterov"], steps=3, group_mode="self"),
            "saved": dict(name="sparseloco", config=CONFIGS["nesterov"], steps=4, save_at=2),
            "reloaded": dict(name="sparseloco", config=CONFIGS["nesterov"], steps=4, save_at=2, reload=True),
            "nan_skip": dict(name="sparseloco", config=CONFIGS["base"], steps=3, nan_at=(0, 2)),
            "nan_abort": dict(name="sparseloco", config=dict(SMALL, nonfinite_policy="abort"), steps=2,
                              nan_at=(0, 2)),
        })
    return jobs


#: jobs also run on real gloo processes (2 ranks, one spawn): a quantised and an entropy-coded
#: payload, momentum, and "self" (subgroups, which the threaded group does not make)
GLOO_JOBS = ("base", "entropy", "nesterov", "self")
THREADS = "threads"
WORLDS = [(2, THREADS), (4, THREADS), pytest.param(2, "gloo", marks=pytest.mark.multirank)]
run = job_runner(_jobs, GLOO_JOBS)  # run(world, job, backend="threads") -> [per-rank result]


# ---------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("world,backend", WORLDS)
@pytest.mark.parametrize("job", list(CONFIGS))
def test_matches_reference_and_bytes(world, backend, job):
    if backend == "gloo" and job not in GLOO_JOBS:
        pytest.skip("threads only")
    res = run(world, job, backend)
    assert_ranks_identical(res)
    anchors, sizes = reference(world, STEPS, CONFIGS[job])
    for t in range(STEPS):
        if CONFIGS[job].get("peer_norm_clip"):  # the peer norms are summed in another order: 1 ulp
            torch.testing.assert_close(res[0]["params"][t], anchors[t], rtol=0, atol=1e-6)
        else:  # same fp32 operations in the same order as the reference: bit for bit
            assert torch.equal(res[0]["params"][t], anchors[t]), \
                f"step {t + 1}: max diff {(res[0]['params'][t] - anchors[t]).abs().max().item():.3e}"
    cfg = SparseLoCoConfig(**CONFIGS[job])
    nb = len(_buckets(cfg))
    for t in range(STEPS):
        for r in range(world):
            st = res[r]["stats"][t]
            if cfg.index_coding == "packed":
                per_bucket = [payload_nbytes(e - s, cfg.codec()) for s, e in _buckets(cfg)]
                assert sizes[t][r] == per_bucket  # the reference's payloads agree with payload_nbytes
                assert st["bytes_sent"] == 4 + sum(per_bucket)
                assert st["bytes_received"] == 4 + (world - 1) * sum(per_bucket)
                assert st["collectives"] == 1 + nb
                assert st["payload_bytes"] == sum(per_bucket)
            else:  # sizes exchanged (int64 each), payloads padded to the largest of the bucket
                maxes = [max(sizes[t][w][b] for w in range(world)) for b in range(nb)]
                assert st["bytes_sent"] == 4 + sum(8 + m for m in maxes)
                assert st["bytes_received"] == 4 + (world - 1) * sum(8 + m for m in maxes)
                assert st["collectives"] == 1 + 2 * nb
                assert st["payload_bytes"] == sum(sizes[t][r])
            assert st["delta_norm"] > 0 and st["update_norm"] > 0
            if cfg.k < cfg.chunk:
                assert st["error_norm"] > 0 and 0 < st["density"] < 1
                assert st["density"] <= st["aggregate_density"] <= 1


@pytest.mark.parametrize("world", [2, 4])
def test_dense_raw_is_model_averaging(world):
    """k == chunk with fp32 values: nothing is dropped, EF stays 0, θ ← mean θ_r (lr 1)."""
    res = run(world, "dense_raw")
    anchor = flat(make_params(0))
    for t in range(STEPS):
        anchor = torch.stack([anchor + flat(drift(r, t + 1)) for r in range(world)]).mean(0)
        torch.testing.assert_close(res[0]["params"][t], anchor, rtol=0, atol=1e-6)
        for r in range(world):
            assert res[r]["stats"][t]["error_norm"] == 0.0
            assert res[r]["stats"][t]["density"] == 1.0 == res[r]["stats"][t]["aggregate_density"]


def test_contributors_differs_from_all():
    """The two reductions are really different (so the reference test can tell them apart)."""
    a, b = run(4, "base")[0]["params"][-1], run(4, "all")[0]["params"][-1]
    assert (a - b).abs().max() > 1e-4


@pytest.mark.parametrize("world", [2, 4])
def test_peer_norm_clip_really_clips(world):
    clip, base = run(world, "clip"), run(world, "base")
    assert all(st["peer_clip_scale_min"] < 0.9 for st in clip[0]["stats"])
    assert (clip[0]["params"][-1] - base[0]["params"][-1]).abs().max() > 1e-5


@pytest.mark.multirank
def test_group_of_one():
    res = run(2, "self", "gloo")
    for r in range(2):
        anchors, _ = reference(1, 3, CONFIGS["nesterov"], workers=[r])
        for t in range(3):
            torch.testing.assert_close(res[r]["params"][t], anchors[t], rtol=0, atol=1e-6)
            assert res[r]["stats"][t]["bytes_sent"] == res[r]["stats"][t]["bytes_received"] == 0
    assert not torch.equal(res[0]["params"][-1], res[1]["params"][-1])


def test_world_of_one_without_distributed():
    params = make_params(0)
    strat = SparseLoCo(params, None, SparseLoCoConfig(**CONFIGS["heavy"]))
    anchors, _ = reference(1, 3, CONFIGS["heavy"])
    for t in range(1, 4):
        with torch.no_grad():
            for p, d in zip(params, drift(0, t)):
                p.add_(d)
        st = strat.step()
        assert st.bytes_sent == st.bytes_received == 0
        torch.testing.assert_close(flat(params), anchors[t - 1], rtol=0, atol=1e-6)


def test_state_dict_round_trip():
    saved, reloaded = run(2, "saved"), run(2, "reloaded")
    for r in range(2):
        for t in range(4):
            assert torch.equal(saved[r]["params"][t], reloaded[r]["params"][t]), f"rank {r} step {t + 1}"
        state = saved[r]["state"]
        assert state["name"] == "sparseloco" and state["outer_steps"] == 2
        assert state["error_feedback"].abs().sum() > 0 and state["momentum"].abs().sum() > 0
    # error feedback differs between workers (it must not be deduplicated in checkpoints)
    assert not torch.equal(saved[0]["state"]["error_feedback"], saved[1]["state"]["error_feedback"])


def test_nonfinite_skip_and_abort():
    res = run(2, "nan_skip")
    assert_ranks_identical(res)
    for r in range(2):
        st = res[r]["stats"]
        assert [s["skipped"] for s in st] == [False, True, False]
        assert st[1]["bytes_sent"] == 4 and st[1]["collectives"] == 1
        assert torch.equal(res[r]["anchor"][1], res[r]["anchor"][0])
        assert torch.equal(res[r]["params"][1], res[r]["anchor"][0])
    ab = run(2, "nan_abort")
    assert "'p0'" in ab[0]["errors"][1] and "worker 0" in ab[1]["errors"][1]
    for r in range(2):
        assert ab[r]["errors"][0] is None
        assert torch.equal(ab[r]["anchor"][1], ab[r]["anchor"][0])


def test_bucket_rounding_and_memory_bound():
    cfg = SparseLoCoConfig(chunk=64, k=4, bucket_numel=150, chunking="flat").validate()
    assert cfg.effective_bucket_numel == 128
    assert SparseLoCoConfig(chunk=64, k=4, bucket_numel=10).effective_bucket_numel == 64
    s = SparseLoCo(make_params(0), None, cfg)
    assert list(s.buckets()) == [(0, 128), (128, 190)]


@pytest.mark.parametrize("field,value", [
    ("k", 65), ("k", 0), ("chunk", 0), ("value_bits", 3), ("index_coding", "zip"),
    ("ef_beta", 1.0), ("ef_beta", -0.5), ("reduce", "sum"), ("lr", 0.0), ("momentum", 1.0),
    ("nesterov", 1), ("peer_norm_clip", "no"), ("quant_group_chunks", -1), ("bucket_numel", 0),
])
def test_config_errors_name_the_field(field, value):
    fields = dict(chunk=64, k=4)
    fields[field] = value
    with pytest.raises(ConfigError, match=field):
        SparseLoCoConfig(**fields).validate()


def test_registry_builds_sparseloco():
    s = build_outer_strategy("sparseloco", make_params(0), None, chunk=64, k=8)
    assert isinstance(s, SparseLoCo) and s.codec == CodecConfig(chunk=64, k=8)
    with pytest.raises(ConfigError, match="chunk_mode"):
        build_outer_strategy("sparseloco", make_params(0), None, chunk_mode="tile")

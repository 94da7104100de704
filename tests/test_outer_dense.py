"""ModelAveraging and DiLoCo on 1, 2 and 4 workers against plain single-process references.

The workers run as threads of one process group (``testing.fake_group``); a smaller integration
set (``GLOO_JOBS``, 2 ranks) runs the same checks on real gloo processes (``multirank``).
"""
from __future__ import annotations

import pytest
import torch

from megatron_sparseloco.outer import (
    AveragingConfig,
    ConfigError,
    DiLoCo,
    DiLoCoConfig,
    ModelAveraging,
    available_outer_strategies,
    build_outer_strategy,
)

from outer_testlib import SHAPES, assert_ranks_identical, drift, flat, job_runner, make_params

NUMEL = sum(torch.Size(s).numel() for s in SHAPES)
BUCKET = 64  # 190 elements → buckets of 64, 64, 62; they span tensor boundaries
N_BUCKETS = 3
STEPS = 4


# ---------------------------------------------------------------------------------- references
def reference_dense(world: int, steps: int, lr: float, momentum: float, nesterov: bool,
                    comm: str = "fp32", workers=None) -> list:
    """θ_outer after each step: torch.optim.SGD fed with the mean pseudo-gradient as gradient.

    ``workers``: which ranks' drifts make up the mean (default all); the wire rounding of
    ``comm="bf16"`` is replayed (cast each Δ to bf16, sum in bf16 in rank order, back to fp32, ÷W).
    """
    workers = list(range(world)) if workers is None else workers
    p = torch.nn.Parameter(flat(make_params(0)).clone())
    opt = torch.optim.SGD([p], lr=lr, momentum=momentum, nesterov=nesterov, foreach=False)
    out = []
    for t in range(1, steps + 1):
        with torch.no_grad():
            anchor = p.detach().clone()
            deltas = [anchor - (anchor + flat(drift(r, t))) for r in workers]
            if comm == "bf16":
                acc = deltas[0].bfloat16()
                for d in deltas[1:]:
                    acc = acc + d.bfloat16()
                mean = acc.float() / len(workers)
            else:
                acc = deltas[0].clone()
                for d in deltas[1:]:
                    acc = acc + d
                mean = acc / len(workers)
        p.grad = mean
        opt.step()
        out.append(p.detach().clone())
    return out


def reference_average(world: int, steps: int) -> list:
    """θ after each step = plain mean of the workers' params."""
    anchor = flat(make_params(0)).clone()
    out = []
    for t in range(1, steps + 1):
        thetas = torch.stack([anchor + flat(drift(r, t)) for r in range(world)])
        anchor = thetas.mean(0)
        out.append(anchor.clone())
    return out


# ---------------------------------------------------------------------------------- jobs
def _jobs(world: int) -> dict:
    jobs = {
        "avg": dict(name="average", config=dict(bucket_numel=BUCKET), steps=STEPS),
        "avg_bf16": dict(name="average", config=dict(bucket_numel=BUCKET, comm_dtype="bf16"), steps=STEPS),
        "nesterov": dict(name="diloco", config=dict(bucket_numel=BUCKET), steps=STEPS),
        "heavy": dict(name="diloco", config=dict(bucket_numel=BUCKET, lr=0.5, momentum=0.8, nesterov=False),
                      steps=STEPS),
        "bf16": dict(name="diloco", config=dict(bucket_numel=BUCKET, comm_dtype="bf16"), steps=STEPS),
        "one_bucket": dict(name="diloco", config=dict(), steps=2),
    }
    if world == 2:
        jobs.update({
            "self": dict(name="diloco", config=dict(bucket_numel=BUCKET), steps=3, group_mode="self"),
            "saved": dict(name="diloco", config=dict(bucket_numel=BUCKET), steps=4, save_at=2),
            "reloaded": dict(name="diloco", config=dict(bucket_numel=BUCKET), steps=4, save_at=2, reload=True),
            "nan_skip": dict(name="diloco", config=dict(bucket_numel=BUCKET), steps=3, nan_at=(1, 2)),
            "nan_abort": dict(name="diloco", config=dict(bucket_numel=BUCKET, nonfinite_policy="abort"), steps=2,
                              nan_at=(1, 2)),
            "mismatch": dict(fn="mismatch", name="diloco", config=dict()),
        })
    return jobs


#: jobs also run on real gloo processes (2 ranks, one spawn); "self" needs subgroups, which the
#: threaded group does not make
GLOO_JOBS = ("avg_bf16", "bf16", "self", "nan_abort", "mismatch")
THREADS = "threads"
GLOO = pytest.param("gloo", marks=pytest.mark.multirank)
WORLDS = [(2, THREADS), (4, THREADS), pytest.param(2, "gloo", marks=pytest.mark.multirank)]
run = job_runner(_jobs, GLOO_JOBS)  # run(world, job, backend="threads") -> [per-rank result]


def _close(a, b, exact: bool, atol: float = 1e-6):
    if exact:
        assert torch.equal(a, b), f"max diff {(a - b).abs().max().item():.3e}"
    else:
        torch.testing.assert_close(a, b, rtol=0, atol=atol)


# ---------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("world,backend", WORLDS)
@pytest.mark.parametrize("job,comm", [("avg", "fp32"), ("avg_bf16", "bf16")])
def test_average_is_mean_of_workers(world, backend, job, comm):
    if backend == "gloo" and job not in GLOO_JOBS:
        pytest.skip("threads only")
    res = run(world, job, backend)
    assert_ranks_identical(res)
    if comm == "fp32":
        for t, ref in enumerate(reference_average(world, STEPS)):
            _close(res[0]["params"][t], ref, exact=False, atol=1e-6)
        # and, for W = 2 (sums of two are order-free), exactly the Δ form documented in averaging.py
    ref_delta = reference_dense(world, STEPS, lr=1.0, momentum=0.0, nesterov=False, comm=comm)
    for t, ref in enumerate(ref_delta):
        _close(res[0]["params"][t], ref, exact=(world == 2), atol=1e-6 if comm == "fp32" else 2e-3)
    item = 4 if comm == "fp32" else 2
    for s in (st for r in res for st in r["stats"]):
        assert s["bytes_sent"] == s["bytes_received"] == 4 + item * NUMEL
        assert s["collectives"] == 1 + N_BUCKETS
        assert not s["skipped"]


@pytest.mark.parametrize("world,backend", WORLDS)
@pytest.mark.parametrize("job,lr,mom,nest,comm", [
    ("nesterov", 0.7, 0.9, True, "fp32"),
    ("heavy", 0.5, 0.8, False, "fp32"),
    ("bf16", 0.7, 0.9, True, "bf16"),
    ("one_bucket", 0.7, 0.9, True, "fp32"),
])
def test_diloco_matches_torch_sgd(world, backend, job, lr, mom, nest, comm):
    if backend == "gloo" and job not in GLOO_JOBS:
        pytest.skip("threads only")
    res = run(world, job, backend)
    assert_ranks_identical(res)
    refs = reference_dense(world, len(res[0]["params"]), lr, mom, nest, comm)
    for t, ref in enumerate(refs):
        # W = 2: a + b is order-free, so the all-reduce equals the reference bit for bit
        _close(res[0]["params"][t], ref, exact=(world == 2), atol=1e-6 if comm == "fp32" else 2e-3)
    item = 4 if comm == "fp32" else 2
    buckets = N_BUCKETS if job != "one_bucket" else 1
    for s in (st for r in res for st in r["stats"]):
        assert s["bytes_sent"] == s["bytes_received"] == 4 + item * NUMEL
        assert s["collectives"] == 1 + buckets
        assert s["delta_norm"] > 0 and s["update_norm"] > 0 and s["time_communicate_s"] > 0
    # the local Δ norm is the rank's own: recompute it for step 1
    for r, rr in enumerate(res):
        anchor0 = flat(make_params(0))
        d = anchor0 - (anchor0 + flat(drift(r, 1)))
        assert rr["stats"][0]["delta_norm"] == pytest.approx(d.double().norm().item(), rel=1e-9)


@pytest.mark.multirank
def test_diloco_group_of_one_inside_a_world():
    """Each rank is a worker alone (group of one): no bytes, its own SGD trajectory."""
    res = run(2, "self", "gloo")
    for r in range(2):
        refs = reference_dense(1, 3, 0.7, 0.9, True, workers=[r])
        for t, ref in enumerate(refs):
            _close(res[r]["params"][t], ref, exact=True)
        for s in res[r]["stats"]:
            assert s["bytes_sent"] == s["bytes_received"] == s["collectives"] == 0
    assert not torch.equal(res[0]["params"][-1], res[1]["params"][-1])


def test_diloco_world_of_one_without_distributed():
    params = make_params(0)
    strat = DiLoCo(params, None, DiLoCoConfig(bucket_numel=50))
    refs = reference_dense(1, 3, 0.7, 0.9, True)
    for t in range(1, 4):
        with torch.no_grad():
            for p, d in zip(params, drift(0, t)):
                p.add_(d)
        st = strat.step()
        assert st.bytes_sent == st.bytes_received == 0
        _close(flat(params), refs[t - 1], exact=True)


def test_state_dict_round_trip():
    saved, reloaded = run(2, "saved"), run(2, "reloaded")
    for r in range(2):
        for t in range(4):
            assert torch.equal(saved[r]["params"][t], reloaded[r]["params"][t]), f"rank {r} step {t + 1}"
        state = saved[r]["state"]
        assert state["name"] == "diloco" and state["outer_steps"] == 2 and state["numel"] == NUMEL
        assert state["momentum"].abs().sum() > 0  # the momentum is really carried over
    refs = reference_dense(2, 4, 0.7, 0.9, True)
    _close(reloaded[0]["params"][3], refs[3], exact=True)


def test_state_dict_round_trip_in_process_and_errors():
    params = make_params(0)
    a = DiLoCo(params, None, DiLoCoConfig())
    for t in (1, 2):
        with torch.no_grad():
            for p, d in zip(params, drift(0, t)):
                p.add_(d)
        a.step()
    sd = a.state_dict()
    b = DiLoCo([p.clone() for p in params], None, DiLoCoConfig())
    b.load_state_dict(sd)
    assert torch.equal(b.anchor, a.anchor) and torch.equal(b.momentum, a.momentum)
    assert b.outer_steps == 2
    with pytest.raises(ValueError, match="diloco"):
        ModelAveraging(params, None).load_state_dict(sd)
    with pytest.raises(ValueError, match="momentum"):
        DiLoCo(params, None, DiLoCoConfig()).load_state_dict({k: v for k, v in sd.items() if k != "momentum"})
    with pytest.raises(ValueError, match="elements"):
        DiLoCo(params[:2], None, DiLoCoConfig()).load_state_dict(sd)


def test_nonfinite_skip_is_consistent():
    res = run(2, "nan_skip")
    assert_ranks_identical(res)
    for r in range(2):
        st = res[r]["stats"]
        assert [s["skipped"] for s in st] == [False, True, False]
        assert st[1]["bytes_sent"] == 4 and st[1]["collectives"] == 1  # only the flag travelled
        assert torch.equal(res[r]["anchor"][1], res[r]["anchor"][0])  # θ_outer untouched
        assert torch.equal(res[r]["params"][1], res[r]["anchor"][0])  # θ_local reset to θ_outer
        assert torch.isfinite(res[r]["params"][2]).all()


@pytest.mark.parametrize("backend", [THREADS, GLOO])
def test_nonfinite_abort_raises_everywhere(backend):
    res = run(2, "nan_abort", backend)
    assert res[0]["errors"][0] is None and res[1]["errors"][0] is None
    assert "worker 1" in res[0]["errors"][1]
    assert "'p0'" in res[1]["errors"][1]
    for r in range(2):
        assert torch.equal(res[r]["anchor"][1], res[r]["anchor"][0])


@pytest.mark.parametrize("backend", [THREADS, GLOO])
def test_mismatched_shards_fail_on_every_rank(backend):
    for msg in run(2, "mismatch", backend):
        assert "same shard" in msg


@pytest.mark.parametrize("cls,field,value", [
    (DiLoCoConfig, "lr", 0.0),
    (DiLoCoConfig, "lr", -1.0),
    (DiLoCoConfig, "lr", float("nan")),
    (DiLoCoConfig, "momentum", 1.0),
    (DiLoCoConfig, "momentum", -0.1),
    (DiLoCoConfig, "nesterov", "yes"),
    (DiLoCoConfig, "comm_dtype", "fp16"),
    (DiLoCoConfig, "bucket_numel", 0),
    (DiLoCoConfig, "nonfinite_policy", "ignore"),
    (AveragingConfig, "comm_dtype", "int8"),
])
def test_config_errors_name_the_field(cls, field, value):
    with pytest.raises(ConfigError, match=field):
        cls(**{field: value}).validate()


def test_registry():
    assert {"average", "diloco"} <= set(available_outer_strategies())
    with pytest.raises(ConfigError, match=r"unknown outer strategy 'dilco'.*average.*diloco"):
        build_outer_strategy("dilco", make_params(0), None)
    with pytest.raises(ConfigError, match=r"no config field.*'mu'.*momentum"):
        build_outer_strategy("diloco", make_params(0), None, mu=0.9)
    with pytest.raises(ConfigError, match="lr"):
        build_outer_strategy("diloco", make_params(0), None, lr=-1)
    s = build_outer_strategy("diloco", make_params(0), None, lr=0.5, nesterov=False)
    assert isinstance(s, DiLoCo) and s.config.lr == 0.5 and not s.config.nesterov
    with pytest.raises(ConfigError, match="fp32"):
        DiLoCo([torch.zeros(3, dtype=torch.bfloat16)], None)

"""SparseLoCo with per-tensor chunking (the default) against a plain per-tensor reference.

The reference encodes every parameter slice alone with the codec's public ``encode`` (its own
quantiser; ``tile`` mode for a slice of whole rows of a 2-D weight, ``flat`` chunks for a slice that
starts or ends mid-row, dense for 1-D tensors), keeps one error-feedback buffer per slice, and
averages over the workers that sent each coordinate. The strategy under test packs those slices
into buckets and sends one payload per bucket; the anchors must agree bit for bit.

Shard layouts: "whole" (each tensor a whole parameter) and the three positions of a Megatron-like
even split of the model's flat buffer over 3 ranks ("pos0of3", ...), which cuts 2-D weights
mid-row and spreads one weight over all three positions.
"""
from __future__ import annotations

import math

import pytest
import torch

from megatron_sparseloco.compress import CodecConfig, decode, decode_dense, encode
from megatron_sparseloco.compress.segments import TensorSlice, bucket_payload_nbytes, plan_buckets
from megatron_sparseloco.outer import build_outer_strategy
from megatron_sparseloco.outer.sparseloco import SparseLoCo, SparseLoCoConfig

MODEL = {"emb": (40, 24), "ln": (24,), "w_qkv": (24, 72), "b_qkv": (72,), "w_fc": (24, 33), "tiny": (3, 5)}
STEPS = 3
BASE = dict(chunk=64, k=4)  # 8x8 tiles, k=4 per tile
CONFIGS = {
    "tensor": dict(BASE, bucket_numel=1 << 20),
    "buckets": dict(BASE, bucket_numel=2000),                 # several buckets of whole slices (no split)
    "sparse_1d": dict(BASE, bucket_numel=1 << 20, dense_1d=False),
    "nesterov": dict(BASE, bucket_numel=1 << 20, lr=0.8, momentum=0.9, nesterov=True),
    "entropy": dict(BASE, bucket_numel=1 << 20, index_coding="entropy"),
}
LAYOUTS = ("whole", "pos0of3", "pos1of3", "pos2of3")


def full_params(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(*s, generator=g) for n, s in MODEL.items()}


def full_drift(rank: int, step: int):
    g = torch.Generator().manual_seed(7919 * rank + 104729 * step + 1)
    # per-tensor scales over three orders of magnitude, per-rank bias so workers choose differently
    return {n: (10.0 ** -(i % 3)) * 1e-2 * (torch.randn(*s, generator=g) * (1 + rank) + 0.1 * rank)
            for i, (n, s) in enumerate(MODEL.items())}


def layout_slices(layout: str):
    """[(name, TensorSlice)] this shard position holds, in order."""
    if layout == "whole":
        return [(n, TensorSlice(s, 0, math.prod(s))) for n, s in MODEL.items()]
    pos = int(layout[3])
    sizes = [math.prod(s) for s in MODEL.values()]
    total = sum(sizes)
    lo, hi = pos * total // 3, (pos + 1) * total // 3
    out, off = [], 0
    for (n, s), size in zip(MODEL.items(), sizes):
        a, b = max(lo, off), min(hi, off + size)
        if a < b:
            out.append((n, TensorSlice(s, a - off, b - off)))
        off += size
    return out


def take(full: dict, sl_list):
    return [full[n].reshape(-1)[sl.start:sl.end].clone() for n, sl in sl_list]


# ---------------------------------------------------------------------------------- reference
def reference_codec(sl: TensorSlice, fields: dict):
    """(codec config, shape) the reference encodes a slice with: chosen here without the planner."""
    chunk, k, bits = fields["chunk"], fields["k"], fields.get("value_bits", 2)
    coding = fields.get("index_coding", "packed")
    if len(sl.shape) <= 1:
        if fields.get("dense_1d", True):
            return CodecConfig(chunk=chunk, k=chunk, value_bits=bits, index_coding=coding), (sl.numel,)
        return CodecConfig(chunk=chunk, k=k, value_bits=bits, index_coding=coding), (sl.numel,)
    cols = sl.shape[-1]
    if sl.start % cols == 0 and sl.end % cols == 0:
        tile = math.isqrt(chunk)
        return (CodecConfig(chunk=chunk, k=k, value_bits=bits, index_coding=coding, chunk_mode="tile", tile=tile),
                (sl.numel // cols, cols))
    return CodecConfig(chunk=chunk, k=k, value_bits=bits, index_coding=coding), (sl.numel,)


def reference(layout: str, workers, fields: dict, steps: int = STEPS):
    """Per step: θ_outer (flat over the layout's slices) and each worker's payload bytes per slice."""
    cfg = SparseLoCoConfig(**fields)
    sls = layout_slices(layout)
    anchor = [t.clone() for t in take(full_params(), sls)]
    errors = {r: [torch.zeros_like(t) for t in anchor] for r in workers}
    mom = [torch.zeros_like(t) for t in anchor]
    out = []
    for step in range(1, steps + 1):
        sums = [torch.zeros_like(t) for t in anchor]
        counts = [torch.zeros_like(t) for t in anchor]
        for r in workers:
            drift = take(full_drift(r, step), sls)
            for i, ((_, sl), a) in enumerate(zip(sls, anchor)):
                delta = a - (a + drift[i])
                errors[r][i] = cfg.ef_beta * errors[r][i] + delta
                codec, shape = reference_codec(sl, fields)
                payload = encode(errors[r][i].view(shape), codec, "ref")
                sent = decode_dense(payload)
                errors[r][i] = errors[r][i] - sent
                sums[i] = sums[i] + sent
                chosen = torch.zeros_like(sent)
                chosen[decode(payload).indices] = 1.0
                counts[i] = counts[i] + chosen
        for i in range(len(anchor)):
            g = sums[i] / counts[i].clamp(min=1)
            if cfg.momentum:  # torch.optim.SGD's operations (outer/sgd.py)
                mom[i] = mom[i].mul(cfg.momentum).add(g)
                g = g.add(mom[i], alpha=cfg.momentum) if cfg.nesterov else mom[i]
            anchor[i] = anchor[i].add(g, alpha=-cfg.lr)
        out.append(torch.cat(anchor))
    return out


# ---------------------------------------------------------------------------------- runs
def layout_strategy(layout: str, fields: dict):
    """(slices, params, strategy): a SparseLoCo strategy over this rank's ``layout`` slices of ``full_params()``."""
    sls = layout_slices(layout)
    params = take(full_params(), sls)
    strat = build_outer_strategy("sparseloco", params, None, names=[n for n, _ in sls],
                                 slices=[sl for _, sl in sls], **fields)
    return sls, params, strat


def add_drift(params, sls, rank: int, step: int) -> None:
    """Inner training stand-in: worker ``rank``'s drift of ``step`` added to its params."""
    with torch.no_grad():
        for p, d in zip(params, take(full_drift(rank, step), sls)):
            p.add_(d)


def drive_layout(rank: int, world: int, layout: str, fields: dict, steps: int = STEPS):
    from megatron_sparseloco.testing.collective_spy import CollectiveSpy

    sls, params, strat = layout_strategy(layout, fields)
    out = {"params": [], "stats": [], "spy": [], "buckets": len(strat.plans)}
    for step in range(1, steps + 1):
        add_drift(params, sls, rank, step)
        if world > 1:
            with CollectiveSpy() as spy:
                st = strat.step()
            out["spy"].append([name for name, _ in spy.calls])
        else:
            st = strat.step()
        out["stats"].append(st.as_dict())
        out["params"].append(torch.cat([p.reshape(-1) for p in params]).clone())
    return out


def drive_all(rank, world, jobs):
    return [drive_layout(rank, world, **job) for job in jobs]


JOB_IDS = [f"{c}-{lay}" for c in CONFIGS for lay in (LAYOUTS if c == "tensor" else ("whole", "pos1of3"))]
JOBS = {i: dict(layout=i.split("-", 1)[1], fields=CONFIGS[i.split("-", 1)[0]]) for i in JOB_IDS}
#: 4 ranks run the layouts of the base config and one of each other feature (spawning is the slow part)
WORLD_JOBS = {1: JOB_IDS, 2: JOB_IDS, 4: [i for i in JOB_IDS if i.startswith("tensor-") or i.endswith("pos1of3")]}


@pytest.fixture(scope="module")
def runs():
    from megatron_sparseloco.testing.multirank import run_ranks

    out = {1: {i: [drive_layout(0, 1, **JOBS[i])] for i in WORLD_JOBS[1]}}
    for world in (2, 4):
        ids = WORLD_JOBS[world]
        per_rank = run_ranks(drive_all, world, args=([JOBS[i] for i in ids],), timeout=300)
        out[world] = {i: [per_rank[r][n] for r in range(world)] for n, i in enumerate(ids)}
    return out


@pytest.mark.multirank
@pytest.mark.parametrize("world,job", [(w, i) for w in (1, 2, 4) for i in WORLD_JOBS[w]])
def test_tensor_chunking_matches_per_tensor_reference(runs, world, job):
    res = runs[world][job]
    ref = reference(JOBS[job]["layout"], list(range(world)), JOBS[job]["fields"])
    for t in range(STEPS):
        for r in range(world):
            assert torch.equal(res[r]["params"][t], res[0]["params"][t]), f"rank {r} differs at step {t + 1}"
        assert torch.equal(res[0]["params"][t], ref[t]), \
            f"step {t + 1}: max diff {(res[0]['params'][t] - ref[t]).abs().max().item():.3e}"


@pytest.mark.multirank
@pytest.mark.parametrize("world", [2, 4])
def test_one_collective_per_bucket_and_exact_bytes(runs, world):
    for j in WORLD_JOBS[world]:
        job = JOBS[j]
        fields = job["fields"]
        sls = layout_slices(job["layout"])
        plans = plan_buckets([sl for _, sl in sls], SparseLoCoConfig(**fields).codec(), fields["bucket_numel"],
                             fields.get("dense_1d", True), [n for n, _ in sls])
        for r in range(world):
            res = runs[world][j][r]
            assert res["buckets"] == len(plans)
            packed = fields.get("index_coding", "packed") == "packed"
            for t in range(STEPS):
                calls = res["spy"][t]
                # one flag all-reduce, then per bucket one all-gather (+ one size exchange for entropy)
                assert calls.count("all_reduce") == 1
                gathers = [c for c in calls if c.startswith("all_gather")]
                assert len(gathers) == len(plans) * (1 if packed else 2), (job, calls)
                st = res["stats"][t]
                if packed:
                    expect = sum(bucket_payload_nbytes(p) for p in plans)
                    assert st["payload_bytes"] == expect
                    assert st["bytes_sent"] == 4 + expect
                    assert st["bytes_received"] == 4 + (world - 1) * expect


def test_layouts_cover_mid_row_cuts_and_a_tensor_on_three_ranks():
    """The fixture really exercises what it claims (so the reference test can fail)."""
    held = {lay: {n: sl for n, sl in layout_slices(lay)} for lay in LAYOUTS[1:]}
    assert all("w_qkv" in h for h in held.values())  # one weight spread over all three positions
    geoms = set()
    for lay in LAYOUTS:
        sls = layout_slices(lay)
        for plan in plan_buckets([sl for _, sl in sls], CodecConfig(**BASE), 1 << 20, True, [n for n, _ in sls]):
            geoms.update((s.name, s.geometry) for s in plan.segments)
    assert ("w_qkv", "flat") in geoms and ("w_qkv", "tile2d") in geoms and ("ln", "dense") in geoms


def _smaller_tensor_cosine(chunking: str) -> float:
    """One outer step, W = 1: cosine between what the small tensor sends and its EF values there."""
    g = torch.Generator().manual_seed(3)
    shapes = [(64, 64), (64, 64), (64, 64)]
    params = [torch.zeros(s) for s in shapes]
    fields = dict(chunk=4096, k=64, chunking=chunking, bucket_numel=1 << 20)
    strat = SparseLoCo(params, None, SparseLoCoConfig(**fields))
    drifts = [torch.randn(s, generator=g) * scale for s, scale in zip(shapes, (1.0, 1e-3, 1.0))]
    with torch.no_grad():
        for p, d in zip(params, drifts):
            p.add_(d)
    strat.step()
    small = slice(4096, 8192)
    true_delta = -drifts[1].reshape(-1)          # Δ = θ_outer − θ_local, e = Δ at the first step
    sent = true_delta - strat.error_feedback[small]       # what was removed from the error = what was sent
    idx = sent != 0
    return torch.nn.functional.cosine_similarity(sent[idx], true_delta[idx], dim=0).item()


def test_small_tensor_beside_large_ones_is_reconstructed():
    assert _smaller_tensor_cosine("tensor") >= 0.95
    assert _smaller_tensor_cosine("flat") < 0.95  # the shared quantiser of flat chunking crushes it


def test_plan_splits_large_slices_at_tile_rows():
    cfg = CodecConfig(chunk=64, k=4)
    plans = plan_buckets([TensorSlice((100, 10), 0, 1000), TensorSlice((7,), 0, 7)], cfg, 300, True, ["w", "b"])
    segs = [(p.start + s.offset, s.numel, s.geometry) for p in plans for s in p.segments]
    # 8 rows of 10 = one tile row; 300 // 80 = 3 tile rows per piece
    assert segs == [(0, 240, "tile2d"), (240, 240, "tile2d"), (480, 240, "tile2d"), (720, 240, "tile2d"),
                    (960, 40, "tile2d"), (1000, 7, "dense")]
    assert [(p.start, p.end) for p in plans] == [(0, 240), (240, 480), (480, 720), (720, 1007)]  # greedy packing


def test_chunk_not_a_square_uses_flat_chunks_inside_tensors():
    plans = plan_buckets([TensorSlice((32, 32), 0, 1024)], CodecConfig(chunk=128, k=4), 1 << 20, True, ["w"])
    assert [s.geometry for s in plans[0].segments] == ["flat"]


def _one_plan():
    sls = layout_slices("whole")  # tile2d, dense and flat segments
    (plan,) = plan_buckets([sl for _, sl in sls], CodecConfig(**BASE), 1 << 20, True, [n for n, _ in sls])
    return plan


@pytest.mark.parametrize("corrupt, match", [
    (lambda p: torch.cat([torch.tensor(list(b"XXXX"), dtype=torch.uint8), p[4:]]), "magic"),
    (lambda p: p[:-1], "truncated"),
    (lambda p: torch.cat([p, p[:2]]), "trailing"),
    (lambda p: p[:20], "fewer than"),
])
def test_bucket_payload_defects_are_refused(corrupt, match):
    from megatron_sparseloco.compress import PayloadError
    from megatron_sparseloco.compress.segments import decode_bucket, encode_bucket
    plan = _one_plan()
    payload = encode_bucket(torch.randn(plan.numel, generator=torch.Generator().manual_seed(1)), plan)
    with pytest.raises(PayloadError, match=match):
        decode_bucket(corrupt(payload), plan)


def test_bucket_payload_from_another_layout_names_the_segment():
    from megatron_sparseloco.compress import PayloadError
    from megatron_sparseloco.compress.segments import decode_bucket, encode_bucket
    plan = _one_plan()
    payload = encode_bucket(torch.randn(plan.numel, generator=torch.Generator().manual_seed(1)), plan)
    i, seg = next((i, s) for i, s in enumerate(plan.segments) if s.geometry != "flat")
    segs = list(plan.segments)
    segs[i] = type(seg)(seg.offset, seg.numel, "flat", 0, seg.name)  # what a mis-planned worker expects
    other = type(plan)(plan.start, plan.end, tuple(segs), plan.codec)
    with pytest.raises(PayloadError, match=f"segment {i} \\({seg.name}\\)"):
        decode_bucket(payload, other)


def test_strategy_names_the_worker_of_a_malformed_payload():
    from megatron_sparseloco.compress import PayloadError
    sls = layout_slices("whole")
    params = take(full_params(), sls)
    strat = build_outer_strategy("sparseloco", params, None, names=[n for n, _ in sls],
                                 slices=[sl for _, sl in sls], **CONFIGS["tensor"])
    plan = strat.plans[0]
    good = torch.zeros(1, dtype=torch.uint8)
    with pytest.raises(PayloadError, match="worker 3"):
        strat._decode(good, plan, 3, plan.start, plan.end)

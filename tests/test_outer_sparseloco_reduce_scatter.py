"""SparseLoCo with ``aggregation="reduce-scatter"`` (outer/sparse_reduce_scatter.py).

* pieces: a worker's piece for owner j decodes to exactly its payload's values inside R_j;
* lossless owner codec (k = chunk, fp32 values): θ_outer equals all-gather's bit for bit on 2, 3
  and 4 ranks (3: uneven owner ranges), every rank identical;
* lossy owner codec (the default): the owner EF conserves mass, f_new = (f_old + A) − u exactly,
  with A the all-gather aggregate replayed here;
* bytes: counted sent / received equal the sizes of the pieces and aggregates of the plan;
* a malformed piece from one worker is rejected naming that worker.
"""
from __future__ import annotations

import pytest
import torch

from megatron_sparseloco.compress.errors import PayloadError
from megatron_sparseloco.compress.segments import decode_bucket, encode_bucket, plan_buckets, segment_layout
from megatron_sparseloco.outer.sparse_reduce_scatter import SparseReduceScatter, owner_ranges
from megatron_sparseloco.outer.sparseloco import SparseLoCoConfig
from test_outer_sparseloco_tensor import add_drift, full_drift, full_params, layout_slices, layout_strategy, take

LAYOUT = "pos1of3"  # mid-row cuts, tile2d, flat and dense segments
BASE = dict(chunk=64, k=4, bucket_numel=2000)
LOSSLESS = dict(BASE, aggregation="reduce-scatter", owner_k=64, owner_value_bits=32)
LOSSY = dict(BASE, aggregation="reduce-scatter")
STEPS = 3
WORLDS = (2, 3, 4)


def plans_of(fields):
    sls = layout_slices(LAYOUT)
    cfg = SparseLoCoConfig(**fields)
    return plan_buckets([s for _, s in sls], cfg.codec(), cfg.bucket_numel, cfg.dense_1d, [n for n, _ in sls])


# ---------------------------------------------------------------------------------- no ranks
@pytest.mark.parametrize("world", [1, 2, 3, 4, 7])
def test_owner_ranges_tile_the_bucket(world):
    cfg = SparseLoCoConfig(**LOSSY)
    for plan in plans_of(LOSSY):
        ranges = owner_ranges(plan, world, cfg.owner_codec())
        spans = [(r.start, r.end) for r in ranges if r.plan is not None]
        assert spans[0][0] == 0 and spans[-1][1] == plan.numel
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
        assert sum(s.kept for r in ranges for s in r.subs) == sum(
            segment_layout(s, plan.codec).total_kept for s in plan.segments)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_pieces_decode_to_the_payload_values_in_each_range(world):
    cfg = SparseLoCoConfig(**LOSSY)
    sls = layout_slices(LAYOUT)
    x = torch.cat(take(full_drift(1, 1), sls))
    plans = plans_of(LOSSY)
    rs = SparseReduceScatter(plans, cfg.owner_codec(), world, 0, x.numel(), torch.device("cpu"))
    for b, plan in enumerate(plans):
        payload = encode_bucket(x[plan.start:plan.end].clone(), plan)
        whole = decode_bucket(payload, plan)
        dense = torch.zeros(plan.numel)
        dense[whole.indices] = whole.values
        chosen = torch.zeros(plan.numel, dtype=torch.bool)
        chosen[whole.indices] = True
        for j, rng in enumerate(rs.ranges[b]):
            piece = rs.make_piece(b, plan, payload, j)
            assert piece.numel() == rng.piece_nbytes
            if rng.plan is None:
                continue
            idx, val = rs.decode_piece(b, plan, piece, j)
            assert torch.equal(idx, torch.nonzero(chosen[rng.start:rng.end]).flatten())
            assert torch.equal(val, dense[rng.start:rng.end][idx])


def test_malformed_pieces_raise():
    cfg = SparseLoCoConfig(**LOSSY)
    sls = layout_slices(LAYOUT)
    x = torch.cat(take(full_drift(1, 1), sls))
    plans = plans_of(LOSSY)
    rs = SparseReduceScatter(plans, cfg.owner_codec(), 3, 0, x.numel(), torch.device("cpu"))
    plan = plans[0]
    piece = rs.make_piece(0, plan, encode_bucket(x[plan.start:plan.end].clone(), plan), 1)
    with pytest.raises(PayloadError, match="bytes"):
        rs.decode_piece(0, plan, piece[:-1], 1)
    bad = piece.clone()
    bad[0] ^= 1
    with pytest.raises(PayloadError, match="header"):
        rs.decode_piece(0, plan, bad, 1)
    with pytest.raises(PayloadError, match="header"):
        rs.decode_piece(0, plan, piece, 2)  # a piece for owner 1 handed to owner 2 (other size or owner)


def test_config_rejects_what_reduce_scatter_cannot_do():
    from megatron_sparseloco.outer.base import ConfigError

    for bad in (dict(chunking="flat"), dict(index_coding="entropy"), dict(peer_norm_clip=True)):
        with pytest.raises(ConfigError, match="reduce-scatter"):
            SparseLoCoConfig(**LOSSY, **bad).validate()
    with pytest.raises(ConfigError, match="owner_k"):
        SparseLoCoConfig(owner_k=8).validate()
    with pytest.raises(ConfigError, match="owner_residual"):
        SparseLoCoConfig(owner_residual="workers").validate()
    with pytest.raises(ConfigError, match="owner_residual"):
        SparseLoCoConfig(**LOSSY, owner_residual="nobody").validate()
    with pytest.raises(ConfigError, match="aggregation"):
        SparseLoCoConfig(aggregation="tree").validate()


# ---------------------------------------------------------------------------------- ranks
def drive(rank: int, world: int, fields: dict, corrupt_rank=None):
    sls, params, strat = layout_strategy(LAYOUT, fields)
    rs = strat.reduce_scatter
    updates, positions = {}, {}
    if rs is not None:
        orig = rs.aggregate

        def capture(b, plan, payload, comm, out, counts, *rest):
            res = orig(b, plan, payload, comm, out, counts, *rest)
            updates[b] = out.clone()
            positions[b] = res[2] + plan.start
            return res
        rs.aggregate = capture
        if corrupt_rank == rank:
            make = rs.make_piece

            def corrupt(*a):
                p = make(*a).clone()
                if p.numel():
                    p[-1] ^= 0xFF  # last index byte (or code byte)
                    p[0] ^= 1      # and the magic
                return p
            rs.make_piece = corrupt
    out = {"anchor": [], "stats": [], "owner_error": [], "update": [], "error": [], "applied": []}
    for step in range(1, STEPS + 1):
        add_drift(params, sls, rank, step)
        try:
            st = strat.step()
        except PayloadError as exc:
            return {"error": str(exc)}
        out["stats"].append(st.as_dict())
        out["anchor"].append(strat.anchor.clone())
        out["error"].append(strat.error_feedback.clone())
        if rs is not None:
            out["applied"].append(torch.cat([positions[b] for b in range(len(strat.plans))]))
            out["owner_error"].append(rs.error.clone())
            out["update"].append(torch.cat([updates[b] for b in range(len(strat.plans))]))
    return out


def drive_jobs(rank, world, jobs):
    return [drive(rank, world, **j) for j in jobs]


PUT_BACK = dict(LOSSY, owner_residual="workers")
JOBS = {"allgather": dict(fields=BASE), "lossless": dict(fields=LOSSLESS), "lossy": dict(fields=LOSSY),
        "corrupt": dict(fields=LOSSY, corrupt_rank=1), "put_back": dict(fields=PUT_BACK),
        "lossless_put_back": dict(fields=dict(LOSSLESS, owner_residual="workers"))}


@pytest.fixture(scope="module")
def runs():
    from megatron_sparseloco.testing.multirank import run_ranks

    out = {}
    for world in WORLDS:
        per_rank = run_ranks(drive_jobs, world, args=(list(JOBS.values()),), timeout=400)
        out[world] = {k: [per_rank[r][i] for r in range(world)] for i, k in enumerate(JOBS)}
    return out


@pytest.mark.multirank
@pytest.mark.parametrize("world", WORLDS)
def test_lossless_owner_codec_equals_allgather_bit_for_bit(runs, world):
    for t in range(STEPS):
        for r in range(world):
            assert torch.equal(runs[world]["lossless"][r]["anchor"][t], runs[world]["allgather"][0]["anchor"][t]), \
                (world, t, r)
            assert torch.equal(runs[world]["lossy"][r]["anchor"][t], runs[world]["lossy"][0]["anchor"][t])
        assert not runs[world]["lossless"][0]["owner_error"][t].any()


def step1_replay(world: int):
    """Step 1 replayed here (every worker's e = Δ): the all-gather aggregate A (contributors mean,
    summed in worker order), and every worker's Δ_w and decoded payload v_w (dense)."""
    sls = layout_slices(LAYOUT)
    plans = plans_of(BASE)
    parts, deltas, sent = [], [[] for _ in range(world)], [[] for _ in range(world)]
    for plan in plans:
        s = torch.zeros(plan.numel)
        c = torch.zeros(plan.numel)
        for w in range(world):
            a0 = torch.cat(take(full_params(), sls))[plan.start:plan.end]
            delta = a0 - (a0 + torch.cat(take(full_drift(w, 1), sls))[plan.start:plan.end])  # θ_outer − θ_local
            dec = decode_bucket(encode_bucket(delta.clone(), plan), plan)
            dense = torch.zeros(plan.numel)
            dense[dec.indices] = dec.values
            s = s + dense
            c[dec.indices] += 1
            deltas[w].append(delta)
            sent[w].append(dense)
        parts.append(s / c.clamp(min=1))
    return torch.cat(parts), [torch.cat(d) for d in deltas], [torch.cat(v) for v in sent]


def allgather_aggregate_step1(world: int) -> torch.Tensor:
    return step1_replay(world)[0]


@pytest.mark.multirank
@pytest.mark.parametrize("world", WORLDS)
def test_lossy_owner_error_feedback_conserves_mass(runs, world):
    A = allgather_aggregate_step1(world)
    plans = plans_of(LOSSY)
    cfg = SparseLoCoConfig(**LOSSY)
    for r, res in enumerate(runs[world]["lossy"]):
        f, u = res["owner_error"][0], res["update"][0]
        owned = torch.zeros_like(f, dtype=torch.bool)
        for plan in plans:
            rng = owner_ranges(plan, world, cfg.owner_codec())[r]
            owned[plan.start + rng.start:plan.start + rng.end] = True
        assert torch.equal(f[owned], (A - u)[owned]), r
        assert not f[~owned].any()
        assert (u != 0).sum() < (A != 0).sum()  # the owner stage really compressed


@pytest.mark.multirank
@pytest.mark.parametrize("world", WORLDS)
def test_bytes_are_those_of_the_pieces_and_aggregates(runs, world):
    cfg = SparseLoCoConfig(**LOSSY)
    plans = plans_of(LOSSY)
    ranges = [owner_ranges(p, world, cfg.owner_codec()) for p in plans]
    for r, res in enumerate(runs[world]["lossy"]):
        sent = 4 + sum(sum(x.piece_nbytes for x in rg if x.owner != r) + max(x.aggregate_nbytes for x in rg)
                       for rg in ranges)
        recv = 4 + sum((world - 1) * rg[r].piece_nbytes + (world - 1) * max(x.aggregate_nbytes for x in rg)
                       for rg in ranges)
        for st in res["stats"]:
            assert (st["bytes_sent"], st["bytes_received"]) == (sent, recv)
        ag = runs[world]["allgather"][r]["stats"][0]
        assert ag["bytes_received"] - 4 == (world - 1) * (ag["bytes_sent"] - 4)
        # the clocks: the owners' compute is a part of the communicate phase; the agreement is timed apart
        for st in res["stats"]:
            assert 0.0 < st["time_owner_s"] < st["time_communicate_s"]
            assert st["time_agree_s"] > 0.0
        assert "time_owner_s" not in ag and ag["time_agree_s"] > 0.0


@pytest.mark.multirank
@pytest.mark.parametrize("world", WORLDS)
def test_malformed_piece_is_rejected_naming_the_worker(runs, world):
    for r, res in enumerate(runs[world]["corrupt"]):
        assert "error" in res and "piece of worker 1" in res["error"], (r, res.get("error"))


@pytest.mark.multirank
@pytest.mark.parametrize("world", WORLDS)
def test_put_back_returns_what_the_owners_did_not_send_to_the_workers(runs, world):
    """``owner_residual="workers"``, step 1: the owner keeps only g − u where it sent (g = A: f was 0),
    and worker w's e is Δ_w − v_w where the owners sent and Δ_w elsewhere: nothing is lost,
    u + Δf + (put back) = A position by position; θ_outer identical on every worker."""
    A, deltas, sent = step1_replay(world)
    plans = plans_of(LOSSY)
    cfg = SparseLoCoConfig(**PUT_BACK)
    res = runs[world]["put_back"]
    applied = torch.zeros_like(A, dtype=torch.bool)
    applied[res[0]["applied"][0]] = True
    for r in range(world):
        f, u = res[r]["owner_error"][0], res[r]["update"][0]
        assert torch.equal(res[r]["applied"][0], res[0]["applied"][0])
        owned = torch.zeros_like(f, dtype=torch.bool)
        for plan in plans:
            rng = owner_ranges(plan, world, cfg.owner_codec())[r]
            owned[plan.start + rng.start:plan.start + rng.end] = True
        assert torch.equal(f[owned & applied], (A - u)[owned & applied]), r
        assert not f[~(owned & applied)].any()
        assert not u[~applied].any()
        want_e = torch.where(applied, deltas[r] - sent[r], deltas[r])
        torch.testing.assert_close(res[r]["error"][0], want_e, rtol=1e-6, atol=1e-7)
        chose = sent[r] != 0
        assert (chose & ~applied).any(), "nothing was put back: the test does not exercise the mode"
        for t in range(STEPS):
            assert torch.equal(res[r]["anchor"][t], res[0]["anchor"][t]), (r, t)
    # the lossless owner codec sends the whole union: nothing to put back, all-gather bit for bit
    for r in range(world):
        for t in range(STEPS):
            assert torch.equal(runs[world]["lossless_put_back"][r]["anchor"][t], runs[world]["allgather"][0]["anchor"][t])
            assert torch.equal(runs[world]["lossless_put_back"][r]["error"][t], runs[world]["allgather"][r]["error"][t])

"""The cost model (megatron_sparseloco/costmodel.py) against the strategies' own byte counters.

One spawn per W in {2, 4, 8, 16} (gloo, one rank per worker, tiny tensors): every rank holds the
same shard position of a tiny Llama-like model cut by the cost model's own TP/PP/DP rules (mid-row
cuts, several buckets, dense 1-D segments), runs one outer step of SparseLoCo (all-gather) and of
DiLoCo in fp32 and bf16, and the counted bytes sent / received must EQUAL the model's prediction.
"""
from __future__ import annotations

import math

import pytest
import torch

from megatron_sparseloco import costmodel as cm
from megatron_sparseloco.compress.segments import TensorSlice

TINY = dict(vocab=40, hidden=16, layers=4, heads=2, kv_heads=1, ffn=24, qkv_bias=True)
SPARSE = cm.SparseSettings(chunk=64, k=4, value_bits=2, bucket_numel=700)
LAYOUT = dict(tp=2, pp=2, dp=3, stage=0, pos=1)  # the shard a rank of stage 0, DP position 1 holds
WORLDS = (2, 4, 8, 16)
SITES = 2  # hierarchical: G site groups (divides every W above)


def tiny_model():
    return cm.llama_like("tiny", **TINY)


def shard():
    lay = LAYOUT
    params = cm.stage_params(tiny_model(), lay["tp"], lay["pp"], lay["stage"])
    return cm.dp_slices(params, lay["dp"], lay["pos"])


def one_step(rank: int, world: int):
    from megatron_sparseloco.outer import build_outer_strategy

    sls = shard()
    names, slices = [n for n, _ in sls], [s for _, s in sls]
    jobs = {"allgather": ("sparseloco", dict(chunk=SPARSE.chunk, k=SPARSE.k, value_bits=SPARSE.value_bits,
                                             bucket_numel=SPARSE.bucket_numel)),
            "diloco-fp32": ("diloco", dict(bucket_numel=SPARSE.bucket_numel, comm_dtype="fp32")),
            "diloco-bf16": ("diloco", dict(bucket_numel=SPARSE.bucket_numel, comm_dtype="bf16")),
            "hierarchical": ("sparseloco", dict(chunk=SPARSE.chunk, k=SPARSE.k, value_bits=SPARSE.value_bits,
                                                bucket_numel=SPARSE.bucket_numel, aggregation="hierarchical",
                                                aggregation_groups=SITES))}
    out = {}
    for mode, (algo, fields) in jobs.items():
        g = torch.Generator().manual_seed(rank)
        params = [torch.randn(sl.numel, generator=g) for sl in slices]
        strat = build_outer_strategy(algo, params, None, names=names, slices=slices, **fields)
        with torch.no_grad():
            for p in params:
                p.add_(torch.randn(p.shape, generator=g) * 1e-2)
        st = strat.step().as_dict()
        out[mode] = {k: st[k] for k in ("bytes_sent", "bytes_received")}
        out[mode]["payload_bytes"] = st.get("payload_bytes")
    return out


@pytest.fixture(scope="module")
def measured():
    from megatron_sparseloco.testing.multirank import run_ranks

    return {w: run_ranks(one_step, w, timeout=400) for w in WORLDS}


@pytest.mark.multirank
@pytest.mark.parametrize("world", WORLDS)
def test_counted_bytes_equal_the_model(measured, world):
    rank = cm.rank_cost([s for _, s in shard()], SPARSE, [n for n, _ in shard()])
    link = cm.Link(1e9, 0.0)
    for mode in ("allgather", "diloco-fp32", "diloco-bf16"):
        pred = cm.mode_cost(mode, [(rank, 1)], world, link, compute_s=1.0)
        for r, res in enumerate(measured[world]):
            assert res[mode]["bytes_sent"] == pred.bytes_sent, (mode, r)
            assert res[mode]["bytes_received"] == pred.bytes_received, (mode, r)
    assert all(res["allgather"]["payload_bytes"] == rank.payload for res in measured[world])
    pred = cm.mode_cost("hierarchical", [(rank, 1)], world, link, compute_s=1.0, sites=SITES)
    got = measured[world]
    assert all((res["hierarchical"]["bytes_sent"], res["hierarchical"]["bytes_received"])
               == (pred.bytes_sent, pred.bytes_received) for res in got)


def test_hierarchical_time_is_one_wan_round_and_one_lan_round_per_collective():
    rank = cm.rank_cost([s for _, s in shard()], SPARSE, [n for n, _ in shard()])
    c = rank.buckets + 1
    fast = cm.Link(1e30, 0.02, 1e30, 0.001)
    assert cm.mode_cost("hierarchical", [(rank, 1)], 16, fast, 1.0, sites=4).time_s == pytest.approx(c * 0.021)
    assert cm.mode_cost("allgather", [(rank, 1)], 16, fast, 1.0).time_s == pytest.approx(c * 15 * 0.02)
    slow_lan = cm.Link(1e30, 0.0, 8e9, 0.0)   # 1 GB/s LAN: the site gather's (g−1)·G·P
    g, W = 4, 16
    want = (g - 1) * (W // g) * rank.payload / 1e9
    slow_wan = cm.Link(8e9, 0.0, 1e30, 0.0)   # 1 GB/s WAN: the rail exchange's (G−1)·P, whatever W
    for w in (8, 16, 64):
        assert cm.mode_cost("hierarchical", [(rank, 1)], w, slow_wan, 1.0, sites=4).time_s == pytest.approx(
            3 * rank.payload / 1e9)
    assert cm.mode_cost("hierarchical", [(rank, 1)], W, slow_lan, 1.0, sites=4).time_s == pytest.approx(want)
    with pytest.raises(cm.CostModelError, match="3 sites do not divide W = 16"):
        cm.mode_cost("hierarchical", [(rank, 1)], 16, fast, 1.0, sites=3)


def test_shard_fixture_exercises_cuts_buckets_and_dense_segments():
    from megatron_sparseloco.compress.segments import plan_buckets

    sls = shard()
    plans = plan_buckets([s for _, s in sls], SPARSE.codec(), SPARSE.bucket_numel, True, [n for n, _ in sls])
    geoms = {s.geometry for p in plans for s in p.segments}
    assert len(plans) >= 2 and {"flat", "tile2d", "dense"} <= geoms


def test_shards_cover_the_model_exactly():
    """TP·(Σ over stages and DP positions) of the slices = every element once (TP-cut params) or TP
    times (replicated norms)."""
    model, tp, pp, dp = tiny_model(), 2, 2, 3
    held = {}
    for stage in range(pp):
        params = cm.stage_params(model, tp, pp, stage)
        covered = {n: [] for n, _ in params}
        for pos in range(dp):
            for n, sl in cm.dp_slices(params, dp, pos):
                covered[n].append((sl.start, sl.end))
        for n, shape in params:
            spans = sorted(covered[n])
            assert spans[0][0] == 0 and spans[-1][1] == math.prod(shape)
            assert all(a[1] == b[0] for a, b in zip(spans, spans[1:])), n
            held[n] = math.prod(shape)
    for p in model.params:
        assert held[p.name] * (tp if p.tp_dim is not None else 1) == math.prod(p.shape), p.name
    assert set(held) == {p.name for p in model.params}


def test_worker_payload_is_the_sum_over_its_ranks():
    model, tp, pp, dp = tiny_model(), 2, 2, 3
    ranks = cm.worker_ranks(model, tp, pp, dp, SPARSE)
    assert sum(m for _, m in ranks) == tp * pp * dp
    expect = 0
    for stage in range(pp):
        for pos in range(dp):
            sls = cm.dp_slices(cm.stage_params(model, tp, pp, stage), dp, pos)
            expect += tp * cm.rank_cost([s for _, s in sls], SPARSE).payload
    assert sum(m * r.payload for r, m in ranks) == expect
    W, link = 8, cm.Link(1e10, 1e-3)
    ag = cm.mode_cost("allgather", ranks, W, link, 1.0)
    assert ag.bytes_received == tp * pp * dp * cm.FLAG_BYTES + (W - 1) * expect
    c = max(r.buckets for r, _ in ranks) + 1
    assert ag.time_s == pytest.approx(c * (W - 1) * 1e-3 + 8 * (W - 1) * expect / 1e10)
    dense = cm.mode_cost("diloco-fp32", ranks, W, link, 1.0)
    assert dense.wire_bytes == pytest.approx(2 * (W - 1) / W * 4 * sum(m * r.numel for r, m in ranks))


def test_presets_have_their_published_sizes_and_compute_formula():
    assert cm.PRESETS["llama-8b"]().numel == 8_030_261_248
    assert 72.0e9 < cm.PRESETS["72b"]().numel < 73.0e9
    c = cm.Compute(inner_steps=10, tokens=1000, mfu=0.5, peak_flops=1e12)
    assert cm.compute_seconds(2_000_000, c, gpus=4) == pytest.approx(10 * 6 * 2e6 * 1000 / (0.5 * 1e12 * 4))


def test_max_workers_is_the_last_w_within_budget():
    ranks = [(cm.rank_cost([TensorSlice((256, 64), 0, 256 * 64)], SPARSE), 1)]
    link, comp = cm.Link(1e6, 1e-3), 1.0
    w = cm.max_workers("allgather", ranks, link, comp, 0.1)
    assert cm.mode_cost("allgather", ranks, w, link, comp).ratio <= 0.1
    assert cm.mode_cost("allgather", ranks, w + 1, link, comp).ratio > 0.1


def test_cli_prints_a_table(capsys):
    assert cm.main(["--params", "20000000", "--workers", "4,16", "--bandwidth-gbps", "10"]) == 0
    out = capsys.readouterr().out
    assert "| 10 | 16 |" in out and "allgather" in out and "Largest W" in out


# ---------------------------------------------------------------------------------- failures
def _toy_failures(**kw):
    """N = 1000 params, T = 100 tokens, u = 0.5, F = 6e5, G = 2 → t_step = 6·1000·100 / (0.5·6e5·2) = 1 s;
    H = 10 → R = 10 s; C = 22 000 B → t_save = 2 s, t_load = 4 s; heal 12 000 B = 96 000 bit → 3 s."""
    f = dict(mtbf_s=1000.0, downtime_s=20.0, detect_s=5.0, restart_s=30.0, ckpt_write_gbps=5.5e-6,
             ckpt_read_gbps=2.75e-6, ckpt_interval_s=50.0, heal_gbps=3.2e-5, quorum_s=1.0)
    f.update(kw)
    return cm.failure_cost(cm.synthetic(1000), gpus=2, tokens=100, workers=4, inner_steps=10, mfu=0.5,
                           peak_flops=6e5, f=cm.FailureSettings(**f))


def test_failure_model_against_hand_computed_values():
    r = _toy_failures()
    assert (r.step_s, r.round_s) == pytest.approx((1.0, 10.0))
    assert (r.save_s, r.load_s, r.heal_s) == pytest.approx((2.0, 4.0, 3.0))
    # fail-fast: λ = 4/1000, τ = 50 (λτ = 0.2), S = 5 + 20 + 30 + 4 = 59
    assert r.failfast_stall_s == pytest.approx(59.0)
    assert r.failures_per_day == pytest.approx(0.004 * 86400)
    assert r.failfast_goodput == pytest.approx((1 - 2 / 50) * (50 / (math.exp(0.2) - 1)) / (250 + 59))
    assert r.failfast_goodput == pytest.approx(0.701617, abs=1e-6)
    # elastic, kept: O = 5 + 20 + 30 + 3 + 5 = 63, c = 5 + 3 = 8; q / R = 0.1
    assert r.elastic_goodput == pytest.approx(0.9 * (1000 - 5 - 3 * 1000 / 1063 * 8) / 1063)
    assert r.elastic_lost_worker_s == pytest.approx(63 + 5 + 3 * 8)
    # discarded: c = 5 + 3 + 10
    d = _toy_failures(keep_local_progress=False)
    assert d.elastic_goodput == pytest.approx(0.9 * (1000 - 5 - 3 * 1000 / 1063 * 18) / 1063)
    assert d.failfast_goodput == r.failfast_goodput


def test_failure_model_limits_and_checkpoint_interval():
    # Young's interval sqrt(2·t_save/λ) = sqrt(2·2/0.004) by default, and no worse than half or twice it
    young = _toy_failures(ckpt_interval_s=None)
    assert young.ckpt_interval_s == pytest.approx(math.sqrt(1000))
    for tau in (young.ckpt_interval_s / 2, young.ckpt_interval_s * 2):
        assert _toy_failures(ckpt_interval_s=tau).failfast_goodput < young.failfast_goodput
    # no failures: fail-fast loses only its checkpoints, elastic only its quorums
    rare = _toy_failures(mtbf_s=1e15, ckpt_interval_s=None)
    assert rare.failfast_goodput == pytest.approx(1.0, abs=1e-5) and rare.elastic_goodput == pytest.approx(0.9)
    # every cost grows with the downtime; elastic keeps the others going, fail-fast stops them all
    slow = _toy_failures(downtime_s=2000.0)
    assert slow.failfast_goodput < _toy_failures().failfast_goodput
    assert slow.failfast_goodput < slow.elastic_goodput
    with pytest.raises(cm.CostModelError, match="not longer than a save"):
        _toy_failures(ckpt_interval_s=1.0)


def test_mixtral_preset_and_active_parameters():
    m = cm.PRESETS["mixtral-8x7b"]()
    assert m.numel == 46_702_792_704
    expert = sum(math.prod(p.shape) for p in m.params if p.expert)
    assert m.active_numel == m.numel - expert + expert * 2 // 8
    dense = cm.PRESETS["llama-8b"]()
    assert dense.active_numel == dense.numel


@pytest.mark.parametrize("name", sorted(cm.RECIPE_WORKERS))
def test_recipe_workers_match_the_recipes(name):
    """W, accelerators per worker and tokens per inner step per worker as the recipe launches them."""
    import os
    import shlex
    import subprocess
    import sys

    spec = cm.RECIPE_WORKERS[name]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k not in ("NNODES", "WORKERS", "TP", "PP", "EP", "CP", "ALGO",
                                                            "GPUS_PER_NODE", "ELASTIC")}
    p = subprocess.run(["bash", os.path.join(root, spec.recipe)], capture_output=True, text=True, timeout=60,
                       env=dict(env, PRINT_ARGS="cmd", PYTHON=sys.executable))
    assert p.returncode == 0, p.stderr
    cmd = shlex.split(p.stdout)
    opt = lambda flag: int(cmd[cmd.index(flag) + 1])  # noqa: E731
    W = opt("--sparseloco-workers")
    assert W == spec.workers
    assert opt("--nnodes") * opt("--nproc-per-node") // W == spec.gpus
    assert opt("--global-batch-size") // W * opt("--seq-length") == spec.tokens


def test_failures_cli_prints_every_recipe_model(capsys, tmp_path):
    out = tmp_path / "f.json"
    assert cm.main(["--failures", "--mtbf-hours", "24", "--downtime-hours", "0,1", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    for name in cm.RECIPE_WORKERS:
        assert f"### {name}:" in text
    assert "| 24 | 1 |" in text and "fail-fast goodput" in text
    import json
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == len(cm.RECIPE_WORKERS) * 2 * 2   # models × downtimes × (kept, discarded)
    assert all(0 <= r["failfast_goodput"] <= 1 and 0 <= r["elastic_goodput"] <= 1 for r in rows)
    with pytest.raises(SystemExit):
        cm.main(["--failures", "--preset", "72b"])   # not a recipe's model

"""The benchmarks' method specs: outer settings reach the run, bad tags and grids are refused."""
from __future__ import annotations

import argparse
import math
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import aggregation_wire  # noqa: E402
import network  # noqa: E402
import quality  # noqa: E402


def test_hetero_specs_carry_outer_settings():
    base = dict(H=15, steps=30)
    diloco, sl_tuned, sl_default, gas = network.hetero_runs(
        "diloco:lr0.7:mu0.6,sparseloco:128:lr1.5,sparseloco,gasloc:bandwidth:lr0.7:mu0.6", base)
    assert (diloco.method, diloco.outer_lr, diloco.outer_momentum) == ("diloco", 0.7, 0.6)
    assert (sl_tuned.k, sl_tuned.outer_lr, sl_tuned.outer_momentum) == (128, 1.5, None)
    assert (sl_default.k, sl_default.outer_lr) == (64, None)
    assert (gas.gasloc_topology, gas.outer_lr, gas.outer_momentum) == ("bandwidth", 0.7, 0.6)
    assert "lr=0.7 mu=0.6" in diloco.label()
    (no_k,) = network.hetero_runs("sparseloco:lr2", base)
    assert (no_k.k, no_k.outer_lr) == (64, 2.0)


@pytest.mark.parametrize("spec", ["diloco:fast", "sparseloco:64:mu0.5", "diloco:lrx"])
def test_hetero_specs_refuse_unknown_tags(spec):
    with pytest.raises(SystemExit, match="unknown tag"):
        network.hetero_runs(spec, dict(H=15, steps=30))


def test_sweep_grid_replaces_only_named_methods(tmp_path):
    assert quality.sweep_grid("") is quality.SWEEP
    grid = quality.sweep_grid('{"sparseloco": [[2.0, null], [2.5, null]]}')
    assert grid == {"sparseloco": [(2.0, None), (2.5, None)]}
    path = tmp_path / "grid.json"
    path.write_text('{"diloco": [[0.7, 0.3]]}')
    assert quality.sweep_grid(str(path)) == {"diloco": [(0.7, 0.3)]}
    args = argparse.Namespace(sweep_grid=str(path), mbs=4, lr=1e-3, eval_windows=8, H=15)
    (run,) = quality.sweep_runs(args, 30)
    assert (run.method, run.outer_lr, run.outer_momentum, run.seed, run.data_seed) == ("diloco", 0.7, 0.3, 1234, 0)


def test_a_top_k_tuned_on_its_own_gets_its_own_setting():
    grid = quality.sweep_grid('{"sparseloco:128": [[1.0, null], [1.2, null]]}')
    assert grid == {"sparseloco:128": [(1.0, None), (1.2, None)]}
    args = argparse.Namespace(sweep_grid='{"sparseloco:128": [[1.0, null], [1.2, null]]}', mbs=4, lr=1e-3,
                              eval_windows=8, H=15)
    runs = quality.sweep_runs(args, 30)
    assert [(r.method, r.k, r.outer_lr) for r in runs] == [("sparseloco", 128, 1.0), ("sparseloco", 128, 1.2)]
    rows = [{"method": "sparseloco", "k": 64, "outer_lr": 1.5, "outer_momentum": None, "held_out_loss": 2.0},
            {"method": "sparseloco", "k": 128, "outer_lr": 1.0, "outer_momentum": None, "held_out_loss": 2.1},
            {"method": "sparseloco", "k": 128, "outer_lr": 1.2, "outer_momentum": None, "held_out_loss": 1.9}]
    tuned = quality.pick_tuned(rows)
    assert tuned == {"sparseloco": (1.5, None), "sparseloco:128": (1.2, None)}
    args = argparse.Namespace(methods="sparseloco:64,sparseloco:128,sparseloco:256", H=15, mbs=4, lr=1e-3,
                              eval_windows=8, overlap_steps="", overlap_merges="replay", fragments="")
    runs, _ = quality.build_runs(args, tuned, [0], 30)
    assert [(r.k, r.outer_lr) for r in runs] == [(64, 1.5), (128, 1.2), (256, 1.5)]


def test_a_ddp_grid_sweeps_ddps_inner_lr_and_its_seeds_run_at_the_chosen_lr():
    """DDP's one setting is its lr: a "ddp" grid point is [inner lr, null]; the sweep's best becomes DDP's tuned
    entry (inner lr, None), its seeds run at that lr, and the outer-loop methods keep the shared inner lr."""
    text = '{"ddp": [[0.000707, null], [0.001, null], [0.00141, null]]}'
    assert quality.sweep_grid(text) == {"ddp": [(0.000707, None), (0.001, None), (0.00141, None)]}
    args = argparse.Namespace(sweep_grid=text, mbs=4, lr=1e-3, eval_windows=8, H=15)
    runs = quality.sweep_runs(args, 30)
    assert [(r.method, r.lr, r.outer_lr, r.seed, r.data_seed) for r in runs] == [
        ("ddp", lr, None, 1234, 0) for lr in (0.000707, 0.001, 0.00141)]
    assert [r.label() for r in runs] == ["ddp lr=0.000707", "ddp", "ddp lr=0.00141"]
    rows = [{"method": "ddp", "k": None, "outer_lr": None, "outer_momentum": None, "held_out_loss": loss,
             "run": {"lr": r.lr}} for r, loss in zip(runs, (2.2, 2.1, 2.15))]
    rows.append({"method": "diloco", "k": None, "outer_lr": 0.7, "outer_momentum": 0.8, "held_out_loss": 2.3,
                 "run": {"lr": 1e-3}})
    tuned = quality.pick_tuned(rows)
    assert tuned == {"ddp": (0.001, None), "diloco": (0.7, 0.8)}
    rows[2]["held_out_loss"] = 2.0
    tuned = quality.pick_tuned(rows)
    assert tuned["ddp"] == (0.00141, None)
    args = argparse.Namespace(methods="ddp,diloco", H=15, mbs=4, lr=1e-3, eval_windows=8, overlap_steps="",
                              overlap_merges="replay", fragments="")
    seeds, _ = quality.build_runs(args, tuned, [0, 1], 30)
    assert [(r.method, r.lr, r.outer_lr, r.data_seed) for r in seeds] == [
        ("ddp", 0.00141, None, 0), ("diloco", 1e-3, 0.7, 0), ("ddp", 0.00141, None, 1), ("diloco", 1e-3, 0.7, 1)]
    # seed 0 at the chosen lr is the sweep's run (the same configuration), not a second one
    assert quality._run_key(seeds[0]) == quality._run_key(runs[2])
    untuned, _ = quality.build_runs(args, {}, [0], 30)
    assert untuned[0].lr == 1e-3


@pytest.mark.parametrize("text", ["{not json", '{"adam": [[1, 2]]}', "{}", "[1]", '{"sparseloco:0": [[1, null]]}',
                                  '{"diloco:64": [[1, 0.6]]}', '{"ddp": [[0.001, 0.9]]}', '{"ddp": [[0, null]]}',
                                  '{"ddp": [["x", null]]}'])
def test_sweep_grid_refuses_bad_input(text):
    with pytest.raises(SystemExit, match="--sweep-grid"):
        quality.sweep_grid(text)


def test_first_seed_sets_model_init_and_data_order():
    args = argparse.Namespace(methods="diloco", H=15, mbs=4, lr=1e-3, eval_windows=8, overlap_steps="", overlap_merges="replay", fragments="")
    runs, _ = quality.build_runs(args, {"diloco": (0.7, 0.6)}, [1, 2], 30)
    assert [(r.seed, r.data_seed, r.outer_lr) for r in runs] == [(1235, 1, 0.7), (1236, 2, 0.7)]


def test_uniform_default_methods_are_the_three_reference_runs():
    from common import RunCfg
    base = dict(H=15, steps=30)
    assert network.hetero_runs("diloco,sparseloco:64,gasloc", base) == [
        RunCfg("diloco", **base), RunCfg("sparseloco", k=64, **base), RunCfg("gasloc", **base)]


def test_overlap_merges_parsed_and_unknown_refused():
    import common

    assert common.overlap_merges("replay, lerp") == ["replay", "lerp"]
    for bad in ("replay,restart", "", " , "):
        with pytest.raises(SystemExit, match="--overlap-merges"):
            common.overlap_merges(bad)


def test_reduce_scatter_and_gossip_tags_reach_the_strategy_fields():
    import common

    args = argparse.Namespace(methods="sparseloco:64:rs128w,sparseloco:64:rs256b8a,gasloc:exponential:mn:g2", H=15,
                              mbs=4, lr=1e-3, eval_windows=8, overlap_steps="", overlap_merges="replay", fragments="")
    rs_w, rs_a, gossip = quality.build_runs(args, {"sparseloco": (1.5, None)}, [0], 30)[0]
    assert common.strategy_fields(rs_w, 2)["owner_k"] == 128 and common.strategy_fields(rs_w, 2)["owner_residual"] == "workers"
    assert "reduce" not in common.strategy_fields(rs_w, 2)
    fa = common.strategy_fields(rs_a, 2)
    assert (fa["owner_k"], fa["owner_value_bits"], fa["reduce"], "owner_residual" in fa) == (256, 8, "all", False)
    fg = common.strategy_fields(gossip, 2)
    assert (fg["topology"], fg["rule"], fg["gossip_rounds"]) == ("exponential", "mixed-nesterov", 2)
    with pytest.raises(SystemExit, match="unknown tag 'g0'"):
        common.gasloc_fields("gasloc:g0")


def test_hierarchical_tag_reaches_the_strategy_fields_and_its_label():
    import common

    args = argparse.Namespace(methods="sparseloco:64:h2", H=15, mbs=4, lr=1e-3, eval_windows=8, overlap_steps="",
                              overlap_merges="replay", fragments="")
    (run,) = quality.build_runs(args, {"sparseloco": (1.0, None)}, [0], 30)[0]
    f = common.strategy_fields(run, 2)
    assert (f["aggregation"], f["aggregation_groups"]) == ("hierarchical", 2)
    assert "hierarchical G=2" in run.label()


def test_all_tag_gives_the_papers_mean_over_all_workers_and_its_own_label():
    import common

    args = argparse.Namespace(methods="sparseloco:64,sparseloco:64:all", H=15, mbs=4, lr=1e-3, eval_windows=8,
                              overlap_steps="", overlap_merges="replay", fragments="")
    plain, mean_all = quality.build_runs(args, {"sparseloco": (1.5, None)}, [0], 30)[0]
    assert "reduce" not in common.strategy_fields(plain, 2)
    assert common.strategy_fields(mean_all, 2)["reduce"] == "all" and mean_all.aggregation == "allgather"
    assert plain.label() != mean_all.label() and "reduce=all" in mean_all.label()


def test_sparseloco_outer_momentum_from_the_tuned_file_reaches_the_strategy():
    import common

    args = argparse.Namespace(methods="sparseloco:64", H=15, mbs=4, lr=1e-3, eval_windows=8, overlap_steps="",
                              overlap_merges="replay", fragments="")
    (plain,), _ = quality.build_runs(args, {"sparseloco": (1.5, None)}, [0], 30)
    (nesterov,), _ = quality.build_runs(args, {"sparseloco": (1.0, 0.3)}, [0], 30)
    assert "momentum" not in common.strategy_fields(plain, 2)
    f = common.strategy_fields(nesterov, 2)
    assert (f["lr"], f["momentum"], f["nesterov"]) == (1.0, 0.3, True)


def _fake_rows(calls, best_lr):
    """A stand-in for quality.run_rows: the held-out loss is a bowl around each W's best outer lr."""
    def run_rows(W, model, runs, ft_runs, paths, timeout, env, notes):
        calls.append((W, list(runs)))
        rows = []
        for r in runs:
            if r.method == "diloco":
                loss = (r.outer_lr - 0.5) ** 2 + (r.outer_momentum - 0.9) ** 2
            else:
                loss = (r.outer_lr - best_lr[W] * (0.8 if r.k == 128 else 1.0)) ** 2
            rows.append({"method": r.method, "k": r.k, "label": r.label(), "seed": r.data_seed, "workers": W,
                         "steps": r.steps, "outer_lr": r.outer_lr, "outer_momentum": r.outer_momentum,
                         "chunking": r.chunking, "held_out_loss": loss + r.data_seed, "bytes_sent_per_worker": 1,
                         "curve": []})
        return rows
    return run_rows


def test_sweep_each_w_tunes_every_w_on_its_own_and_reuses_the_sweeps_seed0_runs(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(quality, "run_rows", _fake_rows(calls, {2: 2.0, 8: 1.0}))
    monkeypatch.setattr(quality.common, "ensure_data", lambda *a, **k: {})
    out = tmp_path / "q.json"
    quality.main(["--sweep", "--sweep-each-w", "--workers", "2,8", "--steps", "30", "--seeds", "2",
                  "--methods", "diloco,sparseloco:64,sparseloco:128", "--json", str(out)])
    import json
    import schema
    res = json.loads(out.read_text())
    assert schema.check(res) == []

    def nearest(lr):   # the bowl's minimum on the sweep's grid
        return min(quality.SWEEP_SPARSELOCO_LRS, key=lambda x: abs(x - lr))
    chosen = {W: (nearest(lr), nearest(0.8 * lr)) for W, lr in ((2, 2.0), (8, 1.0))}
    for W, (lr64, lr128) in chosen.items():
        assert res["config"]["tuned_per_w"][str(W)] == {"diloco": [0.5, 0.9], "sparseloco": [lr64, None],
                                                        "sparseloco:128": [lr128, None]}
    swept_ws = [W for W, runs in calls if len(runs) == sum(len(v) for v in quality.SWEEP.values())]
    assert swept_ws == [2, 8]
    for W, (lr64, lr128) in chosen.items():
        rows = [r for r in res["rows"] if r["workers"] == W]
        assert all(r["sweep"] == (r["seed"] == 0) for r in rows)           # every run once: seed 0 is the sweep's
        assert len(rows) == sum(len(v) for v in quality.SWEEP.values()) + 3
        seed_rows = [r for r in rows if r["seed_run"]]
        assert sorted((r["seed"], r["method"], r["k"], r["outer_lr"]) for r in seed_rows) == sorted(
            (s, m, k, lr) for s in (0, 1) for m, k, lr in (("diloco", None, 0.5), ("sparseloco", 64, lr64),
                                                            ("sparseloco", 128, lr128)))
        (seed_runs,) = [runs for w, runs in calls if w == W and len(runs) != sum(len(v) for v in quality.SWEEP.values())]
        assert sorted(r.data_seed for r in seed_runs) == [1, 1, 1]   # seed 0 is not run twice


def test_sweep_each_w_needs_the_sweep():
    with pytest.raises(SystemExit, match="--sweep-each-w"):
        quality.main(["--sweep-each-w", "--workers", "2,8", "--steps", "30"])


def test_sites_case_addresses_and_shaping():
    """Workers are cut into contiguous sites by address; each side of a link sends the other sites' /24s
    to the WAN class (by destination on the worker's egress, by source toward the worker), and the delay
    is added only when asked, on the worker's egress."""
    assert network.sites_addresses(8, 2) == [f"10.77.{w // 4}.{w % 4 + 1}" for w in range(8)]
    for bad in (3, 1):
        with pytest.raises(SystemExit, match="--sites"):
            network.sites_addresses(8, bad)
    out = network.sites_tc_commands("eth0", "10.77.1.2", 3, "1gbit", "20mbit", "25ms", toward_worker=False)
    filters = [c for c in out if c[1] == "filter"]
    assert [c[c.index("dst") + 1] for c in filters] == ["10.77.0.0/24", "10.77.2.0/24"]
    assert all(c[-1] == "1:20" for c in filters)
    classes = {c[c.index("classid") + 1]: c[c.index("rate") + 1] for c in out if c[1] == "class"}
    assert classes == {"1:10": "1gbit", "1:20": "20mbit"}
    assert ["netem", "delay", "25ms"] == [c for c in out if "netem" in c][0][-5:-2]
    hub = network.sites_tc_commands("p5", "10.77.1.2", 3, "1gbit", "20mbit", "25ms", toward_worker=True)
    assert not any("netem" in c for c in hub) and sum("src" in c for c in hub) == 2
    assert not any("netem" in c for c in network.sites_tc_commands("eth0", "10.77.0.1", 2, "1gbit", "20mbit", "",
                                                                    toward_worker=False))


def test_sites_methods_carry_the_aggregation():
    base = dict(H=15, steps=30)
    ag, hier, rs = network.hetero_runs("sparseloco:64,sparseloco:64:hier:lr1.5,sparseloco:rs", base, sites=2)
    assert (ag.aggregation, ag.aggregation_groups) == ("allgather", 0)
    assert (hier.aggregation, hier.aggregation_groups, hier.outer_lr) == ("hierarchical", 2, 1.5)
    assert (rs.aggregation, rs.k) == ("reduce-scatter", 64)
    with pytest.raises(SystemExit, match="sites"):
        network.hetero_runs("sparseloco:64:hier", base)


def test_summary_splits_the_owners_compute_from_the_wire():
    """Per outer step the slowest rank decides each clock; the wire is communicate − owners per rank
    (then the slowest), not the difference of the two maxima. The first sync is dropped."""
    from dataclasses import asdict
    run = asdict(network.hetero_runs("sparseloco:rs", dict(H=5, steps=10), sites=2)[0])

    def rank(syncs):
        keys = ("time_compress_s", "time_communicate_s", "time_apply_s", "time_agree_s", "time_owner_s",
                "outer_step_s")
        curve = [{"step": 10, "tokens": 0, "bytes_per_worker": 0, "held_out_loss": 3.0, "wall_s": 1.0}]
        return [{"run": run, "curve": curve, "numel": 1, "bytes_sent": 8, "wall_s": 1.0,
                 "sync": [dict(zip(keys, (0.1, c, 0.01, 0.2, o, 1.0))) for c, o in syncs]}]
    res = [rank([(9.0, 9.0), (1.0, 0.7), (2.0, 0.5)]), rank([(9.0, 9.0), (1.2, 0.1), (1.5, 1.4)])]
    (row,) = network.summarise(res, 2, "sites")
    assert row["sync_communicate_s"] == pytest.approx((1.2 + 2.0) / 2)
    assert row["sync_owner_s"] == pytest.approx((0.7 + 1.4) / 2)
    assert row["sync_wire_s"] == pytest.approx((1.1 + 1.5) / 2)
    assert row["sync_agree_s"] == pytest.approx(0.2)


def test_aggregation_wire_shapes_are_the_network_model():
    from common import ModelCfg
    shapes = aggregation_wire.gpt_shapes(ModelCfg(layers=4, hidden=256, heads=4, seq=128))
    assert sum(math.prod(s) for _, s in shapes) == 3_258_112   # network.py's numel for this model
    assert len({n for n, _ in shapes}) == len(shapes) == 2 + 4 * 12 + 2


def test_aggregation_wire_cost_model_columns():
    from common import ModelCfg
    assert aggregation_wire.rate_bps("5mbit") == 5e6 and aggregation_wire.rate_bps("1gbit") == 1e9
    with pytest.raises(SystemExit, match="rate"):
        aggregation_wire.rate_bps("5MB")
    rows = [{"mode": m} for m in aggregation_wire.MODES]
    aggregation_wire.add_cost_model(rows, ModelCfg(layers=4, hidden=256, heads=4, seq=128), 8, 2, 64, "1gbit", "5mbit")
    ag, hier, rs = rows
    # measured on this model: 94,487-byte payload; all-gather's ring = 7 payloads on the WAN link
    assert ag["model_bytes_received"] == 4 + 7 * 94_487 == hier["model_bytes_received"]
    assert ag["model_wire_s"] == pytest.approx(8 * 7 * 94_487 / 5e6)
    assert hier["model_wire_s"] == pytest.approx(8 * 94_487 / 5e6 + 8 * 3 * 2 * 94_487 / 1e9)
    assert rs["model_wire_s"] < hier["model_wire_s"] * 2 < ag["model_wire_s"]


def test_aggregation_wire_refuses_bad_arguments():
    with pytest.raises(SystemExit, match="--modes"):
        aggregation_wire.main(["--modes", "allgather,tree"])
    with pytest.raises(SystemExit, match="--rounds"):
        aggregation_wire.main(["--rounds", "0"])
    with pytest.raises(SystemExit, match="--sites"):
        aggregation_wire.main(["--workers", "4", "--sites", "3"])


def test_aggregation_wire_summary_takes_the_slowest_rank_after_round_0():
    def rank(wires, sha):
        keys = ("time_compress_s", "time_communicate_s", "time_owner_s", "time_apply_s", "step_s",
                "bytes_sent", "bytes_received", "wan_bytes_sent", "wan_bytes_received")
        return {"allgather": {"numel": 10, "anchor_sha256": sha, "rounds": [
            dict(dict.fromkeys(keys, 1.0), wire_s=w, collectives_timed=1, wire_calls_s=[w]) for w in wires]}}
    (row,) = aggregation_wire.summarise([rank([9.0, 0.2, 0.4], "a"), rank([9.0, 0.3, 0.1], "a")], ["allgather"])
    assert row["wire_s"] == pytest.approx((0.3 + 0.4) / 2) and row["anchor_identical_across_ranks"]
    assert row["wire_calls_s"] == [pytest.approx(0.35)]
    (row,) = aggregation_wire.summarise([rank([1.0], "a"), rank([1.0], "b")], ["allgather"])
    assert row["wire_s"] == 1.0 and not row["anchor_identical_across_ranks"]


def test_support_frontier_rows():
    import support_frontier

    def row(label, k, recv, W=8):
        return {"method": "sparseloco", "label": label, "k": k, "workers": W, "seed": 0, "steps": 450, "H": 15,
                "held_out_loss": 2.0, "bytes_received_per_worker": recv, "bytes_sent_per_worker": 30}
    ag, rs, rs128 = (row("sparseloco k=64 lr=1 H=15", 64, 300), row("sparseloco k=64 reduce-scatter lr=1 H=15", 64, 90),
                     row("sparseloco k=64 reduce-scatter owner-k=128 lr=1 H=15", 64, 120))
    out = {r["label"]: r for r in support_frontier.frontier_rows([ag, rs, rs128, {"method": "diloco"}])}
    assert out[ag["label"]]["support_per_chunk"] == 8 * 64 and out[ag["label"]]["received_per_round"] == 10.0
    assert out[rs["label"]]["support_per_chunk"] == 64 and out[rs["label"]]["aggregation"] == "reduce-scatter"
    assert out[rs128["label"]]["support_per_chunk"] == 128 and out[rs128["label"]]["sent_per_round"] == 1.0
    with pytest.raises(SystemExit, match="bytes_received"):
        support_frontier.frontier_rows([dict(ag, bytes_received_per_worker=None)])
    with pytest.raises(SystemExit, match="different"):
        support_frontier.frontier_rows([ag, row("sparseloco k=64 lr=1 H=15", 64, 300, W=4)])


def test_quality_sparseloco_tags_reach_the_run_and_unknown_tags_are_refused():
    import common

    args = argparse.Namespace(methods="sparseloco:64:vb4,sparseloco:128:ef0.9,sparseloco:64:all", H=15,
                              mbs=4, lr=1e-3, eval_windows=8, overlap_steps="", overlap_merges="replay", fragments="")
    vb4, ef, mean_all = quality.build_runs(args, {"sparseloco": (2.0, None)}, [0], 30)[0]
    assert common.strategy_fields(vb4, 2)["value_bits"] == 4 and "bits=4" in vb4.label()
    assert common.strategy_fields(ef, 2)["value_bits"] == 2 and common.strategy_fields(ef, 2)["ef_beta"] == 0.9
    assert mean_all.reduce == "all" and vb4.outer_lr == 2.0
    for bad, match in (("sparseloco:64:vb", "unknown sparseloco tag 'vb'"), ("sparseloco:64:bits4", "unknown sparseloco tag"),
                       ("diloco:0:fast", "diloco takes no tag")):
        with pytest.raises(SystemExit, match=match):
            quality.parse_methods(bad)


@pytest.mark.parametrize("argv", [["--hidden", "100", "--heads", "3"], ["--layers", "0"]])
def test_quality_model_shape_flags_are_checked_before_any_run(argv):
    with pytest.raises(SystemExit, match="--layers / --hidden / --heads"):
        quality.main(argv)


def test_reuse_takes_runs_made_before_and_keeps_the_command(tmp_path, monkeypatch):
    """--reuse: a run whose configuration is in an earlier file of the same model and CPU is not made again;
    the recorded command is the one without --reuse (what reproduces the file), the notes say what was reused."""
    import json
    import schema

    calls = []

    def fake(W, model, runs, ft_runs, paths, timeout, env, notes):
        calls.append([r.outer_lr for r in runs])
        return [{"method": r.method, "k": r.k, "label": r.label(), "seed": r.data_seed, "workers": W, "steps": r.steps,
                 "outer_lr": r.outer_lr, "outer_momentum": r.outer_momentum, "held_out_loss": r.outer_lr,
                 "bytes_sent_per_worker": 1, "curve": [], "run": dataclasses_asdict(r)} for r in runs]
    monkeypatch.setattr(quality, "_run_rows", fake)
    monkeypatch.setattr(quality.common, "ensure_data", lambda *a, **k: {})
    first, second = tmp_path / "a.json", tmp_path / "b.json"
    base = ["--sweep", "--workers", "2", "--steps", "30", "--seeds", "1", "--methods", "sparseloco:64"]
    quality.main(base + ["--sweep-grid", '{"sparseloco": [[1.0, null], [2.0, null]]}', "--json", str(first)])
    assert calls == [[1.0, 2.0]]
    quality.main(base + ["--sweep-grid", '{"sparseloco": [[0.5, null], [1.0, null], [2.0, null]]}',
                         "--reuse", str(first), "--json", str(second)])
    assert calls[1:] == [[0.5]]                                  # only the new grid point is made
    doc = json.loads(second.read_text())
    assert schema.check(doc) == [] and "--reuse" not in doc["command"]
    assert [r["outer_lr"] for r in doc["rows"] if r.get("reused_from")] == [1.0, 2.0]
    assert any("--reuse" in n for n in doc["notes"])
    other = json.loads(first.read_text())
    other["machine"]["cpu"] = "another CPU"
    first.write_text(json.dumps(other))
    with pytest.raises(SystemExit, match="SparseLoCo runs differ between CPU models"):
        quality.main(base + ["--reuse", str(first)])


def dataclasses_asdict(run):
    from dataclasses import asdict
    return asdict(run)


def test_reuse_rebuilds_the_run_of_a_row_written_before_rows_carried_it():
    """A plain diloco / sparseloco row (no tags) of an older file is matched by its rebuilt configuration; the
    rebuilt run must carry the row's own label, else the row is not reused."""
    import argparse
    import common

    config = {"inner": {"micro_batch": 4, "lr": 1e-3}, "eval_windows": 64}
    args = argparse.Namespace(sweep_grid='{"diloco": [[0.5, 0.8]], "sparseloco:128": [[1.5, null]]}', mbs=4,
                              lr=1e-3, eval_windows=64, H=15)
    for run in quality.sweep_runs(args, 900):
        row = {"method": run.method, "k": run.k, "H": 15, "steps": 900, "seed": 0, "outer_lr": run.outer_lr,
               "outer_momentum": run.outer_momentum, "label": run.label()}
        assert quality._run_key(common.RunCfg(**quality._run_of_plain_row(row, config))) == quality._run_key(run)
        assert quality._run_of_plain_row(dict(row, label=run.label() + " flat"), config) is None


def test_network_tuned_settings_refuse_a_quality_file_of_another_model_size(tmp_path):
    """--tuned reads the outer settings a quality file chose; a file that tuned another model is refused, naming
    the flag, instead of running the other size's point as if tuned."""
    import schema
    small = {"layers": 2, "hidden": 128, "heads": 4, "seq": 128, "vocab": 257}
    path = tmp_path / "quality_w4.json"
    schema.write(str(path), schema.document(
        "quality", "python benchmarks/quality.py --sweep --workers 4",
        {"model": small, "tuned_per_w": {"4": {"diloco": [0.5, 0.3], "sparseloco": [1.5, None]}}},
        [{"method": "diloco"}]))
    assert network.tuned_settings(str(path), 4, dict(small)) == {"diloco": (0.5, 0.3), "sparseloco": (1.5, None)}
    with pytest.raises(SystemExit, match=r"--tuned .*quality_w4.json: tuned on the model .*'hidden': 128.*"
                                         r"this run trains .*'hidden': 256"):
        network.tuned_settings(str(path), 4, dict(small, layers=4, hidden=256))
    with pytest.raises(SystemExit, match=r"settings chosen at W = 8"):
        network.tuned_settings(str(path), 8, dict(small))


def test_network_rank_wait_kills_every_rank_when_the_wait_is_interrupted():
    """Ctrl-C (or any error) while the launcher waits for its namespaced ranks: the ranks still running are
    killed before the exception goes on, not left training as orphans on the shared cores."""
    import subprocess
    import time

    class Interrupted:
        """A rank whose wait is where the launcher is when Ctrl-C arrives."""
        returncode = None
        waits = 0

        def wait(self, timeout=None):
            self.waits += 1
            if self.waits == 1:
                raise KeyboardInterrupt
            return self.returncode

        def poll(self):
            return None

        def kill(self):
            self.returncode = -9

    sleepers = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"]) for _ in range(2)]
    first = Interrupted()
    with pytest.raises(KeyboardInterrupt):
        network.wait_ranks([first] + sleepers, time.monotonic() + 300)
    assert first.returncode == -9
    assert [p.returncode for p in sleepers] == [-9, -9]     # killed, and reaped within the call
    # past the deadline: the rank is killed, the wait returns
    late = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    t0 = time.monotonic()
    network.wait_ranks([late], time.monotonic() - 1)
    assert late.returncode == -9 and time.monotonic() - t0 < 30


def test_network_overlap_and_fragment_rows_run_at_the_tuned_setting_of_their_blocking_row():
    """--tuned with --overlap-steps / --fragments: the delayed and fragmented DiLoCo / SparseLoCo runs take the
    chosen outer setting too, so each differs from its method's blocking row in τ and P only (they ran at the
    plugin's defaults before: DiLoCo μ 0.9 beside a blocking row at the chosen μ)."""
    base = dict(H=15, steps=30)
    tuned = {"diloco": (0.5, 0.3), "sparseloco": (1.06, None)}
    runs = network.case_runs("diloco,sparseloco:64", base, tuned, [2], ["replay"], [(2, 0), (2, 2)])
    outer = [(r.method, r.overlap_steps, r.fragments, r.outer_lr, r.outer_momentum) for r in runs]
    assert outer == [("diloco", 0, 1, 0.5, 0.3), ("sparseloco", 0, 1, 1.06, None),
                     ("diloco", 2, 1, 0.5, 0.3), ("sparseloco", 2, 1, 1.06, None),
                     ("diloco", 0, 2, 0.5, 0.3), ("sparseloco", 0, 2, 1.06, None),
                     ("diloco", 2, 2, 0.5, 0.3), ("sparseloco", 2, 2, 1.06, None),
                     ("local", 0, 1, None, None)]
    # a spec that names its lr keeps it; without --tuned every run is at the plugin's defaults
    (named,) = network.case_runs("sparseloco:lr2", base, tuned, [], ["replay"], [])
    assert named.outer_lr == 2.0
    assert all(r.outer_lr is None for r in network.case_runs("diloco", base, {}, [2], ["replay"], []))
    # the heterogeneous case: the same runs, without the local ceiling
    hetero = network.case_runs("diloco,sparseloco:64", base, tuned, [2], ["replay"], [(2, 0)], local=False)
    assert [(r.method, r.overlap_steps, r.fragments, r.outer_lr) for r in hetero] == [
        ("diloco", 0, 1, 0.5), ("sparseloco", 0, 1, 1.06), ("diloco", 2, 1, 0.5), ("sparseloco", 2, 1, 1.06),
        ("diloco", 0, 2, 0.5), ("sparseloco", 0, 2, 1.06)]

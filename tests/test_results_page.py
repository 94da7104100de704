"""docs/results.md, the README's results table and docs/results/*.json agree; the renderer computes what it shows.

The page is generated (benchmarks/render_results.py): these tests fail when a results file changed and the
page was not re-rendered, when a file is not in the one results schema, when a file was made by a command
other than the one `make bench` runs for it, and they check the renderer's arithmetic on synthetic files.
"""
from __future__ import annotations

import json
import os
import re
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import render_results as R  # noqa: E402
import schema  # noqa: E402

PLAN = {b.name: b.command for b in R.PLAN}
MACHINE = {"cpu": "Test CPU", "cpus": "2", "torch": "2.x", "megatron_core": "0.19.2", "plugin_commit": "abc1234",
           "python": "3.12"}


# ---------------------------------------------------------------------------- the repository's files
def test_every_results_file_is_in_the_schema():
    for fname in sorted(os.listdir(R.RESULTS)):
        if fname.endswith(".json"):
            with open(os.path.join(R.RESULTS, fname)) as f:
                assert schema.check(json.load(f)) == [], fname


def test_the_page_readme_and_plots_are_what_the_files_render():
    problems = R.check()
    assert problems == [], "\n".join(problems)


def test_the_archive_index_names_every_archived_file():
    archive = os.path.join(ROOT, "docs", "archive")
    index = open(os.path.join(archive, "README.md")).read()
    for fname in os.listdir(archive):
        if fname != "README.md":
            assert f"]({fname})" in index, fname


def test_benchmarks_md_is_the_protocol_and_points_to_the_results():
    text = open(os.path.join(ROOT, "docs", "benchmarks.md")).read()
    assert len(text.splitlines()) <= 300
    assert "results.md" in text
    assert not re.search(r"\bissues? \d+|#\d+\b", text, re.I), "internal issue numbers in a user doc"


def test_no_doc_points_at_shared_or_a_machine_path():
    for name in ("results.md", "benchmarks.md"):
        text = open(os.path.join(ROOT, "docs", name)).read()
        assert "../shared" not in text and "/work/" not in text and "/tmp/" not in text, name


# ---------------------------------------------------------------------------- synthetic files
def _row(W, method, k, lr, mu, seed, loss, sweep, seed_run, bytes_=1000):
    label = ("diloco" if method == "diloco" else f"sparseloco k={k}") + f" lr={lr:g}" + (
        f" mu={mu:g}" if mu is not None else "") + " H=15"
    return {"method": method, "k": k, "label": label, "seed": seed, "workers": W, "steps": 900, "H": 15,
            "outer_lr": lr, "outer_momentum": mu, "held_out_loss": loss, "bytes_sent_per_worker": bytes_,
            "bytes_received_per_worker": bytes_, "numel": 446_000, "sweep": sweep, "seed_run": seed_run,
            "curve": [{"step": 0, "tokens": 0, "bytes_per_worker": 0, "held_out_loss": 5.5, "wall_s": 0.0},
                      {"step": 900, "tokens": 1, "bytes_per_worker": bytes_, "held_out_loss": loss, "wall_s": 9.0}]}


def quality_doc(W, diloco_losses=(2.10, 2.12, 2.14), sl_losses=(2.05, 2.13, 2.08), command=None, numel=446_000):
    """A quality file: DiLoCo swept on 2 points, SparseLoCo k = 64 on 3 lrs and k = 128 on 2 (today's default
    rule's values at W = 2 and 4 among them), seeds 1 and 2 at the winners."""
    rows = [_row(W, "diloco", None, 0.5, 0.8, 0, diloco_losses[0], True, True, 100_000),
            _row(W, "diloco", None, 0.7, 0.9, 0, 2.3, True, False, 100_000)]
    for lr, loss in ((1.06, 2.2), (1.5, sl_losses[0]), (2.12, 2.3)):
        rows.append(_row(W, "sparseloco", 64, lr, None, 0, loss, True, lr == 1.5, 800))
    for lr, loss in ((0.75, 2.0), (1.06, 2.1)):      # k = 128's winner sits on its grid's low edge
        rows.append(_row(W, "sparseloco", 128, lr, None, 0, loss, True, lr == 0.75, 1600))
    for s in (1, 2):
        rows += [_row(W, "diloco", None, 0.5, 0.8, s, diloco_losses[s], False, True, 100_000),
                 _row(W, "sparseloco", 64, 1.5, None, s, sl_losses[s], False, True, 800),
                 _row(W, "sparseloco", 128, 0.75, None, s, 2.01, False, True, 1600)]
    config = {"model": {"layers": 2, "hidden": 128, "heads": 4, "seq": 128, "vocab": 257}, "numel": numel,
              "steps": 900, "H": 15, "workers": [W], "seeds": [0, 1, 2], "inner": {"lr": 1e-3, "micro_batch": 4},
              "tuned_per_w": {str(W): {"diloco": [0.5, 0.8], "sparseloco": [1.5, None], "sparseloco:128": [0.75, None]}},
              "defaults": {str(W): {"diloco": {"lr": 0.7, "momentum": 0.9}, "sparseloco": {"lr": 2.0},
                                    "sparseloco:128": {"lr": 1.5}}}}
    command = command or PLAN[f"quality_w{W}"]
    config["sweep"] = {"grid": R.sweep_grid_of(command)}     # the grid today's code sweeps for that command
    return schema.document("quality", command, config, rows, machine=dict(MACHINE),
                           load="1.0 1.0 1.0 -> 2.0 2.0 2.0")


def network_doc(W):
    def row(method, k, lr, mu, loss, outer_s, t):
        return {"case": "uniform", "method": method, "k": k, "label": f"{method} k={k}", "workers": W,
                "outer_lr": lr, "outer_momentum": mu, "held_out_loss": loss, "sync_outer_step_s": outer_s,
                "sync_communicate_s": outer_s / 2, "step_s": 0.05, "time_to_diloco_s": t, "overlap_steps": 0,
                "fragments": 1, "bytes_sent_per_worker": 10, "curve": [
                    {"step": 15, "wall_s": 1.0, "held_out_loss": 3.0}, {"step": 900, "wall_s": 60.0, "held_out_loss": loss}]}
    rows = [row("diloco", None, 0.5, 0.8, 2.10, 0.8, 60.0), row("sparseloco", 64, 1.5, None, 2.05, 0.1, 41.0),
            row("sparseloco", 128, 1.0, None, 2.0, 0.1, 30.0)]
    for r in rows:   # what network.py writes: the run's resolved outer settings in "outer"
        r["outer"] = {"lr": r.pop("outer_lr"), **({"momentum": r.pop("outer_momentum")} if r["method"] == "diloco"
                                                    else {"k": r["k"]})}
        r.pop("outer_momentum", None)
    plan = {b.name: b.command for b in R.PLAN}
    return schema.document("network", plan[f"network_w{W}"], {"model": {}}, rows, machine=dict(MACHINE))


def write(tmp_path, name, doc):
    (tmp_path / f"{name}.json").write_text(json.dumps(doc))


def test_the_headline_is_computed_from_the_seeds_at_the_chosen_settings(tmp_path):
    write(tmp_path, "quality_w4", quality_doc(4, numel=3_258_112))   # the lr rule's 3.26 M scale
    docs = R.load_results(str(tmp_path))
    page = R.render_page(docs)
    # DiLoCo 2.10 / 2.12 / 2.14: mean 2.12, spread 0.04; SparseLoCo k = 64 2.05 / 2.13 / 2.08: mean 2.0867,
    # ahead of DiLoCo on seeds 0 and 2 only
    assert "| 4 | DiLoCo | 0.5 / 0.8 | 2.1200 ± 0.040 (3) |  |  | 100.0 kB |" in page
    assert "| 4 | SparseLoCo k = 64 | 1.5 | 2.0867 ± 0.080 (3) | -0.033 | 2 of 3 | 800 B |" in page
    assert "| 4 | SparseLoCo k = 128 | 0.75 | 2.0067 ± 0.010 (3) | -0.113 | 3 of 3 | 1.6 kB |" in page
    assert "| 2 | not measured yet |" in page and "| 8 | not measured yet |" in page
    # k = 64's lead (0.033) is below the spreads (0.080, 0.040): level; k = 128's (0.113) is not
    assert ("SparseLoCo k = 64 is level with DiLoCo (within the seeds' spread) at W = 4 (-0.033). SparseLoCo k = 128 "
            "is ahead of DiLoCo at W = 4 (-0.113).") in page
    # bytes: DiLoCo's over SparseLoCo k = 64's, per outer step (60 of them)
    assert "**125.0×**" in page and "1.7 kB" in page
    # the sweep table: every point, the chosen one bold, k = 128 flagged on its low edge, k = 64 inside
    assert "**1.5 2.0500**" in page and "2.12" not in page.split("## Sweeps")[1].split("k = 64")[0]
    sweep_128 = next(l for l in page.splitlines() if l.startswith("| 4 | SparseLoCo k = 128 | **0.75 2.0000**"))
    assert sweep_128.endswith("**yes: lowest lr** |")
    sweep_64 = next(l for l in page.splitlines() if l.startswith("| 4 | SparseLoCo k = 64 | 1.06 2.2000"))
    assert sweep_64.endswith("| no |")
    # today's plugin defaults at W = 4 on a 3.26 M model (the rule: 1.06 at k = 64, 0.75 at k = 128), not the
    # file's record
    assert "1.06 2.2000 (default)" in sweep_64 and "**0.75 2.0000** (default)" in sweep_128
    diloco_sweep = next(l for l in page.splitlines() if l.startswith("| 4 | DiLoCo | **0.5 / 0.8 2.1000**"))
    assert "**0.5 / 0.8 2.1000**," in diloco_sweep and "0.7 / 0.9 2.3000 (default)" in diloco_sweep
    # the command and the machine under the table
    assert PLAN["quality_w4"] in page and "Test CPU, 2 CPUs" in page and "load 1.0 1.0 1.0 -> 2.0 2.0 2.0" in page
    assert "![W = 4:" in page and R.plot_names(docs) == ["results_W4.png"]


def test_the_machine_line_says_which_runs_came_from_an_earlier_run(tmp_path):
    doc = quality_doc(2)
    for r in doc["rows"][:3]:
        r["reused_from"] = "docs/results/quality_w2_first.json (3ebde43, 2026-12-05)"
    write(tmp_path, "quality_w2", doc)
    page = R.render_page(R.load_results(str(tmp_path)))
    assert "for the 10 of 13 runs this launch made (3 from an earlier run at 3ebde43, same CPU model)" in page


def test_the_machine_line_says_which_runs_an_interrupted_launch_made(tmp_path):
    doc = quality_doc(2)
    doc["wall_s"] = 600.0
    for r in doc["rows"][:4]:
        r["resumed_from_journal"] = ["1420dd8"]
    write(tmp_path, "quality_w2", doc)
    page = R.render_page(R.load_results(str(tmp_path)))
    assert "10 min for the 9 of 13 runs this launch made (4 by an interrupted launch at 1420dd8)" in page


def test_the_machine_line_says_which_runs_another_cpu_model_made(tmp_path):
    doc = quality_doc(2)
    for r in doc["rows"][:4]:
        r["resumed_from_journal"] = ["1420dd8"]
    for r in doc["rows"][:3]:
        r["made_on_cpu"] = "Intel(R) Xeon(R) Processor"
    write(tmp_path, "quality_w2", doc)
    page = R.render_page(R.load_results(str(tmp_path)))
    assert ("for the 9 of 13 runs this launch made (4 by an interrupted launch at 1420dd8, 3 of them on another "
            "CPU model, Intel(R) Xeon(R) Processor)") in page


def test_a_reused_run_counts_as_reused_whatever_made_it_in_its_own_file(tmp_path):
    """A run taken with --reuse keeps its earlier file's journal mark; it is counted once, as reused."""
    doc = quality_doc(2)
    for r in doc["rows"][:3]:
        r.update(reused_from="docs/results/quality_w2.json (905ffd8, 2026-12-05)", resumed_from_journal=["1420dd8"])
    for r in doc["rows"][3:5]:
        r["resumed_from_journal"] = ["af5e1af"]
    write(tmp_path, "quality_w2", doc)
    page = R.render_page(R.load_results(str(tmp_path)))
    assert ("for the 8 of 13 runs this launch made (3 from an earlier run at 905ffd8, same CPU model; "
            "2 by an interrupted launch at af5e1af)") in page


def test_a_second_size_measured_at_one_w_keeps_the_other_ws_command(tmp_path):
    write(tmp_path, "quality_4x256_w4", quality_doc(4))
    page = R.render_page(R.load_results(str(tmp_path)))
    size2 = page.split("## A second model size")[1].split("## Elastic")[0]
    assert "| 8 | not measured yet |" in size2 and PLAN["quality_4x256_w8"] in size2


def test_the_readme_says_the_second_size_in_one_sentence_from_its_file(tmp_path):
    write(tmp_path, "quality_w4", quality_doc(4))
    assert "larger model" not in R.render_readme_block(R.load_results(str(tmp_path)))
    large = quality_doc(4, sl_losses=(1.90, 1.92, 1.91))
    large["config"]["numel"] = 3_258_112
    write(tmp_path, "quality_4x256_w4", large)
    block = R.render_readme_block(R.load_results(str(tmp_path)))
    # k = 64: 1.91 against DiLoCo's 2.12, further apart than either spread (0.02, 0.04)
    assert ("On a 7× larger model (3.26 M parameters, the same protocol on a grid widened for it, 3 seeds): "
            "SparseLoCo k = 64 is ahead of DiLoCo at W = 4 (-0.210).") in block
    assert "Bytes sent per worker: DiLoCo 100.0 kB → SparseLoCo k = 64 800 B (125× fewer)." in block
    # today's default lr at W = 4 (1.06, loss 2.2) is below the chosen 1.5 (seed 0: 1.90)
    assert ("On it SparseLoCo's best outer lr is not the plugin's default (1.5 vs 1.06 at W = 4; the default costs "
            "+0.300 at seed 0): set `--sparseloco-outer-lr` there.") in block
    assert "Measured on Other CPU" not in block and "Against DDP at this size" not in block
    write(tmp_path, "quality_4x256_ddp", ddp_doc([4], losses=(1.80, 1.81, 1.82)))
    block = R.render_readme_block(R.load_results(str(tmp_path)))
    # DDP 1.81 ± 0.01 at this size: k = 64's 1.91 is behind it by +0.100, k = 128's 2.0067 by +0.197, DiLoCo's 2.12
    assert ("Against DDP at this size (negative: SparseLoCo lower): SparseLoCo k = 64 is behind DDP at W = 4 "
            "(+0.100). SparseLoCo k = 128 is behind DDP at W = 4 (+0.197). DiLoCo against DDP: +0.310 at W = 4. "
            "Bytes sent per worker, DDP over SparseLoCo k = 64: 2,000,000× at W = 4.") in block
    (tmp_path / "quality_4x256_ddp.json").unlink()
    large["machine"]["cpu"] = "Other CPU"          # a machine other than the headline's is named
    write(tmp_path, "quality_4x256_w4", large)
    assert "Measured on Other CPU at W = 4." in R.render_readme_block(R.load_results(str(tmp_path)))
    for W, cpu in ((2, "Other CPU"), (8, "Test CPU")):   # each machine named once, with its W
        doc = quality_doc(W, sl_losses=(1.90, 1.92, 1.91))
        doc["config"]["numel"], doc["machine"]["cpu"] = 3_258_112, cpu
        write(tmp_path, f"quality_4x256_w{W}", doc)
    block = R.render_readme_block(R.load_results(str(tmp_path)))
    assert "Measured on Other CPU at W = 2, 4 and Test CPU at W = 8." in block
    # the rule's value is the chosen 1.5 at W = 2; 0.75 at W = 8 is off the grid: only W = 4 is named
    assert "(1.5 vs 1.06 at W = 4; the default costs +0.300 at seed 0)" in block


def test_the_defaults_cost_is_read_from_the_sweep(tmp_path):
    """Today's default point's seed-0 loss minus the chosen point's: DiLoCo 0.7 / 0.9 (2.30 − 2.10), k = 128 at the
    rule's 1.06 (2.1 − 2.0); k = 64's rule gives the chosen 1.5 at W = 2. The file's recorded defaults (what the
    plugin had when it ran) do not enter: the page says what running without the flags costs today."""
    doc = quality_doc(2, numel=3_258_112)   # the lr rule's 3.26 M scale
    write(tmp_path, "quality_w2", doc)
    page = R.render_page(R.load_results(str(tmp_path)))
    expected = ("Without the outer lr / momentum flags (the plugin's defaults; seed 0 of the sweep): DiLoCo at W = 2: "
                "0.7 / 0.9 → 2.3000, +0.200 over the chosen 0.5 / 0.8; SparseLoCo k = 128 at W = 2: 1.06 → 2.1000, "
                "+0.100 over the chosen 0.75. The default is the chosen point for SparseLoCo k = 64 at W = 2.")
    assert expected in page
    doc["config"]["defaults"]["2"] = {"diloco": {"lr": 0.9, "momentum": 0.99}, "sparseloco": {"lr": 2.12},
                                      "sparseloco:128": {"lr": 0.75}}
    write(tmp_path, "quality_w2", doc)
    assert expected in R.render_page(R.load_results(str(tmp_path)))
    doc["rows"] = [r for r in doc["rows"] if not (r["method"] == "diloco" and r["outer_lr"] == 0.7)]
    write(tmp_path, "quality_w2", doc)
    assert "Not on the grid: the default of DiLoCo at W = 2." in R.render_page(R.load_results(str(tmp_path)))


def test_the_size_comparison_is_each_files_mean_difference(tmp_path):
    write(tmp_path, "quality_w4", quality_doc(4))                      # k = 64 − DiLoCo: 2.0867 − 2.12
    large = quality_doc(4, diloco_losses=(2.0, 2.2, 2.1), sl_losses=(1.90, 1.92, 1.91))
    large["config"]["numel"] = 3_258_112
    write(tmp_path, "quality_4x256_w4", large)                         # 1.91 − 2.10; k = 128: 2.0067 − 2.10
    write(tmp_path, "quality_w8", quality_doc(8))                      # no second size at W = 8: no row
    page = R.render_page(R.load_results(str(tmp_path)))
    cmp_ = page.split("Where the comparison moves with size")[1].split("\n## ")[0]
    assert "| W | Δ SparseLoCo k = 64 − DiLoCo: 446 k model | 3.26 M model |" in cmp_
    assert "| 4 | -0.033 | -0.190 | -0.113 | -0.093 |" in cmp_ and "| 8 |" not in cmp_
    assert "From the 446 k to the 3.26 M model, SparseLoCo k = 64 − DiLoCo goes from -0.033 to -0.190 at W = 4." in cmp_


def test_the_network_columns_and_the_readme_table_come_from_the_network_file(tmp_path):
    write(tmp_path, "quality_w2", quality_doc(2))
    write(tmp_path, "network_w2", network_doc(2))
    docs = R.load_results(str(tmp_path))
    page = R.render_page(docs)
    assert "| 2 | DiLoCo | 0.5 / 0.8 | 2.1200 ± 0.040 (3) |  |  | 100.0 kB | 0.80 s | 60.0 s |" in page
    assert "| 2 | SparseLoCo k = 64 | 1.5 | 2.0867 ± 0.080 (3) | -0.033 | 2 of 3 | 800 B | 0.10 s | 41.0 s |" in page
    # the link's share: the communicate column over the outer step column, per method
    assert "Communicating takes DiLoCo 0.400 s and SparseLoCo k = 64 0.050 s per outer step at W = 2 (50 % and 50 %" in page
    block = R.render_readme_block(docs)
    assert block.startswith(R.README_BEGIN) and block.endswith(R.README_END)
    assert ("| 2 | not measured yet | 2.120 ± 0.040 | 2.087 ± 0.080 | 2.007 ± 0.010 | 100.0 kB → 800 B | 60 s → 41 s |"
            in block)
    assert "docs/results.md" in block


def elastic_row(scenario, goodput, **kw):
    row = {"scenario": scenario, "seed": 0, "after_failed_round": "keep", "wall_s": 120.0, "rounds_committed": 30,
           "rounds_failed": 0, "goodput_steps_per_s": goodput, "computed_steps": 1350, "useful_steps": 1350,
           "discarded_steps": 0, "detection_s": None, "rejoin_s": None, "heal_s": None, "heal_bytes": None,
           "held_out_loss": 2.5, "load_avg_start": 3.0, "load_avg_end": 3.0, "round_s_mean": 4.0,
           "quorum_s_mean": 0.05, "header_s_mean": 0.01, "step_compute_s_median": 0.1, "steps_over_pace": 0}
    row.update(kw)
    return row


def test_missing_files_render_their_command_and_elastic_appears_when_written(tmp_path):
    docs = R.load_results(str(tmp_path))
    page = R.render_page(docs)
    assert "Not measured yet" in page and PLAN["quality_w2"] in page
    assert PLAN["elastic"] in page and PLAN["memory"] in page
    cfg = {"workers": 3, "H": 15, "step_seconds": 0.25, "seconds": 120, "kill_at": 0.3, "restart_after": 0.2}
    write(tmp_path, "elastic", schema.document("elastic", PLAN["elastic"], cfg, [
        elastic_row("failure-free", 10.0),
        elastic_row("elastic-keep", 9.1, detection_s=6.0, rejoin_s=30.0, heal_s=0.4, heal_bytes=2e6)],
        machine=dict(MACHINE)))
    page = R.render_page(R.load_results(str(tmp_path)))
    elastic = page.split("## Elastic workers under a failure")[1].split("\n## ")[0]
    assert "| failure-free | 120 | 30 / 0 | 10.00 | 100.0% |" in elastic
    assert "| elastic-keep | 120 | 30 / 0 | 9.10 | 91.0% | 0 | 6.00 | 30.00 | 0.40 / 2.0 |" in elastic
    assert "| failure-free | 4.000 | 0.050 | 0.010 | 1.5% |" in elastic      # quorum + header share of the round
    assert PLAN["elastic"] in elastic and R.plan_problems(R.load_results(str(tmp_path))) == []


def test_a_file_made_by_another_command_or_grid_than_make_bench_is_refused(tmp_path):
    write(tmp_path, "quality_w4", quality_doc(4))
    assert R.plan_problems(R.load_results(str(tmp_path))) == []
    write(tmp_path, "quality_w2", quality_doc(2, command="python benchmarks/quality.py --tuned t.json --workers 2"))
    write(tmp_path, "stray", quality_doc(2))
    old_grid = quality_doc(8)
    old_grid["config"]["sweep"]["grid"]["diloco"] = old_grid["config"]["sweep"]["grid"]["diloco"][:-1]
    write(tmp_path, "quality_w8", old_grid)          # the code's grid grew after the file was made
    problems = R.plan_problems(R.load_results(str(tmp_path)))
    assert any("quality_w2.json: made by" in p for p in problems)
    assert any("stray.json: not in render_results.PLAN" in p for p in problems)
    assert any("quality_w8.json: swept another grid" in p for p in problems)
    assert not any("quality_w4" in p for p in problems)


def test_a_tuned_file_made_at_other_settings_than_its_tuned_file_holds_is_refused(tmp_path):
    """A --tuned quality file (the schedule's) records the settings it ran; when the --tuned file changes (DDP's
    swept lr added to it), the file is stale until rerun."""
    with open(os.path.join(ROOT, "benchmarks", "grids", "tuned_w4.json")) as f:
        today = json.load(f)
    sched = quality_doc(4)
    sched["command"] = PLAN["quality_schedule_w4"]
    sched["config"].pop("sweep")
    sched["config"]["tuned_per_w"] = {"4": today}
    write(tmp_path, "quality_schedule_w4", sched)
    assert R.plan_problems(R.load_results(str(tmp_path))) == []
    sched["config"]["tuned_per_w"] = {"4": {k: v for k, v in today.items() if k != "ddp"}}
    write(tmp_path, "quality_schedule_w4", sched)
    (problem,) = R.plan_problems(R.load_results(str(tmp_path)))
    assert "quality_schedule_w4.json: ran other settings than its --tuned file holds today" in problem


def test_check_reports_a_stale_page_and_readme(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    write(results, "quality_w2", quality_doc(2))
    page, readme = tmp_path / "results.md", tmp_path / "README.md"
    readme.write_text(f"intro\n{R.README_BEGIN}\nold\n{R.README_END}\nrest\n")
    R.render(str(results), str(page), str(readme), plots=False)
    assert readme.read_text().startswith("intro\n") and readme.read_text().endswith("\nrest\n")
    assert [p for p in R.check(str(results), str(page), str(readme)) if "results_W2.png" not in p] == []
    doc = quality_doc(2, diloco_losses=(2.10, 2.12, 2.20))       # a file changes, the page does not
    write(results, "quality_w2", doc)
    problems = R.check(str(results), str(page), str(readme))
    assert any("results.md differs" in p for p in problems) and any("README.md" in p for p in problems)


@pytest.mark.parametrize("broken, message", [
    (lambda d: d.pop("command"), "missing key 'command'"),
    (lambda d: d.update(rows=[]), "rows: not a non-empty list"),
    (lambda d: d["machine"].pop("cpu"), "machine: missing 'cpu'"),
    (lambda d: d.update(schema=0), "schema is 0"),
    (lambda d: d.update(command="make bench"), "not a 'python benchmarks/...' command line"),
])
def test_the_schema_check_names_what_is_wrong(broken, message):
    doc = quality_doc(2)
    assert schema.check(doc) == []
    broken(doc)
    assert any(message in p for p in schema.check(doc)), schema.check(doc)


def streaming_row(scenario, method, tau, P, exposed, loss, **kw):
    row = {"scenario": scenario, "method": method, "mode": "blocking" if not tau and P == 1 else
           ("overlap" if tau else "fragments"), "overlap_steps": tau, "fragments": P, "iterations": 300 + tau,
           "wall_s": 90.0, "rounds_committed": 20, "rounds_failed": 0, "exposed_s_per_round": exposed,
           "quorum_s_per_round": 0.05, "bytes_sent_per_round": 14736.0, "held_out_loss": loss,
           "goodput_steps_s": 10.0, "grace_s": 0.0, "pace_s": 0.25}
    row.update(kw)
    return row


def test_the_elastic_streaming_tables_compare_every_mode_with_blocking_and_the_kill_with_its_failure_free_row(tmp_path):
    cfg = {"workers": 3, "iters": 300, "kill_iters": 600, "inner_steps": 15, "pace_s": 0.25, "rate": "100mbit"}
    write(tmp_path, "elastic_streaming", schema.document("elastic_streaming", PLAN["elastic_streaming"], cfg, [
        streaming_row("mode", "diloco", 0, 1, 0.40, 2.50),
        streaming_row("mode", "diloco", 2, 1, 0.02, 2.51),
        streaming_row("kill", "diloco", 2, 1, 0.03, 2.52, goodput_steps_s=9.2, killed_s=30.0, rejoin_s=35.0,
                      rounds_failed=1),
        streaming_row("slow", "sparseloco", 0, 1, 0.1, 2.6, grace_s=0.5, others_steps_s=8.0, slow_contributions=5,
                      slow_rounds=6, slow_wall_s=80.0)], machine=dict(MACHINE)))
    page = R.render_page(R.load_results(str(tmp_path)))
    part = page.split("## Streaming rounds in elastic mode")[1].split("\n## ")[0]
    assert "| diloco | blocking | 0 | 1 | 0.400 | 100.0% | 2.500 | +0.000 | 20 / 0 | 14.7 kB |" in part
    assert "| diloco | overlap | 2 | 1 | 0.020 | 5.0% | 2.510 | +0.010 | 20 / 0 | 14.7 kB |" in part
    assert "| diloco | 2 | 30.0 | 90.0 | 9.20 | 92.0% | 35.0 | 20 / 1 |" in part
    assert "| 0.5 | 8.00 | 6 / 5 | 80.0 |" in part
    assert PLAN["elastic_streaming"] in part and R.plan_problems(R.load_results(str(tmp_path))) == []


def ddp_doc(workers, losses=(1.90, 1.91, 1.92), size_args="", cpu="Test CPU"):
    """A DDP file (quality.py --methods ddp): 3 seeds at every W, fp32 gradients every step as its bytes."""
    rows = [{"method": "ddp", "k": None, "label": "ddp", "seed": s, "workers": W, "steps": 900, "H": None,
             "outer_lr": None, "outer_momentum": None, "held_out_loss": losses[s], "bytes_sent_per_worker": 1.6e9,
             "bytes_received_per_worker": None, "numel": 446_000, "sweep": False, "seed_run": True,
             "curve": [{"step": 900, "tokens": 1, "bytes_per_worker": 1.6e9, "held_out_loss": losses[s], "wall_s": 9.0}]}
            for W in workers for s in range(3)]
    config = {"model": {}, "numel": 446_000, "steps": 900, "H": 15, "workers": list(workers), "seeds": [0, 1, 2],
              "inner": {"lr": 1e-3, "micro_batch": 4}, "tuned_per_w": {}}
    return schema.document("quality", PLAN["quality_ddp"], config, rows, machine=dict(MACHINE, cpu=cpu))


def test_ddp_sits_beside_diloco_and_sparseloco_in_the_headline_the_reading_and_the_readme(tmp_path):
    write(tmp_path, "quality_w4", quality_doc(4))
    docs = R.load_results(str(tmp_path))
    assert "| 4 | DDP |" not in R.render_page(docs) and PLAN["quality_ddp"] in R.render_page(docs)
    write(tmp_path, "quality_ddp", ddp_doc([2, 4, 8]))
    docs = R.load_results(str(tmp_path))
    page = R.render_page(docs)
    # DDP 1.90 / 1.91 / 1.92 against DiLoCo's 2.12 mean: the synchronous baseline's row first, its gap to DiLoCo
    assert ("| 4 | DDP | every step | 1.9100 ± 0.020 (3) | -0.210 |  | 1.6 GB | | |\n"
            "| 4 | DiLoCo | 0.5 / 0.8 |") in page
    assert "| 2 | not measured yet | | | | | | | |\n| 2 | DDP | every step | 1.9100 ± 0.020 (3) |" in page
    # k = 64: 2.0867 − 1.91 = +0.177, beyond both spreads (0.080, 0.020); k = 128: 2.0067 − 1.91 = +0.097 (0.010, 0.020)
    assert ("Against DDP (every step's gradients all-reduced, the same tokens and inner optimizer; negative: SparseLoCo "
            "lower): SparseLoCo k = 64 is behind DDP at W = 4 (+0.177). SparseLoCo k = 128 is behind DDP at W = 4 "
            "(+0.097). DiLoCo against DDP: +0.210 at W = 4. Bytes sent per worker, DDP over SparseLoCo k = 64: "
            "2,000,000× at W = 4.") in page
    block = R.render_readme_block(docs)
    assert ("| 4 | 1.910 ± 0.020 | 2.120 ± 0.040 | 2.087 ± 0.080 | 2.007 ± 0.010 | 1.6 GB → 100.0 kB → 800 B | "
            "not measured yet |") in block
    assert "SparseLoCo k = 64 is behind DDP at W = 4 (+0.177)" in block and "(DDP: " not in block
    write(tmp_path, "quality_ddp", ddp_doc([2, 4, 8], cpu="Other CPU"))   # measured elsewhere: said so
    assert "Measured on Test CPU (2 CPUs) (DDP: Other CPU, 2 CPUs);" in R.render_readme_block(R.load_results(str(tmp_path)))
    # a size's quality file that ran DDP itself gives DDP's row from there
    q = quality_doc(4)
    q["rows"] += ddp_doc([4], losses=(2.2, 2.3, 2.4))["rows"]
    write(tmp_path, "quality_w4", q)
    assert "| 4 | DDP | every step | 2.3000 ± 0.200 (3) | +0.180 |" in R.render_page(R.load_results(str(tmp_path)))


def swept_ddp_doc(W, sweep, chosen_lr, seed_losses):
    """A DDP file whose lr was swept at W (a "ddp" sweep grid): seed 0 at each (lr, loss) of ``sweep``, seeds 1
    and 2 at ``chosen_lr``."""
    def row(lr, seed, loss, sweep_, seed_run):
        return {"method": "ddp", "k": None, "label": "ddp" if lr == 1e-3 else f"ddp lr={lr:g}", "seed": seed,
                "workers": W, "steps": 900, "H": None, "outer_lr": None, "outer_momentum": None, "held_out_loss": loss,
                "bytes_sent_per_worker": 1.6e9, "bytes_received_per_worker": None, "numel": 446_000,
                "sweep": sweep_, "seed_run": seed_run, "run": {"method": "ddp", "lr": lr},
                "curve": [{"step": 900, "tokens": 1, "bytes_per_worker": 1.6e9, "held_out_loss": loss, "wall_s": 9.0}]}
    rows = [row(lr, 0, loss, True, lr == chosen_lr) for lr, loss in sweep]
    rows += [row(chosen_lr, s, seed_losses[s - 1], False, True) for s in (1, 2)]
    command = (f"python benchmarks/quality.py --sweep --sweep-each-w --workers {W} --steps 900 --seeds 3 --methods ddp "
               f"--sweep-grid '{json.dumps({'ddp': [[lr, None] for lr, _ in sweep]})}' --json docs/results/x.json")
    config = {"model": {}, "numel": 446_000, "steps": 900, "H": 15, "workers": [W], "seeds": [0, 1, 2],
              "inner": {"lr": 1e-3, "micro_batch": 4}, "tuned_per_w": {str(W): {"ddp": [chosen_lr, None]}},
              "sweep": {"grid": R.sweep_grid_of(command)}}
    return schema.document("quality", command, config, rows, machine=dict(MACHINE))


def test_a_swept_ddp_lr_sets_ddps_row_and_the_page_shows_its_sweep(tmp_path):
    """DDP's row is its seeds at the lr its sweep chose (not the other lrs' seed-0 runs); the table names that lr,
    the DDP paragraph lists the sweep with the chosen point bold and an edge flagged, and the README says DDP was
    tuned; an unswept DDP file keeps the untuned caveat."""
    write(tmp_path, "quality_w4", quality_doc(4))
    write(tmp_path, "quality_ddp", ddp_doc([4]))
    docs = R.load_results(str(tmp_path))
    assert "Its lr is the shared inner lr, not tuned for it" in R.render_page(docs)
    assert "at the shared inner lr: not tuned for it" in R.render_readme_block(docs)
    write(tmp_path, "quality_ddp", swept_ddp_doc(4, [(0.000707, 1.95), (0.001, 1.93), (0.00141, 1.90)], 0.00141,
                                                 (1.91, 1.92)))
    docs = R.load_results(str(tmp_path))
    page = R.render_page(docs)
    # seeds 1.90 / 1.91 / 1.92 at lr 0.00141: mean 1.91, spread 0.02 (the 1.95 and 1.93 sweep runs are not in it)
    assert "| 4 | DDP | every step, lr 0.00141 | 1.9100 ± 0.020 (3) | -0.210 |" in page
    assert ("Its lr is tuned per W as the outer-loop methods' outer settings are: swept on seed 0 by √2 steps around "
            "the shared inner lr, its seeds then run at the lowest held-out loss (bold): W = 4: 0.000707 → 1.9500, "
            "0.001 → 1.9300, **0.00141 → 1.9000** (the grid's highest: widen it).") in page
    assert "not tuned for it" not in page
    block = R.render_readme_block(docs)
    assert "every step, its lr tuned at each W)" in block and "not tuned for it" not in block
    write(tmp_path, "quality_ddp", swept_ddp_doc(4, [(0.000707, 1.95), (0.001, 1.90), (0.00141, 1.93)], 0.001,
                                                 (1.91, 1.92)))
    page = R.render_page(R.load_results(str(tmp_path)))
    assert "| 4 | DDP | every step, lr 0.001 | 1.9100 ± 0.020 (3) |" in page
    assert "**0.001 → 1.9000**, 0.00141 → 1.9300." in page


def test_the_default_lr_table_measures_todays_rule_at_every_size_against_the_target(tmp_path):
    write(tmp_path, "quality_w2", quality_doc(2))            # 446 k: the rule's 2.12 against the chosen 1.5
    section = R.render_page(R.load_results(str(tmp_path))).split("## The default outer lr across")[1]
    assert "| 2 layers × 128 | 446 k | 2 | 2.12 | 1.5 | +0.250 |" in section   # the size term: one step higher
    write(tmp_path, "quality_w2", quality_doc(2, numel=3_258_112))   # the rule's 1.5 is the chosen point at W = 2
    docs = R.load_results(str(tmp_path))
    section = R.render_page(docs).split("## The default outer lr across model sizes")[1].split("\n## ")[0]
    assert "| 2 layers × 128 | 3.26 M | 2 | 1.5 | 1.5 | +0.000 |" in section
    assert "Today's default costs at most +0.000 over the best lr on the grid (2 layers × 128 at W = 2), seed 0; " \
           "the target is at most 0.05 at every measured size and W: met." in section
    large = quality_doc(4, sl_losses=(1.90, 1.92, 1.91))    # W = 4: the rule's 1.06 (2.2) against the chosen 1.5 (1.90)
    large["config"]["numel"] = 3_258_112
    write(tmp_path, "quality_4x256_w4", large)
    third = quality_doc(8)                                   # W = 8: the rule's 0.75 is not on this grid
    third["config"]["numel"] = 10_900_000
    write(tmp_path, "quality_6x384_w8", third)
    section = R.render_page(R.load_results(str(tmp_path))).split("## The default outer lr across")[1].split("\n## ")[0]
    assert "| 4 layers × 256 | 3.26 M | 4 | 1.06 | 1.5 | +0.300 |" in section
    assert "6 layers × 384" not in section                   # W = 8 is not a W the page measures the third size at
    assert "missed at 4 layers × 256 at W = 4 (+0.300)." in section


def test_the_third_size_has_its_section_with_ddp_from_its_own_file(tmp_path):
    page = R.render_page(R.load_results(str(tmp_path)))
    third = page.split("## A third model size: 6 layers × 384")[1].split("\n## ")[0]
    assert PLAN["quality_6x384_w4"] in third and "Not measured yet" in third
    doc = quality_doc(4)
    doc["config"]["numel"], doc["config"]["seeds"] = 10_900_000, [0]
    doc["rows"] = [r for r in doc["rows"] if r["seed"] == 0]
    write(tmp_path, "quality_6x384_w4", doc)
    third = R.render_page(R.load_results(str(tmp_path))).split("## A third model size")[1].split("\n## ")[0]
    assert "About 3× the second size (10.90 M parameters), W = 4, the same protocol otherwise; seed 0" in third
    assert "| 4 | SparseLoCo k = 64 | 1.5 | 2.0500 ± 0.000 (1) |" in third
    assert "; DiLoCo on lr / μ 0.35 / 0.6, 0.35 / 0.8, " in third and "1 / 0.8 and 1 / 0.9." in third   # its grid
    second = quality_doc(4)                                   # the second size's DiLoCo choice at W = 4: 0.5 / 0.8
    second["config"]["numel"] = 3_258_112
    write(tmp_path, "quality_4x256_w4", second)
    third = R.render_page(R.load_results(str(tmp_path))).split("## A third model size")[1].split("\n## ")[0]
    assert "1 / 0.9, around its choice on the second size at W = 4 (0.5 / 0.8)." in third
    assert PLAN["quality_6x384_ddp"] in third                 # DDP's file is not there yet: its command
    ddp = ddp_doc([4])
    ddp["command"] = PLAN["quality_6x384_ddp"]
    write(tmp_path, "quality_6x384_ddp", ddp)
    third = R.render_page(R.load_results(str(tmp_path))).split("## A third model size")[1].split("\n## ")[0]
    assert "| 4 | DDP | every step | 1.9100 ± 0.020 (3) | -0.190 |" in third and "Not measured yet" not in third


def test_an_elastic_file_made_at_another_default_outer_lr_is_marked_superseded():
    """Today's default for the file's jobs and model (its recorded numel, its model dict, or an "L layers x H"
    description) against the lr it ran at (recorded, or the first file's 1.73)."""
    from megatron_sparseloco.outer.sparseloco import default_outer_lr
    quality, big = {"layers": 2, "hidden": 128, "heads": 4, "seq": 128, "vocab": 257}, 3258112
    today = default_outer_lr(3, 64, 4096, 446080)
    assert today == R.ELASTIC_STREAMING_FIRST_LR == 1.73   # the quality model at 3 jobs: the first files' lr again
    assert R.outer_lr_note({"config": {"workers": 3, "model": quality, "outer": {"lr": today}}}) == []
    assert R.outer_lr_note({"config": {"workers": 3, "numel": 446080, "sparseloco_outer_lr": today}}) == []
    assert R.outer_lr_note({"config": {"workers": 3, "model": "2 layers x 128 (446 k), seq 128"}}) == []
    note = R.outer_lr_note({"config": {"workers": 3, "model": quality, "outer": {"lr": 1.22}}})[0]
    assert note.startswith(f"**Superseded in part**: SparseLoCo ran at outer lr 1.22; today's default for 3 jobs is "
                           f"{today:g}")
    other = default_outer_lr(3, 64, 4096, big)
    assert other != today and "the file predates recording it" in R.outer_lr_note({"config": {"workers": 3,
                                                                                              "numel": big}})[0]


def schedule_text(tmp_path):
    return R.render_page(R.load_results(str(tmp_path))).split("## A Megatron-style schedule")[1].split("\n## ")[0]


def schedule_doc(W, diloco_losses, sl_losses, ddp_losses, command):
    """A schedule file (warmup + cosine + clipping): a quality file's DiLoCo and k = 64 rows and a DDP's."""
    doc = quality_doc(W, diloco_losses=diloco_losses, sl_losses=sl_losses, command=command)
    doc["rows"] = [r for r in doc["rows"] if r["k"] != 128] + ddp_doc([W], losses=ddp_losses)["rows"]
    if "--tuned" in command:     # no sweep: the seeds at the --tuned file's settings only
        doc["rows"] = [dict(r, sweep=False) for r in doc["rows"] if r["seed_run"]]
    doc["config"]["inner"] = {"lr": 1e-3, "micro_batch": 4, "lr_warmup_fraction": 0.1, "lr_decay_style": "cosine",
                              "min_lr": 1e-4, "clip_grad": 1.0,
                              "schedule": "linear warmup over 0.1 of the steps from 0, then cosine decay to 0.0001"}
    return doc


def test_the_schedule_section_compares_each_method_with_its_constant_lr_rows_and_says_if_the_ranking_holds(tmp_path):
    write(tmp_path, "quality_w4", quality_doc(4))                         # DiLoCo 2.12, k = 64 2.0867
    write(tmp_path, "quality_ddp", ddp_doc([4]))                          # DDP 1.91
    sched = schedule_doc(4, (2.0, 2.02, 2.04), (1.95, 1.97, 1.99), (1.80, 1.81, 1.82), PLAN["quality_schedule_w4"])
    write(tmp_path, "quality_schedule_w4", sched)
    section = schedule_text(tmp_path)
    assert "| DDP | every step | 1.9100 ± 0.020 (3) | every step | 1.8100 ± 0.020 (3) | -0.100 |" in section
    assert "| DiLoCo | 0.5 / 0.8 | 2.1200 ± 0.040 (3) | 0.5 / 0.8 | 2.0200 ± 0.040 (3) | -0.100 |" in section
    assert "| SparseLoCo k = 64 | 1.5 | 2.0867 ± 0.080 (3) | 1.5 | 1.9700 ± 0.040 (3) | -0.117 |" in section
    assert "not swept again under the schedule" in section and "constant-lr rows ran on" not in section
    assert PLAN["quality_schedule_4x256_w4"] in section.split("### 4 layers × 256")[1]   # the second size: not yet
    assert ("constant lr DDP < SparseLoCo k = 64 < DiLoCo; with the schedule DDP < SparseLoCo k = 64 < DiLoCo: "
            "the ranking holds.") in section
    sched["rows"] = [dict(r, held_out_loss=2.5) if r["method"] == "ddp" else r for r in sched["rows"]]
    write(tmp_path, "quality_schedule_w4", sched)
    assert "the ranking changes." in R.render_page(R.load_results(str(tmp_path)))
    # DDP's constant-lr row at a swept lr (0.00141) is not the schedule's DDP at the shared lr: not compared ...
    write(tmp_path, "quality_ddp", swept_ddp_doc(4, [(0.001, 1.95), (0.00141, 1.90)], 0.00141, (1.91, 1.92)))
    section = schedule_text(tmp_path)
    assert "| DDP | not measured |  | every step | 2.5000 ± 0.000 (3) |  |" in section
    # ... until the schedule's DDP runs at that lr too (its --tuned file names DDP's chosen lr)
    sched["config"]["tuned_per_w"]["4"]["ddp"] = [0.00141, None]
    sched["rows"] = [dict(r, run={"method": "ddp", "lr": 0.00141}) if r["method"] == "ddp" else r
                     for r in sched["rows"]]
    write(tmp_path, "quality_schedule_w4", sched)
    section = schedule_text(tmp_path)
    assert ("| DDP | every step, lr 0.00141 | 1.9100 ± 0.020 (3) | every step, lr 0.00141 | 2.5000 ± 0.000 (3) | "
            "+0.590 |") in section


def test_a_schedule_swept_again_compares_each_method_at_its_own_best_and_says_where_the_choice_moved(tmp_path):
    """The second size's schedule file sweeps the outer settings again: a method whose best point moved under the
    schedule is still compared (tuned against tuned) and the sweep says it moved; one that kept its point says so;
    an edge of the grid is flagged; DDP untuned on both sides is compared at the shared lr; constant-lr rows from
    another CPU model are named."""
    const = quality_doc(4, command=PLAN["quality_4x256_w4"])      # DiLoCo 0.5 / 0.8: 2.12; k = 64 1.5: 2.0867
    const["machine"]["cpu"] = "Other CPU"
    write(tmp_path, "quality_4x256_w4", const)
    ddp = ddp_doc([4], losses=(1.95, 1.96, 1.97))
    ddp["command"] = PLAN["quality_4x256_ddp"]
    write(tmp_path, "quality_4x256_ddp", ddp)
    sched = schedule_doc(4, (2.0, 2.02, 2.04), (1.95, 1.97, 1.99), (1.90, 1.91, 1.92), PLAN["quality_schedule_4x256_w4"])
    # SparseLoCo's best moves from 1.5 to 1.06 under the schedule (its seeds there); DiLoCo keeps 0.5 / 0.8
    sched["rows"] = [r for r in sched["rows"] if not (r["method"] == "sparseloco" and r["seed"] > 0)]
    for r in sched["rows"]:
        if r["method"] == "sparseloco":
            r["held_out_loss"], r["seed_run"] = {1.06: 1.93, 1.5: 1.95, 2.12: 2.3}[r["outer_lr"]], r["outer_lr"] == 1.06
    sched["rows"] += [_row(4, "sparseloco", 64, 1.06, None, s, loss, False, True, 800) for s, loss in ((1, 1.94),
                                                                                                      (2, 1.95))]
    sched["config"]["tuned_per_w"]["4"] = {"diloco": [0.5, 0.8], "sparseloco": [1.06, None]}
    write(tmp_path, "quality_schedule_4x256_w4", sched)
    section = schedule_text(tmp_path).split("### 4 layers × 256")[1]
    assert "| SparseLoCo k = 64 | 1.5 | 2.0867 ± 0.080 (3) | 1.06 | 1.9400 ± 0.020 (3) | -0.147 |" in section
    assert "| DiLoCo | 0.5 / 0.8 | 2.1200 ± 0.040 (3) | 0.5 / 0.8 | 2.0200 ± 0.040 (3) | -0.100 |" in section
    assert "| DDP | every step | 1.9600 ± 0.020 (3) | every step | 1.9100 ± 0.020 (3) | -0.050 |" in section
    assert "DiLoCo and SparseLoCo k = 64 swept again under the schedule" in section
    assert "DDP at the shared inner lr as the peak, as in its constant-lr rows (not tuned at this size)" in section
    # the plugin's default at W = 4 on this (446 k) model is 1.5: its point is marked
    assert ("SparseLoCo k = 64 **1.06 → 1.9300**, 1.5 → 1.9500 (default), 2.12 → 2.3000 (moved from 1.5); the grid's "
            "lowest lr: the best may lie beyond it") in section
    assert "DiLoCo **0.5 / 0.8 → 2.0000**, 0.7 / 0.9 → 2.3000 (default) (kept: the constant-lr choice)" in section
    assert ("DiLoCo's and SparseLoCo k = 64's constant-lr rows ran on Other CPU, the schedule's on Test CPU") in section
    assert "constant lr DDP < SparseLoCo k = 64 < DiLoCo; with the schedule DDP < SparseLoCo k = 64 < DiLoCo" in section
    # a schedule file not swept again, at another setting than the constant-lr choice, is not compared
    sched["rows"] = [dict(r, sweep=False) for r in sched["rows"] if r["seed_run"]]
    write(tmp_path, "quality_schedule_4x256_w4", sched)
    section = schedule_text(tmp_path).split("### 4 layers × 256")[1]
    assert "| SparseLoCo k = 64 | not measured |  | 1.06 | 1.9400 ± 0.020 (3) |  |" in section


def test_the_ddp_reading_of_a_size_says_whether_its_standing_against_ddp_holds_under_the_schedule(tmp_path):
    """SparseLoCo ahead of DDP with a constant lr but behind it under the size's schedule check: the size's DDP
    sentence (page and README) says the standing does not hold; where it is the same on both sides, that it holds;
    without a schedule file for the size it says nothing about the schedule."""
    write(tmp_path, "quality_w4", quality_doc(4))                 # the headline: the README's block needs it
    const = quality_doc(4, command=PLAN["quality_4x256_w4"])      # k = 64 at 1.5: 2.0867 ± 0.080
    write(tmp_path, "quality_4x256_w4", const)
    ddp = ddp_doc([4], losses=(2.20, 2.21, 2.22))                  # 2.21: k = 64 ahead by 0.123 > its spread
    ddp["command"] = PLAN["quality_4x256_ddp"]
    write(tmp_path, "quality_4x256_ddp", ddp)

    def said():
        docs = R.load_results(str(tmp_path))
        section = R.render_page(docs).split("## A second model size")[1].split("\n## ")[0]
        return section, R.render_readme_block(docs)

    section, readme = said()
    assert "ahead of DDP at W = 4 (-0.123)" in section and "Megatron-style schedule (warmup" not in section
    sched = schedule_doc(4, (2.0, 2.02, 2.04), (1.95, 1.97, 1.99), (1.80, 1.81, 1.82), PLAN["quality_schedule_4x256_w4"])
    write(tmp_path, "quality_schedule_4x256_w4", sched)
    section, readme = said()
    sentence = ("Under a Megatron-style schedule (warmup, cosine decay, clipping; section \"A Megatron-style schedule\") "
                "at W = 4, SparseLoCo k = 64 is behind DDP (+0.160), and with a constant lr ahead of DDP (-0.123): its "
                "standing against DDP at this size does not hold under the schedule.")
    assert sentence in section and sentence in readme
    sched["rows"] = [dict(r, held_out_loss=2.5) if r["method"] == "ddp" else r for r in sched["rows"]]
    write(tmp_path, "quality_schedule_4x256_w4", sched)
    section, _ = said()
    assert ("SparseLoCo k = 64 is ahead of DDP (-0.530), and with a constant lr ahead of DDP (-0.123): its standing "
            "against DDP at this size holds.") in section


def test_the_streaming_table_puts_every_overlap_and_fragment_row_beside_its_blocking_row(tmp_path):
    def row(method, tau, P, loss, outer_s, outer_steps, **kw):
        return {"case": "uniform", "method": method, "k": 64 if method == "sparseloco" else None, "workers": 4,
                "label": method, "overlap_steps": tau, "fragments": P, "held_out_loss": loss, "H": 15, "steps": 900,
                "outer_steps": outer_steps, "sync_outer_step_s": outer_s, "bytes_sent_per_worker": 1000,
                "curve": [{"step": 900, "wall_s": 9.0, "held_out_loss": loss}], **kw}
    rows = [row("diloco", 0, 1, 2.00, 1.0, 60, sync_wire_s=0.5), row("diloco", 2, 1, 2.01, 0.1, 60),
            row("diloco", 7, 1, 2.03, 0.3, 60), row("diloco", 0, 2, 2.02, 0.6, 120),
            row("sparseloco", 0, 1, 2.05, 0.2, 60, sync_wire_s=0.02, sync_compress_s=0.05, sync_apply_s=0.07),
            row("sparseloco", 2, 1, 2.06, 0.1, 60), row("sparseloco", 0, 2, 2.04, 0.15, 120)]
    write(tmp_path, "network_streaming_w4", schema.document("network", PLAN["network_streaming_w4"], {"model": {}}, rows,
                                                            machine=dict(MACHINE)))
    page = R.render_page(R.load_results(str(tmp_path))).split("## Overlap and fragments")[1].split("\n## ")[0]
    section, larger = page.split("### 4 layers × 256")
    # the second size has no file yet: its heading says so and gives the command that makes it
    assert "Not measured yet" in larger and PLAN["network_streaming_4x256_w4"] in larger
    assert "| DiLoCo |" not in larger
    assert "| DiLoCo | 0 | 1 | 2.0000 |  | 1.000 s |  | 1.0 kB |" in section
    assert "| DiLoCo | 2 | 1 | 2.0100 | +0.010 | 0.100 s | 10 % | 1.0 kB |" in section
    # P = 2: two fragment syncs per H steps, 0.6 s each: 1.2 s per H steps, 120 % of blocking
    assert "| DiLoCo | 0 | 2 | 2.0200 | +0.020 | 1.200 s | 120 % | 1.0 kB |" in section
    assert "| SparseLoCo k = 64 | 0 | 1 | 2.0500 |  | 0.200 s |  | 1.0 kB |" in section
    # the reading: the wire's share of blocking, the overlap that hides most (τ = 2 here), fragments alone
    assert ("Blocking, the wire is 50 % of DiLoCo's outer step and 10 % of SparseLoCo's; the rest is computation on "
            "the cores the ranks share (SparseLoCo's compression and apply: 0.12 s a round).") in section
    assert ("to 10 % of blocking for DiLoCo (τ = 2, held-out +0.010) and 50 % for SparseLoCo (τ = 2, +0.010)"
            in section)
    assert "Fragments P = 2 without overlap take 120 % (DiLoCo) and 150 % (SparseLoCo) of blocking" in section
    assert "the wire is most of DiLoCo's blocking round" in section   # 0.5 of 1.0 s
    # the second size's file: its own table under its heading, its rows beside its own blocking rows
    big = [dict(r, numel=3_258_112, held_out_loss=r["held_out_loss"] - 0.1) for r in rows]
    big[0]["sync_wire_s"] = 0.2
    write(tmp_path, "network_streaming_4x256_w4", schema.document(
        "network", PLAN["network_streaming_4x256_w4"], {"model": {}}, big, machine=dict(MACHINE)))
    page = R.render_page(R.load_results(str(tmp_path))).split("## Overlap and fragments")[1].split("\n## ")[0]
    small, larger = page.split("### 4 layers × 256")
    assert "| DiLoCo | 0 | 2 | 2.0200 | +0.020 | 1.200 s | 120 % | 1.0 kB |" in small
    assert "the 4 layers × 256 model (3.26 M parameters)" in larger and "`quality_4x256_w4.json`" in larger
    assert "| DiLoCo | 0 | 2 | 1.9200 | +0.020 | 1.200 s | 120 % | 1.0 kB |" in larger
    assert "the wire is not most of DiLoCo's blocking round" in larger    # 0.2 of 1.0 s
    assert PLAN["network_streaming_4x256_w4"] in larger and PLAN["network_streaming_w4"] not in larger
    assert "Not comparable" not in page      # every row ran at its blocking row's setting (none recorded here)
    # a file whose overlap row ran at another outer setting than its blocking row: named under the table
    odd = [dict(r, outer={"lr": 0.7, "momentum": 0.9 if r["overlap_steps"] == 2 else 0.8})
           if r["method"] == "diloco" else r for r in rows]
    write(tmp_path, "network_streaming_w4", schema.document("network", PLAN["network_streaming_w4"], {"model": {}}, odd,
                                                            machine=dict(MACHINE)))
    page = R.render_page(R.load_results(str(tmp_path))).split("## Overlap and fragments")[1].split("\n## ")[0]
    small, larger = page.split("### 4 layers × 256")
    assert ("**Not comparable with their blocking row**: DiLoCo τ = 2, P = 1 at 0.7 / 0.9 (blocking: 0.7 / 0.8). "
            in small) and "Not comparable" not in larger


def test_the_aggregation_table_reads_received_over_own_payload_and_the_sites_wan_bytes(tmp_path):
    rows = [{"W": 8, "mode": "allgather", "bytes_received_max": 700, "payload_bytes": 100.0,
             "received_over_payload": 7.0},
            {"W": 8, "mode": "hierarchical G=2", "bytes_received_max": 700, "payload_bytes": 100.0,
             "received_over_payload": 7.0, "site_wan_received": 400, "allgather_site_wan_received": 1600}]
    write(tmp_path, "aggregation_bytes", schema.document("aggregation_bytes", PLAN["aggregation_bytes"], {}, rows,
                                                         machine=dict(MACHINE)))
    section = R.render_page(R.load_results(str(tmp_path))).split("## Aggregation modes")[1].split("\n## ")[0]
    assert "| W | allgather | hierarchical G=2 |" in section
    assert "| 8 | 7.00× | 7.00× (WAN per site 4×, all-gather 16×) |" in section

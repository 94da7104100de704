"""Smoke tests of benchmarks/quality.py and benchmarks/network.py (tiny step counts, schema checks).

quality.py --quick --steps 15 --seeds 2 with every method (ddp, average, diloco, sparseloco
k ∈ {32, 64, 128}, the entropy-coded and flat-chunking rows, gasloc, torchft_diloco) produces a
finite held-out loss and bytes > 0, one row per method × seed, a summary with mean and spread, and
the JSON has the documented schema. network.py --smoke: runs inside a private network namespace with a
shaped loopback; skipped (with the reason network.py prints) where root / netns / tc are missing.
aggregation_wire.py --smoke: the three aggregations on 4 workers in 2 emulated sites (same skip rule):
hierarchical ends on all-gather's θ_outer to the bit, the WAN bytes and received bytes are the modes'.
elastic.py --smoke: 3 worker jobs of a tiny model, one killed and restarted fail-fast (every job restarts
from the newest common checkpoint); the results schema. The elastic scenarios' behaviour (a stopped job
caught up in place, a killed one healed) is tested on the real Megatron loop in test_elastic_megatron.py and
on the toy jobs in test_elastic_rounds.py; here the stall row's figures are checked on exact records.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUALITY = os.path.join(REPO, "benchmarks", "quality.py")
NETWORK = os.path.join(REPO, "benchmarks", "network.py")
WIRE = os.path.join(REPO, "benchmarks", "aggregation_wire.py")
ELASTIC = os.path.join(REPO, "benchmarks", "elastic.py")

ROW_KEYS = {"method", "k", "H", "held_out_loss", "bytes_sent_per_worker", "tokens", "wall_s", "curve"}


def _run(cmd, timeout):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)


def _have_torchft() -> bool:
    try:
        import torchft  # noqa: F401
    except Exception:
        return False
    return True


def test_quality_quick_schema_then_a_launch_resumes_from_its_run_journal(tmp_path):
    """Every method, 2 seeds: the schema and the rows. Then a second launch with one of those runs and a new one
    takes the first from the run journal (the same row, to the bit, marked resumed) and makes only the other."""
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    import schema

    out, journal = tmp_path / "quality.json", tmp_path / "journal"
    asked = "ddp,average,diloco,gasloc,sparseloco:32,sparseloco:64,sparseloco:128,sparseloco:64:entropy,sparseloco:64:flat"
    if _have_torchft():
        asked += ",torchft_diloco"
    cmd = [sys.executable, QUALITY, "--quick", "--steps", "15", "--seeds", "2", "--methods", asked,
           "--journal", str(journal), "--json", str(out)]
    r = _run(cmd, timeout=400)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    data = json.loads(out.read_text())
    assert schema.check(data) == []
    assert data["command"].startswith("python benchmarks/quality.py --quick")
    assert data["config"]["steps"] == 15 and data["config"]["seeds"] == [0, 1]
    rows = data["rows"]
    methods = {row["method"] for row in rows}
    expected = {"ddp", "average", "diloco", "sparseloco", "gasloc"} | ({"torchft_diloco"} if _have_torchft() else set())
    assert expected <= methods, (methods, data.get("notes"))
    assert {row["k"] for row in rows if row["method"] == "sparseloco"} == {32, 64, 128}
    assert any(row.get("index_coding") == "entropy" for row in rows)
    assert any(row.get("chunking") == "flat" for row in rows)
    assert sorted({row["seed"] for row in rows}) == [0, 1]
    assert len(rows) == 2 * len(asked.split(","))
    assert all(row["seed_run"] and not row["sweep"] for row in rows)
    tokens = {row["tokens"] for row in rows}
    assert len(tokens) == 1 and tokens.pop() > 0, "every method must see the same number of tokens"
    for row in rows:
        assert ROW_KEYS <= set(row), (row["method"], ROW_KEYS - set(row))
        assert math.isfinite(row["held_out_loss"]) and 0 < row["held_out_loss"] < 10, row
        assert row["bytes_sent_per_worker"] > 0, row  # every method communicates something
        assert row["curve"][0]["step"] == 0 and row["curve"][-1]["step"] == 15
    dense = next(row for row in rows if row["method"] == "diloco")["bytes_sent_per_worker"]
    for row in rows:
        if row["method"] == "sparseloco":
            assert row["bytes_sent_per_worker"] * 50 < dense, row
            # W = 2, all-gather: each worker receives exactly what the other one sent
            assert row["bytes_received_per_worker"] == row["bytes_sent_per_worker"], row

    runs = len(list(journal.glob("*-rank*.json")))     # W = 2 ranks x every run but torchft's, kept (--journal)
    assert runs == 2 * len([row for row in rows if row["method"] != "torchft_diloco"])
    second = tmp_path / "second.json"
    r = _run([sys.executable, QUALITY, "--quick", "--steps", "15", "--seeds", "1", "--journal", str(journal),
              "--methods", "diloco,sparseloco:16", "--json", str(second)], timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    assert len(list(journal.glob("*-rank*.json"))) == runs + 2
    two = json.loads(second.read_text())
    d2, s2 = two["rows"]
    assert d2["method"] == "diloco" and s2["method"] == "sparseloco" and s2["k"] == 16
    assert d2.pop("resumed_from_journal") == [data["machine"]["plugin_commit"]] and "resumed_from_journal" not in s2
    (d1,) = [row for row in rows if row["method"] == "diloco" and row["seed"] == 0]
    assert d2 == d1
    assert any("1 runs taken from the run journal" in n for n in two["notes"]), two["notes"]
    assert "--journal" not in two["command"]


def _slb_namespaces() -> set:
    try:
        listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    except FileNotFoundError:
        return set()
    return {line.split()[0] for line in listing.splitlines() if line.startswith("slb-")}


def test_network_smoke(tmp_path):
    out = tmp_path / "network.json"
    before = _slb_namespaces()  # another benchmark may be running on this machine
    r = _run([sys.executable, NETWORK, "--smoke", "--no-hetero", "--json", str(out)], timeout=400)
    if r.returncode == 2 and "cannot run" in r.stderr:
        pytest.skip(r.stderr.strip().splitlines()[-1])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    import schema

    data = json.loads(out.read_text())
    assert schema.check(data) == [] and data["config"]["uniform"]["links"] == "shared"
    rows = data["rows"]
    assert {row["method"] for row in rows} >= {"diloco", "sparseloco", "gasloc"}
    for row in rows:
        assert math.isfinite(row["held_out_loss"]), row
        if row["method"] != "ddp":
            assert row["outer_steps"] >= 1 and row["sync_communicate_s"] is not None and row["sync_outer_step_s"] > 0
            assert row["sync_agree_s"] >= 0 and row["sync_wire_s"] <= row["sync_communicate_s"] + 1e-12
    # the namespaces this run created are gone afterwards
    left = _slb_namespaces() - before
    assert not left, left


def test_aggregation_wire_smoke(tmp_path):
    out = tmp_path / "wire.json"
    r = _run([sys.executable, WIRE, "--smoke", "--workers", "4", "--sites", "2", "--rounds", "2",
              "--json", str(out)], timeout=300)
    if r.returncode == 2 and "cannot run" in r.stderr:
        pytest.skip(r.stderr.strip().splitlines()[-1])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    rows = {row["mode"]: row for row in json.loads(out.read_text())["rows"]}
    ag, hier, rs = rows["allgather"], rows["hierarchical"], rows["reduce-scatter"]
    assert all(row["anchor_identical_across_ranks"] and row["wire_s"] > 0 for row in rows.values())
    assert hier["anchor_sha256"] == ag["anchor_sha256"] != rs["anchor_sha256"]
    payload = ag["bytes_sent"] - 4                       # all-gather hands over its payload (+ the 4-byte flag)
    assert ag["bytes_received"] - 4 == 3 * payload       # W − 1 payloads
    assert hier["wan_bytes_sent"] == payload             # G − 1 = one payload over the WAN
    assert rs["bytes_received"] < 2 * payload and rs["time_owner_s"] > 0
    assert (ag["collectives_per_round"], hier["collectives_per_round"], rs["collectives_per_round"]) == (1, 2, 2)


def test_machine_info_names_the_installed_megatron_core_and_this_commit(tmp_path):
    """megatron.core.__version__ appends the HEAD of whatever repository holds site-packages (ours, when
    .venv is inside the checkout); the results must carry the real distribution version, and our commit
    under its own name — "unknown" for a copy that is not a git checkout."""
    from importlib import metadata
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    try:
        import common
    finally:
        sys.path.pop(0)
    info = common.machine_info()
    assert info["megatron_core"] == metadata.version("megatron-core")
    head = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    if head.returncode == 0:
        assert info["plugin_commit"].split("+")[0] == head.stdout.strip()
    copy = tmp_path / "copy"
    import shutil
    shutil.copytree(os.path.join(REPO, "megatron_sparseloco"), copy / "megatron_sparseloco")
    out = subprocess.run([sys.executable, "-c", "import sys; sys.path.insert(0, 'benchmarks_dir');"
                          "import megatron_sparseloco, common; print(common.plugin_commit())".replace(
                              "benchmarks_dir", os.path.join(REPO, "benchmarks"))],
                         capture_output=True, text=True, cwd=copy, env=dict(os.environ, PYTHONPATH=str(copy)))
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "unknown"


def test_elastic_smoke(tmp_path):
    if not _have_torchft():
        pytest.skip("torchft is not installed")
    out = tmp_path / "elastic.json"
    # 50 s: the fail-fast restart (at 20 s) starts 3 processes (5 s on a quiet machine, 40 s at load average 17)
    r = _run([sys.executable, ELASTIC, "--smoke", "--seconds", "50", "--kill-at", "0.15", "--restart-after", "0.25",
              "--outer-timeout", "3", "--scenarios", "fail-fast", "--log-dir", str(tmp_path / "logs"),
              "--json", str(out)],
             timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    data = json.loads(out.read_text())
    assert {"benchmark", "machine", "commit", "command", "config", "rows"} <= set(data)
    assert data["benchmark"] == "elastic" and data["command"].startswith("python benchmarks/elastic.py")
    (ff,) = data["rows"]
    assert ff["scenario"] == "fail-fast" and ff["mode"] == "static", ff
    assert ff["kill_at_s"] < ff["restart_at_s"] < ff["wall_s"], ff
    assert 0 < ff["useful_steps"] <= ff["computed_steps"], ff
    assert ff["discarded_steps"] == ff["computed_steps"] - ff["useful_steps"]
    assert math.isfinite(ff["held_out_loss"]) and ff["theta_outer_identical"], ff
    # fail-fast: nothing commits until every job is back and has loaded the newest common checkpoint
    assert ff["detection_s"] is not None and ff["detection_s"] > ff["restart_at_s"] - ff["kill_at_s"], ff
    assert ff["restart_load_s"] is not None and ff["heal_bytes"] is None, ff


def test_elastic_stall_row_from_the_jobs_records():
    """benchmarks/elastic.py's row for a stopped-and-continued job, on records whose answer is known: job 1 of 2
    is stopped at t0 + 10 and continued at t0 + 20; job 0 commits steps 0..3 (step 2 twice: a redone round
    counts once; 2 samples a round) and computes 12 steps, 4 of them over the pace; job 1 heals (4 MB received) in its round at t0 + 22 and contributes again at t0 + 25."""
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    import elastic

    t0 = 1000.0

    def rnd(t, job, after, committed=True, contributes=True, heals=(), samples=2):
        return {"k": "round", "t": t0 + t, "job": job, "pid": 100 + job, "step": after, "after": after,
                "committed": committed, "contributes": contributes, "contributors": 2, "samples": samples,
                "heals": list(heals), "seconds_quorum": 0.5, "seconds_header": 0.25}

    heal = {"role": "received", "nbytes": 4_000_000, "seconds": 1.5}
    recs = ([{"k": "step", "t": t0 + t, "c": c, "job": 0, "pid": 100} for t, c in enumerate((0.5, 3.0, 0.5) * 4)]
            + [rnd(5, 0, 0), rnd(5, 1, 0), rnd(12, 0, 1), rnd(16, 0, 2), rnd(19, 0, 2),
               rnd(22, 1, 2, contributes=False, heals=[heal]), rnd(25, 0, 3), rnd(25, 1, 3),
               {"k": "final", "t": t0 + 30, "fp": "abc", "loss": 2.5, "step": 3, "job": 0, "pid": 100},
               {"k": "final", "t": t0 + 30, "fp": "abc", "loss": 2.5, "step": 3, "job": 1, "pid": 101}])
    cfg = {"seconds": 30, "step_seconds": 1.0}
    row = elastic.measure("elastic-stall", elastic.scenario_spec("elastic-stall"), recs, t0, t0 + 31,
                          {"kill": None, "restart": None, "stop": t0 + 10, "cont": t0 + 20}, 2, cfg)
    assert (row["stop_at_s"], row["cont_at_s"], row["kill_at_s"]) == (10, 20, 10)
    assert row["detection_s"] == 2          # job 0's first commit after the stop (t0 + 12)
    assert row["catch_up_s"] == 5           # job 1's first contributing commit after the continue (t0 + 25)
    assert row["heal_bytes"] == 4_000_000 and row["heal_s"] == 1.5 and row["victim_pids"] == 1
    assert row["rounds_committed"] == 4 and row["useful_steps"] == 4 * 2   # steps 0..3, step 2 counted once
    assert row["computed_steps"] == 12 and row["discarded_steps"] == 4 and row["steps_over_pace"] == 4
    assert row["wall_s"] == 30 and row["goodput_steps_per_s"] == 8 / 30 and row["rejoin_s"] == 15
    assert row["theta_outer_identical"] and row["held_out_loss"] == 2.5 and row["final_step"] == 3
    assert row["restart_load_s"] is None and row["rounds_failed"] == 0


def test_network_per_worker_links_run_at_a_quality_files_chosen_settings(tmp_path):
    """--links per-worker: one shaped link per worker (the headline's time columns); --tuned: the diloco /
    sparseloco specs run at the settings a quality results file chose at this W."""
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    import schema

    tuned = tmp_path / "quality_w2.json"
    schema.write(str(tuned), schema.document(
        "quality", "python benchmarks/quality.py --sweep --workers 2", {
            "model": {}, "tuned_per_w": {"2": {"diloco": [0.5, 0.8], "sparseloco": [2.12, None],
                                               "sparseloco:128": [1.5, None]}}},
        [{"method": "diloco"}]))
    out = tmp_path / "network.json"
    r = _run([sys.executable, NETWORK, "--smoke", "--no-hetero", "--no-ddp", "--links", "per-worker", "--workers", "2",
              "--uniform-methods", "diloco,sparseloco:64,sparseloco:128", "--tuned", str(tuned), "--json", str(out)],
             timeout=400)
    if r.returncode == 2 and "cannot run" in r.stderr:
        pytest.skip(r.stderr.strip().splitlines()[-1])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    data = json.loads(out.read_text())
    assert schema.check(data) == [] and data["config"]["uniform"]["links"] == "per-worker"
    outer = {(row["method"], row["k"]): row["outer"] for row in data["rows"]}
    assert (outer[("diloco", None)]["lr"], outer[("diloco", None)]["momentum"]) == (0.5, 0.8)
    assert outer[("sparseloco", 64)]["lr"] == 2.12 and outer[("sparseloco", 128)]["lr"] == 1.5
    assert all(row["sync_outer_step_s"] > 0 for row in data["rows"])
    assert next(row for row in data["rows"] if row["method"] == "diloco")["time_to_diloco_s"] > 0


def test_runs_in_one_rank_process_do_not_pile_up_process_groups():
    """benchmarks/common.rank_run_all trains run after run in the same ranks: each run's process groups (and
    their gloo threads) are released, so the thread count does not grow with the number of runs."""
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    import common
    from megatron_sparseloco.testing.multirank import run_ranks

    model = common.ModelCfg(layers=1, hidden=64, heads=4, seq=32)
    runs = [common.RunCfg(m, k=64 if m == "sparseloco" else None, steps=4, H=2, mbs=2, eval_windows=4)
            for m in ("diloco", "sparseloco", "diloco", "sparseloco")]
    counts = run_ranks(_threads_after_each_run, 2, args=(model, runs, common.ensure_data()), timeout=300)
    for per_rank in counts:
        assert per_rank[-1] <= per_rank[1], per_rank     # flat after the first run (lazy start-up threads aside)


def _threads_after_each_run(rank, world, model, runs, paths):
    import common
    out = []
    for run in runs:
        common.rank_run_all(rank, world, model, [run], paths)
        out.append(len(os.listdir("/proc/self/task")))
    return out


def test_memory_benchmark_writes_the_schema_and_measures_the_anchor_on_cpu_split(tmp_path):
    """benchmarks/memory.py (the docs' memory table): sparseloco holds θ_outer and its error feedback (8 B per
    shard element); --sparseloco-anchor-on-cpu moves θ_outer to host memory (4 + 4)."""
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    import schema

    out = tmp_path / "memory.json"
    r = _run([sys.executable, os.path.join(REPO, "benchmarks", "memory.py"), "--numel", "33024", "--bucket", "8192",
              "--json", str(out)], timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    data = json.loads(out.read_text())
    assert schema.check(data) == [] and data["benchmark"] == "memory"
    rows = {row["label"]: row for row in data["rows"]}
    assert (rows["sparseloco"]["device_B_per_elt"], rows["sparseloco"]["host_B_per_elt"]) == (8.0, 0.0)
    on_cpu = rows["sparseloco, --sparseloco-anchor-on-cpu"]
    assert (on_cpu["device_B_per_elt"], on_cpu["host_B_per_elt"]) == (4.0, 4.0)
    # the step's transient does not grow with the shard: test_outer_round.py (pipelined_buckets ... transient)
    assert all(row["step_peak_B"] > 0 for row in data["rows"])
    assert rows["sparseloco"]["save_peak_in_largest_tensors"] <= 1.0


def test_run_journal_takes_a_run_only_when_every_rank_recorded_it(tmp_path):
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    from common import ModelCfg, RunCfg
    from journal import RunJournal

    j = RunJournal(str(tmp_path / "j"), cpu="cpu A", commit="abc")
    model, run, other = ModelCfg(), RunCfg("diloco", H=15, steps=30), RunCfg("diloco", H=15, steps=45)
    j.record(model, 2, 0, run, {"held_out": 1.5})
    assert j.done(model, 2, run) is None                     # rank 1 missing: not done
    j.record(model, 2, 1, run, {"held_out": 1.25})
    assert j.done(model, 2, run) == [{"held_out": 1.5, "journal_commit": "abc"},
                                     {"held_out": 1.25, "journal_commit": "abc"}]
    assert j.done(model, 4, run) is None                     # another W
    assert RunJournal(j.directory, cpu="cpu B", commit="abc").done(model, 2, run) is None   # another CPU model
    assert RunJournal(j.directory, cpu="cpu A", commit="abc", data="other").done(model, 2, run) is None  # other data
    done, todo = j.split(model, 2, [other, run])
    assert list(done) == [1] and todo == [other]
    elsewhere = RunJournal(j.directory, cpu="cpu B", commit="def", other_cpus=["cpu C", "cpu A"])
    assert elsewhere.done(model, 2, run) == [{"held_out": 1.5, "journal_commit": "abc", "journal_cpu": "cpu A"},
                                             {"held_out": 1.25, "journal_commit": "abc", "journal_cpu": "cpu A"}]
    elsewhere.record(model, 2, 0, run, {"held_out": 9.0})   # its own CPU model's run: taken first once whole
    elsewhere.record(model, 2, 1, run, {"held_out": 8.0})
    assert elsewhere.done(model, 2, run) == [{"held_out": 9.0, "journal_commit": "def"},
                                             {"held_out": 8.0, "journal_commit": "def"}]
    j.clear()
    assert not os.path.exists(j.directory)


def test_quality_marks_the_runs_it_takes_from_another_cpu_models_journal(tmp_path):
    """--journal-cpu: a run another CPU model made is taken (not made again) and its row says which CPU made it."""
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    from dataclasses import asdict

    import quality
    from common import ModelCfg, RunCfg
    from journal import RunJournal

    model, run = ModelCfg(), RunCfg("diloco", H=15, steps=30, outer_lr=0.35, outer_momentum=0.6)
    made = RunJournal(str(tmp_path / "j"), cpu="cpu A", commit="abc")
    for rank, loss in enumerate((2.0, 2.5)):
        made.record(model, 2, rank, run, {
            "run": asdict(run), "numel": 10, "bytes_sent": 100 * (rank + 1), "bytes_received": 50, "wall_s": 9.0,
            "train_losses": [3.0], "curve": [{"step": 30, "tokens": 64, "bytes_per_worker": 100,
                                              "held_out_loss": loss, "wall_s": 9.0}]})
    quality.JOURNAL["journal"] = RunJournal(made.directory, cpu="cpu B", commit="def", other_cpus=["cpu A"])
    try:
        (row,) = quality.run_rows(2, model, [run], [], paths=None, timeout=1, env={}, notes=[])
    finally:
        quality.JOURNAL.clear()
    assert row["resumed_from_journal"] == ["abc"] and row["made_on_cpu"] == "cpu A"
    assert row["held_out_loss"] == 2.25 and row["bytes_sent_per_worker"] == 200
    done, todo = RunJournal(made.directory, cpu="cpu B", commit="def").split(model, 2, [run])   # no --journal-cpu
    assert done == {} and todo == [run]


def test_a_journal_key_names_the_default_data_relative_to_the_checkout(tmp_path):
    """The committed journal of a long sweep resumes from a checkout at another place: the data part of the
    key holds the repository-relative path of the default corpus (and the absolute path of one outside)."""
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    import common
    import quality

    inside = os.path.join(common.DATA_DIR, "train_text_document.bin")
    outside = str(tmp_path / "valid_text_document.bin")
    ident = json.loads(quality.data_identity({"train": inside, "valid": outside}))
    assert ident == {"train": os.path.relpath(inside, REPO), "valid": outside}
    assert not ident["train"].startswith(os.sep) and ident["train"].startswith("data" + os.sep)


def test_run_journal_summary_reads_progress_from_the_files(tmp_path, capsys):
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    from dataclasses import asdict

    import journal
    from common import ModelCfg, RunCfg

    j = journal.RunJournal(str(tmp_path / "j"), cpu="cpu A", commit="abc")
    model = ModelCfg()
    done, half = RunCfg("diloco", outer_lr=0.35, outer_momentum=0.6), RunCfg("sparseloco", k=64, outer_lr=0.53)
    curve = [{"held_out_loss": 3.0}, {"held_out_loss": 2.0310}]
    for rank in (0, 1):
        j.record(model, 2, rank, done, {"run": asdict(done), "curve": curve, "elapsed_s": 990.0})
    j.record(model, 2, 1, half, {"run": asdict(half), "curve": curve[:1], "elapsed_s": 5.0})
    rows = journal.summary(j.directory)
    assert [(r["ranks"], r["held_out_loss"], r["commit"]) for r in rows] in (
        [(2, 2.0310, "abc"), (1, None, None)], [(1, None, None), (2, 2.0310, "abc")])
    assert journal.main([j.directory]) == 0
    out = capsys.readouterr().out
    assert "diloco lr=0.35 mu=0.6 H=15 seed=1234" in out and "held-out  2.0310" in out
    assert "sparseloco k=64 lr=0.53 H=15 seed=1234" in out and "ranks  1  held-out       -" in out
    assert journal.main([str(tmp_path / "absent")]) == 2

"""Streaming outer sync in elastic mode, in the real megatron.training loop: delayed rounds (τ),
fragments (P) and the straggler grace under a changing membership (``megatron/elastic/rounds.py``).

Every worker is its own Megatron job (``examples/pretrain_gpt.py``, tiny GPT, mock data, CPU gloo)
through ``testing/elastic_launcher.py``, with a real torchft lighthouse (``tests/test_elastic_megatron.py``'s
``Run``).

* failure-free elastic mode with τ = 2 (sparseloco, replay; diloco, lerp) and with P = 2 (diloco) equals
  single-job mode with the same τ / P and merge bit for bit: 2 elastic jobs × 1 rank against one job of
  2 workers;
* kill -9 of a job while its delayed round is in flight (τ = 1, P = 2): the survivors roll that round back
  (once), go on committing, and a restart heals into the τ ≥ 1 run and contributes again; all end with
  one θ_outer (θ_local differs by design: each job's last window of τ steps is its own);
* a job slowed 3x with ``--sparseloco-elastic-grace``, blocking and τ = 1: the others' rounds do not wait
  for it, its pseudo-gradients still enter θ_outer (it contributes in the rounds it catches up in).
"""
from __future__ import annotations

import json

import pytest

from test_elastic_megatron import Run, check_consistency, first_commit_after, kill_mid_round_then_restart, pretrain_args

pytestmark = [pytest.mark.multirank, pytest.mark.megatron]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["overlap", "overlap-lerp", "fragments"])
def test_elastic_overlap_and_fragments_equal_single_job_mode(tmp_path, mode):
    """overlap: sparseloco, H = 4, τ = 2 (replay; overlap-lerp: diloco with torchft's lerp merge, α 0.5),
    14 iterations (every launch completes); fragments: diloco, H = 4, P = 2, 12 iterations. 2 elastic jobs ×
    1 rank (the lighthouse waits for both) against one job of 2 workers with the same arguments: the same
    model and θ_outer bit for bit."""
    algorithm, iters, flags = {
        "overlap": ("sparseloco", 14, ["--sparseloco-overlap-steps", "2"]),
        "overlap-lerp": ("diloco", 14, ["--sparseloco-overlap-steps", "2", "--sparseloco-overlap-merge", "lerp"]),
        "fragments": ("diloco", 12, ["--sparseloco-fragments", "2"])}[mode]
    with Run(tmp_path / "elastic", algorithm=algorithm, jobs=2, iters=iters, H=4, min_workers=2, lighthouse_min=2,
             ranks=1, extra=flags) as run:
        run.start_all()
        single = run.run.add_job("single", pretrain_args(algorithm=algorithm, slots=2, iters=iters, H=4, nproc=2,
                                                         run_batch=4, extra=flags),
                                 ranks=2, launcher="prefork", env={"ELASTIC_OUT": str(tmp_path / "single")})
        run.start(single)
        codes = [job.wait(240) for job in run.jobs + [single]]
    assert codes == [[0]] * 3, run.logs()
    for i in range(2):
        rounds = run.rounds(i)[1:]
        assert rounds and all(r["committed"] and len(r["contributors"]) == 2 for r in rounds), rounds
        if mode.startswith("overlap"):
            assert all(r["delayed"] for r in rounds) and len(rounds) == 3, rounds
        else:
            assert [r["fragment"] for r in rounds] == [1, 0, 1, 0, 1, 0], rounds
    for w in range(2):
        with open(tmp_path / "single" / f"single.1.rank{w}.jsonl") as f:
            ref = [json.loads(line) for line in f][-1]
        mine = run.final(w)
        assert mine["params"] == ref["params"], f"job {w}: the model differs from single-job mode ({mode})"
        assert mine["sha"] == ref["sha"], f"job {w}: θ_outer differs from single-job rank {w} ({mode})"
        assert mine["iteration"] == ref["iteration"] == iters


@pytest.mark.timeout(420)
def test_elastic_overlap_fragments_kill_with_a_round_in_flight_then_a_restart_heals_into_the_delayed_run(tmp_path):
    """sparseloco, τ = 1 and P = 2 (a fragment's round every 2 steps), H = 4, 3 jobs × 1 rank, 49 iterations.
    Job 2's comm thread pauses inside the round after step 3 (its training goes on until the completion
    waits); it is killed there: the survivors roll that round back (nothing applied, θ_outer unchanged) and
    commit without it; restarted, it heals (every fragment's state) from a live peer at their next launch and
    contributes to delayed rounds of both fragments again; all end with one θ_outer."""
    with Run(tmp_path, algorithm="sparseloco", jobs=3, iters=49, H=4, ranks=1, outer_timeout=5,
             extra=["--sparseloco-overlap-steps", "1", "--sparseloco-fragments", "2"]) as run:
        # job 2's comm thread pauses inside the round after step 3; its training goes on to the completion, where
        # it waits: killed there
        t_kill = kill_mid_round_then_restart(run, pause_after_step=3, commit_timeout=90, settle=0.5,
                                             contributed=lambda r: r["delayed"])
        codes = [job.wait(240) for job in run.jobs]
    assert codes == [[0], [0], [0]], run.logs()
    for i in (0, 1):
        rounds = run.rounds(i)[1:]
        failed = [r for r in rounds if not r["committed"]]
        assert len(failed) == 1 and failed[0]["step"] == 3 and failed[0]["delayed"], rounds
        assert failed[0]["t"] > t_kill and first_commit_after(rounds, failed[0]["t"])["participants"] == [0, 1], rounds
    recs = run.rounds(2, attempt=2)
    heals = [h for r in recs for h in r["heals"] if h["role"] == "received"]
    assert recs[0]["healed"] and recs[0]["behind"] > 0 and heals and heals[0]["nbytes"] > 0, recs[:2]
    assert not recs[0]["delayed"] and all(r["delayed"] for r in recs[1:]), recs   # start-up round, then τ = 1
    assert {r["fragment"] for r in recs[1:] if r["committed"] and r["contributing"]} == {0, 1}, recs
    # θ_outer identical (each job's θ_local holds its own window of τ steps after the last merge)
    check_consistency(run, (0, 1, 2), ranks=(0,), finals_of=())
    assert len({run.final(i)["sha"] for i in range(3)}) == 1, [run.final(i) for i in range(3)]


@pytest.mark.timeout(420)
@pytest.mark.parametrize("tau", [0, 1])
def test_elastic_grace_a_slow_job_does_not_hold_the_others_back_and_still_contributes(tmp_path, tau):
    """sparseloco, H = 2, blocking (τ = 0) or delayed (τ = 1: the late job heals inside the comm thread's quorum
    with its training thread parked), 3 jobs × 1 rank, min-workers 2; job 2 sleeps 0.25 s per inner step
    (about 3x slower) and trains 8 iterations while the others train 80; ``--sparseloco-elastic-grace 0.3``
    with a lighthouse join window of 300 ms. Jobs 0 and 1 commit most of their rounds without job 2; job 2
    catches up in place at each of its rounds and contributes there; every step committed by several jobs
    has one θ_outer, and jobs 0 and 1 end with one θ_outer (and, blocking, one model); a fast job that was left
    out of one quorum itself ends with the other's last round (``ElasticRounds._end_with_the_run``)."""
    overlap = ["--sparseloco-overlap-steps", "1"] if tau else []
    with Run(tmp_path, algorithm="sparseloco", jobs=3, iters=80, iters_of={2: 8}, ranks=1, min_workers=2,
             lighthouse_min=2, join_timeout_ms=300,
             extra=["--sparseloco-elastic-grace", "0.3", "--sparseloco-elastic-quorum-timeout", "60", *overlap]) as run:
        run.start_all(job2={"ELASTIC_SLOW": "0.25"})
        codes = [job.wait(300) for job in run.jobs]
    assert codes == [[0], [0], [0]], run.logs()
    fast = [r for r in run.rounds(0)[1:] if r["committed"]]
    without = [r for r in fast if 2 not in r["participants"]]
    assert len(fast) >= 12 and len(without) >= len(fast) // 2, fast
    late = [r for r in run.rounds(2)[1:] if r["committed"] and r["contributing"]]
    assert len(late) >= 2 and any(r["catch_up"] and r["kept"] for r in late), run.rounds(2)
    assert sum(2 in r["contributors"] for r in fast) >= 2, fast    # its Δ entered the run's θ_outer
    check_consistency(run, (0, 1, 2), ranks=(0,), finals_of=(0, 1) if not tau else (), iterations=False)
    finals = [run.final(i) for i in (0, 1)]
    if finals[0]["step"] == finals[1]["step"]:
        assert finals[0]["sha"] == finals[1]["sha"], (finals, run.rounds(0)[-2:], run.rounds(1)[-2:])
    else:   # delayed: a job that ended with the run settled the last round; the other still has it in flight when
        # train() returns (it settles at exit), one step behind
        assert tau and abs(finals[0]["step"] - finals[1]["step"]) == 1, finals
        assert any("the run ends at this round" in run.jobs[i].output() for i in (0, 1)), run.logs()
    ends = [run.final(i)["iteration"] for i in range(3)]
    assert ends[2] == 8 and max(ends[:2]) == 80, ends
    for i in (0, 1):   # a fast job left out of one quorum (a loaded machine) stays a round behind: it ends with the run
        assert ends[i] == 80 or "the run ends at this round" in run.jobs[i].output(), (ends, run.logs())
    t_slow = [r["t"] for r in run.rounds(2)]
    t_fast = [r["t"] for r in run.rounds(0)]
    assert (t_slow[-1] - t_slow[0]) / 7 > 2 * (t_fast[-1] - t_fast[0]) / 79, "job 2 was not slower"

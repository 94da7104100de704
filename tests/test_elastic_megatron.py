"""Elastic mode in the real megatron.training loop: every worker its own Megatron job, a real lighthouse.

Each job is ``examples/pretrain_gpt.py`` (tiny GPT, mock data, CPU gloo) through
``testing/elastic_launcher.py`` (``megatron_sparseloco.run`` plus per-round records and fault hooks),
launched as its own process tree through ``testing.prefork`` (torchrun's interface, ranks forked
from a warm server) and driven by ``testing.elastic_jobs`` (kill -9, SIGSTOP / SIGCONT, restart).

* kill / restart (sparseloco, 3 jobs × DP 2): a job killed with kill -9 mid-round makes that
  round roll back on the others at most once; they go on committing; restarted, it heals from a
  live peer and contributes again. Every step committed by several jobs has bitwise the same
  θ_outer, a round that rolled back leaves θ_outer unchanged, and the run ends with all three jobs
  at the last iteration, exit 0, θ_outer and the model bitwise identical.
* catch up in place (sparseloco, 2 jobs × DP 2): every process of one job stopped (SIGSTOP) past the
  outer timeout, then continued: it heals from the live job in the same process (no restart), keeps
  its own iteration, and both train together again with identical θ_outer until one finishes, exit 0;
  the same after a vote that failed on one job while the other committed.
* failure-free elastic mode = single-job mode (diloco, 3 jobs × DP 2 vs one job of 3 workers × DP 2,
  same seeds and data slots): the final model and every shard's θ_outer bitwise equal.
* a job with the wrong token joining late is refused by the others (at its heal's handshake, as it
  is behind the run, or at its round header), which name it and go on; it exits naming its token
  file. One stopped rank of a job (average): the job is dropped, the others go on; continued, it
  catches up in place. With ``--sparseloco-elastic-after-failed-round discard`` a round that
  did not commit leaves θ_local = θ_outer (with ``keep``, the kill test: θ_local ≠ θ_outer).
* gasloc with PP 2 (tied embeddings): every round commits with 3 contributors, the first stage's
  word embeddings equal the last stage's output layer in every job.
"""
from __future__ import annotations

import glob
import json
import os
import sys
import time

import pytest

from megatron_sparseloco.demo import build_command
from megatron_sparseloco.testing.elastic_jobs import ElasticRun, wait_until

pytestmark = [pytest.mark.multirank, pytest.mark.megatron]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAUNCHER = ["-m", "megatron_sparseloco.testing.elastic_launcher"]
SECRET = "the-run-secret-0123456789abcdef"


def make_token(path, secret=SECRET):
    with open(path, "w") as f:
        f.write(secret)
    os.chmod(path, 0o600)
    return str(path)


def pretrain_args(*, algorithm, slots, iters, H=2, nproc=2, run_batch=None, extra=()):
    """The Megatron + sparseloco arguments of one job (or of the single job: ``nproc`` = all ranks)."""
    cmd = build_command({"train": "unused", "valid": "unused"}, nproc=nproc, workers=slots, algorithm=algorithm,
                        inner_steps=H, train_iters=iters, eval_interval=1000, eval_iters=1, log_interval=1,
                        micro_batch_size=2, seq_length=32,
                        extra=["--num-layers", "2", "--hidden-size", "64", "--mock-data", "--split", "98,1,1"])
    i = cmd.index("--train-data-path")
    del cmd[i:i + 4]
    if run_batch is not None:   # the run's batch, as in single-job mode (each elastic job trains 1/W of it)
        cmd[cmd.index("--global-batch-size") + 1] = str(run_batch)
    return LAUNCHER + cmd[cmd.index("megatron_sparseloco.run") + 1:] + list(extra)


class Run:
    """A lighthouse and worker jobs of the real loop; their round records (``testing/elastic_launcher.py``)."""

    def __init__(self, tmp_path, *, algorithm, jobs=3, slots=None, iters=16, H=2, min_workers=1, lighthouse_min=1,
                 extra=(), tokens=None, outer_timeout=5, ranks=2, join_timeout_ms=5000, iters_of=None):
        self.out = str(tmp_path)
        self.slots = slots or jobs
        self.iters = iters
        self.barrier = os.path.join(self.out, "barrier")
        os.makedirs(self.barrier)
        token = make_token(tmp_path / "token")
        self.tokens = tokens or [token] * jobs
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT] + sys.path), ELASTIC_OUT=self.out,
                   PYTHONUNBUFFERED="1", TORCHDYNAMO_DISABLE="1")
        self.run = ElasticRun(self.out, min_replicas=lighthouse_min, env=env, heartbeat_timeout_ms=1500,
                              join_timeout_ms=join_timeout_ms)
        common = dict(algorithm=algorithm, slots=self.slots, H=H, run_batch=2 * ranks * self.slots, nproc=ranks)
        self.jobs = []
        for i in range(jobs):
            argv = pretrain_args(**common, iters=(iters_of or {}).get(i, iters), extra=[
                "--sparseloco-lighthouse", self.run.lighthouse.url, "--sparseloco-worker-index", str(i),
                "--sparseloco-elastic-token-file", self.tokens[i], "--sparseloco-min-workers", str(min_workers),
                "--sparseloco-outer-timeout", str(outer_timeout), "--sparseloco-elastic-heartbeat-interval", "0.2",
                *extra])
            self.jobs.append(self.run.add_job(f"job{i}", argv, ranks=ranks, launcher="prefork",
                                              env={"ELASTIC_BARRIER": f"{self.barrier}:{ranks * jobs}"}))

    def __enter__(self):
        return self

    def start_all(self, **env_of):
        """Start every job; ``env_of``: job name → extra environment (fault hooks)."""
        for job in self.jobs:
            self.start(job, **env_of.get(job.name, {}))

    def __exit__(self, *exc):
        self.run.cleanup()

    def start(self, job, **env):
        job.env.update(env, ELASTIC_TAG=f"{job.name}.{job.attempt + 1}")
        job.start()
        return job

    def restart(self, i):
        """Start job i again: no start barrier, no fault hook; it says when it joins (``joined<i>``)."""
        job = self.jobs[i]
        for key in ("ELASTIC_BARRIER", "ELASTIC_PAUSE"):
            job.env.pop(key, None)
        return self.start(job, ELASTIC_STARTUP_FILE=self.path(f"joined{i}.{job.attempt + 1}"))

    def path(self, name):
        return os.path.join(self.out, name)

    def records(self, i, attempt=None, rank=0):
        """Round records of job i (all attempts, or one), in time order."""
        pattern = f"job{i}.{attempt if attempt is not None else '*'}.rank{rank}.jsonl"
        recs = []
        for p in glob.glob(os.path.join(self.out, pattern)):
            att = int(os.path.basename(p).split(".")[1])
            with open(p) as f:
                lines = f.read().split("\n")
            # the last line may still be being written by the job (a poll while it runs): complete lines only
            recs += [dict(json.loads(line), attempt=att) for line in lines[:-1]]
        return sorted(recs, key=lambda r: r["t"])

    def rounds(self, i, attempt=None, rank=0):
        return [r for r in self.records(i, attempt, rank) if not r.get("final")]

    def final(self, i, rank=0):
        finals = [r for r in self.records(i, rank=rank) if r.get("final")]
        assert finals, f"job {i} rank {rank} wrote no final record\n{self.logs()}"
        return finals[-1]

    def wait(self, predicate, timeout, what):
        wait_until(predicate, timeout, what, self.logs)

    def logs(self, n=4000):
        out = []
        for job in self.jobs:
            for a in range(1, job.attempt + 1):
                text = job.output(a)
                keep = [ln for ln in text.splitlines()
                        if "elastic" in ln or "Error" in ln or "error" in ln or ln.startswith("prefork:")]
                out.append(f"--- {job.name} attempt {a}\n" + "\n".join(keep)[-n:])
        return "\n".join(out)


def hold(run: Run, on: bool):
    """Hold the running jobs before their next round (ELASTIC_HOLD) or let them go."""
    path = run.path("hold")
    if on:
        open(path, "w").close()
    elif os.path.exists(path):
        os.remove(path)


def check_consistency(run: Run, jobs, ranks=(0, 1), finals_of=None, iterations=True):
    """Every step committed by several jobs: the same θ_outer; a round rolled back without a heal leaves
    θ_outer unchanged; the final θ_outer and model bitwise identical across ``finals_of`` (default: ``jobs``),
    every job of ``jobs`` at the last iteration (unless ``iterations`` is False)."""
    for rank in ranks:
        by_step = {}
        for i in jobs:
            recs = run.rounds(i, rank=rank)
            for prev, r in zip(recs, recs[1:]):
                if r["attempt"] == prev["attempt"] and not r["committed"] and not r["healed"]:
                    assert r["sha"] == prev["sha"], f"job {i} rank {rank}: a rolled-back round changed θ_outer: {r}"
            for r in recs:
                if r["committed"]:
                    by_step.setdefault(r["after"], set()).add(r["sha"])
        split = {s: fps for s, fps in by_step.items() if len(fps) > 1}
        assert not split, f"rank {rank}: jobs committed different θ_outer at steps {split}\n{run.logs()}"
        finals = [run.final(i, rank) for i in (jobs if finals_of is None else finals_of)]
        assert len({f["sha"] for f in finals}) <= 1, f"rank {rank}: final θ_outer differs: {finals}"
        assert len({f["params"] for f in finals}) <= 1, f"rank {rank}: final model differs"
        if iterations:
            assert {run.final(i, rank)["iteration"] for i in jobs} == {run.iters}, finals


def kill_mid_round_then_restart(run: Run, pause_after_step: int, commit_timeout: float, settle: float = 0.0,
                                contributed=lambda r: True) -> float:
    """Start jobs 0-2 (0 and 1 held before their rounds while job 2 restarts), kill -9 job 2 where its rank 0
    pauses inside the round after committed step ``pause_after_step`` (``settle`` seconds later), wait for
    the survivors to commit without it, restart it and wait until it contributes to a committed round that
    also satisfies ``contributed``; returns the time of the kill."""
    c = run.jobs[2]
    run.start_all(job0={"ELASTIC_HOLD": run.path("hold")}, job1={"ELASTIC_HOLD": run.path("hold")},
                  job2={"ELASTIC_PAUSE": f"{pause_after_step}:" + run.path("paused"), "ELASTIC_HOLD": run.path("hold")})
    run.wait(lambda: os.path.exists(run.path("paused")), 180, "job 2 to pause inside its round")
    time.sleep(settle)
    t_kill = time.time()
    c.kill()
    assert c.wait(30) == [-9]
    run.wait(lambda: any(r["committed"] and r["participants"] == [0, 1] for r in run.rounds(0)), commit_timeout,
             "the survivors to commit without job 2")
    hold(run, True)
    run.restart(2)
    run.wait(lambda: os.path.exists(run.path("joined2.2")), 120, "the restarted job 2 to reach its first round")
    hold(run, False)
    run.wait(lambda: any(r["contributes"] and r["committed"] and contributed(r) for r in run.rounds(2, attempt=2)),
             120, "the restarted job 2 to contribute to a committed round")
    return t_kill


def first_commit_after(recs, t):
    return next((r for r in recs if r["t"] > t and r["committed"]), None)


# ------------------------------------------------------------------------------------------ faults
@pytest.mark.timeout(420)
def test_kill_restart_a_whole_job(tmp_path):
    """sparseloco, 3 jobs × DP 2, H = 2, 24 iterations (module docstring, first item)."""
    with Run(tmp_path, algorithm="sparseloco", iters=24) as run:
        # --- kill -9 job 2 mid-round: its rank 0 pauses inside round 3, after the header
        t_kill = kill_mid_round_then_restart(run, pause_after_step=2, commit_timeout=60)
        codes = [job.wait(240) for job in run.jobs]
    assert codes == [[0], [0], [0]], run.logs()

    # the kill: the round in flight rolled back on the survivors (once), then they went on without job 2
    for i in (0, 1):
        after = [r for r in run.rounds(i) if r["t"] > t_kill]
        failed = [r for r in after[:3] if not r["committed"]]
        assert len(failed) <= 1 and after and first_commit_after(after, t_kill)["participants"] == [0, 1], after[:3]
    detection = first_commit_after(run.rounds(0), t_kill)["t"] - t_kill
    # the restart: healed from a live peer (bytes received), then contributed to committed rounds
    for i, attempt in ((2, 2),):
        recs = run.rounds(i, attempt=attempt)
        heals = [h for r in recs for h in r["heals"] if h["role"] == "received"]
        assert recs[0]["healed"] and recs[0]["behind"] > 0 and heals and heals[0]["nbytes"] > 0, recs[:2]
        assert not recs[0]["contributes"] and any(r["contributes"] and r["committed"] for r in recs), recs
    # --sparseloco-elastic-after-failed-round keep (default): a rolled-back round left θ_local ≠ θ_outer
    kept = [r for i in (0, 1) for r in run.rounds(i) if not r["committed"] and not r["healed"] and r["contributes"]]
    assert kept and all(r["local"] != r["sha"] for r in kept), kept
    check_consistency(run, (0, 1, 2))
    heal = [h for r in run.rounds(2, attempt=2) for h in r["heals"] if h["role"] == "received"][0]
    print(f"\nkill -9 → survivors' next commit {detection:.2f} s; heal {heal['nbytes']} bytes in "
          f"{heal['seconds']:.3f} s")


@pytest.mark.timeout(420)
def test_catch_up_in_place_after_a_stop_and_after_a_failed_vote(tmp_path):
    """sparseloco, 2 jobs × DP 2, H = 2, 40 iterations (module docstring, second item). Job 1 is stopped
    whole past the outer timeout while job 0 commits without it, then continued: it heals in the same
    process (attempt 1 throughout), discards nothing it had not sent, and the two commit together
    again; later job 0's vote fails once (ELASTIC_FAIL_VOTE) while job 1 commits: job 0 catches up in
    place, its progress discarded (its Δ is in θ_outer). Both exit 0 at their last iteration; every
    step both committed has one θ_outer."""
    with Run(tmp_path, algorithm="sparseloco", jobs=2, iters=40) as run:
        a, b = run.jobs
        run.start_all(job0={"ELASTIC_FAIL_VOTE": "14"})
        run.wait(lambda: sum(r["committed"] for r in run.rounds(1)) >= 3, 180, "three commits of job 1")
        t_stop = time.time()
        b.stop()
        run.wait(lambda: sum(r["committed"] and r["participants"] == [0] and r["t"] > t_stop
                             for r in run.rounds(0)) >= 2, 90, "job 0 to commit twice without the stopped job 1")
        b.cont()
        codes = [job.wait(300) for job in run.jobs]
    assert codes == [[0], [0]], run.logs()
    assert a.attempt == b.attempt == 1
    # the stop: job 1 caught up in place (healed, in iteration), keeping its progress, then both committed together
    caught = [r for r in run.rounds(1) if r["catch_up"]]
    assert caught and caught[0]["behind"] >= 2 and caught[0]["kept"], caught
    together = [r for r in run.rounds(1) if r["t"] > caught[0]["t"] and r["committed"] and r["participants"] == [0, 1]]
    assert sum(len(r["contributors"]) == 2 for r in together) >= 2, together   # both contributing again
    # the failed vote: job 0 rolled back the round job 1 committed, then caught up in place, its progress discarded
    failed = [r for r in run.rounds(0) if r["step"] == 14 and not r["committed"] and r["proceed"]]
    assert failed, run.rounds(0)
    later = [r for r in run.rounds(0) if r["t"] > failed[0]["t"] and r["catch_up"]]
    assert later and later[0]["behind"] == 1 and not later[0]["kept"], later
    assert any(r["committed"] and r["after"] == 15 for r in run.rounds(1)), run.rounds(1)
    check_consistency(run, (0, 1), finals_of=())
    for i in (0, 1):
        assert "caught up in place" in run.jobs[i].output() and "restart this job" not in run.jobs[i].output(), \
            run.jobs[i].output()[-3000:]


@pytest.mark.timeout(300)
def test_a_job_a_round_behind_ends_with_the_run_instead_of_waiting_for_a_quorum(tmp_path):
    """sparseloco, 3 jobs × 1 rank, H = 2, 16 iterations, min-workers 2 (a lighthouse join window of 2 s).
    Job 0 is held before one round while jobs 1 and 2 commit without it; released, it catches up in place
    at its next quorum, keeping its own iteration, so it stays a round behind them. Jobs 1 and 2 end at
    iteration 16 in a round whose headers say it is their last; job 0 (at iteration 14) is left with
    nobody to reach min-workers: it ends there with the run's last θ_outer and exit 0 (before this rule
    it waited --sparseloco-elastic-quorum-timeout for a quorum and exited 1)."""
    with Run(tmp_path, algorithm="sparseloco", jobs=3, iters=16, ranks=1, min_workers=2, lighthouse_min=2,
             join_timeout_ms=2000, extra=["--sparseloco-elastic-quorum-timeout", "30"]) as run:
        run.start_all(job0={"ELASTIC_HOLD": run.path("hold0")})
        run.wait(lambda: sum(r["committed"] for r in run.rounds(0)) >= 2, 180, "two commits of job 0")
        t_hold = time.time()
        open(run.path("hold0"), "w").close()
        run.wait(lambda: any(r["committed"] and r["participants"] == [1, 2] and r["t"] > t_hold
                             for r in run.rounds(1)), 90, "jobs 1 and 2 to commit a round without job 0")
        os.remove(run.path("hold0"))
        codes = [job.wait(240) for job in run.jobs]
    assert codes == [[0], [0], [0]], run.logs()
    caught = [r for r in run.rounds(0) if r["catch_up"]]
    assert caught and caught[0]["kept"], run.rounds(0)
    behind = 2 * caught[0]["behind"]          # iterations: H per round it was not in
    ends = [run.final(i)["iteration"] for i in range(3)]
    assert ends == [16 - behind, 16, 16], (ends, caught[0])
    last = run.rounds(0)[-1]
    assert last["committed"] and 0 in last["participants"] and len(last["participants"]) >= 2, last
    said = "the run ends at this round"
    assert said in run.jobs[0].output() and said not in run.jobs[1].output() + run.jobs[2].output(), run.logs()
    assert "no quorum" not in run.jobs[0].output()
    assert len({run.final(i)["sha"] for i in range(3)}) == 1, [run.final(i) for i in range(3)]
    assert len({run.final(i)["params"] for i in range(3)}) == 1    # blocking: θ_local = θ_outer after a commit


# ------------------------------------------------------------------------------------------ = single job
@pytest.mark.timeout(300)
def test_failure_free_elastic_run_equals_single_job_mode(tmp_path):
    """diloco, 8 iterations, H = 2: 3 elastic jobs × DP 2 (the lighthouse waits for all three) against one
    job of 3 workers × DP 2 with the same arguments (the run's --global-batch-size 12): the same data
    slots, the same seeds, so the same model bit for bit, and each shard's θ_outer equal to the
    single job's shard at the same position (elastic job w rank r = single-job rank 2w + r)."""
    with Run(tmp_path / "elastic", algorithm="diloco", iters=8, min_workers=3, lighthouse_min=3) as run:
        run.start_all()
        single = run.run.add_job("single", pretrain_args(algorithm="diloco", slots=3, iters=8, nproc=6, run_batch=12),
                                 ranks=6, launcher="prefork", env={"ELASTIC_OUT": str(tmp_path / "single")})
        run.start(single)
        codes = [job.wait(240) for job in run.jobs + [single]]
    assert codes == [[0]] * 4, run.logs()
    for i in range(3):
        assert all(r["committed"] and len(r["contributors"]) == 3 for r in run.rounds(i)[1:]), run.rounds(i)
    single_finals = {}
    for rank in range(6):
        with open(tmp_path / "single" / f"single.1.rank{rank}.jsonl") as f:
            single_finals[rank] = [json.loads(line) for line in f][-1]
    for w in range(3):
        for r in range(2):
            mine, ref = run.final(w, r), single_finals[2 * w + r]
            assert mine["params"] == ref["params"], f"job {w} rank {r}: the model differs from single-job mode"
            assert mine["sha"] == ref["sha"], f"job {w} rank {r}: θ_outer differs from single-job rank {2 * w + r}"
            assert mine["iteration"] == ref["iteration"] == 8


# ------------------------------------------------------------------------------------------ token, stopped rank
@pytest.mark.timeout(300)
def test_wrong_token_refused_and_one_stopped_rank(tmp_path):
    """average, 4 slots: jobs 0-2 (DP 2) run; a job 3 with another secret joins late: the others refuse
    it, name it in their logs and go on; behind the run, it fails its first heal (nobody sends state to a
    job without the secret) and exits naming its token file. Then rank 1 of job 1 is stopped: job 1 leaves
    the quorums (its rank 0 stops asking), jobs 0 and 2 go on; continued, job 1 catches up in place and
    finishes its own iterations. Jobs 0 and 2 end identical."""
    bad = make_token(tmp_path / "bad-token", "another-secret-0123456789abcdef")
    good = make_token(tmp_path / "token-good")
    with Run(tmp_path, algorithm="average", jobs=4, iters=32, tokens=[good, good, good, bad],
             extra=["--sparseloco-elastic-after-failed-round", "discard"]) as run:
        intruder = run.jobs[3]
        for job in run.jobs[:3]:
            run.start(job, ELASTIC_BARRIER=f"{run.barrier}:6", ELASTIC_HOLD=run.path("hold"))
        run.wait(lambda: any(r["committed"] for r in run.rounds(0)), 120, "a first commit")
        hold(run, True)   # the others wait for the intruder, so that it meets them
        intruder.env.pop("ELASTIC_BARRIER")
        run.start(intruder, ELASTIC_STARTUP_FILE=run.path("intruder"))
        run.wait(lambda: os.path.exists(run.path("intruder")), 120, "the intruder's first round")
        hold(run, False)
        assert intruder.wait(120) == [1], run.logs()
        said = intruder.output()   # refused at its round header, or (behind the run) at its heal's handshake
        assert bad in said and ("refused by the other" in said or "does not hold this run's secret" in said), said[-3000:]
        t_refused = time.time()
        run.wait(lambda: any(r["committed"] and r["participants"] == [0, 1, 2] and r["t"] > t_refused
                             for r in run.rounds(0)), 60, "a commit after the refusal")
        t_stop = time.time()
        run.jobs[1].stop(rank=1)
        run.wait(lambda: sum(r["committed"] and r["participants"] == [0, 2] and r["t"] > t_stop
                             for r in run.rounds(0)) >= 2, 90, "jobs 0 and 2 to commit twice without job 1")
        run.jobs[1].cont(rank=1)
        codes = [run.jobs[i].wait(180) for i in (0, 1, 2)]
    assert codes == [[0], [0], [0]], run.logs()
    refusals = run.jobs[0].output()
    assert "claims worker index 3" in refusals and "secret" in refusals, refusals[-3000:]
    assert "caught up in place" in run.jobs[1].output(), run.jobs[1].output()[-3000:]
    check_consistency(run, (0, 1, 2), finals_of=(0, 2))
    # --sparseloco-elastic-after-failed-round discard: a round that did not commit left θ_local = θ_outer
    failed = [r for i in (0, 2) for r in run.rounds(i) if not r["committed"] and not r["healed"] and r["step"] > 0]
    assert failed and all(r["local"] == r["sha"] for r in failed), failed


# ------------------------------------------------------------------------------------------ gasloc, PP 2
@pytest.mark.timeout(300)
def test_gasloc_with_pipeline_parallel_tied_embeddings(tmp_path):
    """gasloc, 3 jobs × PP 2 (tied word embeddings and output layer on different stages): every round
    after the start-up one commits with the 3 contributors (gossip over the round's members: each job
    keeps its own θ, no fingerprint is compared), and inside every job the tied copies stay bitwise
    identical."""
    with Run(tmp_path, algorithm="gasloc", iters=8, extra=["--pipeline-model-parallel-size", "2"]) as run:
        run.start_all()
        codes = [job.wait(240) for job in run.jobs]
    assert codes == [[0]] * 3, run.logs()
    for i in range(3):
        rounds = run.rounds(i)
        assert len(rounds) == 5 and all(r["committed"] and len(r["contributors"]) == 3 for r in rounds[1:]), rounds
        first, last = run.final(i, 0), run.final(i, 1)
        assert first["tied"]["embedding"] == last["tied"]["output"], (first["tied"], last["tied"])
    assert "fingerprint" not in run.jobs[0].output().split("round 2 of worker 0")[1].split("\n")[0]


# ------------------------------------------------------------------------------------------ checkpoints
def _job_args(run_url, i, token, *, iters, save, load=None, slots=2):
    extra = ["--sparseloco-lighthouse", run_url, "--sparseloco-worker-index", str(i), "--sparseloco-elastic-token-file",
             token, "--sparseloco-outer-timeout", "5", "--sparseloco-elastic-heartbeat-interval", "0.2",
             "--save", save, "--save-interval", "4"] + (["--load", load, "--override-opt-param-scheduler"] if load else [])
    return pretrain_args(algorithm="sparseloco", slots=slots, iters=iters, nproc=1, run_batch=2 * slots, extra=extra)


def _phase(tmp_path, name, jobs, lighthouse_min):
    """Run ``jobs`` ({index: argv}) to the end under a fresh lighthouse; returns (exit codes, Run-like reader)."""
    out = tmp_path / name
    out.mkdir()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT] + sys.path), ELASTIC_OUT=str(out), PYTHONUNBUFFERED="1",
               TORCHDYNAMO_DISABLE="1")
    with ElasticRun(str(out), min_replicas=lighthouse_min, env=env, heartbeat_timeout_ms=1500,
                    join_timeout_ms=5000) as run:
        started = {}
        for i, argv in jobs.items():
            argv = [a.replace("LIGHTHOUSE", run.lighthouse.url) for a in argv]
            started[i] = run.add_job(f"job{i}", argv, ranks=1, launcher="prefork", env={"ELASTIC_TAG": f"job{i}.1"})
            started[i].start()
        codes = {i: job.wait(240) for i, job in started.items()}
        outputs = {i: job.output() for i, job in started.items()}
    reader = Run.__new__(Run)
    reader.out, reader.jobs, reader.iters = str(out), [], None
    return codes, outputs, reader


@pytest.mark.timeout(360)
def test_each_job_checkpoints_and_resumes_alone_or_with_the_newest_step(tmp_path):
    """sparseloco, 2 jobs × 1 rank, each saving its own checkpoint every 4 iterations. (1) 8 iterations.
    (2) Both restart from their checkpoints, job 1's newest one removed (it resumes at iteration 4,
    step 2; job 0 at iteration 8, step 4): the run resumes from the newest step, job 1 says its state
    disagreed and heals at start-up; both reach iteration 12 with identical θ_outer. (3) Job 0
    resumes alone from its own checkpoint (iteration 12, step 6) and trains to 14."""
    token = make_token(tmp_path / "token")
    saves = {i: str(tmp_path / f"ckpt{i}") for i in (0, 1)}
    codes, _, first = _phase(tmp_path, "first", {i: _job_args("LIGHTHOUSE", i, token, iters=8, save=saves[i])
                                                 for i in (0, 1)}, lighthouse_min=2)
    assert codes == {0: [0], 1: [0]}, first.logs() if first.jobs else codes
    import shutil
    shutil.rmtree(os.path.join(saves[1], "iter_0000008"))
    with open(os.path.join(saves[1], "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("4")
    codes, outputs, second = _phase(tmp_path, "second", {
        i: _job_args("LIGHTHOUSE", i, token, iters=12, save=saves[i], load=saves[i]) for i in (0, 1)}, lighthouse_min=2)
    assert codes == {0: [0], 1: [0]}, outputs
    r0, r1 = second.rounds(0), second.rounds(1)
    assert r0[0]["step"] == 4 and not r0[0]["healed"], r0[0]       # job 0 resumed its own step-4 state
    assert r1[0]["healed"] and r1[0]["behind"] == 2, r1[0]         # job 1 (step 2) healed to the newest step
    assert "started at step 2 (iteration 4, from its checkpoint) but the run is at step 4" in outputs[1], outputs[1][-3000:]
    for rank_final in ([second.final(0)], [second.final(1)]):
        assert rank_final[0]["iteration"] == 12 and rank_final[0]["step"] == 6
    assert second.final(0)["sha"] == second.final(1)["sha"] and second.final(0)["params"] == second.final(1)["params"]
    codes, outputs, third = _phase(tmp_path, "third", {0: _job_args("LIGHTHOUSE", 0, token, iters=14, save=saves[0],
                                                                     load=saves[0])}, lighthouse_min=1)
    assert codes == {0: [0]}, outputs
    r0 = third.rounds(0)
    assert r0[0]["step"] == 6 and not r0[0]["healed"] and r0[-1]["committed"] and r0[-1]["after"] == 7, r0
    assert third.final(0)["iteration"] == 14


# ------------------------------------------------------------------------------------------ bad values
@pytest.mark.timeout(120)
def test_a_bad_elastic_value_ends_the_job_before_the_model_is_built(tmp_path):
    """The run's --global-batch-size 10 is not a multiple of 3 slots: the launched job's rank prints one
    error naming the flag and the fix and exits with status 2 before Megatron builds anything."""
    token = make_token(tmp_path / "token")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT] + sys.path), ELASTIC_OUT=str(tmp_path),
               TORCHDYNAMO_DISABLE="1")
    with ElasticRun(str(tmp_path), env=env) as run:
        argv = pretrain_args(algorithm="sparseloco", slots=3, iters=4, nproc=1, run_batch=10, extra=[
            "--sparseloco-lighthouse", run.lighthouse.url, "--sparseloco-worker-index", "0",
            "--sparseloco-elastic-token-file", token])
        job = run.add_job("bad", argv, ranks=1, launcher="prefork")
        job.start()
        assert job.wait(100) == [1], job.output()[-3000:]    # the launcher's status when a rank fails
        out = job.output()
    assert "rank 0 exited with code 2" in out, out[-2000:]
    assert "megatron_sparseloco: error: --global-batch-size 10" in out and "Fix: use a multiple of" in out, out[-2000:]
    assert "building GPT model" not in out and "sparseloco | elastic" not in out

"""The elastic protocol with 3 separate jobs, a real torchft lighthouse, SparseLoCo over TorchFTComm.

Each job is its own process tree (``testing.elastic_jobs``) running
``testing.elastic_toy_job`` (simulated inner steps, no Megatron). Checked on the jobs' round logs:
every step committed by several jobs has bitwise the same θ_outer fingerprint on all of them; a
round that did not commit leaves θ_outer as it was; the jobs end with bitwise identical θ_outer.

* kill -9 of a whole job mid-run: the others go on committing, exit 0; the job restarted with the
  same index heals from a live peer (error feedback at zero) and contributes again;
* SIGSTOP of a job past the timeouts: dropped, the others go on; SIGCONT: it heals and contributes;
  the same with one stopped rank of a 2-rank job;
* a job that rolled back while the others committed is one step behind and heals at the next quorum;
* a job with another token file is refused: the others name it and commit without it; it commits
  nothing, says which token file it read and leaves only through --max-failed-rounds (or its heal);
* tokenless replicas in the quorums never make an honest job exit (one of them alone with them, the
  other started late and fresh); a refused verdict is ignored, a verified "not ok" rolls all back.
"""
import glob
import json
import os
import sys
import time

import pytest

from megatron_sparseloco.testing.elastic_jobs import ElasticRun, start_time, wait_until

pytestmark = pytest.mark.multirank
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOB = ["-m", "megatron_sparseloco.testing.elastic_toy_job"]


def make_token(path, secret):
    with open(path, "w") as f:
        f.write(secret)
    os.chmod(path, 0o600)
    return str(path)


class Scenario:
    """A lighthouse, ``jobs`` jobs of the toy worker (3), their logs. The jobs in ``late`` are neither
    started on entering nor wait at the start barrier: the test starts them (``job.start()``)."""

    def __init__(self, tmp_path, ranks=1, rounds=8, final_members=3, tokens=None, job_args=None,
                 launchers=None, stop_file=None, jobs=3, late=()):
        self.out, self.ranks, self.late = str(tmp_path), ranks, set(late)
        os.makedirs(os.path.join(self.out, "barrier"))
        good = make_token(tmp_path / "token", "the-run-secret-0123456789abcdef")
        self.tokens = tokens or [good] * jobs
        launchers = launchers or ("direct",) * jobs
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT] + sys.path))
        self.run = ElasticRun(self.out, min_replicas=1, env=env, heartbeat_timeout_ms=1500, join_timeout_ms=1000)
        self.common = ["--rounds", str(rounds), "--final-members", str(final_members), "--out", self.out,
                       "--lighthouse", self.run.lighthouse.url, "--outer-timeout", "5", "--step-seconds", "0.05",
                       "--deadline", "200"] + (["--stop-file", stop_file] if stop_file else [])
        barrier = ["--barrier", os.path.join(self.out, "barrier"), "--barrier-count", str((jobs - len(late)) * ranks)]
        # what follows "--barrier" (the start barrier, injected faults) is dropped on a restart
        self.jobs = [self.run.add_job(f"job{i}", JOB + ["--index", str(i), "--token-file", self.tokens[i]] + self.common
                                      + ([] if i in self.late else barrier) + (job_args or {}).get(i, []), ranks=ranks,
                                      launcher=launchers[i])
                     for i in range(jobs)]

    def __enter__(self):
        for i, job in enumerate(self.jobs):
            if i not in self.late:
                job.start()
        return self

    def __exit__(self, *exc):
        self.run.cleanup()

    def restart(self, i):
        job = self.jobs[i]
        job.argv = job.argv[:job.argv.index("--barrier")]   # a restarted job neither waits for others nor pauses
        job.start()

    def records(self, i, rank=0):
        recs = []
        for path in glob.glob(os.path.join(self.out, f"job{i}.rank{rank}.*.jsonl")):
            recs += [json.loads(line) for line in open(path)]
        return sorted(recs, key=lambda r: r["t"])

    def committed(self, i):
        return max([r["after"] for r in self.records(i) if "after" in r] or [0])

    def wait(self, predicate, timeout, what):
        wait_until(predicate, timeout, what, self.logs)

    def finish(self, timeout=240):
        codes = [job.wait(timeout) for job in self.jobs]
        return codes

    def logs(self):
        return "\n".join(f"--- {j.name}\n{j.output()[-3000:]}" for j in self.jobs)


def check_consistency(sc, jobs, ranks, altered=()):
    """Every step committed by several jobs: the same θ_outer; failed rounds leave θ_outer unchanged
    (except on the jobs in ``altered``, whose θ_outer a test changes); the final θ_outer bitwise
    identical across ``jobs``."""
    for rank in range(ranks):
        by_step = {}
        for i in jobs:
            recs = [r for r in sc.records(i, rank) if "committed" in r]
            for prev, r in zip(recs, recs[1:]):
                if not r["committed"] and not r["healed"] and i not in altered:
                    assert r["fp"] == prev["fp"], f"job {i} rank {rank}: a rolled-back round changed θ_outer: {r}"
            for r in recs:
                if r["committed"]:
                    by_step.setdefault(r["after"], set()).add(r["fp"])
        split = {s: fps for s, fps in by_step.items() if len(fps) > 1}
        assert not split, f"rank {rank}: jobs committed different θ_outer at steps {split}"
        finals = {open(os.path.join(sc.out, f"final.job{i}.rank{rank}.bin"), "rb").read() for i in jobs}
        assert len(finals) == 1, f"rank {rank}: final θ_outer differs across jobs {jobs}"


def healed_then_contributed(recs, after_t):
    """(the heal records received after ``after_t``, rounds contributed and committed after the heal)."""
    later = [r for r in recs if r["t"] > after_t and "committed" in r]
    heal_at = next((k for k, r in enumerate(later) if r["healed"]), None)
    if heal_at is None:
        return [], 0
    heals = [h for r in later for h in r["heals"] if h["role"] == "received"]
    return heals, sum(1 for r in later[heal_at + 1:] if r["contributes"] and r["committed"])


def test_kill_9_a_job_mid_round_the_others_go_on_and_the_restarted_job_heals(tmp_path):
    """Job 2 runs under torchrun: its agent and each worker are killed by PID, as a lost node."""
    with Scenario(tmp_path, ranks=2, rounds=10, launchers=("direct", "direct", "torchrun"),
                  job_args={2: ["--pause-at-step", "3"]}) as sc:
        sc.wait(lambda: os.path.exists(os.path.join(sc.out, "paused.job2")), 180, "job 2 inside round 4")
        time.sleep(0.5)         # the others are in their collectives with job 2
        t_kill = time.time()
        killed = sc.jobs[2].pids()
        assert len(killed) == 3, f"torchrun agent + 2 workers expected, got {killed}"
        sc.jobs[2].kill()
        sc.wait(lambda: not any(start_time(p) for p in killed), 30, "job 2's processes gone")
        sc.wait(lambda: sc.committed(0) >= sc.committed(2) + 2, 120, "2 rounds committed without job 2")
        t_restart = time.time()
        sc.restart(2)
        codes = sc.finish()
        logs = sc.logs()
    assert codes == [[0, 0], [0, 0], [0]], f"{codes}\n{logs}"   # job 2: the torchrun agent
    for i in (0, 1):
        rounds = [r for r in sc.records(i) if "committed" in r]
        mid = [r for r in rounds if r["step"] == 3 and r["size"] == 3]
        assert mid and not mid[0]["committed"], f"job {i}: the round job 2 died in committed: {mid}"
        assert any(r["committed"] and r["size"] == 2 and r["t"] > t_kill for r in rounds), \
            f"job {i} never committed without job 2"
    for rank in range(2):
        heals, contributed = healed_then_contributed(sc.records(2, rank), t_restart)
        assert heals and all(h["nbytes"] > 0 for h in heals), f"rank {rank}: the restarted job did not heal"
        assert contributed >= 2, f"rank {rank}: the restarted job contributed to {contributed} committed rounds"
    check_consistency(sc, [0, 1, 2], ranks=2)


def test_sigstop_mid_round_past_the_timeouts_drops_the_job_and_sigcont_heals_it(tmp_path):
    with Scenario(tmp_path, rounds=8, job_args={2: ["--pause-at-step", "2", "--pause-seconds", "1"]}) as sc:
        sc.wait(lambda: os.path.exists(os.path.join(sc.out, "paused.job2")), 180, "job 2 inside round 3")
        sc.jobs[2].stop()        # in its round, before its collectives: the others time out in theirs
        t_stop = time.time()
        sc.wait(lambda: any(r.get("committed") and r["size"] == 2 and r["t"] > t_stop for r in sc.records(0)) and
                sc.committed(0) >= sc.committed(2) + 2, 120, "2 rounds committed without the stopped job")
        t_cont = time.time()
        sc.jobs[2].cont()
        codes = sc.finish()
        logs = sc.logs()
    assert codes == [[0]] * 3, f"{codes}\n{logs}"
    for i in (0, 1):
        mid = [r for r in sc.records(i) if r.get("step") == 2 and r.get("size") == 3 and "committed" in r]
        assert mid and not mid[0]["committed"] and mid[0]["failed"], f"job {i}: the stalled round: {mid}"
    stalled = [r for r in sc.records(2) if r.get("step") == 2 and "committed" in r]
    assert stalled and not stalled[0]["committed"], f"the stopped job committed the round it stalled: {stalled}"
    heals, contributed = healed_then_contributed(sc.records(2), t_cont)
    assert heals and contributed >= 2, f"the resumed job healed {heals}, contributed {contributed}"
    check_consistency(sc, [0, 1, 2], ranks=1)


def test_one_stopped_rank_takes_its_job_out_until_it_resumes(tmp_path):
    """SIGSTOP of rank 1 of a 2-rank job: its job stops asking for quorums (torchft's manager waits for
    every rank), the others go on without it; SIGCONT: the job heals (both ranks) and contributes."""
    with Scenario(tmp_path, ranks=2, rounds=8) as sc:
        sc.wait(lambda: sc.committed(0) >= 2, 180, "2 committed rounds")
        sc.jobs[2].stop(rank=1)
        t_stop = time.time()
        without = lambda: [r for r in sc.records(0) if r.get("committed") and r["size"] == 2 and r["t"] > t_stop]  # noqa
        sc.wait(lambda: len(without()) >= 2, 120, "2 rounds committed without job 2")
        t_cont = time.time()
        sc.jobs[2].cont(rank=1)
        codes = sc.finish()
        logs = sc.logs()
    assert codes == [[0, 0]] * 3, f"{codes}\n{logs}"
    for rank in range(2):
        heals, contributed = healed_then_contributed(sc.records(2, rank), t_cont)
        assert heals and contributed >= 2, f"rank {rank}: healed {heals}, contributed {contributed}"
    check_consistency(sc, [0, 1, 2], ranks=2)


def test_a_job_that_rolled_back_while_the_others_committed_heals_at_the_next_quorum(tmp_path):
    with Scenario(tmp_path, rounds=6, job_args={2: ["--fail-vote-at-step", "2"]}) as sc:
        codes = sc.finish()
        logs = sc.logs()
    assert codes == [[0]] * 3, f"{codes}\n{logs}"
    at = {i: [r for r in sc.records(i) if r.get("step") == 2 and "committed" in r] for i in range(3)}
    assert at[0][0]["committed"] and at[1][0]["committed"] and not at[2][0]["committed"], at
    after = [r for r in sc.records(2) if "committed" in r and r["t"] > at[2][0]["t"]]
    assert after[0]["healed"] and after[0]["behind"] == 1 and not after[0]["contributes"], after[0]
    assert any(r["contributes"] and r["committed"] for r in after[1:]), "job 2 never contributed again"
    check_consistency(sc, [0, 1, 2], ranks=1)


def test_a_job_whose_theta_outer_differs_heals_in_place_without_exiting(tmp_path):
    """Job 2's θ_outer silently drifts (1e-3 added before its round at step 3): the fingerprints differ,
    no job commits that round, job 2 (outside the largest agreeing set) steps its committed step back
    instead of exiting, the next quorum heals it from a peer, and it contributes again; nobody exits."""
    with Scenario(tmp_path, rounds=7, job_args={2: ["--corrupt-at-step", "3"]}) as sc:
        codes = sc.finish()
        logs = sc.logs()
    assert codes == [[0]] * 3, f"{codes}\n{logs}"
    recs = {i: [r for r in sc.records(i) if "committed" in r] for i in range(3)}
    split = {i: [k for k, r in enumerate(recs[i]) if "fingerprints differ" in r["reason"]] for i in range(3)}
    assert all(split.values()), split
    for i in (0, 1):
        after = recs[i][split[i][0] + 1]
        assert not after["healed"] and after["committed"] and after["step"] == 3, after
    k = split[2][0]
    assert not recs[2][k]["committed"] and recs[2][k]["step"] == 3, recs[2][k]
    healed = recs[2][k + 1]
    assert healed["healed"] and healed["behind"] == 1 and not healed["contributes"] and healed["step"] == 3, healed
    assert any(r["contributes"] and r["committed"] for r in recs[2][k + 2:]), "job 2 never contributed again"
    assert "goes back to 2 so that the next quorum heals it" in sc.jobs[2].output()
    check_consistency(sc, [0, 1, 2], ranks=1, altered=(2,))


def test_a_job_with_another_token_is_named_stays_until_its_max_failed_rounds_and_is_refused_when_joining_later(
        tmp_path):
    """At start: its round header is refused: the honest jobs name it and commit without it; it verifies
    nobody, commits nothing, says each round which token file it read, and leaves through
    --max-failed-rounds 2 (or, once behind the run, at its heal). Joining a running run: no peer sends
    it any state (the heal handshake fails first)."""
    good = make_token(tmp_path / "token", "the-run-secret-0123456789abcdef")
    bad = make_token(tmp_path / "other-token", "another-secret-0123456789abcdef")
    stop = str(tmp_path / "stop")
    with Scenario(tmp_path, rounds=6, final_members=2, tokens=[good, good, bad], stop_file=stop,
                  job_args={2: ["--max-failed-rounds", "2"]}) as sc:
        sc.jobs[2].wait(120)
        first = sc.jobs[2].output()
        sc.wait(lambda: sc.committed(0) >= 2, 120, "2 rounds committed by the honest jobs")
        sc.restart(2)           # (without --max-failed-rounds: it follows --barrier)
        sc.jobs[2].wait(120)
        open(stop, "w").close()
        codes = sc.finish()
        late = sc.jobs[2].output()
        logs = sc.logs()
    assert codes[:2] == [[0], [0]], f"{codes}\n{logs}"
    assert codes[2] != [0] and bad in late and "healing from a live peer failed" in late, late[-3000:]
    assert "does not hold this run's secret" in late and "--sparseloco-elastic-token-file" in late, late[-3000:]
    assert bad in first and "none of the other 2 participant(s) of this round verifies" in first and \
        "--sparseloco-elastic-token-file" in first, first[-3000:]
    assert "--sparseloco-elastic-max-failed-rounds 2" in first or "healing from a live peer failed" in first, \
        first[-3000:]
    refusals = [r for i in (0, 1) for r in sc.records(i) if r.get("refused")]
    assert any(r["committed"] and r["size"] == 3 and r["contributors"] == [0, 1] for r in refusals), \
        f"the honest jobs never committed with the refused job present: {refusals}"
    assert "claims worker index 2" in sc.jobs[0].output(attempt=1), "the honest job never named the refused one"
    assert not [r for r in sc.records(2) if r.get("committed")], "the refused job committed a round"
    assert not [h for i in (0, 1) for r in sc.records(i) for h in r.get("heals", []) if h["role"] == "sent"], \
        "a peer sent its state to the job without the secret"
    check_consistency(sc, [0, 1], ranks=1)


def test_tokenless_peers_never_make_an_honest_job_exit(tmp_path):
    """Job 0 (the run's secret) starts with two tokenless replicas (jobs 2 and 3: the toy job with another
    token file, --min-workers 3, job 2 vetoing every round at step 0). Job 0 verifies nobody: it commits
    nothing, names its token file, stays. Job 1 (the run's secret) starts late and fresh (no commit yet:
    2 verified of 4, which once sent it off): jobs 0 and 1 commit with the honest contributors while the
    tokenless ones take part (job 2's veto ignored); behind the run, the tokenless ones fail their heal and
    stay (a failed heal while catching up is no reason to exit either): they still run when the honest jobs
    end, and the test kills them. Job 1's own veto at step 3 rolls back both honest jobs; the honest ones end
    (their last rounds with the tokenless ones present) with identical θ_outer."""
    good = make_token(tmp_path / "token", "the-run-secret-0123456789abcdef")
    bad = make_token(tmp_path / "other-token", "another-secret-0123456789abcdef")
    tokenless = ["--min-workers", "3", "--deadline", "120"]
    with Scenario(tmp_path, rounds=6, final_members=2, jobs=4, late=(1,), tokens=[good, good, bad, bad],
                  job_args={1: ["--veto-at-step", "3"], 2: tokenless + ["--veto-at-step", "0", "--veto-rounds", "1000"],
                            3: tokenless}) as sc:
        sc.wait(lambda: len([r for r in sc.records(0) if "committed" in r]) >= 3, 120, "3 rounds of job 0")
        t_late = time.time()
        sc.jobs[1].start()
        codes = [sc.jobs[i].wait(200) for i in range(2)]
        # the honest jobs are done; the tokenless ones stay (no exit of their own before their --deadline)
        stayed = [sc.jobs[i].alive() for i in (2, 3)]
        for i in (2, 3):
            sc.jobs[i].kill()
        logs = sc.logs()
    assert codes == [[0], [0]], f"{codes}\n{logs}"
    assert stayed == [True, True] and all("healing from a live peer failed" in sc.jobs[i].output()
                                          for i in (2, 3)), f"{stayed}\n{logs}"
    alone = [r for r in sc.records(0) if "committed" in r and r["t"] < t_late]
    assert len(alone) >= 3 and not any(r["committed"] for r in alone), alone
    assert all("none of the other 2 participant(s)" in r["reason"] for r in alone), alone
    said = sc.jobs[0].output()
    assert good in said and "--sparseloco-elastic-token-file" in said and "claims worker index 3" in said, said[-3000:]
    with_them = {i: [r for r in sc.records(i) if r.get("committed") and r["size"] == 4] for i in (0, 1)}
    for i in (0, 1):
        assert with_them[i], f"job {i} never committed with the tokenless replicas present"
        for r in with_them[i]:
            assert len(r["refused"]) == 2 and {r["indices"][p] for p in r["contributors"]} <= {0, 1}, r
    assert not sc.records(1)[0]["contributes"] and sc.records(1)[0]["committed"], sc.records(1)[0]
    vetoes = [r for r in sc.records(2) if r.get("size") == 4 and r.get("verdict") is False]
    assert vetoes and all(r["step"] == 0 for r in vetoes), "job 2 never vetoed a round job 1 took part in"
    at3 = {i: [r for r in sc.records(i) if r.get("step") == 3 and "committed" in r] for i in (0, 1)}
    for i in (0, 1):
        assert not at3[i][0]["committed"] and at3[i][0]["agreed"] is False, at3[i][0]
        assert any(r["committed"] for r in at3[i][1:]), f"job {i} never committed step 3 after the veto"
    assert at3[0][0]["verdict"] and not at3[1][0]["verdict"]
    check_consistency(sc, [0, 1], ranks=1)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("algorithm", ["sparseloco", "diloco"])
def test_corrupt_payload_rolls_the_round_back_on_every_job_then_the_next_commits(tmp_path, algorithm):
    """2 jobs. SparseLoCo (entropy-coded indices), in the rounds after steps 2, 3 and 4: job 1's payload gets
    one bit flipped on the wire (every job receives it: its tag fails), then is cut to half before it is
    tagged (it arrives authentic and does not decode), then job 0 alone receives job 1's payload with a
    flipped bit (only job 0 sees it; its signed "not ok" verdict rolls job 1 back too). DiLoCo, after step 2:
    an Inf in the sum job 1 receives (only job 1 sees it). Each such round rolls back on both jobs with
    θ_outer bitwise as before, nobody raises or exits, and the retried round commits on both."""
    if algorithm == "diloco":
        args = {0: ["--algorithm", "diloco"], 1: ["--algorithm", "diloco", "--nonfinite-sum-at-step", "2"]}
        faulty = (2,)
    else:
        args = {0: ["--index-coding", "entropy", "--corrupt-payload", "4:link"],
                1: ["--index-coding", "entropy", "--corrupt-payload", "2:bit,3:truncate"]}
        faulty = (2, 3, 4)
    with Scenario(tmp_path, jobs=2, rounds=6, final_members=2, job_args=args) as sc:
        codes = sc.finish()
    assert codes == [[0], [0]], sc.logs()
    for i in (0, 1):
        recs = [r for r in sc.records(i) if "committed" in r]
        for step in faulty:
            at = [r for r in recs if r["step"] == step]
            assert len(at) >= 2 and not at[0]["committed"] and at[0]["exchange"], (step, at)
            assert at[0]["agreed"] is False and at[-1]["committed"], (step, at)
            before = [r for r in recs if r["committed"] and r["after"] == step][-1]
            assert at[0]["fp"] == before["fp"], f"job {i}: the rolled-back round after step {step} changed θ_outer"
    check_consistency(sc, (0, 1), ranks=1)

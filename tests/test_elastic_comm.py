"""TorchFTComm against ProcessGroupComm: 3 one-rank replica groups, a real torchft lighthouse.

Every OuterComm operation gives bitwise the result of the c10d implementation on the same
inputs, with the same byte counts; when a member dies mid-round the others get stand-ins
instead of an exception, skip the rest of the round without touching the network, do not
commit, and the next quorum works without the dead member.
"""
import json
import os
import sys

import pytest

from megatron_sparseloco.testing.elastic_jobs import ElasticRun, free_port

pytestmark = pytest.mark.multirank
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
N = 3


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("elastic_comm")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT] + sys.path))
    port = free_port()
    with ElasticRun(str(out), min_replicas=1, env=env, heartbeat_timeout_ms=1500, join_timeout_ms=1000) as run:
        jobs = [run.add_job(f"job{i}", [os.path.join(ROOT, "tests", "elastic_comm_job.py"), str(i), str(N),
                                        run.lighthouse.url, str(port), str(out)]) for i in range(N)]
        for job in jobs:
            job.start()
        codes = [job.wait(120)[0] for job in jobs]
        logs = "\n".join(job.output() for job in jobs)
    assert codes == [0] * N, f"return codes {codes}\n{logs[-6000:]}"
    return [json.load(open(os.path.join(out, f"{i}.json"))) if i < N - 1 else None for i in range(N)] + \
        [None if not os.path.exists(os.path.join(out, f"{N - 1}.json")) else "unexpected"]


def test_every_operation_matches_c10d_bitwise_with_the_same_bytes(results):
    for i, res in enumerate(results[:N - 1]):
        assert (res["size"], res["rank"]) == (N, i)
        for name, op in res["ops"].items():
            assert op["equal"], f"rank {i}: {name} differs from ProcessGroupComm"
            assert op["torchft"] == op["c10d"], f"rank {i}: {name} counted {op['torchft']} vs c10d {op['c10d']}"
            assert op["c10d"][2] >= 1, f"{name} issued no collective"
        assert res["commit"] is True


def test_a_member_lost_mid_round_fails_the_round_without_raising(results):
    for i, res in enumerate(results[:N - 1]):
        f = res["failure"]
        assert f["failed"] and f["manager_errored"], f"rank {i}: the failure was not recorded: {f}"
        assert f["stand_in"], f"rank {i}: the failed all-gather did not return this rank's payload per member"
        assert f["later_ops_unchanged"], f"rank {i}: operations after the failure changed their inputs"
        assert f["skipped_ops_s"] < f["failed_after_s"] + 1.0, f"rank {i}: skipped operations waited: {f}"
        assert f["commit"] is False
        assert (f["next_size"], f["next_sum"], f["next_failed"], f["next_commit"]) == (N - 1, [2.0] * 3, False, True)
    assert results[N] is None


#: the clean-exit runs in ``make test`` (each run a fresh pair of jobs; 6 keeps ``make test`` under 15 min)
RUNS = 6


@pytest.mark.timeout(600)
def test_clean_exit_after_a_peer_stopped_mid_all_gather_repeatedly(tmp_path):
    """``RUNS`` times: two one-rank jobs meet in a round and start a 32 MiB all-gather; one stops itself (SIGSTOP)
    while its part is on the wire; the survivor's all-gather times out (0.5 s), it rolls back, closes its
    session and must exit 0 — never -6 ("terminate called without an active exception": a gloo
    operation still holding its tensors at interpreter teardown). ``tests/elastic_exit_job.py``."""
    token = tmp_path / "token"
    token.write_text("the-run-secret-0123456789abcdef")
    os.chmod(token, 0o600)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT] + sys.path), OMP_NUM_THREADS="1")
    job = os.path.join(ROOT, "tests", "elastic_exit_job.py")
    codes = []
    with ElasticRun(str(tmp_path), min_replicas=2, env=env, heartbeat_timeout_ms=1000, join_timeout_ms=500) as run:
        for i in range(RUNS):
            stopper = run.add_job(f"stopper{i}", [job, "stopper", str(2 * i), run.lighthouse.url, str(token),
                                                  str(tmp_path)])
            survivor = run.add_job(f"survivor{i}", [job, "survivor", str(2 * i + 1), run.lighthouse.url, str(token),
                                                    str(tmp_path)])
            stopper.start()
            survivor.start()
            codes.append(survivor.wait(120))
            assert "survivor done" in survivor.output(), survivor.output()[-3000:]
            stopper.kill()
            stopper.wait(30)
    assert codes == [[0]] * RUNS, codes

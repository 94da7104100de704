"""The round's signed messages (header, verdict; bound to the round and position) and its decisions,
without a network."""
import json

import pytest

from megatron_sparseloco.elastic.auth import derive_key
from megatron_sparseloco.elastic.decision import ForkMemory, decide, fork_check, round_fragment, tally_verdicts
from megatron_sparseloco.elastic.messages import (HEADER_BYTES, RoundBinding, make_header, make_verdict, read_header,
                                                  read_verdict, refusal_line)

KEY = derive_key(b"the-run-secret-0123456789")
OTHER = derive_key(b"another-secret-0123456789")
#: round q of a quorum of 3 (quorum id 7), and what every participant computes from its nonces
NONCES = [bytes([i]) * 32 for i in (1, 2, 3)]
BINDING = RoundBinding.of_nonces(NONCES, 7)


def fields(index, **kw):
    base = {"v": 3, "index": index, "group_rank": 0, "step": 5, "ok": True, "contributes": True, "finite": True,
            "samples": 64, "tokens": 64 * 128, "commits": 3, "fingerprint": 1234, "extra": {"more": 0},
            "newest": 5, "forgone": -1, "waited": 0, "fragment": 0}
    base.update(kw)
    return base


def test_a_header_round_trips_and_has_a_fixed_size():
    raw = make_header(KEY, fields(2), BINDING, 1)
    assert len(raw) == HEADER_BYTES
    assert read_header(KEY, raw, BINDING, 1) == fields(2)


def test_a_header_under_another_secret_or_altered_is_not_read():
    raw = make_header(KEY, fields(2), BINDING, 1)
    assert read_header(OTHER, raw, BINDING, 1) is None
    doc = json.loads(raw)
    doc["body"] = doc["body"].replace('"index":2', '"index":1')
    assert read_header(KEY, json.dumps(doc).encode(), BINDING, 1) is None
    for garbage in (b"", b"\xff" * 10, b"[]", b'{"body": 1, "mac": "00"}', b'{"body": "x", "mac": "zz"}',
                    b'{"body": "{\\"index\\": 99999999999999999999999}", "mac": "00"}'):
        assert read_header(KEY, garbage, BINDING, 1) is None


@pytest.mark.parametrize("edit", [{"index": "2"}, {"ok": 1}, {"extra": []}, {"fingerprint": 1.5}, {"v": 1},
                                  {"samples": True}, {"newest": 1.0}, {"waited": None},
                                  {"fragment": "0"}])
def test_a_signed_header_of_the_wrong_shape_is_not_read(edit):
    body = dict(fields(2), **edit)
    assert read_header(KEY, make_header(KEY, body, BINDING, 1), BINDING, 1) is None


def test_an_oversized_header_is_refused_when_made():
    with pytest.raises(ValueError, match="exceeds"):
        make_header(KEY, fields(0, extra={f"k{i}": i for i in range(400)}), BINDING, 0)


def test_replayed_header_from_another_round_or_position_is_refused_and_named():
    """A tokenless job in quorum q receives every member's signed header; presented in quorum q + 1,
    in another round of the same quorum id (a restarted lighthouse numbers quorums from 1 again), or
    at another position of round q, it does not verify: the round refuses it and names the position
    and the worker index it claims."""
    captured = make_header(KEY, fields(1), BINDING, 1)            # worker 1's header at position 1 of round q
    assert read_header(KEY, captured, BINDING, 1) == fields(1)
    fresh = [bytes([i]) * 32 for i in (4, 5, 6)]
    for later in (RoundBinding.of_nonces(fresh, 8), RoundBinding.of_nonces(fresh, 7),
                  RoundBinding(BINDING.digest, 8)):
        assert read_header(KEY, captured, later, 1) is None
    assert read_header(KEY, captured, BINDING, 2) is None         # the same round, another position
    # round q + 1: the honest worker 0 at position 0, the replay at position 2 (the slot it took)
    mine = fields(0)
    headers = [mine, read_header(KEY, make_header(KEY, fields(3), BINDING, 1), BINDING, 1),
               read_header(KEY, captured, BINDING, 2)]
    d = decide(headers, 0, 1, "T", ignores_non_contributors=True)
    assert d.refused == [2] and d.proceed and d.contributors == [0, 1] and d.exit_message is None
    line = refusal_line(2, captured)
    assert "participant 2" in line and "worker index 1" in line and "replayed" in line
    assert "worker index ?" in refusal_line(1, b"garbage")


def test_nonces_of_another_size_are_refused():
    with pytest.raises(ValueError, match="nonce"):
        RoundBinding.of_nonces([b"short"], 1)


def test_all_good_proceeds_with_every_contributor():
    d = decide([fields(0), fields(1), fields(2)], 1, 2, "T")
    assert d.proceed and d.contributors == [0, 1, 2] and d.exit_message is None and not d.refused


def test_a_job_that_verifies_nobody_else_does_not_commit_names_its_token_file_and_stays():
    headers = [fields(0), None, None]           # as rank 0 with another secret sees the others
    for commits in (0, 7):
        d = decide([fields(0, commits=commits), None, None], 0, 1, "/secrets/token", ignores_non_contributors=True)
        assert not d.proceed and d.alone and d.exit_message is None and d.contributors == []
        assert "/secrets/token" in d.reason and "--sparseloco-elastic-token-file" in d.reason
    assert decide(headers[:1], 0, 1, "T").proceed                  # alone in a quorum of one: a normal round


def test_refused_participants_are_left_out_of_the_round():
    d = decide([fields(0), None, fields(2)], 0, 1, "T", ignores_non_contributors=True)
    assert d.proceed and d.exit_message is None and d.refused == [1] and d.contributors == [0, 2]
    d = decide([fields(0), None, fields(2)], 0, 1, "T")            # a strategy that sums: no commit, no exit
    assert not d.proceed and d.exit_message is None and d.refused == [1] and "combine" in d.reason


def test_tokenless_peers_never_send_an_honest_job_off():
    """2 honest jobs (one fresh: commits 0) and 2 tokenless replicas: once a majority or a tie rule sent
    the fresh job off; now both honest jobs go on with each other whatever the counts."""
    for commits in (0, 5):
        headers = [fields(0, commits=commits), fields(1, commits=0), None, None]
        for me in (0, 1):
            d = decide(headers, me, 1, "T", ignores_non_contributors=True)
            assert d.proceed and d.exit_message is None and d.contributors == [0, 1] and d.refused == [2, 3]
    # refused headers take no part in any check: not in the worker-index, step or fingerprint checks
    d = decide([fields(0), None, fields(1), None, None], 2, 1, "T", ignores_non_contributors=True)
    assert d.proceed and d.contributors == [0, 2]


def test_a_worker_index_held_twice_is_kept_by_the_veteran():
    headers = [fields(0, commits=7), fields(1), fields(0, commits=0)]
    assert decide(headers, 0, 1, "T").exit_message is None
    d = decide(headers, 2, 1, "T")
    assert not d.proceed and "--sparseloco-worker-index" in d.exit_message and "participant 0" in d.exit_message
    assert not decide(headers, 1, 1, "T").proceed


def test_differing_fingerprints_make_the_smaller_set_heal_in_place():
    headers = [fields(0, fingerprint=1), fields(1, fingerprint=2), fields(2, fingerprint=2)]
    d = decide(headers, 0, 1, "T")
    assert not d.proceed and d.rewind and d.exit_message is None     # steps back: the next quorum heals it
    for me in (1, 2):
        d = decide(headers, me, 1, "T")
        assert not d.proceed and not d.rewind and d.exit_message is None
    tie = [fields(0, fingerprint=1), fields(1, fingerprint=2)]      # a tie: the set holding position 0 keeps it
    assert not decide(tie, 0, 1, "T").rewind and decide(tie, 1, 1, "T").rewind


def test_a_job_whose_heal_failed_sits_the_round_out_without_blocking_it():
    headers = [fields(0), fields(1), fields(2, ok=False, step=1, fingerprint=99)]
    d = decide(headers, 0, 1, "T")
    assert d.proceed and d.contributors == [0, 1]


def test_differing_steps_do_not_proceed():
    assert not decide([fields(0), fields(1, step=4)], 0, 1, "T").proceed


def test_non_contributors_and_non_finite_contributors():
    d = decide([fields(0), fields(1, contributes=False), fields(2)], 0, 1, "T")
    assert d.proceed and d.contributors == [0, 2]
    d = decide([fields(0), fields(1, finite=False), fields(2, contributes=False, finite=False)], 0, 1, "T")
    assert not d.proceed and d.nonfinite == [1]


def test_fewer_contributors_than_min_workers_do_not_proceed():
    d = decide([fields(0), fields(1, contributes=False)], 0, 2, "T")
    assert not d.proceed and "--sparseloco-min-workers 2" in d.reason


# ---------------------------------------------------------------------- the fork rule
def test_the_fork_rule_waits_for_a_job_at_the_newest_step_then_goes_on_naming_the_fork():
    """Every participant at step 5, one of them knows the run committed step 7 (no job here holds it):
    no commit while the longest wait is under the timeout; past it the round goes on, fork accepted."""
    waiting = [fields(0, newest=7, waited=3), fields(1, waited=1)]
    for me in (0, 1):                                       # the same decision on both
        d = decide(waiting, me, 1, "T", fork_timeout=10)
        assert not d.proceed and d.fork.newest == 7 and d.fork.step == 5 and not d.fork.accepted
        assert "step 7" in d.reason and "--sparseloco-elastic-quorum-timeout" in d.reason
    d = decide([fields(0, newest=7, waited=3), fields(1, waited=10)], 0, 1, "T", fork_timeout=10)
    assert d.proceed and d.fork.accepted and d.fork.newest == 7
    # the newest step forgone by any participant, or held by the round, is no fork
    assert decide([fields(0, newest=7), fields(1, forgone=7)], 0, 1, "T", fork_timeout=10).fork is None
    assert fork_check({0: fields(0, step=7, newest=7)}, 7, 10) is None
    # a participant at the newest step that sits the round out (its quorum failed) does not make the
    # healthy ones' older step current: they wait (torchft heals them to it at the next quorum)
    assert fork_check({0: fields(0), 1: fields(1, newest=6, step=6, ok=False)}, 5, 10).newest == 6


def test_the_fork_rule_over_rounds_every_participant_waits_then_forgoes_the_step_together():
    """Job X saw the run commit step 7 (then got cut off with Y, both at step 5). Their rounds wait
    until the longer wait passes the timeout; then both go on from step 5 and forgo step 7, so neither
    waits for it again, nor does a job that rejoins still remembering it."""
    x, y = ForkMemory(newest=7), ForkMemory()
    step, timeout = 5, 10

    def round_at(now, memories):
        headers = [fields(i, step=step, **m.fields(step, now)) for i, m in enumerate(memories)]
        ds = [decide(headers, me, 1, "T", fork_timeout=timeout) for me in range(len(memories))]
        assert len({(d.proceed, d.fork) for d in ds}) == 1, ds      # the same decision everywhere
        for m in memories:
            m.learn(headers, ds[0].fork, now)
        return ds[0]

    for now in (100.0, 104.0, 109.0):
        d = round_at(now, [x, y])
        assert not d.proceed and d.fork.newest == 7 and not d.fork.accepted
    assert y.newest == 7 and y.waiting_since == 100.0                # Y learned step 7 from X's header
    d = round_at(110.0, [x, y])
    assert d.proceed and d.fork.accepted and x.forgone == y.forgone == 7 and x.waiting_since is None
    step = 6                                                          # the round committed: the fork is the run now
    assert round_at(111.0, [x, y]).fork is None
    assert round_at(112.0, [x, y, ForkMemory(newest=7)]).fork is None   # a job rejoining with the old newest step


def test_a_refused_header_cannot_hold_a_round_back_with_a_newer_step():
    forged = make_header(OTHER, fields(1, newest=10**6), BINDING, 1)
    headers = [fields(0), read_header(KEY, forged, BINDING, 1), fields(2)]
    d = decide(headers, 0, 1, "T", ignores_non_contributors=True, fork_timeout=10)
    assert d.proceed and d.fork is None and d.refused == [1]


# ---------------------------------------------------------------------- verdicts
def verdicts(oks, key=KEY, binding=BINDING, indices=(0, 1, 2)):
    return [make_verdict(key, ok, binding, p, i) for p, (ok, i) in enumerate(zip(oks, indices))]


def test_verdicts_all_ok_agree():
    raws = verdicts([True, True, True])
    assert read_verdict(KEY, raws[1], BINDING, 1, 1) is True
    t = tally_verdicts(KEY, raws, BINDING, {0: 0, 1: 1, 2: 2})
    assert t.ok and not t.against and not t.unverifiable


def test_verdicts_a_refused_participants_verdict_is_ignored():
    """Position 2's header was refused: its "not ok" (under its own secret or even a well-formed one)
    does not veto the verified participants' round."""
    for key in (OTHER, KEY):
        raws = verdicts([True, True, False], key=KEY)[:2] + [make_verdict(key, False, BINDING, 2, 2)]
        t = tally_verdicts(KEY, raws, BINDING, {0: 0, 1: 1})
        assert t.ok and t.ignored == [2]


def test_verdicts_one_verified_not_ok_makes_every_verified_participant_roll_back():
    raws = verdicts([True, False, True])
    for _ in range(3):      # every verified participant tallies the same gathered bytes: all roll back
        t = tally_verdicts(KEY, raws, BINDING, {0: 0, 1: 1, 2: 2})
        assert not t.ok and t.against == [1]


def test_verdicts_replayed_altered_or_unsigned_from_a_verified_participant_count_as_not_ok():
    ok_elsewhere = make_verdict(KEY, True, RoundBinding.of_nonces(NONCES, 8), 1, 1)   # another round
    at_other_position = make_verdict(KEY, True, BINDING, 2, 1)
    flipped = b"\x01" + make_verdict(KEY, False, BINDING, 1, 1)[1:]
    for bad in (ok_elsewhere, at_other_position, flipped, b"\x01" * 33, b"", make_verdict(OTHER, True, BINDING, 1, 1)):
        raws = verdicts([True, True, True])
        raws[1] = bad
        t = tally_verdicts(KEY, raws, BINDING, {0: 0, 1: 1, 2: 2})
        assert not t.ok and t.unverifiable == [1], bad


def test_an_unreachable_lighthouse_ends_the_job_with_one_message(tmp_path):
    import os

    from torch.distributed import TCPStore

    from megatron_sparseloco.elastic.config import ElasticConfig
    from megatron_sparseloco.elastic.session import ElasticExit, ElasticSession
    from megatron_sparseloco.testing.elastic_jobs import free_port

    token = tmp_path / "token"
    token.write_text("0123456789abcdef0123")
    os.chmod(token, 0o600)
    port, dead = free_port(), free_port()
    store = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)  # noqa: F841 (the job's store)
    config = ElasticConfig(lighthouse=f"http://127.0.0.1:{dead}", worker_index=0, token_file=str(token),
                           connect_timeout=1.0).validate()
    with pytest.raises(ElasticExit) as exc:
        ElasticSession(config, group_rank=0, group_world_size=1, store_addr="127.0.0.1", store_port=port,
                       state_fn=dict, load_fn=lambda state: None, outer_timeout=5.0)
    assert f"--sparseloco-lighthouse http://127.0.0.1:{dead}" in str(exc.value) and "Fix:" in str(exc.value)


def test_a_round_syncs_the_fragment_most_participants_are_at_the_others_sit_it_out():
    """Fragments: the round's fragment is the one most healthy headers name (a tie: the lowest; a start-up
    round's -1 names none); a contributor at another fragment is not a contributor, one naming none is."""
    assert round_fragment([fields(0, fragment=1), fields(1, fragment=1), fields(2, fragment=0)]) == 1
    assert round_fragment([fields(0, fragment=1), fields(1, fragment=0)]) == 0
    assert round_fragment([fields(0, fragment=-1), fields(1, fragment=-1)]) == 0
    d = decide([fields(0, fragment=1), fields(1, fragment=1), fields(2, fragment=0)], 2, 2, "T")
    assert d.proceed and d.fragment == 1 and d.contributors == [0, 1]
    d = decide([fields(0, fragment=1), fields(1, fragment=-1, contributes=False), fields(2, fragment=-1)], 0, 2, "T")
    assert d.proceed and d.fragment == 1 and d.contributors == [0, 2]
    # leaving the other fragment's job out can drop the round below --sparseloco-min-workers
    d = decide([fields(0, fragment=1), fields(1, fragment=0)], 0, 2, "T")
    assert not d.proceed and d.fragment == 0 and d.contributors == [1] and "min-workers" in d.reason

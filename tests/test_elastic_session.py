"""The round header (signed JSON) and the round decision, without a network."""
import json

import pytest

from megatron_sparseloco.elastic.auth import derive_key
from megatron_sparseloco.elastic.session import HEADER_BYTES, decide, make_header, read_header

KEY = derive_key(b"the-run-secret-0123456789")
OTHER = derive_key(b"another-secret-0123456789")


def fields(index, **kw):
    base = {"v": 1, "index": index, "group_rank": 0, "step": 5, "ok": True, "contributes": True, "finite": True,
            "samples": 64, "tokens": 64 * 128, "commits": 3, "fingerprint": 1234, "extra": {"more": 0}}
    base.update(kw)
    return base


def test_a_header_round_trips_and_has_a_fixed_size():
    raw = make_header(KEY, fields(2))
    assert len(raw) == HEADER_BYTES
    assert read_header(KEY, raw) == fields(2)


def test_a_header_under_another_secret_or_altered_is_not_read():
    raw = make_header(KEY, fields(2))
    assert read_header(OTHER, raw) is None
    doc = json.loads(raw)
    doc["body"] = doc["body"].replace('"index":2', '"index":1')
    assert read_header(KEY, json.dumps(doc).encode()) is None
    for garbage in (b"", b"\xff" * 10, b"[]", b'{"body": 1, "mac": "00"}', b'{"body": "x", "mac": "zz"}'):
        assert read_header(KEY, garbage) is None


@pytest.mark.parametrize("edit", [{"index": "2"}, {"ok": 1}, {"extra": []}, {"fingerprint": 1.5}, {"v": 2},
                                  {"samples": True}])
def test_a_signed_header_of_the_wrong_shape_is_not_read(edit):
    body = dict(fields(2), **edit)
    assert read_header(KEY, make_header(KEY, body)) is None


def test_an_oversized_header_is_refused_when_made():
    with pytest.raises(ValueError, match="exceeds"):
        make_header(KEY, fields(0, extra={f"k{i}": i for i in range(400)}))


def test_all_good_proceeds_with_every_contributor():
    d = decide([fields(0), fields(1), fields(2)], 1, 2, "T")
    assert d.proceed and d.contributors == [0, 1, 2] and d.exit_message is None


def test_the_refused_minority_exits_naming_its_token_file():
    headers = [fields(0), None, None]           # as rank 0 with another secret sees the others
    d = decide(headers, 0, 1, "/secrets/token")
    assert not d.proceed and "/secrets/token" in d.exit_message and "--sparseloco-elastic-token-file" in d.exit_message


def test_the_majority_refuses_the_odd_one_and_does_not_proceed():
    d = decide([fields(0), None, fields(2)], 0, 1, "T")
    assert not d.proceed and d.exit_message is None and d.refused == [1]


def test_a_tie_sends_off_the_side_that_never_committed():
    assert decide([fields(0, commits=0), None], 0, 1, "T").exit_message is not None
    assert decide([fields(0, commits=4), None], 0, 1, "T").exit_message is None


def test_a_worker_index_held_twice_is_kept_by_the_veteran():
    headers = [fields(0, commits=7), fields(1), fields(0, commits=0)]
    assert decide(headers, 0, 1, "T").exit_message is None
    d = decide(headers, 2, 1, "T")
    assert not d.proceed and "--sparseloco-worker-index" in d.exit_message and "group rank 0" in d.exit_message
    assert not decide(headers, 1, 1, "T").proceed


def test_differing_fingerprints_send_off_the_smaller_set():
    headers = [fields(0, fingerprint=1), fields(1, fingerprint=2), fields(2, fingerprint=2)]
    d = decide(headers, 0, 1, "T")
    assert not d.proceed and "restart this job" in d.exit_message
    assert decide(headers, 1, 1, "T").exit_message is None and not decide(headers, 1, 1, "T").proceed


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

"""Payload tags of elastic all-gathers: what a corrupted, cut, replayed or foreign payload meets.

``sign_payload`` / ``open_payloads`` are the two ends of ``TorchFTComm.all_gather_payloads`` with a
key (``elastic/comm.py``); the real-lighthouse rounds that roll back on such payloads are in
tests/test_elastic_rounds.py (``corrupt_payload``).
"""
import pytest
import torch

from megatron_sparseloco.elastic.auth import derive_key
from megatron_sparseloco.elastic.comm import PAYLOAD_TAG_BYTES, PayloadAuthError, open_payloads, sign_payload

KEY = derive_key(b"0123456789abcdef-the-run-secret")
ROUND = b"round-challenge-7"


def payloads(n=3, size=40):
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, 256, (size + r,), dtype=torch.uint8, generator=g) for r in range(n)]


def signed(ps, key=KEY, context=ROUND):
    return [sign_payload(key, context, r, p) for r, p in enumerate(ps)]


def test_corrupt_payload_round_trip_and_tag_size():
    ps = payloads()
    got = open_payloads(KEY, ROUND, signed(ps), check=range(3))
    assert all(torch.equal(a, b) for a, b in zip(got, ps))
    assert all(s.numel() == p.numel() + PAYLOAD_TAG_BYTES for s, p in zip(signed(ps), ps))


@pytest.mark.parametrize("byte", [0, 17, -PAYLOAD_TAG_BYTES, -1])
@pytest.mark.parametrize("bit", [0, 7])
def test_corrupt_payload_one_flipped_bit_anywhere_is_refused_naming_the_sender(byte, bit):
    s = signed(payloads())
    s[1] = s[1].clone()
    s[1][byte] ^= 1 << bit
    with pytest.raises(PayloadAuthError, match="group rank 1"):
        open_payloads(KEY, ROUND, s, check=range(3))


@pytest.mark.parametrize("keep", [0, 5, PAYLOAD_TAG_BYTES, 60])
def test_corrupt_payload_truncated_is_refused(keep):
    s = signed(payloads())
    s[2] = s[2][:keep]
    with pytest.raises(PayloadAuthError, match="group rank 2"):
        open_payloads(KEY, ROUND, s, check=range(3))


def test_corrupt_payload_replayed_from_another_round_or_position_or_key_is_refused():
    ps = payloads()
    old = signed(ps, context=b"round-challenge-6")
    s = signed(ps)
    s[0] = old[0]                                            # the same payload, signed for an earlier round
    with pytest.raises(PayloadAuthError, match="group rank 0"):
        open_payloads(KEY, ROUND, s, check=range(3))
    s = signed(ps)
    s[2] = sign_payload(KEY, ROUND, 1, ps[2])                # signed at another position
    with pytest.raises(PayloadAuthError, match="group rank 2"):
        open_payloads(KEY, ROUND, s, check=range(3))
    s = signed(ps)
    s[1] = sign_payload(derive_key(b"another-secret-0123456789"), ROUND, 1, ps[1])
    with pytest.raises(PayloadAuthError, match="group rank 1"):
        open_payloads(KEY, ROUND, s, check=range(3))


def test_corrupt_payload_of_a_non_contributor_is_not_checked():
    """Payloads nobody decodes (participants that do not contribute) are passed through unchecked."""
    ps = payloads()
    s = signed(ps)
    s[1] = torch.zeros(7, dtype=torch.uint8)                 # garbage, shorter than a tag
    got = open_payloads(KEY, ROUND, s, check=[0, 2])
    assert torch.equal(got[0], ps[0]) and torch.equal(got[2], ps[2]) and got[1].numel() == 0

"""The argument checks every ``OuterComm`` shares (comm/p2p.py: ``check_peers``, ``check_payloads``):
what they refuse, and that the torchft implementation refuses it before touching the network and
without turning it into a failed round."""
from __future__ import annotations

from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch

from megatron_sparseloco.comm.p2p import check_payloads, check_peers

U8 = torch.uint8


def test_check_peers_returns_ints_and_refuses_repeats_strangers_and_self():
    assert check_peers((3, 0, 2), size=4, rank=1) == [3, 0, 2]
    assert check_peers([], size=1, rank=0) == []
    with pytest.raises(ValueError, match=r"must be distinct, got \[2, 2\]"):
        check_peers([2, 2], size=4, rank=1)
    with pytest.raises(ValueError, match=r"peer 4 is not a rank of the group \(size 4\)"):
        check_peers([0, 4], size=4, rank=1)
    with pytest.raises(ValueError, match="peer -1 is not a rank"):
        check_peers([-1], size=4, rank=1)
    with pytest.raises(ValueError, match="rank 1 listed itself as a peer"):
        check_peers([0, 1], size=4, rank=1)


@pytest.mark.parametrize("payload", [torch.ones(3), torch.ones(2, 2, dtype=U8), torch.ones(0, dtype=U8)],
                         ids=["float", "2-D", "empty"])
def test_check_payloads_refuses_what_is_not_a_non_empty_1d_uint8_tensor(payload):
    with pytest.raises(ValueError, match="payload for peer 2 must be a non-empty 1-D uint8 tensor"):
        check_payloads({0: torch.ones(1, dtype=U8), 2: payload}, [0, 2], None)


def test_check_payloads_wants_every_peers_size_when_sizes_are_given():
    payloads = {0: torch.ones(1, dtype=U8), 2: torch.ones(5, dtype=U8)}
    check_payloads(payloads, [0, 2], None)
    check_payloads(payloads, [0, 2], {0: 7, 2: 1})
    with pytest.raises(ValueError, match=r"lacks the size for peer\(s\) \[2\]"):
        check_payloads(payloads, [0, 2], {0: 7})


def _torchft_comm(size: int, rank: int):
    """A ``TorchFTComm`` in a round of ``size`` with this job at ``rank``; its process group has no
    methods, so any network operation would fail (and be reported to the manager)."""
    pytest.importorskip("torchft")
    from megatron_sparseloco.elastic.comm import TorchFTComm

    reported = []
    manager = SimpleNamespace(num_participants=lambda: size, participating_rank=lambda: rank,
                              report_error=reported.append)
    comm = TorchFTComm(manager, SimpleNamespace(), timedelta(seconds=1))
    comm.sync_with_quorum()
    return comm, reported


@pytest.mark.parametrize("call, match", [
    (lambda c: c.exchange(torch.ones(2), [1]), "rank 1 listed itself"),
    (lambda c: c.exchange(torch.ones(2), [0, 0]), "must be distinct"),
    (lambda c: c.exchange_per_peer({3: torch.ones(2, dtype=U8)}, None), r"peer 3 is not a rank of the group \(size 3\)"),
    (lambda c: c.exchange_per_peer({0: torch.ones(2)}, None), "payload for peer 0 must be a non-empty 1-D uint8"),
    (lambda c: c.exchange_per_peer({0: torch.ones(2, dtype=U8), 2: torch.ones(1, dtype=U8)}, {0: 2}),
     r"lacks the size for peer\(s\) \[2\]"),
    (lambda c: c.exchange_pieces({1: torch.ones(2, dtype=U8)}, {}), "rank 1 listed itself"),
], ids=["self", "repeat", "stranger", "payload", "sizes", "pieces-self"])
def test_torchft_comm_raises_bad_arguments_instead_of_failing_the_round(call, match):
    comm, reported = _torchft_comm(size=3, rank=1)
    with pytest.raises(ValueError, match=match):
        call(comm)
    assert (comm.failed, reported) == (False, [])

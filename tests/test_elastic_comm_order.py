"""TorchFTComm's point-to-point exchanges (GASLoC's proposals and payloads) pass the strict checker.

Each rank's ``TorchFTComm`` runs over a ``testing.strict_p2p`` fake group (tags refused, operations
matched by issue order alone, as NCCL matches them, wait cycles reported) in its own thread. The
peers are those GASLoC's topologies give each worker (``comm.topology.neighbours``); every exchange
must deliver the right bytes and the checker must find nothing.
"""
import threading
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch

from megatron_sparseloco.comm.topology import neighbours
from megatron_sparseloco.elastic.comm import TorchFTComm
from megatron_sparseloco.testing.strict_p2p import StrictP2P, StrictP2PError

W = 8


def comm_of(world: StrictP2P, rank: int) -> TorchFTComm:
    manager = SimpleNamespace(num_participants=lambda: W, participating_rank=lambda: rank,
                              report_error=lambda exc: None)
    comm = TorchFTComm(manager, world.group(rank), timedelta(seconds=20))
    comm.sync_with_quorum()
    return comm


def run_ranks(fn):
    """``fn(rank)`` on W threads; returns their results (an exception is re-raised)."""
    out, errors = [None] * W, []

    def target(r):
        try:
            out[r] = fn(r)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=target, args=(r,), daemon=True) for r in range(W)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errors:
        raise errors[0]
    return out


def payload(src: int, dst: int) -> torch.Tensor:
    return torch.arange(3 + (5 * src + dst) % 7, dtype=torch.uint8) + src


@pytest.mark.parametrize("topology", ["ring", "exponential", "random2", "complete"])
def test_strict_p2p_order_of_gasloc_exchanges(topology):
    world = StrictP2P()
    comms = [comm_of(world, r) for r in range(W)]
    peers = [[p for p, _ in neighbours(topology, W, round=3, seed=11, me=r)] for r in range(W)]

    def rank_fn(r):
        c = comms[r]
        dense = c.exchange(torch.full((5,), float(r)), peers[r])                      # uncompressed proposals
        sized = c.exchange_per_peer({p: payload(r, p) for p in peers[r]}, None)       # compressed, sizes exchanged
        known = c.exchange_per_peer({p: payload(r, p) for p in peers[r]},
                                    {p: payload(p, r).numel() for p in peers[r]})
        return dense, sized, known, c.failed

    results = run_ranks(rank_fn)
    world.check()
    for r, (dense, sized, known, failed) in enumerate(results):
        assert not failed
        assert sorted(dense) == peers[r] and all(torch.equal(dense[p], torch.full((5,), float(p))) for p in peers[r])
        for got in (sized, known):
            assert all(torch.equal(got[p], payload(p, r)) for p in peers[r])


def test_strict_p2p_order_of_all_to_all_pieces_with_empty_messages():
    world = StrictP2P()
    comms = [comm_of(world, r) for r in range(W)]
    size = lambda s, d: (s * 3 + d) % 4  # noqa: E731  (0: an empty message, skipped on both sides)

    def rank_fn(r):
        pieces = {p: torch.full((size(r, p),), r, dtype=torch.uint8) for p in range(W) if p != r}
        return comms[r].exchange_pieces(pieces, {p: size(p, r) for p in range(W) if p != r})

    results = run_ranks(rank_fn)
    world.check()
    for r, got in enumerate(results):
        assert all(torch.equal(got[p], torch.full((size(p, r),), p, dtype=torch.uint8)) for p in range(W) if p != r)


def test_strict_p2p_order_the_checker_refuses_the_receive_first_pattern():
    """The order TorchFTComm used before (every receive posted, then every send, with tags) is refused:
    the checker cannot pass vacuously."""
    world = StrictP2P(default_wait_s=2.0)
    g0, g1 = world.group(0), world.group(1)

    def old(g, peer):
        try:
            works = [g.recv([torch.empty(4)], peer, 2), g.send([torch.ones(4)], peer, 2)]
            for w in works:
                w.wait(timedelta(seconds=2))
        except (StrictP2PError, TimeoutError):
            pass

    threads = [threading.Thread(target=old, args=(g, 1 - i), daemon=True) for i, g in enumerate((g0, g1))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    with pytest.raises(StrictP2PError):
        world.check(allow_unmatched=True)

"""Point-to-point exchange (comm/p2p.py) on 4 gloo ranks: values, subgroup rank translation,
variable-size payloads (sizes first, zero-size skipped), byte counts, idle ranks, bad arguments."""
from __future__ import annotations

import pytest
import torch

from megatron_sparseloco.comm.collectives import CommCounter
from megatron_sparseloco.comm.p2p import exchange, exchange_per_peer
from megatron_sparseloco.testing.multirank import run_ranks


def _fn(rank: int, world_size: int) -> dict:
    import torch.distributed as dist

    out = {}
    # ring over the world: each rank gets its neighbours' tensors
    c = CommCounter()
    x = torch.arange(6, dtype=torch.float32) + 10 * rank
    got = exchange(x, [(rank - 1) % world_size, (rank + 1) % world_size], None, c)
    out["ring"] = {p: t.tolist() for p, t in got.items()}
    out["ring_counter"] = (c.bytes_sent, c.bytes_received, dict(c.by_kind))
    # subgroups {0, 2} and {1, 3} (Megatron: ranks holding the same shard); peers are group ranks
    g02 = dist.new_group([0, 2])
    g13 = dist.new_group([1, 3])
    g = g02 if rank % 2 == 0 else g13
    me = dist.get_rank(g)
    got = exchange(torch.tensor([float(rank)]), [1 - me], g, CommCounter())
    out["sub"] = {p: t.tolist() for p, t in got.items()}
    # idle ranks: only 2 and 3 talk; 0 and 1 pass no peers and return at once
    c = CommCounter()
    got = exchange(torch.ones(2) * rank, [5 - rank] if rank >= 2 else [], None, c)
    out["idle"] = ({p: t.tolist() for p, t in got.items()}, c.collectives)
    # the batch posts every irecv before the first isend (gloo starts a send only once the peer's
    # recv is posted: docs/scaling.md "The wire alone"); spy on the ops, then run them for real
    import megatron_sparseloco.comm.p2p as p2p
    real, ops = dist.batch_isend_irecv, []
    p2p.dist.batch_isend_irecv = lambda batch: ops.extend((o.op.__name__, o.group_peer) for o in batch) or real(batch)
    try:
        exchange(torch.ones(2), [(rank - 1) % world_size, (rank + 1) % world_size], None, CommCounter())
    finally:
        p2p.dist.batch_isend_irecv = real
    out["order"] = ops
    with pytest.raises(ValueError, match="listed itself"):
        exchange(torch.ones(1), [rank], None, CommCounter())
    with pytest.raises(ValueError, match="not a rank of the group"):
        exchange(torch.ones(1), [world_size], None, CommCounter())
    with pytest.raises(ValueError, match="distinct"):
        exchange(torch.ones(1), [1, 1], None, CommCounter())
    peer = (rank + 1) % world_size
    with pytest.raises(ValueError, match="non-empty 1-D uint8"):
        exchange_per_peer({peer: torch.ones(2)}, None, None, CommCounter())
    with pytest.raises(ValueError, match=rf"lacks the size for peer\(s\) \[{peer}\]"):
        exchange_per_peer({peer: torch.ones(2, dtype=torch.uint8)}, {}, None, CommCounter())
    return out


@pytest.fixture(scope="module")
def out():
    return run_ranks(_fn, world_size=4, timeout=90)


def test_ring_exchange_values_and_bytes(out):
    for r in range(4):
        lo, hi = (r - 1) % 4, (r + 1) % 4
        assert out[r]["ring"] == {lo: [10.0 * lo + k for k in range(6)], hi: [10.0 * hi + k for k in range(6)]}
        assert out[r]["ring_counter"] == (2 * 24, 2 * 24, {"p2p": 1})


def test_subgroup_peers_are_group_ranks(out):
    assert out[0]["sub"] == {1: [2.0]} and out[2]["sub"] == {0: [0.0]}
    assert out[1]["sub"] == {1: [3.0]} and out[3]["sub"] == {0: [1.0]}


def test_idle_ranks_do_not_communicate(out):
    assert out[0]["idle"] == ({}, 0) and out[1]["idle"] == ({}, 0)
    assert out[2]["idle"] == ({3: [3.0, 3.0]}, 1) and out[3]["idle"] == ({2: [2.0, 2.0]}, 1)


def test_all_recvs_are_posted_before_the_sends(out):
    for r in range(4):
        peers = sorted({(r - 1) % 4, (r + 1) % 4})
        assert out[r]["order"] == [("irecv", p) for p in peers] + [("isend", p) for p in peers]


def test_no_peers_needs_no_process_group():
    assert exchange(torch.ones(3), [], None, CommCounter()) == {}

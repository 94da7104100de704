"""Point-to-point exchange with a few peers: the only communication of a gossip round.

``exchange(tensor, peers, group, counter)`` sends ``tensor`` to every peer and receives one
tensor of the same shape and dtype from each of them, all in one
``torch.distributed.batch_isend_irecv`` (an isend and an irecv per peer), then waits. Every peer
must call ``exchange`` in the same round with this rank in its own ``peers`` list and a tensor of
the same shape (the gossip topology guarantees the symmetry: it is computed from a shared seed).
Nothing else in the group takes part: there is no global collective, and a rank with no peers
this round returns at once without touching the network.

``peers`` are ranks *in ``group``* (worker indices in the cross-worker group); they are translated
with ``group_peer=`` so the group may be any subgroup (Megatron's data-parallel-replica group).

Backends [measured, torch 2.14.1 CPU]: ``batch_isend_irecv`` works on gloo (loopback, 2 and 4
ranks, in subgroups too), so no isend/irecv fallback is needed. With NCCL, PyTorch documents that
if this is the first collective on the group, all ranks of the group must take part; a gossip
round where some worker idles would then be undefined, so the caller should have issued any
collective on the group before (Megatron does at setup).

Byte accounting (kind ``"p2p"``): for an N-byte tensor and P peers, N·P sent and N·P received;
one call counts as one collective. ``exchange_per_peer`` sends one (possibly different, any size)
1-D uint8 payload per peer, the sizes exchanged first only when a side cannot know them (GASLoC's
compressed proposals: a different residual per peer). ``exchange_pieces`` is an all-to-all
of pieces whose sizes both sides know (SparseLoCo's reduce-scatter aggregation), kind
``"all_to_all"``: the bytes of the non-empty pieces sent and received.

Arguments are checked before anything is sent, by ``check_peers`` and ``check_payloads``, which the
elastic implementation (``elastic/comm.py``) calls too: both refuse the same input with the same
``ValueError``.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_sparseloco.comm.collectives import CommCounter


def check_peers(peers: Sequence[int], size: int, rank: int) -> List[int]:
    """``peers`` as ints, once they are checked to be distinct ranks of a group of ``size``, none of
    them ``rank`` (this rank: its self-weight is applied locally). Every ``OuterComm`` implementation
    checks its peers here, so they refuse the same lists with the same errors."""
    peers = [int(p) for p in peers]
    if len(set(peers)) != len(peers):
        raise ValueError(f"exchange peers must be distinct, got {peers}")
    for p in peers:
        if not 0 <= p < size:
            raise ValueError(f"peer {p} is not a rank of the group (size {size})")
        if p == rank:
            raise ValueError(f"rank {rank} listed itself as a peer; the self-weight is applied locally")
    return peers


def check_payloads(payloads: Dict[int, torch.Tensor], peers: Sequence[int],
                   recv_nbytes: Optional[Dict[int, int]]) -> None:
    """The arguments of ``exchange_per_peer``: every peer's payload a non-empty 1-D uint8 tensor, and
    ``recv_nbytes``, when given, a size for every peer (shared by the ``OuterComm`` implementations)."""
    for p in peers:
        if payloads[p].dtype != torch.uint8 or payloads[p].dim() != 1 or payloads[p].numel() == 0:
            raise ValueError(f"payload for peer {p} must be a non-empty 1-D uint8 tensor")
    missing = [p for p in peers if p not in recv_nbytes] if recv_nbytes is not None else []
    if missing:
        raise ValueError(f"recv_nbytes lacks the size for peer(s) {missing}")


def _check_peers(peers: Sequence[int], group: Optional[dist.ProcessGroup]) -> List[int]:
    """``check_peers`` against ``group`` (no peers: nothing to check, distributed or not)."""
    peers = [int(p) for p in peers]
    if not peers:
        return peers
    if not dist.is_initialized():
        raise RuntimeError("exchange with peers needs torch.distributed to be initialised")
    return check_peers(peers, dist.get_world_size(group), dist.get_rank(group))


def _p2p(tensors_out: Dict[int, torch.Tensor], tensors_in: Dict[int, torch.Tensor],
         group: Optional[dist.ProcessGroup]) -> None:
    """One batch of an isend and an irecv per peer; empty tensors are neither sent nor received
    (both sides know the size, so they skip the same message).

    Every irecv is posted before the first isend [measured, gloo, torch 2.14.1]. With the isends first,
    hierarchical SparseLoCo's rail exchange (one 94 kB payload each way between two emulated sites over
    5 Mbit/s, W = 8) took 0.264 s, 1.75 times the link time; with the recvs first it takes 0.109 s
    (``benchmarks/aggregation_wire.py``, docs/scaling.md). NCCL runs the batch as one group, so the
    order does not matter there."""
    ops = [dist.P2POp(dist.irecv, tensors_in[p], group=group, group_peer=p)
           for p in sorted(tensors_in) if tensors_in[p].numel() > 0]
    ops += [dist.P2POp(dist.isend, tensors_out[p], group=group, group_peer=p)
            for p in sorted(tensors_out) if tensors_out[p].numel() > 0]
    if not ops:
        return
    for work in dist.batch_isend_irecv(ops):
        work.wait()


def exchange(tensor: torch.Tensor, peers: Sequence[int], group: Optional[dist.ProcessGroup],
             counter: CommCounter, kind: str = "p2p") -> Dict[int, torch.Tensor]:
    """Send ``tensor`` to each peer, receive a same-shaped tensor from each: ``{peer: received}``.
    ``kind``: the counter's name for this traffic (default ``"p2p"``)."""
    peers = _check_peers(peers, group)
    if not peers:
        return {}
    send = tensor.contiguous()
    received = {p: torch.empty_like(send) for p in peers}
    _p2p({p: send for p in peers}, received, group)
    n = send.numel() * send.element_size()
    counter.add(kind, n * len(peers), n * len(peers))
    return received


def exchange_per_peer(payloads: Dict[int, torch.Tensor], recv_nbytes: Optional[Dict[int, int]],
                      group: Optional[dist.ProcessGroup], counter: CommCounter) -> Dict[int, torch.Tensor]:
    """One (possibly different) non-empty 1-D uint8 payload per peer, any sizes.

    ``payloads[p]`` goes to peer p (the peers are the keys). ``recv_nbytes[p]``: the size of peer
    p's payload when both sides know it (fixed-size codec, dense refresh); ``None`` exchanges the
    sizes first (one int64 per peer, kind ``"p2p_sizes"``). The payloads travel in one
    ``batch_isend_irecv`` (kind ``"p2p"``, the exact bytes sent and received).
    """
    peers = _check_peers(sorted(payloads), group)
    if not peers:
        return {}
    check_payloads(payloads, peers, recv_nbytes)
    dev = payloads[peers[0]].device
    if recv_nbytes is None:
        out = {p: torch.tensor([payloads[p].numel()], dtype=torch.int64, device=dev) for p in peers}
        sizes = {p: torch.empty(1, dtype=torch.int64, device=dev) for p in peers}
        _p2p(out, sizes, group)
        counter.add("p2p_sizes", 8 * len(peers), 8 * len(peers))
        recv_nbytes = {p: int(sizes[p].item()) for p in peers}
    received = {p: torch.empty(int(recv_nbytes[p]), dtype=torch.uint8, device=dev) for p in peers}
    _p2p({p: payloads[p].contiguous() for p in peers}, received, group)
    counter.add("p2p", sum(payloads[p].numel() for p in peers), sum(r.numel() for r in received.values()))
    return received


def exchange_pieces(pieces: Dict[int, torch.Tensor], recv_sizes: Dict[int, int],
                    group: Optional[dist.ProcessGroup], counter: CommCounter,
                    kind: str = "all_to_all") -> Dict[int, torch.Tensor]:
    """An all-to-all of 1-D uint8 pieces whose sizes both sides know: ``pieces[p]`` goes to peer p,
    ``recv_sizes[p]`` bytes come from peer p (no size exchange; empty ones are skipped), in one
    ``batch_isend_irecv``. Counted as one collective of ``kind`` (default ``"all_to_all"``)."""
    peers = _check_peers(sorted(set(pieces) | set(recv_sizes)), group)
    if not peers:
        return {}
    device = next(iter(pieces.values())).device if pieces else torch.device("cpu")
    send = {p: pieces.get(p, torch.zeros(0, dtype=torch.uint8, device=device)).contiguous() for p in peers}
    received = {p: torch.empty(int(recv_sizes.get(p, 0)), dtype=torch.uint8, device=device) for p in peers}
    _p2p(send, received, group)
    counter.add(kind, sum(t.numel() for t in send.values()), sum(t.numel() for t in received.values()))
    return received

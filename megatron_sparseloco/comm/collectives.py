"""Cross-worker collectives that count the bytes they hand to torch.distributed.

Every function takes a ``CommCounter`` and adds the size of the tensors it actually gives to the
collective: ``sent`` is what this rank contributes, ``received`` what it gets from the other
ranks of the group. For an all-reduce of an N-byte tensor over W ranks we count N sent and N
received (the logical payload; a ring implementation moves 2·(W−1)/W·N on each link, which is a
property of the backend, not of the algorithm).

Variable-size payloads (entropy-coded indices) are all-gathered in two rounds: the sizes first
(an int64 per rank, counted too), then the payloads padded to the largest size (gloo cannot
all-gather uneven shapes). Padding is counted: those bytes do cross the wire.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

import torch
import torch.distributed as dist

from megatron_sparseloco.comm.pending import Pending


@dataclass
class CommCounter:
    """Bytes this rank handed to collectives, and how many collectives it issued."""

    bytes_sent: int = 0
    bytes_received: int = 0
    collectives: int = 0
    by_kind: dict = field(default_factory=dict)

    def add(self, kind: str, sent: int, received: int) -> None:
        self.bytes_sent += int(sent)
        self.bytes_received += int(received)
        self.collectives += 1
        self.by_kind[kind] = self.by_kind.get(kind, 0) + 1

    def reset(self) -> None:
        self.bytes_sent = self.bytes_received = self.collectives = 0
        self.by_kind = {}


def collective_device(group: Optional[dist.ProcessGroup] = None) -> torch.device:
    """The device a tensor must live on for a collective over ``group`` (None: the default group): CUDA for
    NCCL, else CPU.

    NCCL refuses CPU tensors ("No backend type associated with device type cpu"); gloo takes CPU
    tensors (and, for most ops, CUDA ones through a host copy), so small host-side bookkeeping
    collectives use this instead of hard-coding a device.
    """
    if dist.is_initialized() and torch.cuda.is_available():
        try:
            backend = str(dist.get_backend(group)).lower()
        except (RuntimeError, ValueError):
            backend = ""
        if "nccl" in backend:
            return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _group_size(group: Optional[dist.ProcessGroup]) -> int:
    if group is None and not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def all_reduce_(tensor: torch.Tensor, group: Optional[dist.ProcessGroup], counter: CommCounter,
                op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> torch.Tensor:
    """In-place all-reduce of ``tensor``; a no-op (and nothing counted) for a group of one."""
    world = _group_size(group)
    if world == 1:
        return tensor
    dist.all_reduce(tensor, op=op, group=group)
    counter.add("all_reduce", _nbytes(tensor), _nbytes(tensor))
    return tensor


def broadcast_(tensor: torch.Tensor, src_group_rank: int, group: Optional[dist.ProcessGroup],
               counter: CommCounter) -> torch.Tensor:
    """In-place broadcast from the group-local rank ``src_group_rank``."""
    world = _group_size(group)
    if world == 1:
        return tensor
    src = dist.get_global_rank(group, src_group_rank) if group is not None else src_group_rank
    dist.broadcast(tensor, src=src, group=group)
    me = dist.get_rank(group)
    n = _nbytes(tensor)
    counter.add("broadcast", n if me == src_group_rank else 0, 0 if me == src_group_rank else n)
    return tensor


def all_gather_payloads(payload: torch.Tensor, group: Optional[dist.ProcessGroup],
                        counter: CommCounter, equal_sizes: bool = False) -> List[torch.Tensor]:
    """All-gather one 1-D uint8 payload per rank; returns the list in group-rank order.

    ``equal_sizes=True`` promises every rank sends the same number of bytes (packed indices with
    the same configuration and numel) and skips the size exchange; a mismatch is detected by the
    collective itself on most backends, so only promise it when the codec guarantees it.
    """
    return start_all_gather_payloads(payload, group, counter, equal_sizes).wait()


def start_all_reduce_(tensor: torch.Tensor, group: Optional[dist.ProcessGroup], counter: CommCounter,
                      op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> Pending[torch.Tensor]:
    """``all_reduce_`` issued asynchronously (c10d ``async_op=True``); ``wait()`` gives ``tensor``."""
    if _group_size(group) == 1:
        return Pending.completed(tensor)
    work = dist.all_reduce(tensor, op=op, group=group, async_op=True)
    counter.add("all_reduce", _nbytes(tensor), _nbytes(tensor))

    def wait() -> torch.Tensor:
        work.wait()
        return tensor

    return Pending(wait, work.is_completed)


def start_all_gather_payloads(payload: torch.Tensor, group: Optional[dist.ProcessGroup], counter: CommCounter,
                              equal_sizes: bool = False) -> Pending[List[torch.Tensor]]:
    """``all_gather_payloads`` with the data all-gather issued asynchronously (c10d ``async_op=True``).

    Without ``equal_sizes`` the size exchange runs first and is waited for here: the data
    collective's shape depends on its result, and c10d cannot chain a collective on another's
    completion without a host thread."""
    if payload.dtype != torch.uint8 or payload.dim() != 1:
        raise ValueError(f"all_gather_payloads expects a 1-D uint8 tensor, got {payload.dtype} {tuple(payload.shape)}")
    world = _group_size(group)
    if world == 1:
        return Pending.completed([payload])
    if equal_sizes:
        sizes = [payload.numel()] * world
    else:
        size_t = torch.tensor([payload.numel()], dtype=torch.int64, device=payload.device)
        all_sizes = [torch.empty_like(size_t) for _ in range(world)]
        dist.all_gather(all_sizes, size_t, group=group)
        counter.add("all_gather_sizes", _nbytes(size_t), _nbytes(size_t) * (world - 1))
        sizes = [int(s) for s in torch.cat(all_sizes).tolist()]
    max_size = max(sizes)
    if payload.numel() < max_size:
        padded = torch.zeros(max_size, dtype=torch.uint8, device=payload.device)
        padded[: payload.numel()] = payload
    else:
        padded = payload.contiguous()
    gathered = [torch.empty(max_size, dtype=torch.uint8, device=payload.device) for _ in range(world)]
    work = dist.all_gather(gathered, padded, group=group, async_op=True)
    counter.add("all_gather", max_size, max_size * (world - 1))

    def wait() -> List[torch.Tensor]:
        work.wait()
        return [g[:s] for g, s in zip(gathered, sizes)]

    return Pending(wait, work.is_completed)

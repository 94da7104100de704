"""The communication interface every outer strategy uses: ``OuterComm``.

An outer strategy talks to the ranks that hold the same shard position in every other worker
(its *outer group*) through this interface only, never through ``torch.distributed`` directly,
so the same strategy runs over

* ``ProcessGroupComm`` (``comm/process_group.py``): a ``torch.distributed`` (c10d) process group —
  Megatron's inter-instance group, a copy of it with its own timeout, or a group of one rank (W = 1); and
* the elastic implementation over a torchft-managed process group (``megatron_sparseloco.elastic``),
  whose membership changes from round to round and which c10d does not know.

What an implementation provides (group-local ranks everywhere; ``size`` = W of this round):

    size, rank, device          the group's size, this rank's index in it, where control tensors live
    contributors                the group ranks whose pseudo-gradient enters this round (all of them
                                over a c10d group; an elastic round may leave some out: a job that
                                just healed takes part in the collectives but contributes nothing)
    all_reduce_(t, op)          in place, op "sum" or "max"
    broadcast_(t, src)          in place, from group rank ``src``
    all_gather_payloads(p)      1-D uint8 payloads of any size → list in rank order
    exchange(t, peers)          the same tensor to each peer, one of the same shape from each
    exchange_per_peer(...)      a different uint8 payload per peer, sizes known or exchanged
    exchange_pieces(...)        an all-to-all of uint8 pieces whose sizes both sides know
    agree_max(value)            the largest integer any rank holds (flags, verdicts)
    start_all_reduce_ / start_all_gather_payloads
                                the asynchronous forms: return a ``Pending`` (``comm/pending.py``) whose ``wait()``
                                gives the result; an implementation whose backend cannot run the
                                operation asynchronously runs it at once and returns it completed

Every call adds what this rank hands to the wire to ``counter`` (``CommCounter``): the accounting
rules are those of ``comm/collectives.py`` and ``comm/p2p.py``, whichever implementation moves
the bytes, so bytes reported are comparable across implementations.
"""
from __future__ import annotations

import abc
from typing import Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_sparseloco.comm.collectives import CommCounter
from megatron_sparseloco.comm.pending import Pending

#: reduction names of ``all_reduce_`` → c10d's
REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}


class OuterComm(abc.ABC):
    """Collectives over one outer group, with exact byte accounting (module docstring).

    An implementation keeps ``_size`` / ``_rank`` current (they may change between rounds) and says
    where control tensors live (``_find_device``, asked once)."""

    counter: CommCounter
    _size: int = 1
    _rank: int = 0
    _device: Optional[torch.device] = None

    @property
    def size(self) -> int:
        """Ranks in the group (the number of workers taking part)."""
        return self._size

    @property
    def rank(self) -> int:
        """This rank's index in the group, 0 <= rank < size."""
        return self._rank

    @property
    def device(self) -> torch.device:
        """The device small control tensors (flags, sizes) must live on for this group."""
        if self._device is None:
            self._device = self._find_device()
        return self._device

    @abc.abstractmethod
    def _find_device(self) -> torch.device:
        """Where this group's control tensors must live (CUDA for NCCL, else the CPU)."""

    @property
    def contributors(self) -> List[int]:
        """Group ranks whose pseudo-gradient enters this round, ascending (default: every rank)."""
        return list(range(self.size))

    @property
    def contributes(self) -> bool:
        """This rank's pseudo-gradient enters this round."""
        return self.rank in self.contributors

    @abc.abstractmethod
    def all_reduce_(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """In-place all-reduce (op ``"sum"`` or ``"max"``); a no-op for a group of one."""

    @abc.abstractmethod
    def broadcast_(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        """In-place broadcast from group rank ``src``."""

    @abc.abstractmethod
    def all_gather_payloads(self, payload: torch.Tensor, equal_sizes: bool = False) -> List[torch.Tensor]:
        """One 1-D uint8 payload per rank, in rank order (``equal_sizes``: skip the size exchange)."""

    @abc.abstractmethod
    def exchange(self, tensor: torch.Tensor, peers: Sequence[int], kind: str = "p2p") -> Dict[int, torch.Tensor]:
        """Send ``tensor`` to each peer and receive a same-shaped one from each: ``{peer: received}``."""

    @abc.abstractmethod
    def exchange_per_peer(self, payloads: Dict[int, torch.Tensor],
                          recv_nbytes: Optional[Dict[int, int]]) -> Dict[int, torch.Tensor]:
        """A (possibly different) non-empty 1-D uint8 payload per peer; ``recv_nbytes`` None: sizes exchanged."""

    @abc.abstractmethod
    def exchange_pieces(self, pieces: Dict[int, torch.Tensor], recv_sizes: Dict[int, int],
                        kind: str = "all_to_all") -> Dict[int, torch.Tensor]:
        """An all-to-all of 1-D uint8 pieces whose sizes both sides know (empty ones skipped)."""

    def agree_max(self, value: int) -> int:
        """The largest ``value`` any rank of the group passed (one 4-byte all-reduce MAX, counted).

        Values are small non-negative integers (flags, rank + 1 of a culprit): they travel as one
        fp32, exact up to 2**24."""
        flag = torch.tensor([float(value)], device=self.device)
        self.all_reduce_(flag, op="max")
        return int(flag.item())

    def start_all_reduce_(self, tensor: torch.Tensor, op: str = "sum") -> Pending[torch.Tensor]:
        """``all_reduce_`` started; the default runs it at once (no asynchronous form)."""
        return Pending.completed(self.all_reduce_(tensor, op))

    def start_all_gather_payloads(self, payload: torch.Tensor,
                                  equal_sizes: bool = False) -> Pending[List[torch.Tensor]]:
        """``all_gather_payloads`` started; the default runs it at once (no asynchronous form)."""
        return Pending.completed(self.all_gather_payloads(payload, equal_sizes))


__all__ = ["OuterComm", "REDUCE_OPS"]

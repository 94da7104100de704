"""``ProcessGroupComm``: the ``OuterComm`` over a ``torch.distributed`` (c10d) process group.

Megatron's inter-instance group, a copy of it with its own timeout, or a group of one rank (W = 1);
the operations are those of ``comm/collectives.py`` and ``comm/p2p.py``. ``as_outer_comm`` turns a
c10d group (or None) into one and passes an ``OuterComm`` through.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Union

import torch
import torch.distributed as dist

from megatron_sparseloco.comm import collectives as _c10d
from megatron_sparseloco.comm import p2p as _p2p
from megatron_sparseloco.comm.collectives import CommCounter
from megatron_sparseloco.comm.interface import REDUCE_OPS, OuterComm
from megatron_sparseloco.comm.pending import Pending


class ProcessGroupComm(OuterComm):
    """``OuterComm`` over a ``torch.distributed`` process group (None: the default group, or no
    distributed at all: a group of one). The operations are those of ``comm/collectives.py`` and
    ``comm/p2p.py``; peers are group ranks, translated with ``group_peer=``."""

    def __init__(self, group: Optional[dist.ProcessGroup], counter: Optional[CommCounter] = None):
        self.group = group
        self.counter = counter if counter is not None else CommCounter()
        self._size = dist.get_world_size(group) if dist.is_initialized() else 1
        self._rank = dist.get_rank(group) if dist.is_initialized() else 0

    def _find_device(self) -> torch.device:
        return _c10d.collective_device(self.group)

    def all_reduce_(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        return _c10d.all_reduce_(tensor, self.group, self.counter, op=REDUCE_OPS[op])

    def broadcast_(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        return _c10d.broadcast_(tensor, src, self.group, self.counter)

    def all_gather_payloads(self, payload: torch.Tensor, equal_sizes: bool = False) -> List[torch.Tensor]:
        return _c10d.all_gather_payloads(payload, self.group, self.counter, equal_sizes=equal_sizes)

    def exchange(self, tensor: torch.Tensor, peers: Sequence[int], kind: str = "p2p") -> Dict[int, torch.Tensor]:
        return _p2p.exchange(tensor, peers, self.group, self.counter, kind=kind)

    def exchange_per_peer(self, payloads: Dict[int, torch.Tensor],
                          recv_nbytes: Optional[Dict[int, int]]) -> Dict[int, torch.Tensor]:
        return _p2p.exchange_per_peer(payloads, recv_nbytes, self.group, self.counter)

    def exchange_pieces(self, pieces: Dict[int, torch.Tensor], recv_sizes: Dict[int, int],
                        kind: str = "all_to_all") -> Dict[int, torch.Tensor]:
        return _p2p.exchange_pieces(pieces, recv_sizes, self.group, self.counter, kind=kind)

    def start_all_reduce_(self, tensor: torch.Tensor, op: str = "sum") -> Pending[torch.Tensor]:
        return _c10d.start_all_reduce_(tensor, self.group, self.counter, op=REDUCE_OPS[op])

    def start_all_gather_payloads(self, payload: torch.Tensor,
                                  equal_sizes: bool = False) -> Pending[List[torch.Tensor]]:
        return _c10d.start_all_gather_payloads(payload, self.group, self.counter, equal_sizes=equal_sizes)


def as_outer_comm(group_or_comm: Union[OuterComm, dist.ProcessGroup, None]) -> OuterComm:
    """An ``OuterComm`` as given, or a ``ProcessGroupComm`` over a c10d group (None: default / none)."""
    if isinstance(group_or_comm, OuterComm):
        return group_or_comm
    return ProcessGroupComm(group_or_comm)


__all__ = ["ProcessGroupComm", "as_outer_comm"]

"""Tensor accounting: the bytes of tensor storage a piece of code allocates, by device, on any device.

    with TensorAccounting() as acc:
        ...
    acc.peak["cpu"]        # most bytes allocated inside the block and alive at once
    acc.live["cpu"]        # bytes allocated inside the block still alive at its end
    acc.allocated["cpu"]   # all bytes allocated inside the block (freed or not)

A ``TorchDispatchMode``: every aten op's output whose storage is none of its inputs' storages is a
new allocation (views, in-place ops and ``copy_`` into an existing tensor are not); it counts until
its storage is freed (a finalizer on the storage's Python object, which torch keeps for as long as
the storage lives). Storages that existed before the block are never counted, so ``peak`` is the
block's transient memory. Allocations made inside C++ without an aten op (a collective's internal
buffers, a file writer's staging) are not seen; neither are tensors on the ``meta`` device.

``state_bytes(tensors)``: the bytes of distinct storages held by ``tensors``, by device, with pinned
host memory as ``"cpu (pinned)"``: what a strategy keeps between outer steps.

Testing and measuring only (the memory table of docs/integration.md).
"""
from __future__ import annotations

import weakref
from collections import defaultdict
from typing import Dict, Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


def _place(t: torch.Tensor) -> str:
    if t.device.type == "cpu" and t.is_pinned():
        return "cpu (pinned)"
    return t.device.type


class TensorAccounting(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.live: Dict[str, int] = defaultdict(int)
        self.peak: Dict[str, int] = defaultdict(int)
        self.allocated: Dict[str, int] = defaultdict(int)
        self._held: Dict[int, tuple] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage()._cdata for t in tree_flatten((args, kwargs or {}))[0]
                  if isinstance(t, torch.Tensor) and t.device.type != "meta"}
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            key = storage._cdata
            if key in inputs or key in self._held:
                continue
            place, n = _place(t), storage.nbytes()
            self._held[key] = (place, n)
            self.live[place] += n
            self.allocated[place] += n
            self.peak[place] = max(self.peak[place], self.live[place])
            weakref.finalize(storage, self._freed, key)
        return out

    def _freed(self, key: int) -> None:
        place, n = self._held.pop(key, (None, 0))
        if place is not None:
            self.live[place] -= n


def state_bytes(tensors: Iterable[torch.Tensor]) -> Dict[str, int]:
    """Bytes of the distinct storages behind ``tensors``, by place (``"cuda"``, ``"cpu"``, ``"cpu (pinned)"``)."""
    seen: set = set()
    out: Dict[str, int] = defaultdict(int)
    for t in tensors:
        if t is None:
            continue
        storage = t.untyped_storage()
        if storage._cdata in seen:
            continue
        seen.add(storage._cdata)
        out[_place(t)] += storage.nbytes()
    return dict(out)


__all__ = ["TensorAccounting", "state_bytes"]

"""Count the host synchronisations a piece of code would make on a GPU, while it runs on the CPU.

On CUDA every read of a device value into Python (``Tensor.item()``, ``tolist()``, ``cpu()``,
``numpy()``, ``int(t)`` / ``float(t)`` / ``bool(t)`` / ``operator.index(t)``) and every explicit
``torch.cuda.synchronize`` / ``Event.synchronize`` / ``Stream.synchronize`` blocks the host until
the device catches up. On the CPU the same calls cost nothing, but they are the same calls:

    with HostSyncCounter() as syncs:
        strategy.step()
    syncs.total, syncs.by_kind         # how many, of which kind; syncs.sites: where (file:line)

counts them through the same code path, so a test can assert that an outer step's count does not
grow with the number of buckets or of workers. Only calls made directly by ``megatron_sparseloco``
code, on the thread that entered the counter, count (torch's own internals, and the collectives'
bookkeeping inside torch.distributed, are not ours to bound). ``numel()`` / ``dim()`` / ``shape``
are metadata, not syncs.
"""
from __future__ import annotations

import collections
import sys
import threading
from typing import Callable, Dict, List, Tuple

import torch

_PACKAGE = "megatron_sparseloco"
_TENSOR_METHODS = ("item", "tolist", "cpu", "numpy", "__int__", "__float__", "__bool__", "__index__")


class HostSyncCounter:
    """A context manager counting host-sync calls made by this package's code (module docstring)."""

    def __init__(self) -> None:
        self.by_kind: Dict[str, int] = collections.Counter()
        self.sites: Dict[str, int] = collections.Counter()
        self._saved: List[Tuple[object, str, Callable]] = []
        self._thread = threading.get_ident()

    @property
    def total(self) -> int:
        return sum(self.by_kind.values())

    @staticmethod
    def _ours() -> str:
        """The calling site when it is this package's code ('' otherwise)."""
        frame = sys._getframe(2)
        name = frame.f_globals.get("__name__", "")
        return f"{name}:{frame.f_lineno}" if name.startswith(_PACKAGE) and name != __name__ else ""

    def _wrap(self, owner: object, attr: str, kind: str) -> None:
        orig = getattr(owner, attr)
        counter = self

        def counted(*args, **kwargs):
            site = counter._ours() if threading.get_ident() == counter._thread else ""
            if site:
                counter.by_kind[kind] += 1
                counter.sites[site] += 1
            return orig(*args, **kwargs)

        self._saved.append((owner, attr, orig))
        setattr(owner, attr, counted)

    def __enter__(self) -> "HostSyncCounter":
        self._thread = threading.get_ident()
        for name in _TENSOR_METHODS:
            self._wrap(torch.Tensor, name, name.strip("_"))
        self._wrap(torch.cuda, "synchronize", "cuda.synchronize")
        self._wrap(torch.cuda.Event, "synchronize", "event.synchronize")
        self._wrap(torch.cuda.Stream, "synchronize", "stream.synchronize")
        return self

    def __exit__(self, *exc) -> None:
        for owner, attr, orig in reversed(self._saved):
            setattr(owner, attr, orig)
        self._saved.clear()


__all__ = ["HostSyncCounter"]

"""Record every torch.distributed collective a rank issues, with the ranks of its group.

    with CollectiveSpy() as spy:
        ...train...
    spy.calls   # [(function name, tuple of global ranks in the group)]

Patches the public ``torch.distributed`` functions and the module-level aliases megatron-core
binds at import time (``param_and_grad_buffer.dist_reduce_scatter_func`` / ``dist_all_gather_func``),
so a call from Megatron or from us is seen either way. ``group=None`` means the world.
Testing only.
"""
from __future__ import annotations

import functools
import importlib
from typing import List, Tuple

import torch.distributed as dist

_FUNCS = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
          "_reduce_scatter_base", "_all_gather_base", "broadcast", "all_to_all", "all_to_all_single",
          "all_gather_object", "broadcast_object_list", "barrier", "reduce", "gather", "scatter",
          "send", "recv", "isend", "irecv", "batch_isend_irecv")
_ALIASES = (("megatron.core.distributed.param_and_grad_buffer", ("dist_reduce_scatter_func", "dist_all_gather_func")),)


def _group_ranks(group) -> Tuple[int, ...]:
    if group is None or group is dist.group.WORLD:
        return tuple(range(dist.get_world_size()))
    return tuple(dist.get_process_group_ranks(group))


def _group_of(name, args, kwargs):
    if name == "batch_isend_irecv":
        ops = args[0] if args else kwargs.get("p2p_op_list", [])
        ranks = set()
        for op in ops:
            ranks.add(dist.get_rank())
            peer = getattr(op, "peer", None)  # global rank; torch also accepts a group-local group_peer
            if peer is None:
                peer = dist.get_global_rank(op.group, op.group_peer)
            ranks.add(int(peer))
        return tuple(sorted(ranks))
    if name in ("send", "recv", "isend", "irecv"):
        grp = kwargs.get("group", args[2] if len(args) > 2 else None)
        peer = kwargs.get("dst", kwargs.get("src", args[1] if len(args) > 1 else None))
        if peer is None:  # group-local peer (torch >= 2.6: group_dst / group_src / group_peer)
            local = next((kwargs[k] for k in ("group_dst", "group_src", "group_peer")
                          if kwargs.get(k) is not None), None)
            if local is None:
                return ("?",)
            peer = dist.get_global_rank(grp, local) if grp is not None else local
        return tuple(sorted({dist.get_rank(), int(peer)}))
    return _group_ranks(kwargs.get("group"))


class CollectiveSpy:
    def __init__(self):
        self.calls: List[Tuple[str, Tuple[int | str, ...]]] = []  # ("?",): the ranks could not be read
        self._saved = []

    def _wrap(self, name, fn):
        @functools.wraps(fn)
        def spy(*args, **kwargs):
            try:
                self.calls.append((name, _group_of(name, args, kwargs)))
            except Exception:  # never break the collective because the spy failed
                self.calls.append((name, ("?",)))
            return fn(*args, **kwargs)
        return spy

    def __enter__(self):
        import torch.distributed.distributed_c10d as c10d

        for name in _FUNCS:
            fn = getattr(dist, name, None)
            if fn is not None:
                # The same wrapper in both modules: P2POp checks ``op in (isend, irecv)`` against
                # distributed_c10d's globals, so they must stay the same objects as torch.distributed's.
                spy = self._wrap(name, fn)
                for mod in (dist, c10d):
                    if getattr(mod, name, None) is fn:
                        self._saved.append((mod, name, fn))
                        setattr(mod, name, spy)
        for module_name, attrs in _ALIASES:
            try:
                mod = importlib.import_module(module_name)
            except ImportError:
                continue
            for attr in attrs:
                fn = getattr(mod, attr, None)
                if fn is not None:
                    self._saved.append((mod, attr, fn))
                    setattr(mod, attr, self._wrap(attr, fn))
        return self

    def __exit__(self, *exc):
        for obj, name, fn in reversed(self._saved):
            setattr(obj, name, fn)
        self._saved.clear()

    def crossing(self, worker_of) -> List[Tuple[str, Tuple[int | str, ...]]]:
        """Calls whose group holds ranks of more than one worker (``worker_of[rank]``)."""
        out = []
        for name, ranks in self.calls:
            if "?" in ranks or len({worker_of[r] for r in ranks}) > 1:
                out.append((name, ranks))
        return out

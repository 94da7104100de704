"""W workers in one process: each in its own thread, joined by a process group that really exchanges data.

    results = run_threads(fn, world_size=2, args=(...,))   # fn(rank, world_size, *args) in each thread

Unit tests of the outer strategies need the collectives' *data* (an all-reduce must add the
workers' Δ), not separate processes: spawning gloo ranks costs seconds per world and makes the
tests depend on module-scoped fixtures. Here every thread calls
``torch.distributed.init_process_group("threaded", ...)`` on one shared ``HashStore``: the backend
of ``torch.testing._internal.distributed.multi_threaded_pg`` (torch's own tests use it), whose
``ProcessLocalGroup`` meets all threads at each collective and computes it on rank 0's thread:

- ``all_reduce``: ``torch.stack(tensors).sum(0)`` (MAX / MIN likewise), copied to every rank. For
  two workers that is ``a + b``, bit for bit what gloo computes; for more, the summation order
  is torch's reduction order, not gloo's ring (tests compare those to tolerances, as with gloo);
- ``all_gather`` / ``broadcast``: copies of each rank's tensor.

(torch's ``fake`` backend, ``torch.testing._internal.distributed.fake_pg``, does not exchange
anything and returns garbage, so it cannot check any math.) Not covered: point-to-point
(``batch_isend_irecv``: gossip tests stay multi-process) and subgroups made with ``new_group``;
multi-process tests (``testing.multirank``) keep an integration set of those.

The threaded backend swaps ``torch.distributed``'s world for a thread-local one while it runs;
``run_threads`` installs it, and restores the process's own world (and autograd threading) after,
so it must not run while this process has a real process group of its own.
"""
from __future__ import annotations

import threading
import traceback
from datetime import timedelta
from typing import Any, Callable, List, Sequence

import torch
import torch.distributed as dist

_LOCK = threading.Lock()  # one threaded world at a time in this process


class ThreadRankFailure(RuntimeError):
    """A worker thread raised; the message holds its traceback."""


def run_threads(fn: Callable[..., Any], world_size: int, args: Sequence[Any] = (), timeout: float = 120.0) -> List[Any]:
    """``[fn(rank, world_size, *args) for rank]``, run in ``world_size`` threads of one process group.

    An exception in any thread fails the call with that thread's traceback (the others are released
    from the collective they wait in). A thread still running after ``timeout`` fails it too.
    """
    from torch.testing._internal.distributed import multi_threaded_pg as mtpg

    if dist.is_initialized():
        raise RuntimeError("run_threads needs a process without a process group of its own")
    with _LOCK:
        # group names per thread; torch's _distributed_c10d.pyi stub lacks this binding (torch's own tests call it)
        torch._C._distributed_c10d._set_thread_isolation_mode(True)  # type: ignore[attr-defined]
        mtpg._install_threaded_pg()
        mtpg.ProcessLocalGroup.reset()
        store = dist.HashStore()
        results: List[Any] = [None] * world_size
        errors: List[str] = []

        def worker(rank: int) -> None:
            try:
                dist.init_process_group("threaded", rank=rank, world_size=world_size, store=store,
                                        timeout=timedelta(seconds=timeout))
                try:
                    results[rank] = fn(rank, world_size, *args)
                finally:
                    dist.destroy_process_group()
            except SystemExit:  # released by another thread's failure
                pass
            except BaseException:  # noqa: BLE001 - reported to the caller
                errors.append(f"rank {rank}:\n{traceback.format_exc()}")
                mtpg.ProcessLocalGroup.exception_handle(None)

        threads = [threading.Thread(target=worker, args=(r,), name=f"fake-rank{r}", daemon=True)
                   for r in range(world_size)]
        try:
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout)
            if any(t.is_alive() for t in threads):
                mtpg.ProcessLocalGroup.exception_handle(None)
                errors.append(f"ranks {[r for r, t in enumerate(threads) if t.is_alive()]} still running after "
                              f"{timeout:.0f} s (a collective some rank never joined?)")
        finally:
            mtpg._uninstall_threaded_pg()
            mtpg.ProcessLocalGroup.reset()
            torch._C._distributed_c10d._set_thread_isolation_mode(False)  # type: ignore[attr-defined]  # stub gap
        if errors:
            raise ThreadRankFailure("\n".join(errors))
        return results


__all__ = ["run_threads", "ThreadRankFailure"]

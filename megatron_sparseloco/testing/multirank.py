"""Run a function on N gloo ranks on loopback, with a hard timeout that reports the ranks' stacks.

    results = run_ranks(fn, world_size=4, args=(...,), timeout=120)

``fn(rank, world_size, *args)`` runs in its own process after
``torch.distributed.init_process_group("gloo")`` on a TCP store that the calling process hosts
(as torchrun's agent does; a rank that returns early does not take the store with it); its return value
(picklable) comes back in ``results[rank]``. An exception in any rank fails the call with that
rank's traceback. Ranks are forked from multiprocessing's fork server, which imported ``PRELOAD``
once per test session (a spawned rank re-imported torch and megatron: seconds per rank). A rank
still running ``timeout`` seconds after start dumps all its threads' stacks (faulthandler) and is
killed, and the call raises ``RankTimeout`` carrying every rank's captured output, so a hung
collective fails a test instead of hanging CI.
"""
from __future__ import annotations

import faulthandler
import multiprocessing as mp
import os
import pickle
import random
import socket
import sys
import tempfile
import time
import traceback
from typing import Any, Callable, List, Optional, Sequence, Tuple


#: what the fork server imports once per test session: a rank is forked from it, so it starts with
#: torch and megatron imported (spawn re-imported them per rank: about 7 CPU-seconds each, most of a
#: multi-rank test's time on 2 cores). Third-party only; the rank imports ``fn``'s module itself.
PRELOAD = ("torch", "torch.distributed", "numpy", "megatron.core", "megatron.training")


class RankFailure(RuntimeError):
    """A rank raised; the message holds its traceback and output."""


class RankTimeout(RuntimeError):
    """Ranks did not finish within the timeout; the message holds their stacks and output."""


#: the ephemeral range's usual start (Linux), where ``net.ipv4.ip_local_port_range`` cannot be read
_EPHEMERAL_LOW_FALLBACK = 32768


def _ephemeral_low() -> int:
    """The lowest port the kernel hands out to unbound sockets (``net.ipv4.ip_local_port_range``)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return _EPHEMERAL_LOW_FALLBACK


def free_port() -> int:
    """A TCP port nothing is bound to, drawn at random below the kernel's ephemeral range.

    The caller binds it later (a job's store, a lighthouse). A port the kernel picked (``bind(0)``) lies
    in its ephemeral range, from which it also hands source ports to other processes' outgoing
    connections (gloo's peer sockets, ...): in between, such a connection can take it and the bind
    fails with EADDRINUSE. Below the range only another explicit bind can take it."""
    low = _ephemeral_low()
    draw = random.Random()   # not the global RNG: tests seed that one
    for _ in range(200):
        port = draw.randrange(max(1024, low // 2), low)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:   # the range below is full: the kernel's pick
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(fn, rank, world_size, port, args, out_dir, timeout, env):
    log_path = os.path.join(out_dir, f"rank{rank}.log")
    log = open(log_path, "w", buffering=1)
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    sys.stdout = sys.stderr = log
    # Dump every thread's stack shortly before the parent gives up on us.
    faulthandler.dump_traceback_later(max(1.0, timeout - 2.0), exit=True, file=log)
    os.environ.clear()                 # the caller's environment, not the fork server's
    os.environ.update(env)
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "TORCHELASTIC_USE_AGENT_STORE": "True",
                       "RANK": str(rank),
                       "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(world_size), "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "1")})
    result_path = os.path.join(out_dir, f"rank{rank}.pkl")
    try:
        import torch
        import torch.distributed as dist
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
        import numpy as np
        np.random.seed()               # fresh, as a spawned process had it (Python's random reseeds at fork)
        from datetime import timedelta
        # the store lives in the calling process (as torchrun's agent hosts it): a rank that
        # finishes first can exit without taking the others' rendezvous with it
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=timedelta(seconds=timeout))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout))
        value = fn(rank, world_size, *args)
        payload = ("ok", value)
    except BaseException as exc:  # report everything, including SystemExit from a bad rank
        payload = ("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
    try:
        with open(result_path, "wb") as f:
            pickle.dump(payload, f)
    except Exception as exc:  # unpicklable result
        with open(result_path, "wb") as f:
            pickle.dump(("error", f"result of rank {rank} could not be pickled: {exc}"), f)
    log.flush()
    os._exit(0)  # skip atexit/destroy_process_group, which can block when a peer died


def _tail(path: str, n: int = 6000) -> str:
    try:
        with open(path, "r", errors="replace") as f:
            data = f.read()
        return data[-n:]
    except OSError:
        return "<no output>"


def run_ranks(fn: Callable[..., Any], world_size: int, args: Sequence[Any] = (), timeout: float = 120.0,
              env: Optional[dict] = None, expect_dead: Sequence[int] = ()) -> List[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; see the module docstring.

    Ranks in ``expect_dead`` are allowed to die without a result (fault-injection tests); their
    entry in the returned list is ``None``.
    """
    import torch.distributed as dist
    from datetime import timedelta

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))
    store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=timeout))
    port = store.port
    env = {**os.environ, **(env or {})}
    with tempfile.TemporaryDirectory(prefix="sparseloco-ranks-") as out_dir:
        procs = [ctx.Process(target=_rank_main, args=(fn, r, world_size, port, tuple(args), out_dir, timeout, env),
                             daemon=True) for r in range(world_size)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout + 5.0
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
        logs = {r: _tail(os.path.join(out_dir, f"rank{r}.log")) for r in range(world_size)}
        results: List[Any] = []
        errors: List[Tuple[int, str]] = []
        for r in range(world_size):
            path = os.path.join(out_dir, f"rank{r}.pkl")
            if not os.path.exists(path):
                results.append(None)
                if r not in expect_dead:
                    errors.append((r, f"rank {r} produced no result (exit code {procs[r].exitcode})"))
                continue
            with open(path, "rb") as f:
                status, value = pickle.load(f)
            if status == "ok":
                results.append(value)
            else:
                results.append(None)
                errors.append((r, value))
        if hung:
            report = "\n".join(f"----- rank {r} output (stacks at timeout) -----\n{logs[r]}" for r in range(world_size))
            raise RankTimeout(f"ranks {hung} still running after {timeout:.0f} s\n{report}")
        if errors:
            report = "\n".join(f"----- rank {r} -----\n{msg}\n----- rank {r} output -----\n{logs[r]}"
                               for r, msg in errors)
            raise RankFailure(f"{len(errors)} rank(s) failed\n{report}")
        return results

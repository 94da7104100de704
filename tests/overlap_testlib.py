"""Rank drivers of the delayed-application tests (``outer/overlap.py``), run by ``run_ranks``.

Inner steps are simulated: inner step i of worker r adds ``drift(r, i)`` to its params, so a
single-process reference can replay every worker's trajectory. Round k launches after inner step
H·k and completes after inner step H·k + τ.
"""
from __future__ import annotations

import time
from datetime import timedelta
from typing import Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from outer_testlib import drift, flat, make_params


def _merge(anchor, now, launch, merge, alpha):
    if merge == "replay":
        return (now - launch) + anchor
    return torch.lerp(anchor, now, alpha)


def drive_delayed(rank: int, world: int, name: str, config: Dict, H: int, tau: int, rounds: int,
                  merge: str = "replay", alpha: float = 0.5, shadow: bool = True,
                  nan_at: Optional[tuple] = None, state_at: Optional[int] = None) -> Dict:
    """Run ``rounds`` delayed rounds (plus the last completion); record params after every inner step.

    ``shadow``: a blocking strategy on its own group is stepped at every launch from θ_launch; its
    θ_outer must equal the delayed one's after completion, and the merged params must equal
    merge(θ_outer,k+1, θ_now, θ_launch) computed here (bitwise; same collectives, same order).
    ``nan_at=(rank, i)``: that rank puts a NaN into its params at inner step i.
    ``state_at=i``: save the strategy's state dict after inner step i, rebuild the strategy and
    driver from it (mid-window: the driver is ``wait``-ed first, as a checkpoint does) and go on.
    """
    from megatron_sparseloco.outer import build_outer_strategy
    from megatron_sparseloco.outer.overlap import DelayedOuter, OverlapConfig

    group = dist.new_group(list(range(world)))
    params = make_params(0)
    names = [f"p{i}" for i in range(len(params))]
    strat = build_outer_strategy(name, params, group, names=names, **config)
    ocfg = OverlapConfig(steps=tau, merge=merge, alpha=alpha)
    drv = DelayedOuter(strat, ocfg)
    shadow_group = dist.new_group(list(range(world))) if shadow else None
    sparams = [p.clone() for p in params]
    sh = build_outer_strategy(name, sparams, shadow_group, names=names, **config) if shadow else None
    out = {"params": [], "anchor": {}, "stats": [], "shadow_ok": [], "merge_ok": []}
    launch_flat = None
    total = rounds * H + tau
    for i in range(1, total + 1):
        with torch.no_grad():
            for p, d in zip(params, drift(rank, i)):
                p.add_(d)
            if nan_at == (rank, i):
                params[0].view(-1)[3] = float("nan")
        if i % H == 0 and i // H <= rounds:
            if shadow:
                assert torch.equal(sh.anchor, strat.anchor), f"rank {rank} step {i}: shadow anchor diverged"
                for sp, p in zip(sparams, params):
                    sp.copy_(p)
                sh.step()
            drv.launch()
            launch_flat = flat(params).clone()
        if i % H == tau and i > H:
            before = flat(params).clone()
            stats = drv.complete()
            out["stats"].append(stats.as_dict() if stats is not None else None)
            out["anchor"][i] = strat.anchor.clone()
            if shadow:
                out["shadow_ok"].append(torch.equal(sh.anchor, strat.anchor))
                # (a skipped round reset the params to θ_outer,k before the snapshot)
                want = _merge(strat.anchor, before, launch_flat, merge, alpha)
                out["merge_ok"].append(torch.equal(flat(params), want))
        if state_at == i:
            drv.wait()
            sd = strat.state_dict()
            due = drv.merge_due
            strat = build_outer_strategy(name, params, group, names=names, **config)
            drv = DelayedOuter(strat, ocfg, comm=None)
            strat.load_state_dict(sd)
            drv.merge_due = due
        out["params"].append(flat(params).clone())
    drv.close()
    return out


def drive_slow_peer(rank: int, world: int, name: str, config: Dict, H: int, tau: int, rounds: int,
                    step_s: float, slow_rank: int, delay_s: float, late_s: float = 0.0) -> Dict:
    """Inner steps of ``step_s`` seconds; ``slow_rank``'s comm thread sleeps ``delay_s`` before each round
    and its main thread ``late_s`` before each launch (a worker that reaches the round's end later)."""
    from megatron_sparseloco.outer import build_outer_strategy
    from megatron_sparseloco.outer.overlap import DelayedOuter, OverlapConfig

    group = dist.new_group(list(range(world)))
    params = make_params(0)
    strat = build_outer_strategy(name, params, group, **config)
    hook = (lambda: time.sleep(delay_s)) if rank == slow_rank else None
    drv = DelayedOuter(strat, OverlapConfig(steps=tau), before_communicate=hook)
    out = {"step_times": {}, "launch": {}, "launch_s": {}, "comm_end": {}, "wait": {}, "agree": {}, "anchor": None}
    for i in range(1, rounds * H + tau + 1):
        time.sleep(step_s)  # "compute"
        with torch.no_grad():
            for p, d in zip(params, drift(rank, i)):
                p.add_(d)
        out["step_times"][i] = time.perf_counter()
        if i % H == 0 and i // H <= rounds:
            if rank == slow_rank and late_s:
                time.sleep(late_s)
            out["launch"][i] = time.perf_counter()
            drv.launch()
            out["launch_s"][i + tau] = time.perf_counter() - out["launch"][i]   # keyed by its completion
        if i % H == tau and i > H:
            stats = drv.complete()
            out["comm_end"][i] = drv.comm_ended_at
            out["wait"][i] = stats.extra["time_wait_s"]
            out["agree"][i] = stats.extra["time_agree_s"]
    drv.close()
    out["anchor"] = strat.anchor.clone()
    return out


def drive_timeout(rank: int, world: int, timeout_s: float) -> Dict:
    """Round 2's collective stalls on rank 1's comm thread: the completions must fail after about the
    group's timeout (not hang), on both ranks."""
    from megatron_sparseloco.outer import build_outer_strategy
    from megatron_sparseloco.outer.overlap import DelayedOuter, OverlapConfig

    group = dist.new_group(list(range(world)), timeout=timedelta(seconds=timeout_s))
    params = make_params(0)
    rounds = []
    hook = (lambda: time.sleep(timeout_s * 3) if len(rounds) == 2 else None) if rank == 1 else None
    drv = DelayedOuter(build_outer_strategy("diloco", params, group), OverlapConfig(steps=1),
                       before_communicate=hook)
    out = {}
    for k in (1, 2):
        rounds.append(k)
        t0 = time.perf_counter()
        drv.launch()
        try:
            drv.complete()
            out[k] = (None, time.perf_counter() - t0)
        except Exception as exc:  # noqa: BLE001 (the backend's error type varies)
            out[k] = (f"{type(exc).__name__}: {exc}", time.perf_counter() - t0)
    return out


def drive_abort(rank: int, world: int, name: str, config: Dict, H: int, tau: int, nan_rank: int) -> Dict:
    """Policy abort with τ: ``nan_rank`` puts a NaN into its params before round 2's launch. Every
    worker must launch without blocking and raise ``NonFiniteError`` at that round's completion, with
    θ_outer and the strategy state (error feedback) as they were before the launch."""
    from megatron_sparseloco.outer import build_outer_strategy
    from megatron_sparseloco.outer.base import NonFiniteError
    from megatron_sparseloco.outer.overlap import DelayedOuter, OverlapConfig

    group = dist.new_group(list(range(world)))
    params = make_params(0)
    strat = build_outer_strategy(name, params, group, names=[f"p{i}" for i in range(len(params))],
                                 **dict(config, nonfinite_policy="abort"))
    drv = DelayedOuter(strat, OverlapConfig(steps=tau))
    out = {"error": None, "raised_at": None}
    for i in range(1, 2 * H + tau + 1):
        with torch.no_grad():
            for p, d in zip(params, drift(rank, i)):
                p.add_(d)
            if rank == nan_rank and i == 2 * H:
                params[1].view(-1)[0] = float("inf")
        if i % H == 0:
            if i == 2 * H:
                out["state_before"] = {k: v.clone() for k, v in strat.elementwise_state().items()}
            drv.launch()
        if i % H == tau and i > H:
            try:
                drv.complete()
            except NonFiniteError as exc:
                out["error"], out["raised_at"] = str(exc), i
                break
    out["state_after"] = {k: v.clone() for k, v in strat.elementwise_state().items()}
    out["in_flight"] = drv.in_flight
    drv.close()
    return out


def drive_many(rank: int, world: int, jobs: Sequence[Dict]) -> List:
    fns = {"delayed": drive_delayed, "slow": drive_slow_peer, "timeout": drive_timeout, "abort": drive_abort}
    results = []
    for job in jobs:
        job = dict(job)
        results.append(fns[job.pop("fn", "delayed")](rank, world, **job))
    return results

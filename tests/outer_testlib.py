"""Shared pieces of the outer-strategy tests: parameters, per-rank drift, a rank driver.

Every rank builds the same initial parameters (a few odd-sized fp32 tensors), then before each
outer step adds a drift that depends on (rank, step) only, so the parent process can replay the
whole trajectory in a plain single-process reference.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

SHAPES = [(7, 13), (5,), (3, 4, 5), (1,), (33,)]  # 91 + 5 + 60 + 1 + 33 = 190 elements


def make_params(seed: int = 0, shapes: Sequence[tuple] = SHAPES) -> List[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g, dtype=torch.float32) for s in shapes]


def drift(rank: int, step: int, shapes: Sequence[tuple] = SHAPES, scale: float = 1e-2,
          seed: int = 0) -> List[torch.Tensor]:
    """The local progress of worker ``rank`` during round ``step`` (deterministic)."""
    g = torch.Generator().manual_seed(1_000_003 * (seed + 1) + 7919 * rank + step)
    # heavy-ish tails and a per-rank bias so that the top-k choices differ between workers
    return [scale * (torch.randn(*s, generator=g) * (1.0 + rank) + 0.1 * rank) for s in shapes]


def flat(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def outer_group(mode: str) -> Optional[dist.ProcessGroup]:
    """"world": all ranks are workers of one shard group; "self": each rank is a worker alone."""
    if mode == "world":
        return None
    if mode == "self":
        groups = [dist.new_group([r]) for r in range(dist.get_world_size())]
        return groups[dist.get_rank()]
    raise ValueError(mode)


def drive(rank: int, world_size: int, name: str, config: Dict, steps: int, seed: int = 0,
          group_mode: str = "world", nan_at: Optional[tuple] = None,
          save_at: Optional[int] = None, reload: bool = False) -> Dict:
    """Run ``steps`` outer steps of strategy ``name``; return per-step flat params and stats.

    ``nan_at=(rank, step)``: that rank puts a NaN into its first tensor before that step.
    ``save_at=t``: take the state dict after step t; with ``reload`` build a fresh strategy from
    it and continue with that one (to compare with the uninterrupted run).
    """
    from megatron_sparseloco.outer import NonFiniteError, build_outer_strategy

    torch.manual_seed(1234 + rank)  # anything random in the strategy must not depend on it
    params = make_params(seed)
    group = outer_group(group_mode)
    names = [f"p{i}" for i in range(len(params))]
    strat = build_outer_strategy(name, params, group, names=names, **config)
    out = {"params": [], "anchor": [], "stats": [], "errors": [], "state": None}
    for t in range(1, steps + 1):
        with torch.no_grad():
            for p, d in zip(params, drift(rank, t, seed=seed)):
                p.add_(d)
            if nan_at is not None and nan_at == (rank, t):
                params[0].view(-1)[3] = float("nan")
        try:
            stats = strat.step()
            out["stats"].append(stats.as_dict())
            out["errors"].append(None)
        except NonFiniteError as exc:
            out["stats"].append(None)
            out["errors"].append(str(exc))
        out["params"].append(flat(params).clone())
        out["anchor"].append(strat.anchor.clone())
        if save_at == t:
            sd = strat.state_dict()
            out["state"] = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in sd.items()}
            if reload:
                strat = build_outer_strategy(name, params, group, names=names, **config)
                strat.load_state_dict(sd)
    return out


def mismatch(rank: int, world_size: int, name: str, config: Dict) -> str:
    """Rank 1 owns one element more than the others: construction must fail on every rank."""
    from megatron_sparseloco.outer import ConfigError, build_outer_strategy

    params = make_params(0)
    if rank == 1:
        params.append(torch.zeros(1))
    try:
        build_outer_strategy(name, params, None, **config)
    except ConfigError as exc:
        return str(exc)
    return "no error"


def drive_many(rank: int, world_size: int, jobs: Sequence[Dict]) -> List:
    """Run several jobs in one process group (spawning ranks is the slow part of these tests)."""
    fns = {"drive": drive, "mismatch": mismatch}
    results = []
    for job in jobs:
        job = dict(job)
        fn = fns[job.pop("fn", "drive")]
        results.append(fn(rank, world_size, **job))
    return results


def run_jobs(jobs_for_world, worlds: Sequence[int] = (2, 4)) -> Dict[int, Dict[str, List]]:
    """{world: {job: [per-rank result]}}: one ``run_ranks`` spawn per world size for all its jobs."""
    from megatron_sparseloco.testing.multirank import run_ranks

    out = {}
    for world in worlds:
        jobs = jobs_for_world(world)
        per_rank = run_ranks(drive_many, world, args=(list(jobs.values()),), timeout=240)
        out[world] = {k: [per_rank[r][i] for r in range(world)] for i, k in enumerate(jobs)}
    return out


def run_jobs_in_threads(jobs: Dict[str, Dict], world: int) -> Dict[str, List]:
    """{job: [per-rank result]} with ``world`` workers as threads of this process, joined by a
    process group that really exchanges data (``testing.fake_group``): milliseconds, no spawn."""
    from megatron_sparseloco.testing.fake_group import run_threads

    per_rank = run_threads(drive_many, world, args=(list(jobs.values()),))
    return {k: [per_rank[r][i] for r in range(world)] for i, k in enumerate(jobs)}


def job_runner(jobs_for_world: Callable[[int], Dict[str, Dict]], gloo_jobs: Sequence[str]):
    """``run(world, job, backend="threads") -> [per-rank result]`` for one job of ``jobs_for_world(world)``.

    ``"threads"``: that job alone, workers as threads (``run_jobs_in_threads``), cached per job, so a
    test asking for it runs on its own. ``"gloo"``: the ``gloo_jobs`` on 2 real gloo processes
    (one spawn for all of them, on first use), the integration set.
    """
    import functools

    @functools.lru_cache(maxsize=None)
    def gloo() -> Dict[str, List]:
        return run_jobs(lambda world: {k: v for k, v in jobs_for_world(world).items() if k in gloo_jobs},
                        worlds=(2,))[2]

    @functools.lru_cache(maxsize=None)
    def run(world: int, job: str, backend: str = "threads") -> List:
        if backend == "gloo":
            return gloo()[job]
        return run_jobs_in_threads({job: jobs_for_world(world)[job]}, world)[job]

    return run


def assert_ranks_identical(res: Sequence[Dict]) -> None:
    """After every step all ranks hold bitwise the same params and θ_outer, and params == θ_outer."""
    for t in range(len(res[0]["params"])):
        for r in range(1, len(res)):
            assert torch.equal(res[r]["params"][t], res[0]["params"][t]), f"step {t + 1}: rank {r} differs from rank 0"
            assert torch.equal(res[r]["anchor"][t], res[0]["anchor"][t])
        assert torch.equal(res[0]["params"][t], res[0]["anchor"][t]), "θ_local must equal θ_outer after a step"


#: GASLoC's documented defaults (docs/gasloc.md §8.6): what the references use where a scenario leaves
#: η or γ unset, so a changed default in the plugin fails these tests
GASLOC_DEFAULTS = {"proposal_lr": 0.7, "momentum": 0.6}


def gossip_reference(sc: dict, W: int, init_theta: Callable[[str, int], torch.Tensor],
                     drift: Callable[[int, int], torch.Tensor]) -> List[torch.Tensor]:
    """GASLoC anchors [W, N] after each round, float64, from the matrix form of the uncompressed update:

        y = θ0 − η(θ0 − θ_local) ;   d ← γd + (M y − θ0) ;   θ0 ← θ0 + d

    ``sc``: a scenario (``cfg`` with topology / proposal_lr / momentum / seed / mixing_weight, ``init``,
    ``rounds``, ``drift``, optional ``nan`` = (worker, round) whose local progress is discarded).
    """
    from megatron_sparseloco.comm.topology import mixing_matrix

    c = sc["cfg"]
    eta, gamma = (c.get(key, GASLOC_DEFAULTS[key]) for key in ("proposal_lr", "momentum"))
    theta0 = torch.stack([init_theta(sc["init"], i) for i in range(W)]).double()
    d = torch.zeros_like(theta0)
    out = []
    for r in range(sc["rounds"]):
        local = theta0 - torch.stack([drift(i, r) for i in range(W)]).double() if sc["drift"] else theta0.clone()
        if sc.get("nan") is not None and sc["nan"][1] == r:
            local[sc["nan"][0]] = theta0[sc["nan"][0]]  # skip: that worker's local progress is discarded
        y = theta0 - eta * (theta0 - local)
        M = mixing_matrix(c["topology"], W, r, c.get("seed", 0), c.get("mixing_weight"))
        d = gamma * d + (M @ y - theta0)
        theta0 = theta0 + d
        out.append(theta0.clone())
    return out

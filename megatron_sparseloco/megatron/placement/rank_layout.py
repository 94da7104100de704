"""Where the DiLoCo workers of a Megatron job live: rank layout, worker membership, cross-worker groups.

A DiLoCo worker is one Megatron distributed-optimizer instance
(``--num-distributed-optimizer-instances W``). This module recomputes, without any process group,
the rank layout that megatron-core 0.19.2 ``parallel_state.initialize_model_parallel`` builds:

* ranks are laid out along the axes of ``order`` (default ``tp-cp-ep-dp-pp``, or ``tp-cp-ep-pp-dp``
  with ``--use-tp-pp-dp-mapping``), the first axis varying fastest;
* the dense grid uses (tp, cp, dp, pp), the expert grid (expert-tp, ep, expert-dp, pp);
* a worker is Megatron's ``intra_distributed_optimizer_instance_group``: consecutive blocks of
  ``expert_dp / W`` expert tensor-expert-pipeline groups (in expert-dp order);
* the cross-worker groups are Megatron's ``inter_distributed_optimizer_instance_group``: each expert
  data-parallel group cut into W consecutive slices; position j of every slice forms one group.
  These are the only groups that communicate across workers.

torchrun places global rank ``node_rank * gpus_per_node + local_rank``, so node of rank r is
``r // gpus_per_node``. A worker must not span two sites (slow links): its every step reduces
gradients over the whole worker. The ``sparseloco-layout`` command (``megatron_sparseloco/worker_layout.py``)
prints a layout from the command line.
"""
from __future__ import annotations

import itertools
import re
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

DEFAULT_ORDER = "tp-cp-ep-dp-pp"
TP_PP_DP_ORDER = "tp-cp-ep-pp-dp"


class LayoutError(ValueError):
    """A layout Megatron or the outer step cannot run; the message says which flag to change."""


def orthogonal_groups(sizes: Sequence[int], grouped: Sequence[bool]) -> List[List[int]]:
    """Rank groups of a grid whose axes have ``sizes`` (first axis fastest).

    A group holds the ranks that share their coordinates on the axes not in ``grouped``; inside a
    group ranks are ordered by the grouped coordinates (first grouped axis fastest), and groups are
    ordered by the other coordinates (first axis fastest), which is the convention of megatron-core's
    ``generate_masked_orthogonal_rank_groups``.
    """
    strides, s = [], 1
    for n in sizes:
        strides.append(s)
        s *= n
    inner = [i for i, g in enumerate(grouped) if g]
    outer = [i for i, g in enumerate(grouped) if not g]

    def coords(axes):
        # itertools.product varies the last factor fastest; reverse so the first axis is fastest.
        for combo in itertools.product(*[range(sizes[a]) for a in reversed(axes)]):
            yield dict(zip(reversed(axes), combo))

    groups = []
    for oc in coords(outer):
        base = sum(oc[a] * strides[a] for a in outer)
        groups.append([base + sum(ic[a] * strides[a] for a in inner) for ic in coords(inner)])
    return groups


def _grid(order: str, sizes: Dict[str, int]):
    axes = order.lower().split("-")
    for name, n in sizes.items():
        if name not in axes:
            if n != 1:
                raise LayoutError(f"order '{order}' has no '{name}' axis but its size is {n}")
            axes.append(name)
    return axes, [sizes[a] for a in axes]


def _groups(order: str, sizes: Dict[str, int], token: str) -> List[List[int]]:
    axes, shape = _grid(order, sizes)
    want = token.split("-")
    return orthogonal_groups(shape, [a in want for a in axes])


def expand_nodelist(nodelist: str) -> List[str]:
    """Expand a SLURM node list ("node[01-04]", "a,b,c", "gpu[1-2,7]x,cpu3") like ``scontrol show hostnames``.

    Handles one bracket range per host name (what SLURM prints for simple allocations), zero padding,
    and comma-separated lists of such names.
    """
    names, depth, cur = [], 0, ""
    for ch in nodelist.strip():
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        if ch == "," and depth == 0:
            names.append(cur)
            cur = ""
        else:
            cur += ch
    if depth != 0:
        raise LayoutError(f"unbalanced brackets in node list '{nodelist}'")
    names.append(cur)
    hosts: List[str] = []
    for name in filter(None, (n.strip() for n in names)):
        m = re.fullmatch(r"([^\[\]]*)\[([^\[\]]+)\]([^\[\]]*)", name)
        if not m:
            if "[" in name or "]" in name:
                raise LayoutError(f"cannot expand node list entry '{name}' (one [..] range per name supported); "
                                  f"pass the hosts as a comma-separated list instead")
            hosts.append(name)
            continue
        prefix, body, suffix = m.groups()
        for part in body.split(","):
            if "-" in part:
                lo, hi = part.split("-", 1)
                width = len(lo) if lo.startswith("0") else 0
                if not (lo.isdigit() and hi.isdigit()) or int(hi) < int(lo):
                    raise LayoutError(f"bad range '{part}' in node list '{nodelist}'")
                hosts.extend(f"{prefix}{i:0{width}d}{suffix}" for i in range(int(lo), int(hi) + 1))
            else:
                hosts.append(f"{prefix}{part}{suffix}")
    return hosts


@dataclass
class Layout:
    nodes: int
    gpus_per_node: int
    world_size: int
    tp: int
    pp: int
    cp: int
    ep: int
    expert_tp: int
    dp: int
    expert_dp: int
    workers: int
    order: str
    sites: List[int]
    ranks_per_worker: int
    worker_ranks: List[List[int]]
    worker_nodes: List[List[int]]
    worker_sites: List[int]
    cross_worker_groups: List[List[int]]
    dense_intra_dp_cp_groups: List[List[int]] = field(default_factory=list)
    warnings: List[str] = field(default_factory=list)

    def worker_of_rank(self, rank: int) -> int:
        for w, ranks in enumerate(self.worker_ranks):
            if rank in ranks:
                return w
        raise KeyError(rank)

    def to_dict(self) -> dict:
        return asdict(self)


def _parse_sites(sites, nodes: int) -> List[int]:
    if sites is None or sites == "":
        return [0] * nodes
    if isinstance(sites, str):
        try:
            sites = [int(s) for s in sites.replace(" ", "").split(",") if s != ""]
        except ValueError:
            raise LayoutError(f"--sites '{sites}': expected comma-separated integer site ids, one per node") from None
    sites = list(sites)
    if len(sites) != nodes:
        raise LayoutError(f"--sites has {len(sites)} entries but --nodes is {nodes}: give one site id per node "
                          f"(e.g. --sites {','.join(['0'] * (nodes // 2) + ['1'] * (nodes - nodes // 2))})")
    return sites


def compute_layout(nodes: int, gpus_per_node: int, tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1,
                   workers: int = 1, expert_tp: Optional[int] = None, order: str = DEFAULT_ORDER,
                   sites=None) -> Layout:
    """Megatron's rank layout for this job and the DiLoCo worker placement; raises LayoutError."""
    for name, v in (("--nodes", nodes), ("--gpus-per-node", gpus_per_node), ("--tp", tp), ("--pp", pp),
                    ("--cp", cp), ("--ep", ep), ("--workers", workers)):
        if int(v) < 1:
            raise LayoutError(f"{name} must be >= 1 (got {v})")
    etp = tp if expert_tp is None else expert_tp
    if etp < 1:
        raise LayoutError(f"--expert-tp must be >= 1 (got {etp})")
    order = order.lower()
    if sorted(order.split("-")) != sorted(DEFAULT_ORDER.split("-")):
        raise LayoutError(f"--order '{order}' must be a permutation of tp,cp,ep,dp,pp "
                          f"(Megatron uses {DEFAULT_ORDER}, or {TP_PP_DP_ORDER} with --use-tp-pp-dp-mapping)")
    world = nodes * gpus_per_node
    site_of_node = _parse_sites(sites, nodes)
    dp, edp = _data_parallel_sizes(world, tp, pp, cp, ep, etp, workers, order,
                                   f"{nodes} nodes x {gpus_per_node} GPUs")
    dense_sizes = {"tp": tp, "cp": cp, "ep": 1, "dp": dp, "pp": pp}
    expert_sizes = {"tp": etp, "cp": 1, "ep": ep, "dp": edp, "pp": pp}
    worker_ranks, cross = _worker_groups(order, expert_sizes, edp // workers, workers)
    dense_intra = _dense_intra_groups(order, dense_sizes, worker_ranks, workers, (tp, cp, etp, ep))
    worker_nodes = [sorted({r // gpus_per_node for r in rs}) for rs in worker_ranks]
    worker_sites = [_site_of_worker(w, worker_ranks[w], ns, site_of_node, pp, order, world, workers, gpus_per_node)
                    for w, ns in enumerate(worker_nodes)]
    warnings = []
    if tp > gpus_per_node or (gpus_per_node % tp and tp < gpus_per_node):
        warnings.append(f"tensor-parallel groups (tp={tp}) cross node boundaries (gpus-per-node={gpus_per_node})")
    if ep * etp > gpus_per_node:
        warnings.append(f"expert-parallel groups (expert-tp*ep={etp * ep}) cross node boundaries")
    if workers > 1 and len(set(site_of_node)) > 1 and len(set(worker_sites)) == 1:
        warnings.append("all workers are in one site although several sites were given")
    return Layout(nodes=nodes, gpus_per_node=gpus_per_node, world_size=world, tp=tp, pp=pp, cp=cp, ep=ep,
                  expert_tp=etp, dp=dp, expert_dp=edp, workers=workers, order=order, sites=site_of_node,
                  ranks_per_worker=world // workers, worker_ranks=worker_ranks, worker_nodes=worker_nodes,
                  worker_sites=worker_sites, cross_worker_groups=cross, dense_intra_dp_cp_groups=dense_intra,
                  warnings=warnings)


def _data_parallel_sizes(world: int, tp: int, pp: int, cp: int, ep: int, etp: int, workers: int,
                         order: str, machines: str) -> Tuple[int, int]:
    """(dense DP, expert DP) of the world, each divisible by W; raises LayoutError naming the flag to change."""
    model = tp * pp * cp
    if world % model:
        raise LayoutError(f"world size {world} (= {machines}) is not divisible by "
                          f"tp*pp*cp = {tp}*{pp}*{cp} = {model}: change --nodes/--gpus-per-node or the "
                          f"model-parallel sizes (--tensor-model-parallel-size, --pipeline-model-parallel-size, "
                          f"--context-parallel-size)")
    dp = world // model
    expert_model = etp * ep * pp
    if world % expert_model:
        raise LayoutError(f"world size {world} is not divisible by expert-tp*ep*pp = {etp}*{ep}*{pp} = "
                          f"{expert_model}: change --expert-model-parallel-size / --expert-tensor-parallel-size")
    edp = world // expert_model
    if not order.endswith("pp") and pp > 1 and edp != dp:
        raise LayoutError(f"with order {order} (--use-tp-pp-dp-mapping) and pp={pp}, Megatron needs the dense "
                          f"data-parallel size ({dp}) to equal the expert one ({edp}): make "
                          f"expert-tp*ep equal tp*cp, or drop --use-tp-pp-dp-mapping")
    if dp % workers:
        raise LayoutError(f"--sparseloco-workers {workers} does not divide the data-parallel size {dp} "
                          f"(= world {world} / (tp*pp*cp = {model})): choose W among the divisors of {dp} "
                          f"({', '.join(str(d) for d in range(1, dp + 1) if dp % d == 0)}), or change the "
                          f"node count")
    if edp % workers:
        raise LayoutError(f"--sparseloco-workers {workers} does not divide the expert data-parallel size {edp} "
                          f"(= world {world} / (expert-tp*ep*pp = {expert_model})): lower "
                          f"--expert-model-parallel-size or choose W among "
                          f"{', '.join(str(d) for d in range(1, edp + 1) if edp % d == 0 and dp % d == 0)}")
    return dp, edp


def _worker_groups(order: str, expert_sizes: dict, intra_e: int,
                   workers: int) -> Tuple[List[List[int]], List[List[int]]]:
    """Worker membership (parallel_state's intra distributed-optimizer-instance groups) and the
    cross-worker groups (its inter partial expert-DP groups = the inter-instance group)."""
    worker_ranks, acc = [], []
    for i, g in enumerate(_groups(order, expert_sizes, "tp-ep-pp"), start=1):
        acc.extend(g)
        if i % intra_e == 0:
            worker_ranks.append(sorted(acc))
            acc = []
    cross = []
    for g in _groups(order, expert_sizes, "dp"):
        for j in range(intra_e):
            cross.append([g[j + i * intra_e] for i in range(workers)])
    return worker_ranks, cross


def _dense_intra_groups(order: str, dense_sizes: dict, worker_ranks: List[List[int]], workers: int,
                        shape: Tuple[int, int, int, int]) -> List[List[int]]:
    """Dense intra-instance DP×CP groups: each must lie inside one worker, or dense gradients would be
    reduced across workers every step."""
    tp, cp, etp, ep = shape
    intra = dense_sizes["dp"] * cp // workers
    dense_intra: List[List[int]] = []
    for g in _groups(order, dense_sizes, "dp-cp"):
        dense_intra.extend(g[i * intra:(i + 1) * intra] for i in range(workers))
    rank_worker = {r: w for w, rs in enumerate(worker_ranks) for r in rs}
    for g in dense_intra:
        if len({rank_worker[r] for r in g}) != 1:
            raise LayoutError(f"dense data-parallel slice {g} would span workers "
                              f"{sorted({rank_worker[r] for r in g})}; "
                              f"this expert/dense combination (tp={tp}, cp={cp}, expert-tp={etp}, ep={ep}) cannot "
                              f"be split into {workers} workers: make expert-tp*ep a multiple of tp*cp")
    return dense_intra


def _site_of_worker(w: int, ranks: List[int], nodes: List[int], site_of_node: List, pp: int, order: str, world: int,
                    workers: int, gpus_per_node: int):
    """The one site worker w's nodes are in; a worker spanning sites raises LayoutError with the fix."""
    ss = sorted({site_of_node[n] for n in nodes})
    if len(ss) == 1:
        return ss[0]
    if pp > 1 and order.endswith("pp"):
        fix = ("with pipeline parallelism and the default order each worker holds a slice of every "
               "pipeline stage, and stages are far apart in rank space: add --use-tp-pp-dp-mapping "
               "(layout order tp-cp-ep-pp-dp, --order tp-cp-ep-pp-dp here) so each worker is a "
               "contiguous block of nodes")
    else:
        nodes_per_worker = max(1, world // workers // gpus_per_node)
        fix = (f"each worker spans {nodes_per_worker} node(s); give every site a multiple of that many "
               f"consecutive nodes (list nodes site by site), or change --sparseloco-workers so that "
               f"W is a multiple of the number of sites")
    raise LayoutError(f"worker {w} (ranks {_ranges(ranks)}) spans sites {ss} on nodes {nodes}: "
                      f"a worker reduces gradients every step and must stay inside one site. Fix: {fix}")


def _ranges(ranks: Sequence[int]) -> str:
    """[0,1,2,3,8,9] -> '0-3,8-9'."""
    runs: List[List[int]] = []  # [first, last] of each run of consecutive ranks
    for r in sorted(ranks):
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    return ",".join(f"{first}-{last}" if last != first else f"{first}" for first, last in runs)


def format_layout(lay: Layout, hostnames: Optional[List[str]] = None, max_groups: int = 16) -> str:
    host = (lambda n: hostnames[n]) if hostnames else (lambda n: f"node{n}")
    lines = [f"world size {lay.world_size} = {lay.nodes} nodes x {lay.gpus_per_node} GPUs; order {lay.order}; "
             f"tp={lay.tp} pp={lay.pp} cp={lay.cp} ep={lay.ep} expert-tp={lay.expert_tp}; "
             f"data-parallel {lay.dp} (expert {lay.expert_dp}); "
             f"{lay.workers} worker(s) of {lay.ranks_per_worker} ranks",
             "workers (Megatron distributed-optimizer instances; all per-step traffic stays inside one):"]
    for w, rs in enumerate(lay.worker_ranks):
        lines.append(f"  worker {w}: site {lay.worker_sites[w]}, ranks {_ranges(rs)}, "
                     f"nodes {', '.join(host(n) for n in lay.worker_nodes[w])}")
    lines.append(f"cross-worker groups (the only groups that talk across workers; {len(lay.cross_worker_groups)} "
                 f"groups of {lay.workers}):")
    for g in lay.cross_worker_groups[:max_groups]:
        lines.append(f"  {g}")
    if len(lay.cross_worker_groups) > max_groups:
        lines.append(f"  ... {len(lay.cross_worker_groups) - max_groups} more (use --json for all)")
    for wmsg in lay.warnings:
        lines.append(f"warning: {wmsg}")
    return "\n".join(lines)

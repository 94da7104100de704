"""``sparseloco-layout``: print which ranks form which DiLoCo worker, and refuse a worker spanning two sites.

    python -m megatron_sparseloco.worker_layout --nodes 8 --gpus-per-node 8 --tp 2 --workers 4 [--sites 0,0,0,0,1,1,1,1]
    python -m megatron_sparseloco.worker_layout --nodes 4 --megatron-args <the pretrain arguments>
    python -m megatron_sparseloco.worker_layout --expand-nodelist 'gpu[01-04]'

The layout is ``megatron.placement.rank_layout.compute_layout``'s (no process group needed); with
``--megatron-args`` the parallel sizes come from Megatron's flags and W from the plugin's own parser
(``--sparseloco-workers``; in elastic mode, ``--sparseloco-lighthouse``, a job is one worker). Exit status 2
with one message on a layout Megatron or the outer step cannot run.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Optional, Sequence

from megatron_sparseloco.megatron.placement.rank_layout import (DEFAULT_ORDER, TP_PP_DP_ORDER, LayoutError,
                                                                compute_layout, expand_nodelist, format_layout)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sparseloco-layout", description=(__doc__ or "").split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, help="number of nodes (SLURM_NNODES)")
    p.add_argument("--gpus-per-node", type=int, default=8, help="ranks per node (torchrun --nproc-per-node)")
    p.add_argument("--tp", type=int, default=1, help="--tensor-model-parallel-size")
    p.add_argument("--pp", type=int, default=1, help="--pipeline-model-parallel-size")
    p.add_argument("--cp", type=int, default=1, help="--context-parallel-size")
    p.add_argument("--ep", type=int, default=1, help="--expert-model-parallel-size")
    p.add_argument("--expert-tp", type=int, default=None, help="--expert-tensor-parallel-size (default: --tp)")
    p.add_argument("--workers", type=int, default=1,
                   help="--sparseloco-workers W (= --num-distributed-optimizer-instances)")
    p.add_argument("--sites", default=None, help="site id per node, e.g. '0,0,1,1' (default: all nodes one site)")
    p.add_argument("--order", default=None, help=f"rank order (default {DEFAULT_ORDER})")
    p.add_argument("--use-tp-pp-dp-mapping", action="store_true", help=f"Megatron's flag: order {TP_PP_DP_ORDER}")
    p.add_argument("--hostnames", default=None, help="SLURM node list, used to name nodes in the output")
    p.add_argument("--json", action="store_true", help="print the layout as JSON")
    p.add_argument("--quiet", action="store_true", help="print nothing on success (exit status only)")
    p.add_argument("--expand-nodelist", metavar="NODELIST", default=None,
                   help="print the host names of a SLURM node list, one per line, and exit")
    p.add_argument("--megatron-args", nargs=argparse.REMAINDER, default=None,
                   help="last option: the Megatron pretrain arguments; the parallel sizes and W are read "
                        "from them (--tensor-model-parallel-size, ..., --sparseloco-workers) instead of "
                        "--tp/--pp/--cp/--ep/--expert-tp/--workers")
    return p


def sizes_from_megatron_args(argv: Sequence[str]) -> dict:
    """The layout-relevant sizes in a Megatron argument list (the last occurrence wins, as in argparse).
    In elastic mode (``--sparseloco-lighthouse``) the arguments are one job's, and a job is one worker."""
    from megatron_sparseloco.megatron.args import add_sparseloco_args   # (imports torch: only here, not for a
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)      # node list or a layout from the sizes)
    add_sparseloco_args(p)   # the plugin's own flags (--sparseloco-workers, --sparseloco-lighthouse), as it parses them
    p.add_argument("--tensor-model-parallel-size", type=int, default=1)
    p.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    p.add_argument("--context-parallel-size", type=int, default=1)
    p.add_argument("--expert-model-parallel-size", type=int, default=1)
    p.add_argument("--expert-tensor-parallel-size", type=int, default=None)
    p.add_argument("--num-distributed-optimizer-instances", type=int, default=None)
    p.add_argument("--use-tp-pp-dp-mapping", action="store_true")
    known, _ = p.parse_known_args(list(argv))
    w, inst = known.sparseloco_workers, known.num_distributed_optimizer_instances
    if known.sparseloco_lighthouse is not None:   # elastic mode: the job is one worker, W counts the run's slots
        w = None
    if w is not None and inst not in (None, 1, w):
        raise LayoutError(f"--sparseloco-workers {w} disagrees with --num-distributed-optimizer-instances {inst}: "
                          f"give only one of them, or the same value to both")
    return dict(tp=known.tensor_model_parallel_size, pp=known.pipeline_model_parallel_size,
                cp=known.context_parallel_size, ep=known.expert_model_parallel_size,
                expert_tp=known.expert_tensor_parallel_size, workers=w or inst or 1,
                order=TP_PP_DP_ORDER if known.use_tp_pp_dp_mapping else DEFAULT_ORDER)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.expand_nodelist is not None:
            print("\n".join(expand_nodelist(args.expand_nodelist)))
            return 0
        if args.nodes is None:
            raise LayoutError("--nodes is required")
        if args.megatron_args is not None:
            kw = sizes_from_megatron_args(args.megatron_args)
        else:
            kw = dict(tp=args.tp, pp=args.pp, cp=args.cp, ep=args.ep, expert_tp=args.expert_tp, workers=args.workers,
                      order=TP_PP_DP_ORDER if args.use_tp_pp_dp_mapping else DEFAULT_ORDER)
        if args.order:
            kw["order"] = args.order
        lay = compute_layout(args.nodes, args.gpus_per_node, sites=args.sites, **kw)
        hosts = expand_nodelist(args.hostnames) if args.hostnames else None
        if hosts is not None and len(hosts) != lay.nodes:
            raise LayoutError(f"--hostnames lists {len(hosts)} hosts but --nodes is {lay.nodes}")
    except LayoutError as exc:
        print(f"sparseloco-layout: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        d = lay.to_dict()
        d["hostnames"] = hosts
        print(json.dumps(d))
    elif not args.quiet:
        print(format_layout(lay, hosts))
    return 0


if __name__ == "__main__":
    sys.exit(main())

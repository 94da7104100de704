"""Translate validated ``--sparseloco-*`` arguments into an outer-strategy factory."""
from __future__ import annotations

import argparse
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from megatron_sparseloco.outer.registry import build_outer_strategy


def outer_config_fields(args: argparse.Namespace, worker_index: int = 0) -> Dict[str, object]:
    """The config fields of ``args.sparseloco_algorithm``'s strategy (see ``megatron_sparseloco.outer``)."""
    algo = args.sparseloco_algorithm
    common = {"bucket_numel": args.sparseloco_bucket_size, "nonfinite_policy": args.sparseloco_nonfinite_policy}
    if algo == "average":
        return {**common, "comm_dtype": args.sparseloco_diloco_comm_dtype}
    if algo == "diloco":
        return {**common, "lr": args.sparseloco_outer_lr, "momentum": args.sparseloco_outer_momentum,
                "nesterov": args.sparseloco_outer_nesterov, "comm_dtype": args.sparseloco_diloco_comm_dtype}
    codec = {"chunk": args.sparseloco_chunk_size, "k": args.sparseloco_topk,
             "value_bits": args.sparseloco_value_bits, "ef_beta": args.sparseloco_ef_decay}
    if algo == "sparseloco":
        return {**common, **codec, "index_coding": args.sparseloco_index_coding, "reduce": args.sparseloco_reduce,
                "chunking": args.sparseloco_chunking, "dense_1d": args.sparseloco_dense_1d,
                "aggregation": args.sparseloco_aggregation,
                "lr": args.sparseloco_outer_lr, "momentum": args.sparseloco_outer_momentum,
                "nesterov": args.sparseloco_outer_nesterov}
    if algo == "gasloc":
        fields = {**common, "topology": args.sparseloco_gossip_topology, "seed": args.sparseloco_gossip_seed,
                  "proposal_lr": args.sparseloco_gossip_proposal_lr, "momentum": args.sparseloco_outer_momentum,
                  "compress": args.sparseloco_gossip_compress}
        if args.sparseloco_gossip_compress:
            fields.update({k: v for k, v in codec.items() if k != "ef_beta"},
                          index_coding=args.sparseloco_index_coding, gossip_step=args.sparseloco_gossip_step)
        return fields
    raise ValueError(f"unknown --sparseloco-algorithm {algo!r}")


def inner_steps_for_worker(args: argparse.Namespace, worker_index: int) -> int:
    per_worker = getattr(args, "sparseloco_inner_steps_per_worker", None)
    return per_worker[worker_index] if per_worker else args.sparseloco_inner_steps


def strategy_factory_from_args(args: argparse.Namespace):
    fields = outer_config_fields(args)

    def factory(params: List[torch.Tensor], group: Optional[dist.ProcessGroup], names: List[str], slices=None):
        return build_outer_strategy(args.sparseloco_algorithm, params, group, names=names, slices=slices, **fields)

    return factory

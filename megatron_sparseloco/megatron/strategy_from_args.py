"""Translate validated ``--sparseloco-*`` arguments into an outer-strategy factory.

The config fields are read from ``args`` through each field's flag metadata
(``outer.config_fields``): no per-algorithm mapping lives here.
"""
from __future__ import annotations

import argparse
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from megatron_sparseloco.megatron.arguments import dest_of
from megatron_sparseloco.outer.config_fields import flagged_fields
from megatron_sparseloco.outer.registry import build_outer_strategy, outer_strategy_class


def outer_config_fields(args: argparse.Namespace) -> Dict[str, object]:
    """The config fields of ``args.sparseloco_algorithm``'s strategy whose flag holds a value
    (after ``validate_sparseloco_args``: all of them, resolved); unset ones keep the config default."""
    config_class = outer_strategy_class(args.sparseloco_algorithm).config_class
    fields = {}
    for flag, spec in flagged_fields(config_class).items():
        value = getattr(args, dest_of(flag), None)
        if value is not None:
            fields[spec.name] = value
    return fields


def inner_steps_for_worker(args: argparse.Namespace, worker_index: int) -> int:
    per_worker = getattr(args, "sparseloco_inner_steps_per_worker", None)
    if per_worker == "auto":  # measured at run time (megatron/auto_steps.py); H until the first agreement
        return args.sparseloco_inner_steps
    return per_worker[worker_index] if per_worker else args.sparseloco_inner_steps


def strategy_factory_from_args(args: argparse.Namespace):
    fields = outer_config_fields(args)
    # a loop flag that is a field of every strategy's config (where each strategy allocates θ_outer)
    fields["anchor_on_cpu"] = bool(getattr(args, "sparseloco_anchor_on_cpu", False))

    def factory(params: List[torch.Tensor], group: Optional[dist.ProcessGroup], names: List[str], slices=None):
        return build_outer_strategy(args.sparseloco_algorithm, params, group, names=names, slices=slices, **fields)

    return factory

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
from megatron_sparseloco.megatron.loop_config import OuterLoopConfig
from megatron_sparseloco.outer.config_fields import flagged_fields
from megatron_sparseloco.outer.registry import build_outer_strategy, outer_strategy_class


def outer_config_fields(args: argparse.Namespace) -> Dict[str, object]:
    """The config fields of ``args.sparseloco_algorithm``'s strategy whose flag holds a value
    (after ``validate_sparseloco_args``: all of them, resolved); unset ones keep the config default."""
    config_class = outer_strategy_class(args.sparseloco_algorithm).config_class
    fields: Dict[str, object] = {}
    for flag, spec in flagged_fields(config_class).items():
        value = getattr(args, dest_of(flag), None)
        if value is not None:
            fields[spec.name] = value
    ruled = tuple(getattr(args, "sparseloco_defaults_by_rule", None) or ())
    if ruled:   # defaults set from a rule of W (``OuterConfig.rule_fields``)
        fields["rule_fields"] = ruled
    return fields


def inner_steps_for_worker(args: argparse.Namespace, worker_index: int) -> int:
    per_worker = getattr(args, "sparseloco_inner_steps_per_worker", None)
    if per_worker == "auto":  # measured at run time (megatron/auto_steps.py); H until the first agreement
        return args.sparseloco_inner_steps
    return per_worker[worker_index] if per_worker else args.sparseloco_inner_steps


def loop_config_from_args(args: argparse.Namespace, worker_index: int) -> OuterLoopConfig:
    """The loop config from validated args: every flagged field from its (resolved) flag, and this
    worker's H_w (None with 'auto': measured at run time)."""
    fields = {spec.name: getattr(args, dest_of(flag)) for flag, spec in flagged_fields(OuterLoopConfig).items()}
    config = OuterLoopConfig(**fields)
    if not config.auto_inner_steps:
        config.active_inner_steps = inner_steps_for_worker(args, worker_index)
    return config


def strategy_factory_from_args(args: argparse.Namespace):
    fields = outer_config_fields(args)

    def factory(params: List[torch.Tensor], group: Optional[dist.ProcessGroup], names: List[str], slices=None):
        return build_outer_strategy(args.sparseloco_algorithm, params, group, names=names, slices=slices, **fields)

    return factory

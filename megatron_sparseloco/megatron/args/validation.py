"""Validate the ``--sparseloco-*`` flags and build the configs from them, once.

``validate_sparseloco_args(args)`` runs before any model is built (the plugin calls it before Megatron's
own ``validate_args``):

    elastic flags          ``elastic.config.validate_elastic_args`` → ``args.sparseloco_elastic``
    workers and layout     ``--sparseloco-workers W`` onto ``--num-distributed-optimizer-instances W`` (a
                           DiLoCo worker *is* a distributed-optimizer instance), world size, data-parallel
                           divisibility, expert-parallel groups, Megatron options we cannot combine with,
                           checkpoint format
    the loop config        ``OuterLoopConfig`` from the loop flags given, its ``validate`` (the loop's
                           cross-field rules), then what depends on the algorithm → ``args.sparseloco_loop_config``
    the outer config       the algorithm's config from its flags given, its ``validate_given``, the defaults
                           that depend on W (``resolve_for_workers``), ``check_workers``
                           → ``args.sparseloco_outer_config``

Every config is built here once and handed on as an object (the optimizer wrapper, the strategies, the
start-up report read it); the flags on ``args`` stay as the user gave them. A ``ConfigError`` becomes a
``SparseLoCoArgumentError`` naming the flag and the fix (``outer.flags.argument_error``); a flag the
algorithm's config has no field for is refused, naming the algorithms that take it.
"""
from __future__ import annotations

import argparse
from typing import Any, Collection, Dict, List, NoReturn, Optional, Type

from megatron_sparseloco.elastic.config import validate_elastic_args
from megatron_sparseloco.megatron.args.flags import algorithms, flag_table, takers
from megatron_sparseloco.megatron.args.flags import given as flags_given
from megatron_sparseloco.megatron.args.loop_config import AUTO, OuterLoopConfig
from megatron_sparseloco.outer.base import OuterConfig, OuterStrategy
from megatron_sparseloco.outer.config_fields import ConfigError, flagged_fields
from megatron_sparseloco.outer.flags import SparseLoCoArgumentError, argument_error, dest_of, flag_error, option
from megatron_sparseloco.outer.registry import available_outer_strategies, outer_strategy_class


def _fail(flag: str, problem: str, fix: str) -> NoReturn:
    raise flag_error(flag, problem, fix)


def _refuse_flags_without_algorithm(args: argparse.Namespace) -> None:
    stray = flags_given(args)
    if stray:
        raise SparseLoCoArgumentError(
            f"{', '.join(option(f) for f in stray)} given without --sparseloco-algorithm, so it would be ignored. "
            f"Fix: add --sparseloco-algorithm {{{','.join(algorithms())}}} or drop those flags")


def _refuse_flag_not_taken(flag: str, value, algo: str, config_class: type[OuterConfig], table) -> None:
    """``flag`` given although ``algo``'s config has no field for it (an implied value is accepted as is)."""
    implied = config_class.implied_flags
    others = [a for a in takers(flag, table) if a != algo]
    use = f", or use --sparseloco-algorithm {' / '.join(others)}" if others else ""
    if flag in implied:
        if value == implied[flag]:
            return
        _fail(flag, f"{value} is not a setting of {algo}, which behaves as {option(flag)} {implied[flag]} "
                    f"(only {', '.join(others)} take it)", f"drop it{use}")
    _fail(flag, f"does not apply to {algo} (a setting of {', '.join(others) or 'no algorithm'} only)", f"drop it{use}")


# ---------------------------------------------------------------------- workers and layout
def parse_per_worker_steps(text: str, workers: int) -> List[int]:
    flag = "inner-steps-per-worker"
    try:
        steps = [int(x) for x in text.split(",") if x.strip() != ""]
    except ValueError:
        _fail(flag, f"{text!r} is not a comma-separated list of integers",
              "give one integer per worker, e.g. 30,30,15,30")
    if len(steps) != workers:
        _fail(flag, f"has {len(steps)} entries for {workers} workers", f"give exactly {workers} comma-separated values")
    if any(s < 1 for s in steps):
        _fail(flag, f"{steps} has a value < 1", "every worker needs at least one inner step")
    return steps


def resolve_workers(args: argparse.Namespace) -> None:
    """Map ``--sparseloco-workers`` onto ``--num-distributed-optimizer-instances`` (before Megatron's validation)."""
    if getattr(args, "sparseloco_algorithm", None) is None:
        return
    instances = getattr(args, "num_distributed_optimizer_instances", 1)
    if args.sparseloco_workers is None:
        args.sparseloco_workers = instances
    elif instances not in (1, args.sparseloco_workers):
        _fail("workers", f"{args.sparseloco_workers} disagrees with --num-distributed-optimizer-instances {instances}",
              "give only one of them, or the same value to both")
    if args.sparseloco_workers < 1:
        _fail("workers", f"must be >= 1, got {args.sparseloco_workers}", "use a positive number of workers")
    args.num_distributed_optimizer_instances = args.sparseloco_workers


def elastic_job_batch(args: argparse.Namespace) -> None:
    """Elastic mode: ``--global-batch-size`` is the run's, as in single-job mode (all W slots together);
    each job trains G / W per iteration, so the same Megatron arguments give the same batches, data
    and LR schedule in both modes (``elastic.data``: worker I reads slot I of W). Idempotent (the run's
    value is kept as ``args.sparseloco_run_global_batch_size``). Sample-based schedules and batch-size
    ramp-up are refused: a job's iteration would not be the run's."""
    W = args.sparseloco_workers
    for dest, flag in (("train_samples", "--train-samples"), ("rampup_batch_size", "--rampup-batch-size")):
        if getattr(args, dest, None):
            raise SparseLoCoArgumentError(
                f"{flag} is not supported in elastic mode (a job's samples are its slot's, 1/W of the run's). "
                "Fix: give --train-iters (and --lr-decay-iters / --lr-warmup-iters) instead, or run without "
                "--sparseloco-lighthouse")
    if getattr(args, "sparseloco_run_global_batch_size", None) is not None:
        return
    G = getattr(args, "global_batch_size", None)
    args.sparseloco_run_global_batch_size = G
    if G is None:   # Megatron's default, micro-batch × the job's data-parallel size: the run's is W times it
        return
    if G % W != 0:
        raise SparseLoCoArgumentError(
            f"--global-batch-size {G}: in elastic mode it is the run's batch (all {W} worker slots together, as in "
            f"single-job mode), which every job trains 1/{W} of. Fix: use a multiple of --sparseloco-workers {W}, "
            f"e.g. {(G // W + 1) * W}")
    args.global_batch_size = G // W


def _check_world_layout(args: argparse.Namespace, world_size: Optional[int], strategy: Type[OuterStrategy],
                        elastic: bool = False) -> None:
    """W divides the data-parallel size, each worker holds whole EP groups, the distributed optimizer, W ≥ min.
    ``elastic``: the job is one worker of W slots (the layout is checked for one worker per job)."""
    least = strategy.capabilities.min_workers
    if args.sparseloco_workers < least:
        _fail("workers", f"{strategy.name} needs W >= {least}, got {args.sparseloco_workers}",
              f"use --sparseloco-workers {least} or more, or another --sparseloco-algorithm")
    W = 1 if elastic else args.sparseloco_workers
    if world_size is not None:
        tp = getattr(args, "tensor_model_parallel_size", 1) or 1
        pp = getattr(args, "pipeline_model_parallel_size", 1) or 1
        cp = getattr(args, "context_parallel_size", 1) or 1
        mp = tp * pp * cp
        if world_size % mp != 0:
            raise SparseLoCoArgumentError(
                f"world size {world_size} is not divisible by TP×PP×CP = {mp}. Fix: launch a multiple of {mp} ranks")
        dp = world_size // mp
        if dp % W != 0:
            _fail("workers", f"{W} workers do not divide the data-parallel size {dp} "
                  f"(world {world_size} / TP×PP×CP {mp})", f"choose W among the divisors of {dp}")
        ep = getattr(args, "expert_model_parallel_size", 1) or 1
        etp = getattr(args, "expert_tensor_parallel_size", None) or tp
        if getattr(args, "num_experts", None) and ((world_size // W) % (ep * etp * pp) != 0):
            _fail("workers", f"a worker of {world_size // W} ranks cannot hold whole expert-parallel "
                  f"groups (EP {ep} × expert-TP {etp} × PP {pp})", "choose W so that each worker holds whole EP groups")
    if W > 1 and not getattr(args, "use_distributed_optimizer", False):
        _fail("workers", f"{W} workers need Megatron's distributed optimizer (a worker is a "
              "distributed-optimizer instance)", "add --use-distributed-optimizer")


#: Megatron options the outer loop cannot be combined with, and why
INCOMPATIBLE_MEGATRON_OPTIONS = (
    ("use_megatron_fsdp", "Megatron-FSDP shards parameters differently from the distributed optimizer"),
    ("use_torch_fsdp2", "torch FSDP2 is not the distributed optimizer the outer step works on"),
    ("overlap_param_gather_with_optimizer_step", "the outer step rewrites params after the optimizer step"),
    ("calculate_per_token_loss", "per-token loss normalisation all-reduces token counts across all workers"),
    ("moe_router_enable_expert_bias", "the expert-bias update all-reduces token counts across all workers every step"),
    ("use_precision_aware_optimizer", "its fp32 master params live in the optimizer state, where the outer step "
     "cannot read or write them (the workers would never sync)"),
    ("optimizer_cpu_offload", "its fp32 master params live in the offloaded optimizer state, where the outer step "
     "cannot read or write them (the workers would never sync)"),
)


def _check_megatron_options(args: argparse.Namespace) -> None:
    for dest, why in INCOMPATIBLE_MEGATRON_OPTIONS:
        if getattr(args, dest, False):
            name = "--" + dest.replace("_", "-")
            raise SparseLoCoArgumentError(f"{name} cannot be combined with --sparseloco-algorithm ({why}). "
                                          f"Fix: drop {name}")
    fmt = getattr(args, "ckpt_format", "torch_dist")
    if (getattr(args, "save", None) or getattr(args, "load", None)) and fmt != "torch_dist":
        raise SparseLoCoArgumentError(
            f"--ckpt-format {fmt} cannot hold the per-worker outer state (Megatron saves that format's optimizer "
            "only from data-parallel rank 0, losing the other workers' error feedback). Fix: --ckpt-format torch_dist")


# ---------------------------------------------------------------------- configs from the flags
def _from_args(args: argparse.Namespace, config_class: type, given: Collection[str]) -> dict:
    """The config fields of ``config_class`` whose flag was given, read through the field → flag metadata."""
    return {spec.name: getattr(args, dest_of(flag)) for flag, spec in flagged_fields(config_class).items()
            if flag in given}


def loop_flags_from_args(args: argparse.Namespace, given: Collection[str],
                         strategy: Type[OuterStrategy]) -> OuterLoopConfig:
    """The validated ``OuterLoopConfig``: its own ``validate`` (the loop's rules, errors in flag terms),
    then what depends on the strategy and on which flags were given."""
    loop = OuterLoopConfig(**_from_args(args, OuterLoopConfig, given))
    algo, W = strategy.name, args.sparseloco_workers
    loop.workers = W
    _check_per_worker_steps(loop, given, algo, W)
    try:
        loop.validate()
    except ConfigError as exc:
        raise argument_error(exc, OuterLoopConfig, f"--sparseloco-algorithm {algo}") from None
    if loop.consistency_check_interval > 0 and algo not in takers("consistency-check-interval"):
        _fail("consistency-check-interval", f"{algo} workers legitimately differ between rounds, "
              "so θ_outer hashes never agree", f"use 0 with {algo}")
    _check_overlap(loop, given, algo)
    _check_fragments(loop, algo, getattr(args, "num_layers", None))
    return loop


def _check_per_worker_steps(loop: OuterLoopConfig, given: Collection[str], algo: str, W: int) -> None:
    """``--sparseloco-inner-steps-per-worker``: only where the strategy allows it; a list sets H = max(H_w)."""
    text = loop.inner_steps_per_worker
    if text is None:
        return
    able = takers("inner-steps-per-worker")
    if algo not in able:
        _fail("inner-steps-per-worker", f"only {', '.join(able)} {'supports' if len(able) == 1 else 'support'} "
              f"per-worker step counts, not {algo}", f"drop the flag or use --sparseloco-algorithm {' / '.join(able)}")
    if isinstance(text, str) and text.strip() == AUTO:   # H = --sparseloco-inner-steps, H_w measured
        loop.inner_steps_per_worker = AUTO
        return
    if "inner-steps" in given:
        _fail("inner-steps", "is replaced by --sparseloco-inner-steps-per-worker when that is given",
              "give only one of them")
    steps = parse_per_worker_steps(str(text), W)
    loop.inner_steps_per_worker = steps
    loop.inner_steps = max(steps)


def _check_overlap(loop: OuterLoopConfig, given: Collection[str], algo: str) -> None:
    """``--sparseloco-overlap-*``: a strategy that can delay its step, merge / α only where they act."""
    tau = loop.overlap_steps
    able = takers("overlap-steps")
    if tau > 0 and algo not in able:
        _fail("overlap-steps", f"{algo} cannot delay its outer step (its gossip rounds are not split into launch / "
              "complete)", f"use 0 with {algo}, or --sparseloco-algorithm {' / '.join(able)}")
    if tau == 0:
        stray = [f for f in ("overlap-merge", "overlap-alpha") if f in given]
        if stray:
            raise SparseLoCoArgumentError(
                f"{', '.join(option(f) for f in stray)} only {'applies' if len(stray) == 1 else 'apply'} with "
                "--sparseloco-overlap-steps >= 1. Fix: add --sparseloco-overlap-steps τ or drop them")
    if "overlap-alpha" in given and loop.overlap_merge != "lerp":
        _fail("overlap-alpha", f"only applies to --sparseloco-overlap-merge lerp, not {loop.overlap_merge}",
              "add --sparseloco-overlap-merge lerp or drop it")


def _check_fragments(loop: OuterLoopConfig, algo: str, num_layers: Optional[int]) -> None:
    """``--sparseloco-fragments P``: an algorithm with one shared θ_outer, P <= the model's layers
    (P <= H and τ·P < H are the loop config's own rules)."""
    P = loop.fragments
    if P == 1:
        return
    able = takers("fragments")
    if algo not in able:
        _fail("fragments", f"{algo} cannot sync by fragments (its gossip rounds mix whole models between "
              "neighbours; each worker keeps its own θ_outer)", f"use 1 with {algo}, or --sparseloco-algorithm "
              f"{' / '.join(able)}")
    if num_layers is not None and P > num_layers:
        _fail("fragments", f"P={P} is more than the model's --num-layers {num_layers} (a fragment is a group of "
              "whole layers)", f"use 1 <= P <= {num_layers}")


def outer_config_from_args(args: argparse.Namespace, algo: str, given: Optional[Collection[str]] = None):
    """The selected algorithm's config built from the flags given, validated by the config itself.

    ``given``: the flags the user set (default: those not None in ``args``). A flag given that the
    config has no field for is refused (unless it carries the value the algorithm implies).
    """
    strategy = outer_strategy_class(algo)
    cls = strategy.config_class
    table = flag_table()
    given = set(flags_given(args)) if given is None else set(given)
    loop_flags = set(flagged_fields(OuterLoopConfig))
    for flag in sorted(given - loop_flags - set(flagged_fields(cls)), key=list(table).index):
        _refuse_flag_not_taken(flag, getattr(args, dest_of(flag)), algo, cls, table)
    fields = _from_args(args, cls, given)
    try:
        config = cls(**fields).validate_given(fields)
        config.resolve_for_workers(args.sparseloco_workers, fields)
        config.check_workers(args.sparseloco_workers)
    except ConfigError as exc:
        raise argument_error(exc, cls, f"--sparseloco-algorithm {algo}") from None
    return config


def validate_sparseloco_args(args: argparse.Namespace, world_size: Optional[int] = None) -> argparse.Namespace:
    """Check every ``--sparseloco-*`` value and combination, and build the configs (module docstring).

    ``world_size`` defaults to ``args.world_size`` (set by Megatron's ``validate_args``). The elastic
    flags are checked first; in elastic mode the job is one worker of ``--sparseloco-workers`` slots and
    its batch is the run's divided by W (``elastic_job_batch``). Sets ``args.sparseloco_loop_config`` and
    ``args.sparseloco_outer_config`` (with the plugin off ``args`` is left unchanged); idempotent.
    """
    elastic = validate_elastic_args(args)   # first: in elastic mode W counts slots, not instances
    algo = getattr(args, "sparseloco_algorithm", None)
    if algo is None:
        _refuse_flags_without_algorithm(args)
        return args
    if algo not in available_outer_strategies():
        raise SparseLoCoArgumentError(f"--sparseloco-algorithm: unknown algorithm {algo!r}. "
                                      f"Fix: use one of {', '.join(algorithms())}")
    strategy = outer_strategy_class(algo)
    if elastic is None:
        resolve_workers(args)
    else:
        elastic_job_batch(args)
    given = set(flags_given(args))
    _check_world_layout(args, world_size if world_size is not None else getattr(args, "world_size", None), strategy,
                        elastic=elastic is not None)
    _check_megatron_options(args)
    args.sparseloco_loop_config = loop_flags_from_args(args, given, strategy)
    args.sparseloco_outer_config = outer_config_from_args(args, algo, given)
    return args


def resolved_flag_values(args: argparse.Namespace) -> Dict[str, Any]:
    """flag → the value the run uses, read from the validated configs: every loop flag, every flag of the
    algorithm's config, and the flags its algorithm implies (model averaging: ``outer-lr`` 1.0 ...)."""
    loop, config = args.sparseloco_loop_config, args.sparseloco_outer_config
    out: Dict[str, Any] = {flag: getattr(loop, spec.name) for flag, spec in flagged_fields(loop).items()}
    out.update(type(config).implied_flags)
    out.update({flag: getattr(config, spec.name) for flag, spec in flagged_fields(config).items()})
    return out


__all__ = ["INCOMPATIBLE_MEGATRON_OPTIONS", "SparseLoCoArgumentError", "elastic_job_batch", "loop_flags_from_args",
           "outer_config_from_args", "parse_per_worker_steps", "resolve_workers", "resolved_flag_values",
           "validate_sparseloco_args"]

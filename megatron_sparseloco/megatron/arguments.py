"""The ``--sparseloco-*`` flags: built from the strategies' config dataclasses, and validated by them.

Usage with megatron.training (what ``python -m megatron_sparseloco.run`` does for an unmodified
pretrain script)::

    args = parse_args(extra_args_provider=add_sparseloco_args)
    validate_sparseloco_args(args)           # before Megatron's validate_args (world size from the launcher)

One source per setting: every field of a registered strategy's config declared with
``outer.config_fields.flag_field`` is the flag ``--sparseloco-<flag>`` (its type and choices from the
field, its help from the field's docstring); several algorithms may share a flag, each with its own
default (``--sparseloco-outer-lr``: DiLoCo 0.7, SparseLoCo a rule of W and k). The loop-level flags
(workers, inner steps, timeout, consistency checks, overlap, fragments) are the flagged fields of
``loop_config.OuterLoopConfig``, whose ``validate`` holds the loop's cross-field rules. Every flag is
None on the parser, so a flag given can be told from one left unset.

``validate_sparseloco_args`` runs before any model is built (the plugin calls it before Megatron's
own ``validate_args``): the Megatron-layout checks (world size, data-parallel divisibility, Megatron
options we cannot combine with, checkpoint format),
then the selected algorithm's config is built from the flags given and runs its own
``validate_given``; a ``ConfigError`` becomes a ``SparseLoCoArgumentError`` that names the flag
and the fix. A flag the algorithm's config has no field for is refused, naming the algorithms
that take it. Finally every flag the algorithm uses is set in place to its resolved value, and
``--sparseloco-workers W`` is mapped onto Megatron's ``--num-distributed-optimizer-instances W``:
a DiLoCo worker *is* a distributed-optimizer instance (see ``megatron_sparseloco.megatron.optimizer``).
"""
from __future__ import annotations

import argparse
from typing import Collection, Dict, List, Mapping, Optional, Set, Type

from megatron_sparseloco.megatron.loop_config import AUTO, OuterLoopConfig
from megatron_sparseloco.outer.base import OuterConfig, OuterStrategy
from megatron_sparseloco.outer.config_fields import (ConfigError, FieldSpec, field_specs, flagged_fields,
                                                     render_refs)
from megatron_sparseloco.outer.registry import available_outer_strategies, outer_strategy_class, outer_strategy_classes

#: owner of the loop-level flags in ``flag_table`` (the other owners are algorithm names)
LOOP = "loop"


#: the loop-level flags are the flagged fields of the outer loop's one config (``loop_config``)
LoopFlags = OuterLoopConfig


class SparseLoCoArgumentError(ValueError):
    """A bad ``--sparseloco-*`` value or combination; the message names the flag and the fix."""


def algorithms() -> List[str]:
    """The registered algorithm names, in registration order."""
    return list(outer_strategy_classes())


ALGORITHMS = tuple(algorithms())


# ---------------------------------------------------------------------- flag names and the table
def option(flag: str) -> str:
    return "--sparseloco-" + flag


def dest_of(flag: str) -> str:
    return "sparseloco_" + flag.replace("-", "_")


def _loop_specs() -> Dict[str, FieldSpec]:
    return flagged_fields(OuterLoopConfig)


def flag_table() -> Dict[str, Dict[str, FieldSpec]]:
    """flag → {owner: its field spec}; owners: ``LOOP``, then each registered algorithm in order."""
    table: Dict[str, Dict[str, FieldSpec]] = {}
    for flag, spec in _loop_specs().items():
        table.setdefault(flag, {})[LOOP] = spec
    for name, cls in outer_strategy_classes().items():
        for flag, spec in flagged_fields(cls.config_class).items():
            table.setdefault(flag, {})[name] = spec
    return table


#: loop flags that only some strategies take: flag → the ``Capabilities`` field that allows it
LOOP_FLAG_NEEDS = {"inner-steps-per-worker": "per_worker_inner_steps",
                   "consistency-check-interval": "identical_across_workers",
                   "overlap-steps": "supports_overlap", "overlap-merge": "supports_overlap",
                   "overlap-alpha": "supports_overlap",
                   # fragments sync parts of one shared θ_outer; gossip's workers hold their own
                   "fragments": "identical_across_workers"}


def takers(flag: str, table: Optional[Dict[str, Dict[str, FieldSpec]]] = None) -> List[str]:
    """The algorithms with a config field for ``flag`` (for a loop flag: those whose strategy allows it)."""
    owners = (table or flag_table()).get(flag, {})
    if LOOP in owners:
        needs = LOOP_FLAG_NEEDS.get(flag)
        return [a for a, c in outer_strategy_classes().items() if needs is None or getattr(c.capabilities, needs)]
    return list(owners)


def shared_help(owners: Mapping[str, FieldSpec]) -> str:
    """A flag's help: its field's docstring; where the algorithms that share the flag describe it differently,
    each description after the algorithms it belongs to ("diloco/sparseloco: ... gasloc: ...")."""
    owners_of: Dict[str, List[str]] = {}
    for owner, spec in owners.items():
        owners_of.setdefault(spec.help, []).append(owner)
    if len(owners_of) == 1:
        return next(iter(owners_of))
    return " ".join(f"{'/'.join(names)}: {text}" for text, names in owners_of.items())


def argparse_help(text: str) -> str:
    """``text`` as an argparse help string (argparse reads ``%`` as a format: ``1.56 %`` must be ``%%``)."""
    return text.replace("%", "%%")


def _argparse_kwargs(flag: str, owners: Mapping[str, FieldSpec]) -> dict:
    specs = list(owners.values())
    first = specs[0]
    for s in specs[1:]:
        if (s.type, s.store_true) != (first.type, first.store_true):
            raise TypeError(f"{option(flag)}: config fields {first.name} and {s.name} declare it with different "
                            f"types ({first.type.__name__}, {s.type.__name__}) or kinds of flag")
    help_text = argparse_help(shared_help(owners))
    if first.type is bool:
        action = "store_true" if first.store_true else argparse.BooleanOptionalAction
        return dict(action=action, default=None, help=help_text)
    choices: List = []
    for s in specs:
        choices += [c for c in (s.choices or ()) if c not in choices]
    kw: Dict[str, object] = dict(type=first.type, default=None, help=help_text)
    if choices and all(s.choices for s in specs):
        kw["choices"] = sorted(choices) if first.type in (int, float) else choices
    return kw


def add_sparseloco_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``--sparseloco-*`` group and the elastic flags (``elastic.config``) to a Megatron
    argument parser (an ``extra_args_provider``).

    The flags are the union of ``OuterLoopConfig``'s and every registered config's flagged fields, read
    when called (a strategy registered later shows up on the next parser). Idempotent: a parser
    that already has the group (the installed plugin adds it) is returned as is.
    """
    if any(a.dest == "sparseloco_algorithm" for a in parser._actions):
        return parser
    g = parser.add_argument_group(title="sparseloco",
                                  description="DiLoCo / SparseLoCo / GASLoC outer steps across data-parallel workers")
    g.add_argument("--sparseloco-algorithm", choices=algorithms(), default=None,
                   help="Outer algorithm. Unset: the plugin is off and Megatron trains as usual.")
    for flag, owners in flag_table().items():
        g.add_argument(option(flag), dest=dest_of(flag), **_argparse_kwargs(flag, owners))
    from megatron_sparseloco.elastic.config import add_elastic_args  # (it imports this module)
    return add_elastic_args(parser)


# ---------------------------------------------------------------------- errors
def _fail(flag: str, problem: str, fix: str) -> None:
    raise SparseLoCoArgumentError(f"{option(flag)}: {problem}. Fix: {fix}")


def _render(field_to_flag: Dict[str, FieldSpec]):
    """``config_fields.render_refs`` callback: a backticked field (``name=value``) as its flag."""

    def render(name: str, value: Optional[str]) -> Optional[str]:
        spec = field_to_flag.get(name)
        if spec is None:
            return None
        assert spec.flag is not None, f"{name}: field_to_flag holds flagged fields only"
        opt = option(spec.flag)
        if value is None:
            return opt
        value = value.strip("'\"")
        if spec.type is bool:
            on = value == "True"
            return opt if on or spec.store_true else "--no-" + opt[2:]
        return f"{opt} {value}"

    return render


def argument_error(exc: ConfigError, config_class: type, algo: str) -> SparseLoCoArgumentError:
    """A config's ``ConfigError`` in flag terms: the flag of the offending field, the fix with flags."""
    by_field = {s.name: s for s in field_specs(config_class) if s.flag is not None}
    render = _render(by_field)
    spec = by_field.get(exc.field) if exc.field else None
    where = option(spec.flag) if spec is not None and spec.flag is not None else f"--sparseloco-algorithm {algo}"
    fix = render_refs(exc.fix, render) if exc.fix else "change the value"
    return SparseLoCoArgumentError(f"{where}: {render_refs(exc.problem, render)}. Fix: {fix}")


# ---------------------------------------------------------------------- given flags
def _given(args: argparse.Namespace) -> Set[str]:
    """The flags the user gave (every ``--sparseloco-*`` flag is None on the parser when unset)."""
    return {flag for flag in flag_table() if getattr(args, dest_of(flag), None) is not None}


def _refuse_flags_without_algorithm(args: argparse.Namespace) -> None:
    stray = sorted(_given(args), key=list(flag_table()).index)
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
        raise argument_error(exc, OuterLoopConfig, algo) from None
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
    given = _given(args) if given is None else set(given)
    loop_flags = set(_loop_specs())
    for flag in sorted(given - loop_flags - set(flagged_fields(cls)), key=list(table).index):
        _refuse_flag_not_taken(flag, getattr(args, dest_of(flag)), algo, cls, table)
    fields = _from_args(args, cls, given)
    try:
        config = cls(**fields).validate_given(fields)
        ruled = config.resolve_for_workers(args.sparseloco_workers, fields)
        config.check_workers(args.sparseloco_workers)
    except ConfigError as exc:
        raise argument_error(exc, cls, algo) from None
    #: config field → the rule its default came from (shown in the start-up block)
    args.sparseloco_defaults_by_rule = {name: cls.default_rules[name][0] for name in ruled}
    return config


def _store_resolved(args: argparse.Namespace, loop: OuterLoopConfig, config) -> None:
    """Every flag the algorithm uses set to its resolved value (implied ones too); the others stay None."""
    for flag, spec in _loop_specs().items():
        setattr(args, dest_of(flag), getattr(loop, spec.name))
    for flag, value in type(config).implied_flags.items():
        setattr(args, dest_of(flag), value)
    for flag, spec in flagged_fields(config).items():
        setattr(args, dest_of(flag), getattr(config, spec.name))


def validate_sparseloco_args(args: argparse.Namespace, world_size: Optional[int] = None) -> argparse.Namespace:
    """Check every ``--sparseloco-*`` value and combination; resolve defaults in place.

    ``world_size`` defaults to ``args.world_size`` (set by Megatron's ``validate_args``). The elastic
    flags are checked first (``elastic.config.validate_elastic_args``); in elastic mode the job is one
    worker of ``--sparseloco-workers`` slots and its batch is the run's divided by W (``elastic_job_batch``).
    """
    from megatron_sparseloco.elastic.config import validate_elastic_args  # (it imports this module)
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
    given = _given(args)
    _check_world_layout(args, world_size if world_size is not None else getattr(args, "world_size", None), strategy,
                        elastic=elastic is not None)
    _check_megatron_options(args)
    loop = loop_flags_from_args(args, given, strategy)
    config = outer_config_from_args(args, algo, given)
    _store_resolved(args, loop, config)
    return args

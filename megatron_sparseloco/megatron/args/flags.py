"""The ``--sparseloco-*`` flags: one per flagged config field, on Megatron's argument parser.

Usage with megatron.training (what ``python -m megatron_sparseloco.run`` does for an unmodified
pretrain script)::

    args = parse_args(extra_args_provider=add_sparseloco_args)
    validate_sparseloco_args(args)           # ``args/validation.py``: the configs, built once

One source per setting: every field of a registered strategy's config declared with
``outer.config_fields.flag_field`` is the flag ``--sparseloco-<flag>`` (its type and choices from the
field, its help from the field's docstring); several algorithms may share a flag, each with its own
default (``--sparseloco-outer-lr``: DiLoCo 0.7, SparseLoCo a rule of W and k). The loop-level flags
(workers, inner steps, timeout, consistency checks, overlap, fragments) are the flagged fields of
``args.loop_config.OuterLoopConfig``; the elastic ones those of ``elastic.config.ElasticConfig``.
Every flag is None on the parser, so a flag given can be told from one left unset. Flag names, dests
and the error type come from ``outer.flags``.
"""
from __future__ import annotations

import argparse
from typing import Dict, List, Mapping, Optional

from megatron_sparseloco.elastic.config import add_elastic_args
from megatron_sparseloco.megatron.args.loop_config import OuterLoopConfig
from megatron_sparseloco.outer.config_fields import FieldSpec, flagged_fields
from megatron_sparseloco.outer.flags import SparseLoCoArgumentError, argparse_help, dest_of, option
from megatron_sparseloco.outer.registry import outer_strategy_classes

#: owner of the loop-level flags in ``flag_table`` (the other owners are algorithm names)
LOOP = "loop"


#: the loop-level flags are the flagged fields of the outer loop's one config (``loop_config``)
LoopFlags = OuterLoopConfig


def algorithms() -> List[str]:
    """The registered algorithm names, in registration order."""
    return list(outer_strategy_classes())


ALGORITHMS = tuple(algorithms())


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
    return add_elastic_args(parser)


def given(args: argparse.Namespace) -> List[str]:
    """The ``--sparseloco-*`` flags of ``flag_table`` the user gave, in table order."""
    return [flag for flag in flag_table() if getattr(args, dest_of(flag), None) is not None]


__all__ = ["ALGORITHMS", "LOOP", "LOOP_FLAG_NEEDS", "SparseLoCoArgumentError", "add_sparseloco_args", "algorithms",
           "dest_of", "flag_table", "given", "option", "shared_help", "takers"]

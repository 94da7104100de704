"""The command-line face of the config fields: a field's flag, its argparse dest and help, and its errors.

A config field declared with ``config_fields.flag_field(flag="outer-lr")`` is the command-line flag
``--sparseloco-outer-lr`` (``option``), stored on an ``argparse.Namespace`` as ``sparseloco_outer_lr``
(``dest_of``). Every layer that turns flags into a config (the outer loop's and the strategies' in
``megatron/args``, the elastic one in ``elastic/config.py``) uses these helpers, and renders a config's
``ConfigError`` in flag terms through the one renderer here (``argument_error``): the offending field's
flag first, then the problem and the fix with every backticked field reference written as its flag::

    ConfigError("lr must be > 0, got -1", "lr", "use e.g. the default `lr=0.7`")
        → "--sparseloco-outer-lr: lr must be > 0, got -1. Fix: use e.g. the default --sparseloco-outer-lr 0.7"

Leaf module: it knows argparse's conventions, nothing of Megatron.
"""
from __future__ import annotations

import argparse
from typing import Collection, Dict, Optional, Set

from megatron_sparseloco.outer.config_fields import ConfigError, FieldSpec, field_specs, render_refs


class SparseLoCoArgumentError(ValueError):
    """A bad ``--sparseloco-*`` value or combination; the message names the flag and the fix."""


def option(flag: str) -> str:
    """``outer-lr`` → ``--sparseloco-outer-lr``."""
    return "--sparseloco-" + flag


def dest_of(flag: str) -> str:
    """``outer-lr`` → ``sparseloco_outer_lr``, the flag's attribute on a parsed Namespace."""
    return "sparseloco_" + flag.replace("-", "_")


def argparse_help(text: str) -> str:
    """``text`` as an argparse help string (argparse reads ``%`` as a format: ``1.56 %`` must be ``%%``)."""
    return text.replace("%", "%%")


def flag_error(flag: str, problem: str, fix: str) -> SparseLoCoArgumentError:
    """``--sparseloco-<flag>: <problem>. Fix: <fix>``."""
    return SparseLoCoArgumentError(f"{option(flag)}: {problem}. Fix: {fix}")


def given_flags(args: argparse.Namespace, flags: Collection[str]) -> Set[str]:
    """The ``flags`` given on the command line (every ``--sparseloco-*`` flag is None on the parser when unset)."""
    return {flag for flag in flags if getattr(args, dest_of(flag), None) is not None}


def field_refs_as_flags(field_to_flag: Dict[str, FieldSpec]):
    """``config_fields.render_refs`` callback: a backticked field (``name`` / ``name=value``) as its flag."""

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


def argument_error(exc: ConfigError, config_class: type, where: str) -> SparseLoCoArgumentError:
    """A config's ``ConfigError`` in flag terms: the flag of the offending field (``where`` when no flagged
    field is to blame), the problem and the fix with field references written as flags."""
    by_field = {s.name: s for s in field_specs(config_class) if s.flag is not None}
    render = field_refs_as_flags(by_field)
    spec = by_field.get(exc.field) if exc.field else None
    head = option(spec.flag) if spec is not None and spec.flag is not None else where
    fix = render_refs(exc.fix, render) if exc.fix else "change the value"
    return SparseLoCoArgumentError(f"{head}: {render_refs(exc.problem, render)}. Fix: {fix}")


__all__ = ["SparseLoCoArgumentError", "argparse_help", "argument_error", "dest_of", "field_refs_as_flags",
           "flag_error", "given_flags", "option"]

"""The --sparseloco-* flags come from the config dataclasses: one source for name, type, default, range.

* a toy outer algorithm defined here (its config with one flagged field + a registry entry) gets its
  flag on a fresh parser, has bad values refused by its own ``validate()`` before any model, and its
  value reaches the strategy;
* for EVERY flagged field of every registered config (the table is generated from the metadata, so
  a new field is covered without editing this file): an out-of-range value, a value outside its
  choices, a value of the wrong type, the field given in a mode that ignores it, and the flag given
  to an algorithm without the field are all refused by the flag validation, naming the flag;
* the defaults resolved per algorithm are the config classes' defaults.
"""
import argparse
from dataclasses import dataclass
from typing import List

import pytest
import torch

from megatron_sparseloco.megatron.args import (LOOP, LoopFlags, SparseLoCoArgumentError, add_sparseloco_args,
                                                    dest_of, flag_table, option, shared_help, takers,
                                                    resolved_flag_values, validate_sparseloco_args)
from megatron_sparseloco.outer.base import OuterConfig, OuterStepStats, OuterStrategy
from megatron_sparseloco.outer.config_fields import FieldSpec, field_specs, flag_field, flagged_fields
from megatron_sparseloco.outer.registry import (outer_strategy_classes, register_outer_strategy, strategy_factory,
                                                unregister_outer_strategy)

WORLD = 4
BASE = ["--sparseloco-workers", "2"]


def _args(argv: List[str], **set_after) -> argparse.Namespace:
    """Parse ``argv`` with a fresh parser (the flags as registered now); ``set_after``: dest → value
    put into the namespace afterwards (a value argparse itself would refuse, e.g. of the wrong type)."""
    args = add_sparseloco_args(argparse.ArgumentParser()).parse_args(argv)
    args.use_distributed_optimizer = True
    for dest, value in set_after.items():
        setattr(args, dest, value)
    return args


def _refused(args, flag: str) -> str:
    with pytest.raises(SparseLoCoArgumentError) as err:
        validate_sparseloco_args(args, world_size=WORLD)
    msg = str(err.value)
    assert msg.startswith(option(flag)) and "Fix:" in msg, msg
    return msg


# ---------------------------------------------------------------------- (a) a toy algorithm
@dataclass
class ToyConfig(OuterConfig):
    """The toy outer step: θ_outer ← θ_outer − gain·Δ̄ (one worker: Δ̄ = Δ)."""

    gain: float = flag_field(0.5, flag="toy-gain", low=0.0, high=1.0, low_open=True)
    """Toy outer step: the gain g in θ_outer ← θ_outer − g·Δ,
    in (0, 1]."""


class Toy(OuterStrategy):
    name = "toy"
    config_class = ToyConfig

    def _outer_step(self, stats: OuterStepStats, nonfinite_tensor) -> None:
        for s, e in self.buckets():
            self.anchor[s:e].sub_(self.pseudo_gradient(s, e), alpha=self.config.gain)
            self.write_back(s, e)


@pytest.fixture
def toy():
    register_outer_strategy("toy")(Toy)
    try:
        yield Toy
    finally:
        unregister_outer_strategy("toy")
    assert "toy" not in outer_strategy_classes()


def test_toy_algorithm_flag_appears_validates_and_reaches_the_strategy(toy):
    parser = add_sparseloco_args(argparse.ArgumentParser())
    assert "--sparseloco-toy-gain" in parser.format_help()
    gain = next(a for a in parser._actions if a.dest == "sparseloco_toy_gain")
    assert gain.help == "Toy outer step: the gain g in θ_outer ← θ_outer − g·Δ, in (0, 1]."   # the docstring
    assert "toy" in next(a for a in parser._actions if a.dest == "sparseloco_algorithm").choices

    args = validate_sparseloco_args(_args(["--sparseloco-algorithm", "toy", "--sparseloco-toy-gain", "0.25"]), WORLD)
    strategy = strategy_factory("toy", args.sparseloco_outer_config)([torch.full((8,), 2.0)], None, ["w"])
    assert isinstance(strategy, Toy) and strategy.config.gain == 0.25
    strategy.params.tensors[0].fill_(1.0)        # Δ = 2 − 1 = 1
    strategy.step()
    assert torch.allclose(strategy.anchor, torch.full((8,), 1.75))

    msg = _refused(_args(["--sparseloco-algorithm", "toy", "--sparseloco-toy-gain", "1.5"]), "toy-gain")
    assert "(0, 1]" in msg
    msg = _refused(_args(["--sparseloco-algorithm", "diloco", "--sparseloco-toy-gain", "0.25"]), "toy-gain")
    assert "toy" in msg                          # names the algorithm that takes it
    # its default is the config's
    args = validate_sparseloco_args(_args(["--sparseloco-algorithm", "toy"]), WORLD)
    assert args.sparseloco_outer_config.gain == ToyConfig().gain and args.sparseloco_toy_gain is None


def test_toy_flag_gone_once_unregistered(toy):
    unregister_outer_strategy("toy")
    assert "--sparseloco-toy-gain" not in add_sparseloco_args(argparse.ArgumentParser()).format_help()


# ---------------------------------------------------------------------- (b) every field's invalid values
def _mode_argv(algo: str, spec: FieldSpec, specs) -> List[str]:
    """The flags that put ``algo``'s config in the mode where ``spec`` applies (its ``requires``)."""
    out = []
    for other, needed in spec.requires.items():
        flag = next(f for f, s in specs.items() if s.name == other)
        if isinstance(needed, bool):
            out.append(option(flag) if needed else "--no-" + option(flag)[2:])
        else:
            out += [option(flag), str(needed)]
    return out


def _bad_values(spec: FieldSpec, union_choices) -> List[tuple]:
    """(label, value) pairs ``spec`` must refuse, from its metadata alone."""
    out = []
    if spec.low is not None:
        out.append(("below range", spec.low if spec.low_open else spec.type(spec.low - 1)))
    if spec.high is not None:
        out.append(("above range", spec.high if spec.high_open else spec.type(spec.high + 1)))
    if spec.choices is not None:
        inside_union = [c for c in union_choices if c not in spec.choices]
        out.append(("not a choice", inside_union[0] if inside_union else
                    ("no-such-choice" if spec.type is str else max(spec.choices) + 1)))
    wrong_type = {bool: "yes", int: 2.5, float: "fast", str: 3}[spec.type]
    out.append(("wrong type", wrong_type))
    return out


def _field_cases():
    cases = []
    table = flag_table()
    for algo, cls in outer_strategy_classes().items():
        specs = flagged_fields(cls.config_class)
        for flag, spec in specs.items():
            union = [c for s in table[flag].values() for c in (s.choices or ())]
            mode = _mode_argv(algo, spec, specs)
            for label, value in _bad_values(spec, union):
                cases.append(pytest.param(algo, flag, mode, value, id=f"{algo}-{flag}-{label}"))
    for flag, spec in flagged_fields(LoopFlags).items():
        if flag == "workers":
            continue  # resolved from Megatron's instances first; tests/test_arguments.py covers it
        for label, value in _bad_values(spec, ()):
            if spec.type is str and label == "wrong type":
                continue
            cases.append(pytest.param("diloco", flag, [], value, id=f"loop-{flag}-{label}"))
    return cases


@pytest.mark.parametrize("algo,flag,mode,value", _field_cases())
def test_every_field_refuses_its_invalid_values_naming_the_flag(algo, flag, mode, value):
    args = _args(["--sparseloco-algorithm", algo, *BASE, *mode], **{dest_of(flag): value})
    _refused(args, flag)


def _mode_cases():
    """A field given while its config is in a mode that ignores it (``requires`` unmet)."""
    cases = []
    for algo, cls in outer_strategy_classes().items():
        specs = flagged_fields(cls.config_class)
        for flag, spec in specs.items():
            for other, needed in spec.requires.items():
                other_flag, other_spec = next((f, s) for f, s in specs.items() if s.name == other)
                wrong = (not needed) if isinstance(needed, bool) else next(c for c in other_spec.choices if c != needed)
                cases.append(pytest.param(algo, flag, spec.default, other_flag, wrong, id=f"{algo}-{flag}"))
    assert cases
    return cases


@pytest.mark.parametrize("algo,flag,value,other_flag,wrong", _mode_cases())
def test_field_given_in_a_mode_that_ignores_it_is_refused(algo, flag, value, other_flag, wrong):
    args = _args(["--sparseloco-algorithm", algo, *BASE], **{dest_of(flag): value, dest_of(other_flag): wrong})
    _refused(args, flag)


def _wrong_algorithm_cases():
    cases = []
    table = flag_table()
    for flag, owners in table.items():
        if LOOP in owners:
            continue
        valid = next(iter(owners.values())).default
        for algo, cls in outer_strategy_classes().items():
            if algo in owners:
                continue
            implied = cls.config_class.implied_flags
            value = valid
            if flag in implied:   # accepted with the implied value only
                value = {bool: lambda v: not v, int: lambda v: v + 1, float: lambda v: v + 0.5}[type(implied[flag])](implied[flag])
            cases.append(pytest.param(algo, flag, value, id=f"{algo}-{flag}"))
    return cases


@pytest.mark.parametrize("algo,flag,value", _wrong_algorithm_cases())
def test_flag_of_another_algorithm_is_refused_naming_who_takes_it(algo, flag, value):
    msg = _refused(_args(["--sparseloco-algorithm", algo, *BASE], **{dest_of(flag): value}), flag)
    assert all(a in msg for a in takers(flag)), msg


def test_implied_value_is_accepted():
    for algo, cls in outer_strategy_classes().items():
        for flag, value in cls.config_class.implied_flags.items():
            args = validate_sparseloco_args(_args(["--sparseloco-algorithm", algo, *BASE],
                                                  **{dest_of(flag): value}), WORLD)
            assert getattr(args, dest_of(flag)) == value


def test_gossip_compress_with_16_bit_values_is_refused_before_the_model():
    """The drift bug: passed flag validation, then failed in GASLoCConfig.validate once the model existed."""
    args = _args(["--sparseloco-algorithm", "gasloc", *BASE, "--sparseloco-gossip-compress",
                  "--sparseloco-value-bits", "16"])
    msg = _refused(args, "value-bits")
    assert "16" in msg and "32" in msg


# ---------------------------------------------------------------------- (c) defaults per algorithm
@pytest.mark.parametrize("algo", list(outer_strategy_classes()))
def test_defaults_resolved_per_algorithm_are_the_config_defaults(algo):
    cls = outer_strategy_classes()[algo].config_class
    args = validate_sparseloco_args(_args(["--sparseloco-algorithm", algo, *BASE]), WORLD)
    default = cls()
    default.resolve_for_workers(args.sparseloco_workers, ())   # defaults that depend on W (sparseloco: lr)
    resolved = resolved_flag_values(args)
    for flag, spec in flagged_fields(cls).items():
        assert resolved[flag] == getattr(default, spec.name), flag
    for flag, value in cls.implied_flags.items():
        assert resolved[flag] == value, flag
    for flag, spec in flagged_fields(LoopFlags).items():
        if flag != "workers":
            assert resolved[flag] == spec.default, flag
    for flag, owners in flag_table().items():   # flags the algorithm neither has nor implies: not part of the run
        if algo not in owners and LOOP not in owners and flag not in cls.implied_flags:
            assert flag not in resolved, flag
    for flag in set(flag_table()) - {"workers"}:   # the flags on args stay as given: only --sparseloco-workers
        assert getattr(args, dest_of(flag)) is None, flag
    strategy = strategy_factory(algo, args.sparseloco_outer_config)([torch.zeros(8192)], None, ["w"])
    assert strategy.config == default


def test_shared_flags_declare_one_type():
    """A flag shared by several configs (e.g. --sparseloco-outer-lr) has one type and kind, several defaults."""
    for flag, owners in flag_table().items():
        assert len({(s.type, s.store_true) for s in owners.values()}) == 1, flag


# ---------------------------------------------------------------------- the docstring is the help
def test_a_field_without_a_docstring_is_refused_naming_it():
    @dataclass
    class Undocumented(OuterConfig):
        gain: float = flag_field(0.5, flag="toy-gain")

    with pytest.raises(TypeError, match=r"Undocumented\.gain: a config field needs a docstring"):
        list(field_specs(Undocumented))


def test_a_class_docstring_overrides_a_helpers_doc_and_shared_flags_name_their_owners():
    @dataclass
    class Plain(OuterConfig):
        gain: float = flag_field(0.5, flag="toy-gain", doc="The helper's ``gain``\n   description.")

    @dataclass
    class Own(Plain):
        gain: float = flag_field(0.25, flag="toy-gain", doc="The helper's ``gain`` description.")
        """This config's
        own meaning."""

    @dataclass
    class Again(Own):
        gain: float = flag_field(0.75, flag="toy-gain", doc="Declared again, with the helper's description.")

    plain, own = flagged_fields(Plain)["toy-gain"], flagged_fields(Own)["toy-gain"]
    assert flagged_fields(Again)["toy-gain"].help == "Declared again, with the helper's description."
    assert plain.help == "The helper's gain description."       # literal marks dropped, one line
    assert own.help == "This config's own meaning."
    assert shared_help({"a": plain, "b": plain}) == plain.help
    assert shared_help({"a": plain, "b": own, "c": plain}) == (
        "a/c: The helper's gain description. b: This config's own meaning.")


def test_every_flag_has_help_from_its_fields():
    """Every --sparseloco-* flag's help is its fields' description (shared flags: each owner's)."""
    for flag, owners in flag_table().items():
        assert shared_help(owners) and all(s.help for s in owners.values()), flag


# ---------------------------------------------------------------------- explicit forwarding
def test_outer_loop_optimizer_forwards_only_named_members():
    from megatron_sparseloco.megatron.optimizer import FORWARDED_ATTRIBUTES, FORWARDED_METHODS, OuterLoopOptimizer

    class Inner:
        param_groups = [{"lr": 1.0}]
        is_stub_optimizer = False

        def get_loss_scale(self):
            return torch.tensor(1.0)

        def zero_grad(self, set_to_none=True):
            self.zeroed = set_to_none

        def secret(self):
            return "inner"

    wrapper = OuterLoopOptimizer.__new__(OuterLoopOptimizer)
    wrapper.optimizer = Inner()
    assert {"zero_grad", "get_loss_scale", "reload_model_params"} <= set(FORWARDED_METHODS)
    assert {"param_groups", "is_stub_optimizer"} <= set(FORWARDED_ATTRIBUTES)
    wrapper.zero_grad(set_to_none=False)
    assert wrapper.optimizer.zeroed is False and wrapper.get_loss_scale().item() == 1.0
    assert wrapper.param_groups is Inner.param_groups and wrapper.is_stub_optimizer is False
    with pytest.raises(AttributeError, match=r"'secret'.*FORWARDED_METHODS.*megatron/optimizer\.py"):
        wrapper.secret
    assert not hasattr(wrapper, "chained_optimizers")   # forwarded, but the wrapped one is not chained

"""Build an outer strategy from its name and config fields.

    strategy = build_outer_strategy("diloco", params, group, lr=0.7, momentum=0.9)

Strategies register themselves with the decorator::

    @register_outer_strategy("gasloc")
    class GASLoC(OuterStrategy):
        config_class = GASLoCConfig
        ...

and their module is listed in ``_STRATEGY_MODULES`` so that ``build_outer_strategy`` imports it
on first use (a module listed there but absent from the tree is skipped, so a strategy can be
added or removed without touching this file twice).
"""
from __future__ import annotations

import dataclasses
import importlib
from typing import Dict, List, Optional, Sequence, Type

import torch
import torch.distributed as dist

from megatron_sparseloco.outer.base import ConfigError, OuterConfig, OuterStrategy

_REGISTRY: Dict[str, Type[OuterStrategy]] = {}

#: modules that define (and register) strategies; imported lazily by ``build_outer_strategy``
_STRATEGY_MODULES = (
    "megatron_sparseloco.outer.averaging",
    "megatron_sparseloco.outer.diloco",
    "megatron_sparseloco.outer.sparseloco",
    "megatron_sparseloco.outer.gasloc",
)


def register_outer_strategy(name: str):
    """Class decorator: make ``cls`` buildable as ``name``. ``cls.config_class`` must be set."""

    def deco(cls: Type[OuterStrategy]) -> Type[OuterStrategy]:
        config_class = getattr(cls, "config_class", None)
        if config_class is None or not (isinstance(config_class, type) and issubclass(config_class, OuterConfig)):
            raise TypeError(f"outer strategy {cls.__name__} needs a config_class deriving from OuterConfig")
        other = _REGISTRY.get(name)
        if other is not None and (other.__module__, other.__qualname__) != (cls.__module__, cls.__qualname__):
            raise ValueError(f"outer strategy name {name!r} is taken by {other.__module__}.{other.__qualname__}")
        _REGISTRY[name] = cls
        return cls

    return deco


def _import_strategies() -> None:
    for mod in _STRATEGY_MODULES:
        try:
            importlib.import_module(mod)
        except ModuleNotFoundError as exc:
            if exc.name != mod:  # the module exists but one of its imports is missing: a real error
                raise


def unregister_outer_strategy(name: str) -> None:
    """Forget strategy ``name`` (for tests that register a toy strategy); unknown names are ignored."""
    _REGISTRY.pop(name, None)


def outer_strategy_classes() -> Dict[str, Type[OuterStrategy]]:
    """name → strategy class, in registration order (the order flags and help list them in)."""
    _import_strategies()
    return dict(_REGISTRY)


def available_outer_strategies() -> List[str]:
    """Names ``build_outer_strategy`` accepts, sorted."""
    _import_strategies()
    return sorted(_REGISTRY)


def outer_strategy_class(name: str) -> Type[OuterStrategy]:
    _import_strategies()
    if name not in _REGISTRY:
        raise ConfigError(f"unknown outer strategy {name!r}; valid names: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name]


def build_outer_config(name: str, **config_fields) -> OuterConfig:
    """The validated config of strategy ``name``; unknown fields raise ConfigError listing the valid ones."""
    cls = outer_strategy_class(name)
    valid = [f.name for f in dataclasses.fields(cls.config_class)]
    unknown = sorted(set(config_fields) - set(valid))
    if unknown:
        raise ConfigError(f"outer strategy {name!r} has no config field(s) {unknown}; valid fields: {valid}")
    return cls.config_class(**config_fields).validate()


def strategy_factory(name: str, config: OuterConfig):
    """``(params, group, names, slices) -> strategy``: strategy ``name`` on ``config``, an already validated
    config object built once (the Megatron integration's, from the flags) and shared by every strategy it
    builds (one per member optimizer and fragment)."""
    cls = outer_strategy_class(name)
    if not isinstance(config, cls.config_class):
        raise TypeError(f"outer strategy {name!r} takes a {cls.config_class.__name__}, got {type(config).__name__}")

    def build(params: Sequence[torch.Tensor], group: Optional[dist.ProcessGroup],
              names: Optional[Sequence[str]] = None, slices=None) -> OuterStrategy:
        return cls(params, group, config, names=names, slices=slices)

    return build


def build_outer_strategy(name: str, params: Sequence[torch.Tensor], group: Optional[dist.ProcessGroup],
                         names: Optional[Sequence[str]] = None, slices=None, **config_fields) -> OuterStrategy:
    """Construct strategy ``name`` on ``params`` with ``config_class(**config_fields)``.

    ``slices`` (optional): one ``compress.segments.TensorSlice`` per tensor, the model parameter
    each is a piece of (per-tensor compression reads the shapes); default: whole tensors.
    """
    config = build_outer_config(name, **config_fields)
    return outer_strategy_class(name)(params, group, config, names=names, slices=slices)

"""Outer optimisers on flat fp32 shards, independent of Megatron."""
from megatron_sparseloco.outer.base import (  # noqa: F401
    ConfigError,
    FlatShards,
    NonFiniteError,
    OuterConfig,
    OuterStepStats,
    OuterStrategy,
)

"""Outer optimisers on flat fp32 shards, independent of Megatron."""
from megatron_sparseloco.outer.base import (  # noqa: F401
    ConfigError,
    FlatShards,
    NonFiniteError,
    OuterConfig,
    OuterStepStats,
    OuterStrategy,
)
from megatron_sparseloco.outer.registry import (  # noqa: F401
    available_outer_strategies,
    build_outer_config,
    build_outer_strategy,
    register_outer_strategy,
)
from megatron_sparseloco.outer.averaging import AveragingConfig, ModelAveraging  # noqa: F401
from megatron_sparseloco.outer.diloco import DiLoCo, DiLoCoConfig  # noqa: F401
from megatron_sparseloco.outer.sparseloco import SparseLoCo, SparseLoCoConfig  # noqa: F401

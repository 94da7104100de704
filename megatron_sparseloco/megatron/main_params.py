"""Find the fp32 main parameters this rank owns in a megatron-core optimizer.

The outer step works on the optimizer's fp32 master copy (the inner optimizer's truth), then the
usual main → model copy and in-worker param all-gather spread it:

- ``DistributedOptimizer``: ``shard_fp32_from_float16_groups`` (fp32 copies of bf16/fp16 shards)
  and ``shard_fp32_groups`` (views of fp32 model params): the shard this rank owns.
- ``Float16OptimizerWithFloat16Params``: ``fp32_from_float16_groups`` and ``fp32_from_fp32_groups``.
- ``FP32Optimizer``: the params of its torch optimizer.
- ``ChainedOptimizer`` (dense + expert, or per model chunk): each member separately.

The same shard index in every worker covers the same parameter elements (the layouts are
identical), which is what makes a shard-wise outer step correct.

Each shard also records its model parameter and the flat element range ``[start, end)`` of that
parameter it holds, and the optimizer records every model parameter it shards and the group it
shards them over: checkpoints use these to store the state in model space (whole parameters),
which does not depend on how many ranks the worker has (``megatron/checkpoint/model_space.py``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

from megatron_sparseloco.compress.segments import TensorSlice


@dataclass
class MainParamShards:
    optimizer: object                      # the megatron-core optimizer owning the tensors
    tensors: List[torch.Tensor]            # fp32, this rank's elements
    names: List[str]
    model_params: List[torch.Tensor]       # the model parameter each tensor is a shard of
    ranges: List[Tuple[int, int]]          # [start, end) of tensors[i] in model_params[i].view(-1)
    all_model_params: List[torch.Tensor]   # every param the optimizer updates, same order on all its ranks
    shard_group: Optional[dist.ProcessGroup] = None  # ranks that split those params between them (None: not split)

    def slices(self) -> List[TensorSlice]:
        """What each tensor is a piece of: its model parameter's shape and the range held."""
        return [TensorSlice(tuple(p.shape), s, e) for p, (s, e) in zip(self.model_params, self.ranges)]

    def inner_optimizer(self) -> Optional[torch.optim.Optimizer]:
        """The torch optimizer (Adam) that steps these tensors, whose ``state[t]`` holds their moments; None
        when the megatron-core optimizer wraps none."""
        inner = getattr(self.optimizer, "optimizer", None)
        return inner if isinstance(inner, torch.optim.Optimizer) else None


def _param_names(optimizer) -> dict:
    names = {}
    for chunk in getattr(optimizer, "model_chunks", None) or []:
        for n, p in chunk.named_parameters():
            names[id(p)] = n
    return names


def member_optimizers(optimizer) -> list:
    """The non-chained optimizers inside ``optimizer`` (itself when not chained)."""
    if hasattr(optimizer, "chained_optimizers"):
        out = []
        for o in optimizer.chained_optimizers:
            out.extend(member_optimizers(o))
        return out
    return [optimizer]


def main_param_shards(optimizer) -> MainParamShards:
    """The fp32 tensors ``optimizer`` (not chained) updates on this rank, with readable names."""
    names = _param_names(optimizer)
    out = MainParamShards(optimizer=optimizer, tensors=[], names=[], model_params=[], ranges=[], all_model_params=[])
    distributed = hasattr(optimizer, "shard_fp32_from_float16_groups")

    def owned_range(model_param, main) -> Tuple[int, int]:
        if not distributed:
            return 0, model_param.numel()
        r = optimizer._get_model_param_range_map(model_param)["param"]
        if r.end - r.start != main.numel():
            raise AssertionError(f"{names.get(id(model_param), '?')}: shard of {main.numel()} elements but range "
                                 f"[{r.start}, {r.end})")
        return r.start, r.end

    def add(model_groups, main_groups):
        for model_group, main_group in zip(model_groups, main_groups):
            if len(model_group) != len(main_group):
                raise AssertionError(f"{type(optimizer).__name__}: {len(model_group)} model params but "
                                     f"{len(main_group)} main params in a param group")
            for model_param, main in zip(model_group, main_group):
                if main is None:
                    # Never skip a parameter silently: the outer step would not cover it.
                    raise AssertionError(
                        f"{names.get(id(model_param), '?')}: {type(optimizer).__name__} keeps no fp32 main param "
                        "for it (--use-precision-aware-optimizer / --optimizer-cpu-offload keep the masters in "
                        "the optimizer state), so the outer step cannot cover it. Fix: drop those flags")
                if main.numel() == 0:
                    continue
                if main.dtype != torch.float32:
                    raise TypeError(f"main param of {names.get(id(model_param), '?')} is {main.dtype}, expected fp32")
                out.tensors.append(main)
                out.names.append(names.get(id(model_param), f"param{len(out.names)}"))
                out.model_params.append(model_param)
                out.ranges.append(owned_range(model_param, main))

    if distributed:                                                    # DistributedOptimizer
        add(optimizer.model_float16_groups, optimizer.shard_fp32_from_float16_groups)
        add(optimizer.model_fp32_groups, optimizer.shard_fp32_groups)
        out.all_model_params = [p for buffer in optimizer.buffers for p in buffer.param_index_map]
        out.shard_group = optimizer.data_parallel_group
        # The shards must cover everything the optimizer updates on this rank.
        owned = sum(optimizer._get_model_param_range_map(p)["param"].size
                    for group in (optimizer.model_float16_groups, optimizer.model_fp32_groups)
                    for g in group for p in g)
        covered = sum(t.numel() for t in out.tensors)
        if covered != owned:
            raise AssertionError(f"{type(optimizer).__name__}: the outer step would cover {covered} of the {owned} "
                                 "elements this rank's optimizer updates")
    elif hasattr(optimizer, "fp32_from_float16_groups"):              # Float16OptimizerWithFloat16Params
        add(optimizer.float16_groups, optimizer.fp32_from_float16_groups)
        add(optimizer.fp32_from_fp32_groups, optimizer.fp32_from_fp32_groups)
        out.all_model_params = list(out.model_params)
    elif hasattr(optimizer, "optimizer"):                              # FP32Optimizer
        groups = [g["params"] for g in optimizer.optimizer.param_groups]
        add(groups, groups)
        out.all_model_params = list(out.model_params)
    else:
        raise TypeError(f"cannot find main params in {type(optimizer).__name__}")
    return out

"""Keep parameters that Megatron ties across pipeline stages bitwise identical through outer steps.

With ``--pipeline-model-parallel-size`` > 1 and tied embeddings (Megatron's default) the first stage
holds ``word_embeddings.weight`` and the last stage a copy as ``output_layer.weight``; Megatron
marks both ``shared_embedding`` and sums their gradients over its embedding group, so inner steps
keep them equal. An outer step does not: each stage runs its own strategy on its own shard, and a
compressing one (SparseLoCo: chunked top-k with error feedback over a flat bucket) selects
different elements of the two copies. Only one copy is checkpointed, so a resume would silently
change the model.

Exact scheme: after the strategies' step, for each tied parameter the first stage's per-element
state — fp32 main param, θ_outer, error feedback, outer momentum (the Adam moments already agree:
same gradients) — is assembled whole inside each stage's data-parallel group (an int32 sum of
disjoint pieces, bit exact), broadcast over Megatron's embedding group from the first stage, and
the other stage writes its own slices of it. The main → model copy and param all-gather that end
the outer step then give both stages the same model parameter. The tied copy is still sent by
both stages' strategies (a few extra bytes), and its result on the last stage is discarded.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from megatron_sparseloco.megatron.fragments import per_tensor_state
from megatron_sparseloco.comm.collectives import collective_device


def is_tied_across_stages(param: torch.Tensor) -> bool:
    """Megatron's flag for the embedding / output-layer copies kept in sync over the embedding group."""
    return bool(getattr(param, "shared_embedding", False))


def _embedding_group():
    from megatron.core import parallel_state
    if parallel_state.get_pipeline_model_parallel_world_size() <= 1:
        return None
    try:
        group = parallel_state.get_embedding_group()
    except (AssertionError, RuntimeError):
        return None
    if group is None or dist.get_world_size(group) <= 1:
        return None
    return group


class TiedParamSync:
    """Per member optimizer, the tied params it shards, and the copy step run after each outer step."""

    def __init__(self, shards_list, strategy_of):
        self.group = _embedding_group() if dist.is_initialized() else None
        #: [(member index, param index in all_model_params, numel)]
        self.plan: List[Tuple[int, int, int]] = []
        self.state_names: List[Optional[List[str]]] = []
        if self.group is None:
            return
        for m, shards in enumerate(shards_list):
            for j, p in enumerate(shards.all_model_params):
                if is_tied_across_stages(p):
                    self.plan.append((m, j, p.numel()))
        for m, shards in enumerate(shards_list):
            self.state_names.append(self._names(shards, strategy_of[m]) if any(pm == m for pm, _, _ in self.plan)
                                    else None)
        # Both ends of the embedding group must run the same number of broadcasts.
        counts = [len(self.plan)] * dist.get_world_size(self.group)  # placeholders: all_gather_object overwrites
        dist.all_gather_object(counts, len(self.plan), group=self.group)
        if len(set(counts)) != 1:
            raise RuntimeError(f"sparseloco: pipeline stages hold different numbers of tied parameters {counts}; "
                               "cannot keep the tied copies identical")

    @staticmethod
    def _names(shards, strategy) -> List[str]:
        mine = ["inner.main_param"] + sorted(f"outer.{k}" for k in per_tensor_state(strategy))
        group = shards.shard_group
        if group is not None and dist.get_world_size(group) > 1:
            gathered = [mine] * dist.get_world_size(group)  # placeholders: all_gather_object overwrites them
            dist.all_gather_object(gathered, mine, group=group)
            mine = max(gathered, key=len)
        return mine

    def _views(self, m, shards, strategy, j) -> Dict[str, Tuple[torch.Tensor, int, int]]:
        """state name -> (live view of this rank's piece of param j, start, end); empty when none held."""
        target = shards.all_model_params[j]
        out = {}
        for i, p in enumerate(shards.model_params):
            if p is not target:
                continue
            start, end = shards.ranges[i]
            out["inner.main_param"] = (shards.tensors[i], start, end)
            for k, v in per_tensor_state(strategy).items():
                out[f"outer.{k}"] = (v[i], start, end)
        return out

    @torch.no_grad()
    def sync(self, shards_list, strategy_of) -> None:
        if not self.plan:
            return
        src = dist.get_process_group_ranks(self.group)[0]  # the first pipeline stage
        for m, j, numel in self.plan:
            shards, strategy = shards_list[m], strategy_of[m]
            names = self.state_names[m]
            assert names is not None  # __init__ sets them for every member with a tied param
            views = self._views(m, shards, strategy, j)
            device = shards.tensors[0].device if shards.tensors else collective_device()
            whole = torch.zeros(len(names), numel, dtype=torch.int32, device=device)
            for s, name in enumerate(names):
                if name in views:
                    view, start, end = views[name]
                    whole[s, start:end] = view.reshape(-1).view(torch.int32)
            group = shards.shard_group
            if group is not None and dist.get_world_size(group) > 1:
                dist.all_reduce(whole, group=group)  # disjoint pieces: an exact integer sum
            dist.broadcast(whole, src=src, group=self.group)
            if dist.get_rank() == src:
                continue
            for s, name in enumerate(names):
                if name in views:
                    view, start, end = views[name]
                    view.copy_(whole[s, start:end].view(torch.float32).view_as(view))

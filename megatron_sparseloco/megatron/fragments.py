"""Streaming-DiLoCo fragments (``--sparseloco-fragments P``): P groups of layers, each synced at its own offset.

Fragment of a model parameter (the same on every TP / PP / EP rank that holds it), with L the
model's number of transformer layers:

    transformer layer l (global, 0-based)      → fragment P − 1 − ⌊(L − 1 − l)·P / L⌋
                                                 (P contiguous groups of ⌊L/P⌋ or ⌈L/P⌉ layers,
                                                 the larger ones last: fragment 0 has the embedding)
    embedding, and any param Megatron ties to it across pipeline stages (``shared_embedding``:
    the last stage's copy as ``output_layer.weight``)                       → fragment 0
    output layer, final norm                                                → fragment P − 1
    MoE experts, routers, the layer's norms                                 → their layer's

l is ``TransformerLayer.layer_number − 1``: Megatron computes ``layer_number`` (1-based) with the
pipeline / virtual-pipeline layer offset, so a stage's local ``decoder.layers.<i>`` maps to its
global layer and the fragment does not depend on the parallel layout.

Schedule, with H inner steps per round: fragment p syncs after the inner steps t > 0 with

    t ≡ o_p (mod H),      o_p = ⌊p·H / P⌋

so each fragment's rounds are H inner steps long (fragment p's first round o_p steps when
o_p > 0), P syncs happen per round and each moves ≈ 1/P of the bytes (the layers of a fragment,
plus the embedding / output layer for the first / last one): the peak bandwidth drops by ≈ P.
With delayed application τ (``outer/overlap.py``) fragment p launches at t ≡ o_p and merges at
t ≡ o_p + τ; τ < H/P keeps at most one fragment in flight (o_{p+1} − o_p ≥ ⌊H/P⌋ ≥ τ, and the
last fragment's window ends before fragment 0's next launch: H − o_{P−1} = ⌈H/P⌉ > τ).

State: per member optimizer (dense, expert) the main-param shards are split by fragment, order
kept, and each non-empty fragment gets its own strategy over its shards — its own θ_outer, error
feedback, outer momentum. A round of fragment p on worker r is the strategy's ordinary step on
those shards:  Δ_p = θ_outer,p − θ_r,p ; communicate ; θ_outer,p ← U(θ_outer,p, agg_p) ;
θ_r,p ← θ_outer,p (or the overlap merge). ``MemberFragments`` presents a member's fragment
strategies (one, with P = 1) with per-tensor state in the member's tensor order, so the checkpoint
layout (per member, per model parameter) is the same for every P.
"""
from __future__ import annotations

import re
from typing import Dict, List, Optional, Protocol, Sequence, Tuple

import torch

from megatron_sparseloco.megatron.schedule import fragment_offsets, round_in_flight, syncs_at
from megatron_sparseloco.outer.base import OuterStrategy

_LAYER = re.compile(r"(?:^|.*\.)decoder\.layers\.(\d+)$")


class FragmentError(ValueError):
    """A parameter cannot be placed in a fragment, or P does not fit the model."""


def layer_fragment(layer: int, num_layers: int, fragments: int) -> int:
    """P − 1 − ⌊(L − 1 − l)·P / L⌋ for the 0-based global layer l: contiguous groups of ⌊L/P⌋ or ⌈L/P⌉
    layers, the larger ones last (fragment 0 also holds the embedding)."""
    return fragments - 1 - (num_layers - 1 - layer) * fragments // num_layers


def _strip(name: str) -> str:
    while name.startswith("module."):
        name = name[len("module."):]
    return name


def param_fragments(model_chunks: Sequence, fragments: int) -> Dict[int, int]:
    """``{id(model param): fragment}`` for every parameter of ``model_chunks`` (this rank's chunks)."""
    out: Dict[int, int] = {}
    layers = []
    num_layers: Optional[int] = None
    for chunk in model_chunks:
        for name, module in chunk.named_modules():
            if _LAYER.match(name) and hasattr(module, "layer_number"):
                layers.append((module, int(module.layer_number) - 1))
                n = getattr(getattr(module, "config", None), "num_layers", None)
                if n is not None:
                    num_layers = int(n)
    if layers and num_layers is None:
        num_layers = max(l for _, l in layers) + 1
    if num_layers is not None and fragments > num_layers:
        raise FragmentError(f"--sparseloco-fragments {fragments} is more than the model's {num_layers} layers. Fix: "
                            f"use at most {num_layers} fragments")
    for module, layer in layers:
        assert num_layers is not None
        f = layer_fragment(layer, num_layers, fragments)
        for p in module.parameters():
            out[id(p)] = f
    for chunk in model_chunks:
        for name, p in chunk.named_parameters():
            if id(p) in out:
                continue
            n = _strip(name)
            if getattr(p, "shared_embedding", False) or n.startswith("embedding.") or ".embedding." in n:
                out[id(p)] = 0
            elif (n.startswith("output_layer.") or n.startswith("decoder.final_layernorm.")
                  or n.startswith("decoder.final_norm.")):
                out[id(p)] = fragments - 1
            else:
                raise FragmentError(
                    f"--sparseloco-fragments {fragments}: cannot place parameter {name!r} in a fragment (it is not in "
                    "a transformer layer decoder.layers.<i>, the embedding, the output layer or the final norm). "
                    "Fix: use --sparseloco-fragments 1, or teach megatron_sparseloco/megatron/fragments.py where "
                    "it goes")
    return out


class MemberFragments:
    """One member optimizer's outer state: its shards split by fragment, a strategy per non-empty fragment.

    ``fragment_of[i]``: the fragment of the member's shard tensor i; ``strategies[p]``: the
    strategy over the tensors of fragment p, in the member's order. With P = 1 it holds the one
    strategy over all of the member's shards, so the loop, the checkpoint code and the
    tied-parameter sync handle every member the same way.
    """

    def __init__(self, fragment_of: Sequence[int], strategies: Dict[int, OuterStrategy]):
        self.fragment_of = list(fragment_of)
        self.strategies = dict(strategies)
        self.position: List[int] = []          # index of tensor i inside its fragment's strategy
        seen: Dict[int, int] = {}
        for f in self.fragment_of:
            self.position.append(seen.get(f, 0))
            seen[f] = seen.get(f, 0) + 1
        for f, n in seen.items():
            if len(self.strategies[f].params.tensors) != n:
                raise AssertionError(f"fragment {f}: strategy over {len(self.strategies[f].params.tensors)} "
                                     f"tensors, the member has {n}")

    @property
    def numel(self) -> int:
        return sum(s.params.numel for s in self.strategies.values())

    def per_tensor_state(self) -> Dict[str, List[torch.Tensor]]:
        """``{state name: [live view of tensor i's elements]}`` in the member's tensor order."""
        by_fragment = {f: s.per_tensor_state() for f, s in self.strategies.items()}
        names: Optional[List[str]] = None
        for f, state in by_fragment.items():
            if names is None:
                names = sorted(state)
            elif sorted(state) != names:
                raise AssertionError(f"fragment strategies keep different state ({names} vs {sorted(state)})")
        return {k: [by_fragment[f][k][j] for f, j in zip(self.fragment_of, self.position)] for k in names or []}


class MemberState(Protocol):
    """What the checkpoint code and the tied-parameter sync read of a member's outer state: a
    ``MemberFragments``, or a single ``OuterStrategy`` over all of the member's shards."""

    @property
    def numel(self) -> int: ...

    def per_tensor_state(self) -> Dict[str, List[torch.Tensor]]: ...


def per_tensor_state(member: Optional[MemberState]) -> Dict[str, List[torch.Tensor]]:
    """A member's per-element state, one live view per shard tensor (``{}`` where this rank holds none)."""
    return {} if member is None else member.per_tensor_state()


def state_numel(member: MemberState) -> int:
    return member.numel


__all__ = ["FragmentError", "MemberFragments", "MemberState", "build_member_strategies", "fragment_offsets",
           "layer_fragment", "param_fragments",
           "per_tensor_state", "round_in_flight", "state_numel", "syncs_at"]


def build_member_strategies(shards_list: Sequence, model_chunks: Sequence, factory, group,
                            fragments: int) -> Tuple[List[Optional[MemberFragments]], List[List[OuterStrategy]]]:
    """Per member optimizer its outer state (None where this rank holds none of its params), and per
    fragment its strategies (one per member holding params of it here).

    ``factory(tensors, group, names, slices)`` builds one strategy; with P = 1 each member gets one
    over all its shards, with P > 1 one per fragment over that fragment's shards (member order kept)."""
    by_fragment: List[List[OuterStrategy]] = [[] for _ in range(fragments)]
    where = param_fragments(model_chunks, fragments) if fragments > 1 else {}
    members: List[Optional[MemberFragments]] = []
    for sh in shards_list:
        if not sh.tensors:
            members.append(None)
            continue
        frag = [where[id(p)] if fragments > 1 else 0 for p in sh.model_params]
        slices = sh.slices()
        built: Dict[int, OuterStrategy] = {}
        for f in sorted(set(frag)):
            idx = [i for i, g in enumerate(frag) if g == f]
            built[f] = factory([sh.tensors[i] for i in idx], group, [sh.names[i] for i in idx],
                               [slices[i] for i in idx])
            by_fragment[f].append(built[f])
        members.append(MemberFragments(frag, built))
    return members, by_fragment

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
θ_r,p ← θ_outer,p (or the overlap merge). With P = 1 the member's single strategy is used as
before (bitwise today's path). ``MemberFragments`` presents a member's fragment strategies with
per-tensor state in the member's tensor order, so the checkpoint layout (per member, per model
parameter) is the same for every P.
"""
from __future__ import annotations

import re
from typing import Dict, List, Optional, Sequence

import torch

_LAYER = re.compile(r"(?:^|.*\.)decoder\.layers\.(\d+)$")


class FragmentError(ValueError):
    """A parameter cannot be placed in a fragment, or P does not fit the model."""


def fragment_offsets(inner_steps: int, fragments: int) -> List[int]:
    """o_p = ⌊p·H/P⌋ for p = 0 .. P−1."""
    return [p * inner_steps // fragments for p in range(fragments)]


def syncs_at(calls: int, offset: int, inner_steps: int) -> bool:
    """Does a fragment with offset ``offset`` sync (blocking step or launch) after inner step ``calls``?"""
    return calls > 0 and (calls - offset) % inner_steps == 0


def round_in_flight(calls: int, offset: int, inner_steps: int, tau: int) -> bool:
    """After inner step ``calls``: was this fragment launched in the last τ steps (merge still due)?"""
    if tau <= 0:
        return False
    phase = (calls - offset) % inner_steps
    return phase < tau and calls - phase > 0


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
                    "Fix: use --sparseloco-fragments 1, or teach megatron_sparseloco/megatron/fragments.py where it goes")
    return out


class MemberFragments:
    """One member optimizer's shards split by fragment: a strategy per non-empty fragment.

    ``fragment_of[i]``: the fragment of the member's shard tensor i; ``strategies[p]``: the
    strategy over the tensors of fragment p, in the member's order.
    """

    def __init__(self, fragment_of: Sequence[int], strategies: Dict[int, object]):
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
        by_fragment = {f: per_tensor_state(s) for f, s in self.strategies.items()}
        names = None
        for f, state in by_fragment.items():
            if names is None:
                names = sorted(state)
            elif sorted(state) != names:
                raise AssertionError(f"fragment strategies keep different state ({names} vs {sorted(state)})")
        return {k: [by_fragment[f][k][j] for f, j in zip(self.fragment_of, self.position)] for k in names or []}


def per_tensor_state(strategy) -> Dict[str, List[torch.Tensor]]:
    """A member's per-element state, one live view per shard tensor (``{}`` without a strategy).

    ``strategy``: an ``OuterStrategy`` over the member's shards or a ``MemberFragments``.
    """
    if strategy is None:
        return {}
    if isinstance(strategy, MemberFragments):
        return strategy.per_tensor_state()
    offsets = strategy.params.offsets
    return {k: [v[offsets[i]:offsets[i + 1]] for i in range(len(strategy.params.tensors))]
            for k, v in strategy.elementwise_state().items()}


def state_numel(strategy) -> int:
    return strategy.numel if isinstance(strategy, MemberFragments) else strategy.params.numel


__all__ = ["FragmentError", "MemberFragments", "fragment_offsets", "layer_fragment", "param_fragments",
           "per_tensor_state", "round_in_flight", "state_numel", "syncs_at"]

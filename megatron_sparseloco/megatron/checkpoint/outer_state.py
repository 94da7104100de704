"""Outer state in Megatron ``torch_dist`` checkpoints, reshardable across intra-worker data parallelism.

What a worker must keep across a restart, beyond what Megatron saves:

- per element: θ_outer, the strategy's buffers (error feedback, outer momentum), and the worker's
  *own* fp32 main params and Adam moments — Megatron treats data-parallel replicas and
  distributed-optimizer instances as copies and keeps one of each shard, but DiLoCo workers are not
  copies between outer steps (the model part itself holds θ_outer: ``model_holds_outer_params``);
- scalars: the inner-call counter (so a resume in the middle of an inner loop runs the outer step
  at the same iteration), outer steps, Adam ``step`` per worker, cumulative byte counters.

Per-element state is stored in **model space** (``model_space``): one parameter-shaped tensor per
(worker, state, parameter), sharded like the model parameter, key
``optimizer.sparseloco.worker{w}.{state}.{param key}``; θ_outer of a strategy that keeps it
identical on every worker (sparseloco, diloco, average) once for all workers, key
``optimizer.sparseloco.outer.anchor.{param key}``. Each rank writes its own pieces as views of the
live state (the boxes of its flat range: ``build_save_state``), so a save allocates nothing for the
outer state and sends nothing; on load every rank reads the whole parameters it holds a piece of
and slices its range. So a checkpoint resumes with a different intra-worker data-parallel size (the
per-element state lands on the new owners bit for bit); the worker count must stay the same.

Scalars: the job-wide ones and the layout facts go into Megatron's content metadata (key
``sparseloco``, read back before the load is planned, so a mismatched worker count or algorithm
fails with a clear error before anything is read); per-rank ones (bytes, Adam steps by parameter
key) are gathered into the common state (``optimizer.sparseloco.ranks``, written by rank 0). After
a change of layout a worker's byte totals are kept on its first rank.

A checkpoint without ``sparseloco`` content metadata (a plain Megatron run that now continues with
an outer loop) loads Megatron's state as usual and θ_outer is anchored on the loaded params at the
first step, with zero error feedback / momentum (a warning says so).

``torch`` format: Megatron saves ``optimizer.state_dict()`` only from data-parallel rank 0, which
would drop the other workers' state; the wrapper refuses it with a clear error (use torch_dist).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from megatron_sparseloco.megatron.fragments import per_tensor_state, state_numel
from megatron_sparseloco.megatron.main_params import MainParamShards
from megatron_sparseloco.megatron.checkpoint.model_space import flat_range_boxes, owned_piece, piece_table

OUTER_KEY = "sparseloco"            # in the optimizer's (sharded) state dict
METADATA_KEY = "sparseloco"         # in Megatron's checkpoint content metadata
STATE_PREFIX = "optimizer.sparseloco"
FORMAT_VERSION = 3
#: formats this version loads: 2 kept θ_outer per worker (``worker{w}.outer.anchor``), 3 once (``SHARED``)
READABLE_FORMATS = (2, 3)
#: states every worker holds bitwise equal when the strategy is ``identical_across_workers``:
#: written once per shard position, under a key without the worker
SHARED_STATES = ("outer.anchor",)


class OuterStateLayoutError(ValueError):
    """A checkpoint's outer state does not fit this run's layout; the message ends with the ways out."""

    WAY_OUT = (" Or keep the checkpoint's params and start a fresh outer state: --no-load-optim (also drops the "
               "inner optimizer state) or --finetune (also resets the iteration count); see docs/integration.md.")

    def __str__(self) -> str:
        return super().__str__() + self.WAY_OUT


# ---------------------------------------------------------------------------- the live state
def ensure_adam_step_state(members) -> int:
    """Give torch Adam states a placeholder ``step`` before a checkpoint load; returns how many.

    megatron-core 0.19.2 without Apex / Transformer Engine: ``DistributedOptimizer.state_dict``
    (called while building the sharded state dict for a *load*) asserts that every torch Adam
    param state has a ``step``, but torch creates ``step`` only at the optimizer's first step and
    Megatron's ``init_state_fn`` creates just ``exp_avg`` / ``exp_avg_sq``. So resuming into a
    fresh optimizer fails on any machine without Apex/TE (GPU or CPU). ``load_state_dict`` then
    overwrites ``step`` with the checkpoint's value, so a 0 placeholder is exact.
    tests/test_checkpoint_resume.py checks that the workaround is still needed.
    """
    added = 0
    for m in members:
        inner = getattr(m, "optimizer", None)
        if inner is None or not isinstance(inner, torch.optim.Optimizer):
            continue
        init_state_fn = getattr(m, "init_state_fn", None)
        for group in inner.param_groups:
            for p in group["params"]:
                state = inner.state[p]
                if not state and init_state_fn is not None:
                    init_state_fn(inner, getattr(m, "config", None))
                if "exp_avg" in state and "step" not in state:
                    state["step"] = torch.tensor(0.0)
                    added += 1
    return added


def _inner_elementwise_names(shards: MainParamShards) -> List[str]:
    """Names of the inner optimizer's per-element states (Adam: exp_avg, exp_avg_sq)."""
    inner = shards.inner_optimizer()
    if inner is None:
        return []
    names: Optional[List[str]] = None
    for t, label in zip(shards.tensors, shards.names):
        state = inner.state.get(t, {})
        mine = sorted(k for k, v in state.items() if k != "step" and torch.is_tensor(v) and v.shape == t.shape)
        other = sorted(k for k in state if k != "step" and k not in mine)
        if other:
            raise TypeError(f"inner optimizer state {other} of {label} is neither per-element nor 'step'; "
                            "the outer-loop checkpoint cannot store it")
        if names is None:
            names = mine
        elif names != mine:
            raise TypeError(f"inner optimizer states differ between params ({names} vs {mine} at {label})")
    return names or []


def elementwise_state(shards: MainParamShards, strategy) -> Dict[str, List[torch.Tensor]]:
    """``{state name: [live tensor holding shard i's elements]}`` for one member optimizer.

    ``outer.*``: slices of the strategy's flat vectors (``strategy.params`` is ``shards.tensors``
    in order; with ``--sparseloco-fragments`` a ``fragments.MemberFragments`` gives each tensor's
    slice of its fragment's strategy, so the layout is the same for every P); ``inner.main_param``:
    the fp32 main-param shards; ``inner.*``: Adam moments.
    """
    out: Dict[str, List[torch.Tensor]] = {}
    if strategy is not None:
        if state_numel(strategy) != sum(t.numel() for t in shards.tensors):
            raise AssertionError("strategy does not cover the member's main-param shards")
        for k, v in per_tensor_state(strategy).items():
            out[f"outer.{k}"] = v
    out["inner.main_param"] = list(shards.tensors)
    inner = shards.inner_optimizer()
    for k in _inner_elementwise_names(shards):
        assert inner is not None  # the names come from it
        out[f"inner.{k}"] = [inner.state[t][k] for t in shards.tensors]
    return out


def _adam_steps(shards: MainParamShards, keys: Dict[int, str]) -> Dict[str, float]:
    inner = shards.inner_optimizer()
    out: Dict[str, float] = {}
    if inner is None:
        return out
    for t, p in zip(shards.tensors, shards.model_params):
        step = inner.state.get(t, {}).get("step")
        if step is not None:
            out[keys[id(p)]] = float(step)
    return out


# ---------------------------------------------------------------------------- sharded tensors
def model_param_metadata(model_sharded_state_dict) -> Dict[int, object]:
    """``{id(model param): its ShardedTensor / ShardedTensorFactory}`` from the model's sharded state dict."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.utils import extract_sharded_tensors_and_factories

    sharded, _ = extract_sharded_tensors_and_factories(model_sharded_state_dict or {})
    return {id(sh.data): sh for sh in nested_values(sharded)}


def _metadata_of(metas: Dict[int, object], p: torch.Tensor, label: str):
    try:
        return metas[id(p)]
    except KeyError:
        raise ValueError(f"model param {label} is not in the model's sharded state dict (built without "
                         "keep_vars=True?); the outer-loop checkpoint needs it to place the param's state") from None


def _sharded_like(meta, key: str, data: torch.Tensor, group_rank: Optional[int]):
    """``meta`` (the model param's sharding) re-keyed for ``data``; within the shard group only rank 0 is main."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    rid = meta.replica_id
    if group_rank is not None:
        rid = (*rid[:-1], group_rank) if isinstance(rid, tuple) else (rid if rid != 0 else group_rank)
    kwargs = dict(key=key, data=data, replica_id=rid)
    if isinstance(meta, ShardedTensor):
        kwargs["dtype"] = data.dtype
    out = replace(meta, **kwargs)
    if isinstance(out, ShardedTensor):
        out.validate_metadata_integrity()
    return out


def _key(worker: Optional[int], state: str, meta) -> str:
    """The checkpoint key of one state of one param: per worker, or (``worker=None``) shared by all."""
    who = "" if worker is None else f"worker{worker}."
    return f"{STATE_PREFIX}.{who}{state}.{meta.key}"


def _state_owner(worker: int, state: str, shared: bool) -> Optional[int]:
    """``worker`` for a per-worker state, None for one written once per shard position."""
    return None if shared and state in SHARED_STATES else worker


def param_slot(meta) -> str:
    """The name of one model param in our nested state dicts: its checkpoint key, plus its offset on
    the prepended axes where Megatron stacks several params under one key (``decoder.layers.*``:
    every layer's weight is a slice of one ``ShardedTensor`` key, told apart by ``global_offset``)."""
    prepend = int(getattr(meta, "prepend_axis_num", 0) or 0)
    offset = tuple(getattr(meta, "global_offset", ()) or ())[:prepend]
    return meta.key if not offset else f"{meta.key}@{','.join(str(int(o)) for o in offset)}"


def member_kind(shards: MainParamShards) -> str:
    """``"expert"`` for the optimizer of expert-parallel params (megatron-core marks them
    ``allreduce=False``), else ``"dense"``."""
    params = shards.all_model_params or shards.model_params
    return "expert" if params and all(not getattr(p, "allreduce", True) for p in params) else "dense"


def member_keys(shards_list: List[MainParamShards]) -> List[str]:
    """The name of each member optimizer's outer state: its kind (``dense`` / ``expert``), numbered
    (``dense0``, ``dense1`` ...) only where several members share a kind (one per model chunk)."""
    kinds = [member_kind(sh) for sh in shards_list]
    seen: Dict[str, int] = {}
    out = []
    for k in kinds:
        out.append(k if kinds.count(k) == 1 else f"{k}{seen.get(k, 0)}")
        seen[k] = seen.get(k, 0) + 1
    return out


def saved_member_states(saved: dict, key: str, index: int) -> Optional[List[str]]:
    """The state names a checkpoint's metadata lists for member ``key``; checkpoints written before
    members had names list them as ``m{index}`` (position in the chained optimizer)."""
    states = saved.get("states", {})
    found = states.get(key, states.get(f"m{index}"))
    return None if found is None else list(found)


def _check_unique_param_keys(labels_and_keys) -> None:
    """Refuse two tensors of one member under one checkpoint key (they would overwrite each other)."""
    seen: Dict[str, str] = {}
    for label, key in labels_and_keys:
        if key in seen:
            raise ValueError(f"model params {seen[key]} and {label} share the checkpoint key {key!r}")
        seen[key] = label


def _with_replica(rid, last: int):
    """``rid`` (a model param's replica id) with its data-parallel component set to ``last``."""
    return (*rid[:-1], last) if isinstance(rid, tuple) else (rid if rid != 0 else last)


def _param_regions(meta, key: str, shape) -> List[tuple]:
    """Where the elements of one local model param go in the checkpoint under ``key``: a list of
    (template ShardedTensor, box offset in the param, box size) tiling the param. A plain param is
    one box, the param's own sharding; a ``ShardedTensorFactory`` (SwiGLU's fused w / v halves,
    Mamba's in_proj parts) is asked what it makes of the param: its ``build_fn`` on a ``meta``
    tensor of the param's shape returns the ShardedTensors as views, whose storage offsets are the
    boxes."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    shape = tuple(shape)
    if isinstance(meta, ShardedTensor):
        return [(replace(meta, key=key, data=None), (0,) * len(shape), shape)]
    probe = torch.empty(shape, device="meta")
    strides = probe.stride()
    out = []
    for sub in nested_values(meta.build_fn(key, probe, meta.replica_id, None)):
        view = sub.data
        if view.stride() != strides and view.numel() > 1:
            raise NotImplementedError(f"{type(meta).__name__} of {meta.key} builds a view that is not a box of the "
                                      "param; the outer-loop checkpoint cannot place its state")
        offset, rest = [], view.storage_offset()
        for st in strides:
            offset.append(rest // st)
            rest %= st
        out.append((replace(sub, data=None), tuple(offset), tuple(view.shape)))
    return out


def _piece_chunks(template, box_offset, box_size, piece: torch.Tensor, start: int, end: int, shape,
                  replica_id) -> List[object]:
    """The ShardedTensors of this rank's piece ``piece`` (elements [start, end) of the param) that
    fall inside one region: views of ``piece`` (a copy only where a factory splits an inner axis),
    irregular chunks of the region's global tensor, the prepended axes folded into singleton axes."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    prepend = template.prepend_axis_num
    flat = piece.reshape(-1)
    out = []
    for run_off, run_size, a, b in flat_range_boxes(shape, start, end):
        lo = [max(r, o) for r, o in zip(run_off, box_offset)]
        hi = [min(r + n, o + m) for r, n, o, m in zip(run_off, run_size, box_offset, box_size)]
        if any(h <= l for l, h in zip(lo, hi)):
            continue
        run = flat[a - start:b - start].view(run_size)
        data = run[tuple(slice(l - r, h - r) for l, h, r in zip(lo, hi, run_off))]
        if not data.is_contiguous():
            data = data.contiguous()
        size = tuple(h - l for l, h in zip(lo, hi))
        data = data.view((1,) * prepend + size)
        offset = tuple(template.global_offset[:prepend]) + tuple(
            g + l - o for g, l, o in zip(template.global_offset[prepend:], lo, box_offset))
        out.append(ShardedTensor(key=template.key, data=data, dtype=data.dtype, local_shape=tuple(data.shape),
                                 global_shape=tuple(template.global_shape), global_offset=offset,
                                 axis_fragmentations=None, replica_id=replica_id, prepend_axis_num=0))
    return out


def exchange_outer_and_local(strategy) -> None:
    """θ_local (the strategy's shards) ↔ θ_outer (its anchor), one shard tensor at a time (its own inverse).

    Exact copies; extra memory one shard tensor, at most the largest parameter."""
    with torch.no_grad():
        for t, lo, hi in zip(strategy.params.tensors, strategy.params.offsets, strategy.params.offsets[1:]):
            held = t.detach().clone()
            t.copy_(strategy.anchor[lo:hi].view_as(t))
            strategy.anchor[lo:hi].copy_(held.view(-1))
            del held   # before the next tensor's copy: one at a time


def outer_in_shards_overrides(shards_list, strategies_by_member) -> List[Dict[str, List[torch.Tensor]]]:
    """After ``exchange_outer_and_local``: per member, the tensors that now hold θ_outer (the shards)
    and θ_local (the anchor), for ``build_save_state``'s ``overrides``."""
    out = []
    for shards, strategy in zip(shards_list, strategies_by_member):
        state = per_tensor_state(strategy)
        out.append({"outer.anchor": list(shards.tensors), "inner.main_param": state["anchor"]} if "anchor" in state
                   else {})
    return out


def build_save_state(strategies_by_member, shards_list, worker: int, metas: Dict[int, object],
                     overrides: Optional[List[Dict[str, List[torch.Tensor]]]] = None,
                     shared: bool = False) -> Dict[str, dict]:
    """Sharded tensors of this rank's pieces of every per-element state, as views of the live state.

    Every state of every param this rank holds a piece of is saved in the param's coordinates as
    the boxes of its flat range (``model_space.flat_range_boxes``): chunks of one parameter-shaped
    tensor per (worker, state, param) that views this rank's live tensors, so building the save
    copies nothing (and sends nothing); the writer reads each chunk from the live state. Inside a
    worker the ranks' chunks tile each param once (data-parallel replica 0 on every rank).

    ``shared``: the strategy keeps θ_outer identical on every worker (``SHARED_STATES``): it is
    keyed without the worker and worker w's chunks carry replica id w, so one worker's copy is
    written per shard position. ``metas``: ``model_param_metadata`` of the model's sharded state
    dict. ``overrides`` (per member, ``{state: tensors}``): live tensors that hold a state in place
    of its usual ones (during a save the shards hold θ_outer, ``OuterLoopOptimizer``).
    """
    out: Dict[str, dict] = {}
    for mi, (key, shards, strategy) in enumerate(zip(member_keys(shards_list), shards_list, strategies_by_member)):
        states = elementwise_state(shards, strategy)
        if overrides is not None:
            states.update(overrides[mi])
        split = shards.shard_group is not None
        member: Dict[str, dict] = {}
        for name, pieces in sorted(states.items()):
            owner = _state_owner(worker, name, shared)
            chunks: Dict[str, list] = {}
            for i, (p, (start, end), piece) in enumerate(zip(shards.model_params, shards.ranges, pieces)):
                if piece.numel() != end - start:
                    raise ValueError(f"{name} of {shards.names[i]}: {piece.numel()} elements for range "
                                     f"[{start}, {end})")
                meta = _metadata_of(metas, p, shards.names[i])
                rid = meta.replica_id
                if split:  # pieces are unique inside the worker; a shared state's copy of worker w is replica w
                    rid = _with_replica(rid, 0 if owner is not None else worker)
                for template, box_off, box_size in _param_regions(meta, _key(owner, name, meta), p.shape):
                    chunks.setdefault(param_slot(meta), []).extend(
                        _piece_chunks(template, box_off, box_size, piece, start, end, p.shape, rid))
            member[name] = chunks
        out[key] = member
    return out


def build_load_request(strategies_by_member, shards_list, worker: int, metas: Dict[int, object],
                       saved: Optional[dict], shared: bool = False) -> Dict[str, dict]:
    """Empty sharded tensors for the whole params this rank holds pieces of.

    dist_checkpointing wants one main reader per tensor: the param's owner (``model_space``).
    ``shared``: the strategy keeps θ_outer identical on every worker; it is read from the key
    without the worker unless the checkpoint's format predates that (2: one copy per worker).
    """
    if saved is not None and int(saved.get("format", FORMAT_VERSION)) < 3:
        shared = False
    out: Dict[str, dict] = {}
    for mi, (key, shards, strategy) in enumerate(zip(member_keys(shards_list), shards_list, strategies_by_member)):
        live = elementwise_state(shards, strategy)
        if saved is not None:
            have = set(saved_member_states(saved, key, mi) or [])
            missing = sorted(set(live) - have)
            if missing:
                raise OuterStateLayoutError(
                    f"the checkpoint has no {missing} for the {key} optimizer (it holds {sorted(have)}). Fix: resume "
                    "with the --sparseloco-* flags of the run that saved it (algorithm, outer momentum)")
        metas_i = [_metadata_of(metas, p, shards.names[i]) for i, p in enumerate(shards.model_params)]
        _check_unique_param_keys((shards.names[i], param_slot(m)) for i, m in enumerate(metas_i))
        table = piece_table(shards)
        split = shards.shard_group is not None
        member: Dict[str, dict] = {}
        for name, tensors in live.items():
            member[name] = {}
            for p, t, meta in zip(shards.model_params, tensors, metas_i):
                data = torch.empty(p.shape, dtype=t.dtype, device=t.device)
                owner = _state_owner(worker, name, shared)
                reader = (0 if table.owner_of(p) == table.me else table.me) if split else None
                if reader is not None and owner is None and worker != 0:  # a shared state: worker 0's owner reads
                    reader += 1
                member[name][param_slot(meta)] = _sharded_like(meta, _key(owner, name, meta), data, reader)
        out[key] = member
    return out


def restore_state(strategies_by_member, shards_list, loaded: Dict[str, dict], keys: Dict[int, str]) -> None:
    """Slice this rank's ranges out of the loaded whole params into the live state.

    ``loaded``: what ``build_load_request`` asked for, ``{member key: {state: {param key: whole param}}}``;
    ``keys``: ``param_keys`` (id(model param) → its ``param_slot``).
    """
    for key, shards, strategy in zip(member_keys(shards_list), shards_list, strategies_by_member):
        live = elementwise_state(shards, strategy)
        member = loaded[key]
        inner = shards.inner_optimizer()
        with torch.no_grad():
            for name, tensors in live.items():
                for i, ((start, end), t) in enumerate(zip(shards.ranges, tensors)):
                    src = owned_piece(member[name][keys[id(shards.model_params[i])]], start, end)
                    if name.startswith("inner.") and name != "inner.main_param":
                        # Fresh tensors, never copy_ into what is there: megatron-core 0.19.2's load
                        # (no Apex/TE) gives every param state the *same* tensor for some entries.
                        assert inner is not None  # live holds inner.* states only when there is one
                        inner.state[shards.tensors[i]][name[len("inner."):]] = src.clone().view(t.shape)
                    else:
                        t.view(-1).copy_(src)


# ---------------------------------------------------------------------------- scalars
def param_keys(metas: Dict[int, object]) -> Dict[int, str]:
    """``{id(model param): its param_slot}`` (global across TP / PP / EP ranks, one per param)."""
    return {pid: param_slot(meta) for pid, meta in metas.items()}


def rank_record(shards_list, worker: int, worker_rank: int, worker_size: int, log, keys: Dict[int, str]) -> dict:
    steps: Dict[str, float] = {}
    for sh in shards_list:
        steps.update(_adam_steps(sh, keys))
    return {"worker": worker, "worker_rank": worker_rank, "worker_size": worker_size,
            "bytes_sent": int(log.bytes_sent), "bytes_received": int(log.bytes_received), "adam_step": steps}


def gather_rank_records(record: dict) -> Dict[str, dict]:
    """Per worker: byte counters in worker-rank order and Adam steps by param key (one value when uniform)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    records = [record]
    if world > 1:
        records = [record] * world  # placeholders: all_gather_object overwrites every entry
        dist.all_gather_object(records, record)
    workers: Dict[str, dict] = {}
    for r in sorted(records, key=lambda r: (r["worker"], r["worker_rank"])):
        w = workers.setdefault(str(r["worker"]), {"bytes": [], "adam_step": {}})
        w["bytes"].append([r["bytes_sent"], r["bytes_received"]])
        w["adam_step"].update(r["adam_step"])
    for w in workers.values():
        values = set(w["adam_step"].values())
        if len(values) == 1:
            w["adam_step"] = {"*": values.pop()}
    return workers


def restore_scalars(shards_list, worker: int, worker_rank: int, worker_size: int, log, workers: Dict[str, dict],
                    keys: Dict[int, str]) -> None:
    try:
        entry = workers[str(worker)]
    except KeyError:
        raise OuterStateLayoutError(f"checkpoint has no scalars for worker {worker}. Fix: resume with the same "
                                    "--sparseloco-workers") from None
    if len(entry["bytes"]) == worker_size:
        log.bytes_sent, log.bytes_received = (int(x) for x in entry["bytes"][worker_rank])
    else:  # resharded: the worker's totals (what is logged) stay exact, kept on its first rank
        totals = [sum(int(b[j]) for b in entry["bytes"]) for j in (0, 1)]
        log.bytes_sent, log.bytes_received = totals if worker_rank == 0 else (0, 0)
    steps = entry["adam_step"]
    for sh in shards_list:
        inner = sh.inner_optimizer()
        if inner is None:
            continue
        for t, p in zip(sh.tensors, sh.model_params):
            key = keys.get(id(p))
            # checkpoints written before slots had offsets keyed the steps by the plain key
            value = steps.get("*", steps.get(key, steps.get((key or "").split("@")[0])))
            if value is None:
                if "step" in inner.state.get(t, {}):
                    raise OuterStateLayoutError(f"checkpoint has no Adam step for {key}. Fix: resume with the same "
                                                "model as the run that saved it")
                continue
            old = inner.state[t].get("step")
            like = old if torch.is_tensor(old) else torch.tensor(0.0)
            inner.state[t]["step"] = torch.tensor(value, dtype=like.dtype, device=like.device)


#: facts of checkpoints written before a fact existed (SparseLoCo chunked flat until per-tensor chunking)
FACTS_BEFORE_RECORDED = {"chunking": "flat", "overlap_steps": 0, "fragments": 1}


def describe_inner_steps_change(saved: dict, inner_steps: int) -> Optional[str]:
    """What a resume with another ``--sparseloco-inner-steps`` does (None when unchanged or unknown).

    Rounds are counted by the inner-call counter: an outer step runs whenever it reaches a
    multiple of H. A new H keeps every state and re-aligns the rounds to multiples of the new H.
    """
    old = saved.get("inner_steps")
    if old is None or int(old) == int(inner_steps):
        return None
    old, calls = int(old), int(saved["inner_calls"])
    wait = (-calls) % inner_steps or inner_steps
    return (f"sparseloco: the checkpoint was saved with --sparseloco-inner-steps {old} at inner step {calls} "
            f"({calls % old} of {old} into its round); this run uses --sparseloco-inner-steps {inner_steps}. "
            f"Rounds re-align to multiples of {inner_steps}: the next outer step runs after {wait} more inner "
            f"step(s) (at inner step {calls + wait}); θ_outer, error feedback, momentum and the inner optimizer "
            f"state are kept. Resume with --sparseloco-inner-steps {old} to keep the saved rounds")


def _saved_fact(saved: dict, key: str):
    """A fact the checkpoint recorded, or what a checkpoint written before it was recorded implies."""
    facts = saved.get("facts", {})
    if key in facts:
        return facts[key].get("value")
    if key == "aggregation":  # recorded since reduce-scatter's owners keep state: tell by the states
        states = {n for names in saved.get("states", {}).values() for n in names}
        return "reduce-scatter" if "outer.owner_error_feedback" in states else "allgather"
    return FACTS_BEFORE_RECORDED.get(key)


def check_saved_metadata(saved: dict, num_workers: int, algorithms: List[str], facts: Optional[dict] = None) -> None:
    """Fail before anything is read when the checkpoint's outer state cannot fit this run."""
    version = saved.get("format")
    if version not in READABLE_FORMATS:
        raise OuterStateLayoutError(f"checkpoint outer state has format {version!r}, this version reads "
                                    f"{' and '.join(map(str, READABLE_FORMATS))}. Fix: resume with the "
                                    "megatron_sparseloco that saved it")
    if int(saved["num_workers"]) != num_workers:
        raise OuterStateLayoutError(
            f"checkpoint was saved by {saved['num_workers']} workers, this run has {num_workers}. Fix: resume with "
            f"--sparseloco-workers {saved['num_workers']} (the intra-worker data-parallel size may change)")
    if sorted(saved["algorithms"]) != sorted(algorithms):
        raise OuterStateLayoutError(
            f"checkpoint outer state is for {saved['algorithms']}, this run uses {algorithms}. Fix: resume with "
            f"--sparseloco-algorithm {saved['algorithms'][0] if saved['algorithms'] else '?'}")
    for key, now in (facts or {}).items():
        was = _saved_fact(saved, key)
        if was is not None and was != now["value"]:
            raise OuterStateLayoutError(
                f"checkpoint outer state was saved with {now['flag']} {was}, this run uses {now['value']} (the "
                f"saved state means something else there). Fix: resume with {now['flag']} {was}, or start the "
                "outer state afresh with --no-load-optim")

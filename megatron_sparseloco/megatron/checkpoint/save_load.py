"""The outer loop's part of Megatron's checkpoint, for ``OuterLoopOptimizer``'s checkpoint methods.

``save_with_outer_params``: the model part of a checkpoint is θ_outer (module docstring of
``megatron/checkpoint/outer_state.py`` for the layout); ``sharded_state_dict`` / ``load_state_dict`` add and
read the outer state; ``metadata`` / ``facts``: the job-wide facts stored in Megatron's content
metadata and checked on resume.
"""
from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING, Iterator, List

import torch
import torch.distributed as dist

from megatron_sparseloco.comm.process_group import as_outer_comm
from megatron_sparseloco.megatron.checkpoint import outer_state as ckpt

if TYPE_CHECKING:
    from megatron_sparseloco.megatron.optimizer import OuterLoopOptimizer

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def save_with_outer_params(opt: "OuterLoopOptimizer") -> Iterator[None]:
    """Inside the block the model (and the fp32 main params) hold θ_outer; after it, θ_local again.

    Megatron keeps one data-parallel replica of each model shard in a checkpoint, and which
    replica writes a shard is the save strategy's choice; mid-round the workers' θ_local differ,
    so the model part would be a mixture no worker ever had. ``megatron.training``'s
    ``save_checkpoint`` runs inside this block (``plugin.install``), so the model part — what
    ``--no-load-optim``, ``--finetune``, export and evaluation read, and the wrapped optimizer's
    own fp32 master copies — is

        θ_outer                     (sparseloco, diloco, average: identical on every worker)
        (1/W) Σ_w θ_outer,w         (gasloc: the workers' mean, which gossip preserves;
                                     one all-reduce over the workers at each save)

    while each worker's own θ_local goes into its per-worker outer state
    (``inner.main_param``), so a resume with the plugin stays bitwise. Costs two in-worker param
    all-gathers per save (memory: below). With ``--sparseloco-overlap-steps`` and a round in flight
    the save waits for it and the model part is θ_outer,k+1. Nothing changes before the first step
    (θ_outer is anchored on the params then) or for a rank without shards.

    Memory: where θ_outer is identical on every worker the shards and the anchor trade contents
    one shard tensor at a time (``checkpointing.exchange_outer_and_local``; extra memory one tensor,
    at most the largest parameter) and trade back afterwards; gasloc keeps θ_local in host memory
    for the duration of the save (one shard of fp32 on the host) while the shards hold the mean.
    """
    if opt._anchor_at_first_step or opt._save_overrides is not None or not opt.strategies:
        yield
        return
    # τ >= 1 with a round in flight: θ_outer,k+1 first (what sharded_state_dict would do), so
    # the model part is the newest synced model; the merge stays due at H·k+τ.
    opt.wait_outer_step()
    mean = not opt.identical_across_workers and opt.num_workers > 1
    with torch.no_grad():
        local = _put_outer_in_shards(opt, mean)
        opt.publish()
    try:
        yield
    finally:
        with torch.no_grad():
            if mean:
                for shards, lc in zip(opt.shards, local):
                    for t, saved in zip(shards.tensors, lc):
                        t.copy_(saved)
            else:
                for strategy in opt.strategies:
                    ckpt.exchange_outer_and_local(strategy)
            opt._save_overrides = None
            opt.publish()


def _put_outer_in_shards(opt: "OuterLoopOptimizer", mean: bool) -> List[List[torch.Tensor]]:
    """θ_outer (gasloc: the workers' mean) into the shards; returns the host copies of θ_local (gasloc)."""
    local: List[List[torch.Tensor]] = []
    if mean:
        pin = opt.strategies[0].device.type == "cuda"
        local = [[torch.empty(t.shape, dtype=t.dtype, pin_memory=pin).copy_(t) for t in sh.tensors]
                 for sh in opt.shards]
        comm = as_outer_comm(opt.group)   # (not the outer step's bytes)
        for strategy in opt.strategies:
            strategy.params.write(0, strategy.params.numel, strategy.anchor)
        for sh in opt.shards:
            for t in sh.tensors:
                comm.all_reduce_(t)
                t.div_(opt.num_workers)
        opt._save_overrides = [{"inner.main_param": lc} for lc in local]
    else:
        for strategy in opt.strategies:
            ckpt.exchange_outer_and_local(strategy)
        opt._save_overrides = ckpt.outer_in_shards_overrides(opt.shards, opt.strategy_of)
    return local


def outer_shared(opt: "OuterLoopOptimizer") -> bool:
    """θ_outer is identical on every worker, so checkpoints keep one copy per shard position."""
    return bool(opt.strategies) and all(s.capabilities.identical_across_workers for s in opt.strategies)


def metadata(opt: "OuterLoopOptimizer") -> dict:
    """Job-wide outer-loop facts stored in Megatron's checkpoint content metadata."""
    return {"format": ckpt.FORMAT_VERSION, "num_workers": opt.num_workers, "algorithms": opt.algorithms,
            "states": {key: sorted(ckpt.elementwise_state(sh, st))
                       for key, sh, st in zip(ckpt.member_keys(opt.shards), opt.shards, opt.strategy_of)},
            "inner_calls": opt.inner_calls, "outer_steps": opt.outer_steps,
            "fragment_syncs": list(opt.fragment_syncs),
            "facts": facts(opt),
            "inner_steps": opt.config.inner_steps,
            # what the rounds' mode keeps across a resume (``Rounds.state_dict``)
            **opt.rounds.state_dict()}


def facts(opt: "OuterLoopOptimizer") -> dict:
    """The settings a resume must keep (e.g. SparseLoCo's chunking), with their flags."""
    out = {}
    for s in opt.strategies:
        for key, value in s.checkpoint_facts().items():
            out[key] = {"value": value, "flag": s.checkpoint_fact_flags[key]}
    # a round in flight / a merge due means something only under the same τ and merge rule
    out["overlap_steps"] = {"value": opt.config.overlap_steps, "flag": "--sparseloco-overlap-steps"}
    # fragment p's state and schedule exist only with the same P (the layout is P-independent)
    out["fragments"] = {"value": opt.config.fragments, "flag": "--sparseloco-fragments"}
    if opt.config.overlap_steps > 0:
        out["overlap_merge"] = {"value": opt.config.overlap_merge, "flag": "--sparseloco-overlap-merge"}
    return out


def sharded_state_dict(opt: "OuterLoopOptimizer", model_sharded_state_dict, is_loading: bool, **kwargs):
    """The wrapped optimizer's sharded state plus the outer state (see ``checkpointing``).

    ``metadata`` (Megatron's content metadata, passed by megatron.training): on save the
    outer-loop facts are added to it; on load they are read from it, checked, and decide what
    to request — nothing when the checkpoint has no outer state.
    """
    content = kwargs.get("metadata")
    if not is_loading:
        # A round in flight: wait for its collective and compute θ_outer,k+1 now (bitwise what
        # the completion would compute); the merge stays due at H·k+τ and is derived on load
        # from the saved inner-call counter, with the launch snapshot saved as outer state.
        opt.wait_outer_step()
    # Load: megatron-core needs a ``step`` in every Adam state; save: the model-space state needs
    # the Adam moments to exist (a save before the first step stores fresh zeros).
    ckpt.ensure_adam_step_state(opt.members)
    sd = opt.optimizer.sharded_state_dict(model_sharded_state_dict, is_loading, **kwargs)
    if not isinstance(sd, dict):
        raise TypeError(f"expected a dict from {type(opt.optimizer).__name__}.sharded_state_dict, got {type(sd)}")
    metas = ckpt.model_param_metadata(model_sharded_state_dict)
    opt._param_keys = ckpt.param_keys(metas)
    if is_loading:
        return _load_request(opt, sd, content, metas)
    saved_facts = metadata(opt)
    if isinstance(content, dict):
        content[ckpt.METADATA_KEY] = saved_facts
    record = ckpt.rank_record(opt.shards, opt.worker_index, opt.worker_rank, opt.worker_size, opt.log,
                              opt._param_keys)
    sd[ckpt.OUTER_KEY] = {
        "tensors": ckpt.build_save_state(opt.strategy_of, opt.shards, opt.worker_index, metas,
                                         opt._save_overrides, shared=outer_shared(opt)),
        "ranks": ckpt.gather_rank_records(record),
        "scalars": saved_facts,
    }
    return sd


def _load_request(opt: "OuterLoopOptimizer", sd: dict, content, metas) -> dict:
    saved = content.get(ckpt.METADATA_KEY) if isinstance(content, dict) else None
    if saved is None and isinstance(content, dict):
        return sd  # a checkpoint without outer state
    if saved is not None:
        ckpt.check_saved_metadata(saved, opt.num_workers, opt.algorithms, facts(opt))
        change = ckpt.describe_inner_steps_change(saved, opt.config.inner_steps)
        if change:
            logger.warning(change)
            if not dist.is_initialized() or dist.get_rank() == 0:
                print(change, flush=True)
    sd[ckpt.OUTER_KEY] = {"tensors": ckpt.build_load_request(opt.strategy_of, opt.shards, opt.worker_index,
                                                             metas, saved, shared=outer_shared(opt))}
    return sd


def load_state_dict(opt: "OuterLoopOptimizer", state_dict) -> None:
    """The wrapped optimizer's state, then the outer state: counters, each worker's own per-element
    state (Megatron loaded worker 0's into every worker), the merge due, the params published."""
    outer = state_dict.pop(ckpt.OUTER_KEY, None) if isinstance(state_dict, dict) else None
    # no_grad: megatron-core 0.19.2's DistributedOptimizer copies loaded values into fp32
    # main params that are views of model params (leaves requiring grad) in place.
    with torch.no_grad():
        opt.optimizer.load_state_dict(state_dict)
    if outer is None:
        logger.warning("checkpoint has no sparseloco outer state: θ_outer is anchored on the loaded params at the "
                       "first step, error feedback / outer momentum start from zero")
        return
    scalars = outer["scalars"]
    opt.inner_calls = int(scalars["inner_calls"])
    outer_steps = int(scalars["outer_steps"])
    opt.rounds.restore_counters(outer_steps, [int(n) for n in scalars.get("fragment_syncs", [outer_steps])],
                                opt.inner_calls)
    # Megatron loaded worker 0's params / moments into every worker: put each worker's back,
    # sliced for this rank's ranges (which may differ from the saving run's).
    ckpt.restore_state(opt.strategy_of, opt.shards, outer["tensors"], opt._param_keys)
    ckpt.restore_scalars(opt.shards, opt.worker_index, opt.worker_rank, opt.worker_size, opt.log,
                         outer["ranks"], opt._param_keys)
    opt._anchor_at_first_step = False
    opt.rounds.load_state_dict(scalars)
    opt.publish()


__all__ = ["facts", "load_state_dict", "metadata", "save_with_outer_params", "sharded_state_dict"]

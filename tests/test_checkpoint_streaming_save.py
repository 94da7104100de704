"""The outer state's checkpoint save streams from the live state: no assembled copies, θ_outer once.

4 gloo ranks = 2 workers x 2 data-parallel ranks; each worker's two ranks split 4 model params
(a layer-stacked matrix cut mid-row, a SwiGLU fc1 weight behind megatron-core's ShardedTensorFactory
cut inside its w half, a whole matrix, a 1-D tensor) as a distributed optimizer would. Every per-element
state (θ_outer, DiLoCo momentum, fp32 main params, Adam moments) is saved with megatron-core's
``dist_checkpointing.save`` (torch_dist) and loaded back into zeroed state. Checked:

- building the save state allocates nothing (tensor accounting: 0 bytes; before: every state of
  every param the rank owned, assembled whole) and every chunk is a view of the live state;
- trading θ_outer and θ_local for a save (``exchange_outer_and_local``) allocates at most one shard
  tensor, never the shard;
- θ_outer (identical on both workers) is in the checkpoint once, under one key per param, with
  chunks tiling each param exactly; the per-worker states once per worker;
- the load gives back every state bit for bit, on every rank.
"""
from __future__ import annotations

import math

import pytest
import torch

from megatron_sparseloco.testing.multirank import run_ranks

#: (checkpoint key, local shape, kind): kind "layer<i>" = decoder.layers.* stacked over 2 layers
PARAMS = [("decoder.layers.mlp.linear_fc2.weight", (6, 8), "layer0"),
          ("decoder.layers.mlp.linear_fc2.weight", (6, 8), "layer1"),
          ("decoder.layers.mlp.linear_fc1.weight", (8, 6), "swiglu"),
          ("output_layer.weight", (5, 6), "plain"),
          ("decoder.final_layernorm.weight", (7,), "plain")]
#: data-parallel rank -> [(param index, start, end)]: param 1 cut at element 28 (row 3, col 4), the
#: SwiGLU weight at 21 (inside w = rows 0..3), param 3 on rank 1 only
LAYOUT = {0: [(0, 0, 48), (1, 0, 28), (2, 0, 21)], 1: [(1, 28, 48), (2, 21, 48), (3, 0, 30), (4, 0, 7)]}


def _metas(model):
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
    metas = {}
    for (key, _, kind), p in zip(PARAMS, model):
        if kind.startswith("layer"):
            sh = ShardedTensor.from_rank_offsets(key, p, (0, int(kind[-1]), 2), replica_id=(0, 0, 0),
                                                 prepend_axis_num=1)
        else:
            sh = ShardedTensor.from_rank_offsets(key, p, replica_id=(0, 0, 0))
            if kind == "swiglu":
                sh = apply_swiglu_sharded_factory(sh, ())
        metas[id(p)] = sh
    return metas


class _Inner:
    """What checkpointing reads of a megatron-core optimizer: its torch optimizer."""

    def __init__(self, tensors):
        self.optimizer = torch.optim.Adam(tensors, lr=1e-3)
        for t in tensors:
            t.grad = torch.randn_like(t)
        self.optimizer.step()


def _member(rank, group_in_worker, cross_group, worker):
    from megatron_sparseloco.megatron.main_params import MainParamShards
    from megatron_sparseloco.outer import DiLoCo, DiLoCoConfig
    model = [torch.nn.Parameter(torch.zeros(shape)) for _, shape, _ in PARAMS]
    mine = LAYOUT[rank % 2]
    g = torch.Generator().manual_seed(100 + worker)          # this worker's own θ_local
    main = [torch.randn(b - a, generator=g) for _, a, b in mine]
    shards = MainParamShards(optimizer=_Inner(main), tensors=main, names=[f"p{i}" for i, _, _ in mine],
                             model_params=[model[i] for i, _, _ in mine], ranges=[(a, b) for _, a, b in mine],
                             all_model_params=model, shard_group=group_in_worker)
    strategy = DiLoCo(main, cross_group, DiLoCoConfig(bucket_numel=16))
    shared = torch.Generator().manual_seed(7)                 # θ_outer: the same on both workers
    full = {i: torch.randn(math.prod(s), generator=shared) for i, (_, s, _) in enumerate(PARAMS)}
    with torch.no_grad():
        strategy.anchor.copy_(torch.cat([full[i][a:b] for i, a, b in mine]))
        strategy.momentum.normal_(generator=g)
    return model, shards, strategy


def _snapshot(shards, strategy):
    from megatron_sparseloco.megatron.checkpoint import outer_state as ckpt
    return {k: [t.detach().clone() for t in v] for k, v in ckpt.elementwise_state(shards, strategy).items()}


def _rank(rank, world, ckpt_dir):
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from torch.distributed.checkpoint import FileSystemReader

    from megatron_sparseloco.megatron.checkpoint import outer_state as ckpt
    from megatron_sparseloco.testing.cpu_bridges import apply_cpu_bridges
    from megatron_sparseloco.testing.tensor_accounting import TensorAccounting

    apply_cpu_bridges()   # megatron-core's writer synchronizes CUDA (no-op with a GPU)
    worker = rank // 2
    in_worker, _ = dist.new_subgroups_by_enumeration([[0, 1], [2, 3]])
    cross, _ = dist.new_subgroups_by_enumeration([[0, 2], [1, 3]])
    model, shards, strategy = _member(rank, in_worker, cross, worker)
    metas = _metas(model)
    before = _snapshot(shards, strategy)
    live = [t for ts in ckpt.elementwise_state(shards, strategy).values() for t in ts]
    out = {"largest_tensor": max(t.numel() * 4 for t in shards.tensors), "shard": 4 * strategy.params.numel}

    with TensorAccounting() as acc:
        ckpt.exchange_outer_and_local(strategy)
        swapped = (torch.equal(shards.tensors[0], before["outer.anchor"][0])
                   and torch.equal(strategy.anchor[:shards.tensors[0].numel()], before["inner.main_param"][0]))
        ckpt.exchange_outer_and_local(strategy)
    out["exchange_peak"], out["swapped"] = acc.peak["cpu"], swapped

    with TensorAccounting() as acc:
        sd = ckpt.build_save_state([strategy], [shards], worker, metas, shared=True)
    out["build_peak"], out["build_live"] = acc.peak["cpu"], acc.live["cpu"]
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory
    chunks = list(nested_values(sd))
    out["factories"] = sum(isinstance(c, ShardedTensorFactory) for c in chunks)
    spans = [(t.untyped_storage().data_ptr(), t.untyped_storage().data_ptr() + t.untyped_storage().nbytes())
             for t in live]
    out["views"] = all(any(lo <= c.data.data_ptr() < hi for lo, hi in spans) for c in chunks)

    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async
    filesystem_async._results_queue = queue.Queue()   # in-process (megatron's spawns a Manager; see prefork)
    dist_checkpointing.save({"opt": sd}, ckpt_dir)
    dist.barrier()
    meta = FileSystemReader(ckpt_dir).read_metadata().state_dict_metadata
    out["stored"] = {k: (tuple(m.size), sum(math.prod(c.sizes) for c in m.chunks)) for k, m in meta.items()
                     if k.startswith(ckpt.STATE_PREFIX)}

    # load into zeroed state
    with torch.no_grad():
        for ts in ckpt.elementwise_state(shards, strategy).values():
            for t in ts:
                t.zero_()
    saved = {"format": ckpt.FORMAT_VERSION, "states": {"dense": sorted(before)}}
    request = ckpt.build_load_request([strategy], [shards], worker, metas, saved, shared=True)
    loaded = dist_checkpointing.load({"opt": request}, ckpt_dir)["opt"]
    ckpt.restore_state([strategy], [shards], loaded, ckpt.param_keys(metas))
    after = _snapshot(shards, strategy)
    out["bitwise"] = {k: all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(before[k], after[k]))
                      for k in before}
    return out


@pytest.mark.multirank
@pytest.mark.timeout(300)
def test_streaming_save_views_the_live_state_writes_theta_outer_once_and_loads_bitwise(tmp_path):
    (tmp_path / "ckpt").mkdir()
    res = run_ranks(_rank, 4, args=(str(tmp_path / "ckpt"),), timeout=240)
    for rank, r in enumerate(res):
        assert r["build_peak"] == 0 and r["build_live"] == 0, r      # no assembled copy of anything
        assert r["views"] and r["factories"] == 0, r                  # every chunk views the live state
        assert r["swapped"] and 0 < r["exchange_peak"] <= r["largest_tensor"] < r["shard"], r
        assert all(r["bitwise"].values()), (rank, r["bitwise"])
    stored = res[0]["stored"]
    anchor = {k for k in stored if ".outer.anchor." in k}
    assert anchor and all(k.startswith("optimizer.sparseloco.outer.anchor.") for k in anchor), sorted(stored)
    per_worker = {k for k in stored if k not in anchor}
    for w in (0, 1):
        for state in ("outer.momentum", "inner.main_param", "inner.exp_avg", "inner.exp_avg_sq"):
            assert any(k.startswith(f"optimizer.sparseloco.worker{w}.{state}.") for k in per_worker), (w, state)
    for k, (size, chunk_elements) in stored.items():   # chunks tile each tensor once: no copy twice
        assert chunk_elements == math.prod(size), (k, size, chunk_elements)

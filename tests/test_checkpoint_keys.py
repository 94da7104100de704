"""The outer state's checkpoint keys say what they hold (member kind, param checkpoint key), and the
metadata of checkpoints written with the old positional keys (``m{i}``) still loads. One process."""
from __future__ import annotations

import pytest
import torch

from megatron_sparseloco.megatron.checkpoint import outer_state as ckpt
from megatron_sparseloco.megatron.main_params import MainParamShards
from megatron_sparseloco.outer import DiLoCo, DiLoCoConfig

mapping = pytest.importorskip("megatron.core.dist_checkpointing.mapping")

KEYS = ["decoder.layers.0.mlp.weight", "decoder.final_norm.weight"]


def _member(expert: bool = False, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    model = [torch.randn(3, 4, generator=g), torch.randn(5, generator=g)]
    for p in model:
        if expert:
            p.allreduce = False
    main = [p.clone() for p in model]
    shards = MainParamShards(optimizer=object(), tensors=main, names=["mlp", "norm"], model_params=model,
                             ranges=[(0, p.numel()) for p in model], all_model_params=list(model))
    metas = {id(p): mapping.ShardedTensor.from_rank_offsets(k, p, replica_id=0) for p, k in zip(model, KEYS)}
    strategy = DiLoCo(main, None, DiLoCoConfig())
    return shards, strategy, metas


def test_member_keys_name_the_kind():
    dense, expert = _member()[0], _member(expert=True)[0]
    assert ckpt.member_keys([dense]) == ["dense"]
    assert ckpt.member_keys([dense, expert]) == ["dense", "expert"]
    assert ckpt.member_keys([dense, dense, expert]) == ["dense0", "dense1", "expert"]


def test_save_and_load_keys_say_what_they_hold():
    shards, strategy, metas = _member()
    saved = ckpt.build_save_state([strategy], [shards], 0, metas)
    assert list(saved) == ["dense"]
    assert set(saved["dense"]) == {"outer.anchor", "outer.momentum", "inner.main_param"}
    assert set(saved["dense"]["outer.anchor"]) == set(KEYS)
    assert {sh.key for sh in saved["dense"]["outer.anchor"][KEYS[0]]} == {f"optimizer.sparseloco.worker0.outer.anchor.{KEYS[0]}"}
    request = ckpt.build_load_request([strategy], [shards], 0, metas, None)
    assert {k: set(v) for k, v in request["dense"].items()} == {k: set(v) for k, v in saved["dense"].items()}
    # θ_outer identical on every worker (diloco): one key for all workers, worker w's copy is replica w
    shared = ckpt.build_save_state([strategy], [shards], 1, metas, shared=True)
    anchor = {sh.key for sh in shared["dense"]["outer.anchor"][KEYS[0]]}
    assert anchor == {f"optimizer.sparseloco.outer.anchor.{KEYS[0]}"}
    momentum = {sh.key for sh in shared["dense"]["outer.momentum"][KEYS[0]]}
    assert momentum == {f"optimizer.sparseloco.worker1.outer.momentum.{KEYS[0]}"}
    states = {"states": {"dense": sorted(saved["dense"])}}
    request = ckpt.build_load_request([strategy], [shards], 1, metas, {"format": 3, **states}, shared=True)
    assert request["dense"]["outer.anchor"][KEYS[0]].key == f"optimizer.sparseloco.outer.anchor.{KEYS[0]}"
    old = ckpt.build_load_request([strategy], [shards], 1, metas, {"format": 2, **states}, shared=True)  # per worker
    assert old["dense"]["outer.anchor"][KEYS[0]].key == f"optimizer.sparseloco.worker1.outer.anchor.{KEYS[0]}"


@pytest.mark.parametrize("member_key", ["dense", "m0"])  # "m0": checkpoints written before members had names
def test_metadata_with_new_or_old_member_keys_loads(member_key):
    shards, strategy, metas = _member()
    states = sorted(ckpt.elementwise_state(shards, strategy))
    request = ckpt.build_load_request([strategy], [shards], 0, metas, {"states": {member_key: states}})
    # what dist_checkpointing hands back: the requested tensors, filled
    loaded = {m: {name: {k: sh.data.copy_(torch.full_like(sh.data, float(len(name)))) for k, sh in per.items()}
                  for name, per in member.items()} for m, member in request.items()}
    ckpt.restore_state([strategy], [shards], loaded, ckpt.param_keys(metas))
    assert torch.equal(strategy.anchor, torch.full_like(strategy.anchor, float(len("outer.anchor"))))
    assert torch.equal(strategy.momentum, torch.full_like(strategy.momentum, float(len("outer.momentum"))))
    with pytest.raises(ckpt.OuterStateLayoutError, match=r"no \['outer.momentum'\] for the dense optimizer"):
        ckpt.build_load_request([strategy], [shards], 0, metas,
                                {"states": {member_key: [s for s in states if s != "outer.momentum"]}})

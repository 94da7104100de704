"""megatron/model_space.py on 3 gloo ranks: whole params reassembled bit for bit from uneven
per-rank ranges (a rank holding nothing of one param, one holding nothing at all), -0.0 and NaN
payloads kept, bf16 state, and exactly one first holder per param."""
from __future__ import annotations

import pytest
import torch

from megatron_sparseloco.megatron.main_params import MainParamShards
from megatron_sparseloco.megatron.model_space import assemble_whole_params, first_holders, owned_piece
from megatron_sparseloco.testing.multirank import run_ranks

SHAPES = [(4, 5), (7,), (3, 2)]
# rank -> [(param index, start, end)]: param 0 split 0:8 / 8:20, param 1 on rank 1 only,
# param 2 split 0:1 / 1:6; rank 2 holds nothing
LAYOUT = {0: [(0, 0, 8), (2, 0, 1)], 1: [(0, 8, 20), (1, 0, 7), (2, 1, 6)], 2: []}


def _reference(dtype):
    g = torch.Generator().manual_seed(3)
    ref = [torch.randn(s, generator=g).to(dtype) for s in SHAPES]
    ref[0].view(-1)[3] = -0.0
    ref[2].view(-1)[4] = float("nan")
    return ref


def _fn(rank: int, world_size: int) -> dict:
    import torch.distributed as dist

    group = dist.new_group(list(range(world_size)))
    params = [torch.nn.Parameter(torch.zeros(s)) for s in SHAPES]
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        ref = _reference(dtype)
        mine = LAYOUT[rank]
        shards = MainParamShards(optimizer=None, tensors=[], names=[f"p{i}" for i, _, _ in mine],
                                 model_params=[params[i] for i, _, _ in mine], ranges=[(a, b) for _, a, b in mine],
                                 all_model_params=params, shard_group=group)
        pieces = [ref[i].reshape(-1)[a:b].clone() for i, a, b in mine]
        whole = assemble_whole_params(shards, pieces, dtype)
        out[str(dtype)] = [whole[id(p)].clone() for p in params]
        # the inverse: each rank slices its range back out of the whole params
        out[f"back {dtype}"] = all(torch.equal(owned_piece(whole[id(params[i])], a, b).view(torch.uint8),
                                               piece.view(torch.uint8)) for (i, a, b), piece in zip(mine, pieces))
    out["first"] = first_holders(shards)
    return out


def test_whole_params_are_exact_bitwise_and_first_holders_unique():
    res = run_ranks(_fn, world_size=3, timeout=90)
    for dtype in (torch.float32, torch.bfloat16):
        ref = _reference(dtype)
        for r in range(3):
            got = res[r][str(dtype)]
            for p, (g, want) in enumerate(zip(got, ref)):
                assert g.dtype == dtype and g.shape == want.shape
                assert torch.equal(g.view(torch.uint8), want.view(torch.uint8)), (r, p, dtype)
            assert res[r][f"back {dtype}"]
        assert torch.signbit(res[0][str(dtype)][0].view(-1)[3]) and torch.isnan(res[2][str(dtype)][2].view(-1)[4])
    # param 0: ranks 0, 1 -> rank 0 first; param 1: rank 1 only; param 2: ranks 0, 1 -> rank 0
    assert res[0]["first"] == [True, True]
    assert res[1]["first"] == [False, True, False]
    assert res[2]["first"] == []


def test_mismatched_piece_is_refused():
    p = torch.nn.Parameter(torch.zeros(4))
    shards = MainParamShards(optimizer=None, tensors=[], names=["p"], model_params=[p], ranges=[(0, 2)],
                             all_model_params=[p], shard_group=None)
    with pytest.raises(ValueError, match=r"range \[0, 2\)"):
        assemble_whole_params(shards, [torch.zeros(3)], torch.float32)
    with pytest.raises(ValueError, match="float32 expected"):
        assemble_whole_params(shards, [torch.zeros(2, dtype=torch.bfloat16)], torch.float32)

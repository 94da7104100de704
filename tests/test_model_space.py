"""megatron/model_space.py on 3 gloo ranks: whole params reassembled bit for bit on their owner
(the holder of the first element) from uneven per-rank ranges (a param on one rank only, a rank
holding nothing), -0.0 and NaN payloads kept, bf16 state; ranges that do not tile are refused."""
from __future__ import annotations

import pytest
import torch

from megatron_sparseloco.megatron.main_params import MainParamShards
from megatron_sparseloco.megatron.model_space import gather_owned_whole_params, owned_piece, piece_table
from megatron_sparseloco.testing.multirank import run_ranks

SHAPES = [(4, 5), (7,), (3, 2)]
# rank -> [(param index, start, end)]: param 0 split 0:8 (rank 1) / 8:20 (rank 0), param 1 on rank 1
# only, param 2 split 0:1 (rank 0) / 1:6 (rank 1); rank 2 holds nothing
LAYOUT = {0: [(0, 8, 20), (2, 0, 1)], 1: [(0, 0, 8), (1, 0, 7), (2, 1, 6)], 2: []}
OWNER = {0: 1, 1: 1, 2: 0}


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
        table = piece_table(shards)
        whole = gather_owned_whole_params(shards, table, pieces)
        out[str(dtype)] = {j: t.clone() for j, t in whole.items()}
        out["owners"] = {j: table.owner(j) for j in table.holders}
    # pieces that leave a gap are refused on every rank
    bad = [(i, a, b) for i, a, b in LAYOUT[rank] if not (i == 1)] + ([(1, 0, 6)] if rank == 1 else [])
    shards = MainParamShards(optimizer=None, tensors=[], names=["x"] * len(bad), model_params=[params[i] for i, _, _ in bad],
                             ranges=[(a, b) for _, a, b in bad], all_model_params=params, shard_group=group)
    try:
        piece_table(shards)
        out["gap"] = None
    except AssertionError as exc:
        out["gap"] = str(exc)
    return out


def test_whole_params_are_exact_bitwise_on_their_owner():
    res = run_ranks(_fn, world_size=3, timeout=90)
    for dtype in (torch.float32, torch.bfloat16):
        ref = _reference(dtype)
        for r in range(3):
            got = res[r][str(dtype)]
            assert sorted(got) == sorted(j for j, o in OWNER.items() if o == r), (r, sorted(got))
            for j, g in got.items():
                assert g.dtype == dtype and g.shape == ref[j].shape
                assert torch.equal(g.view(torch.uint8), ref[j].view(torch.uint8)), (r, j, dtype)
        assert torch.signbit(res[1][str(dtype)][0].view(-1)[3]) and torch.isnan(res[0][str(dtype)][2].view(-1)[4])
    for r in range(3):
        assert res[r]["owners"] == OWNER
        assert res[r]["gap"] is not None and "do not tile its 7 elements" in res[r]["gap"]


def test_owned_piece_is_the_range():
    whole = torch.arange(12.0).view(3, 4)
    assert owned_piece(whole, 5, 9).tolist() == [5.0, 6.0, 7.0, 8.0]


def test_mismatched_piece_is_refused():
    p = torch.nn.Parameter(torch.zeros(4))
    shards = MainParamShards(optimizer=None, tensors=[], names=["p"], model_params=[p], ranges=[(0, 2)],
                             all_model_params=[p], shard_group=None)
    table = piece_table(shards)
    with pytest.raises(ValueError, match=r"range \[0, 2\)"):
        gather_owned_whole_params(shards, table, [torch.zeros(3)])


@pytest.mark.parametrize("saved, match", [
    ({"format": 1, "num_workers": 2, "algorithms": ["sparseloco"]}, "format 1"),
    ({"format": 2, "num_workers": 4, "algorithms": ["sparseloco"]}, "--sparseloco-workers 4"),
    ({"format": 2, "num_workers": 2, "algorithms": ["diloco"]}, "--sparseloco-algorithm diloco"),
])
def test_checkpoint_metadata_mismatch_names_the_flag(saved, match):
    from megatron_sparseloco.megatron.checkpointing import OuterStateLayoutError, check_saved_metadata
    with pytest.raises(OuterStateLayoutError, match=match):
        check_saved_metadata(saved, num_workers=2, algorithms=["sparseloco"])
    check_saved_metadata({"format": 2, "num_workers": 2, "algorithms": ["sparseloco"]}, 2, ["sparseloco"])


TENSOR = {"chunking": {"value": "tensor", "flag": "--sparseloco-chunking"}}


@pytest.mark.parametrize("saved_facts, match", [
    ({"chunking": {"value": "flat", "flag": "--sparseloco-chunking"}}, "--sparseloco-chunking flat"),
    (None, "--sparseloco-chunking flat"),  # written before chunking was recorded: those chunked flat
])
def test_checkpoint_chunking_mismatch_names_the_flag(saved_facts, match):
    from megatron_sparseloco.megatron.checkpointing import OuterStateLayoutError, check_saved_metadata
    saved = {"format": 2, "num_workers": 2, "algorithms": ["sparseloco"]}
    if saved_facts is not None:
        saved["facts"] = saved_facts
    with pytest.raises(OuterStateLayoutError, match=match) as err:
        check_saved_metadata(saved, 2, ["sparseloco"], TENSOR)
    assert "--no-load-optim" in str(err.value)
    check_saved_metadata(dict(saved, facts=TENSOR), 2, ["sparseloco"], TENSOR)


AGG = {"aggregation": {"value": "allgather", "flag": "--sparseloco-aggregation"}}


@pytest.mark.parametrize("saved, match", [
    ({"facts": {"aggregation": {"value": "reduce-scatter", "flag": "--sparseloco-aggregation"}}},
     "--sparseloco-aggregation reduce-scatter"),
    # written before the aggregation was recorded: told by the owners' error feedback in the states
    ({"states": {"m0": ["outer.anchor", "outer.error_feedback", "outer.owner_error_feedback"]}},
     "--sparseloco-aggregation reduce-scatter"),
])
def test_checkpoint_aggregation_mismatch_names_the_flag(saved, match):
    """An all-gather resume of a reduce-scatter checkpoint would silently drop the owners' error
    feedback (and the other way round find none): refused, naming the flag and the way out."""
    from megatron_sparseloco.megatron.checkpointing import OuterStateLayoutError, check_saved_metadata
    base = {"format": 2, "num_workers": 2, "algorithms": ["sparseloco"], **saved}
    with pytest.raises(OuterStateLayoutError, match=match) as err:
        check_saved_metadata(base, 2, ["sparseloco"], AGG)
    assert "--no-load-optim" in str(err.value)
    # an all-gather checkpoint from before the fact was recorded resumes with all-gather
    check_saved_metadata({"format": 2, "num_workers": 2, "algorithms": ["sparseloco"],
                          "states": {"m0": ["outer.anchor", "outer.error_feedback"]}}, 2, ["sparseloco"], AGG)

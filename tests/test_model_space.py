"""megatron/checkpoint/model_space.py: a flat range as boxes of the parameter (tiling it exactly, each a
contiguous run); on 3 gloo ranks the owners (holders of the first element) of params split over
uneven per-rank ranges (a param on one rank only, a rank holding nothing); ranges that do not tile
are refused."""
from __future__ import annotations

import pytest
import torch

from megatron_sparseloco.megatron.main_params import MainParamShards
from megatron_sparseloco.megatron.checkpoint.model_space import flat_range_boxes, owned_piece, piece_table
from megatron_sparseloco.testing.multirank import run_ranks

SHAPES = [(4, 5), (7,), (3, 2)]
# rank -> [(param index, start, end)]: param 0 split 0:8 (rank 1) / 8:20 (rank 0), param 1 on rank 1
# only, param 2 split 0:1 (rank 0) / 1:6 (rank 1); rank 2 holds nothing
LAYOUT = {0: [(0, 8, 20), (2, 0, 1)], 1: [(0, 0, 8), (1, 0, 7), (2, 1, 6)], 2: []}
OWNER = {0: 1, 1: 1, 2: 0}


def _fn(rank: int, world_size: int) -> dict:
    import torch.distributed as dist

    group = dist.new_group(list(range(world_size)))
    params = [torch.nn.Parameter(torch.zeros(s)) for s in SHAPES]
    mine = LAYOUT[rank]
    shards = MainParamShards(optimizer=None, tensors=[], names=[f"p{i}" for i, _, _ in mine],
                             model_params=[params[i] for i, _, _ in mine], ranges=[(a, b) for _, a, b in mine],
                             all_model_params=params, shard_group=group)
    table = piece_table(shards)
    out = {"owners": {j: table.owner(j) for j in table.holders}}
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


def test_owners_are_the_first_holders_and_gaps_are_refused():
    res = run_ranks(_fn, world_size=3, timeout=90)
    for r in range(3):
        assert res[r]["owners"] == OWNER
        assert res[r]["gap"] is not None and "do not tile its 7 elements" in res[r]["gap"]


@pytest.mark.parametrize("shape", [(4, 5), (7,), (3, 2, 4), (2, 3, 2, 2), ()])
def test_flat_range_boxes_tile_the_range_with_contiguous_runs(shape):
    """Every range [a, b) of the tensor: its boxes are, in order, exactly its elements (each a
    contiguous run), and there are at most 2·(ndim − 1) + 1 of them."""
    whole = torch.arange(max(1, torch.Size(shape).numel())).view(shape)
    n = whole.numel()
    for a in range(n + 1):
        for b in range(a, n + 1):
            boxes = flat_range_boxes(shape, a, b)
            assert len(boxes) <= max(1, 2 * (len(shape) - 1) + 1), (a, b, boxes)
            got = []
            for offset, size, s, e in boxes:
                box = whole[tuple(slice(o, o + z) for o, z in zip(offset, size))]
                assert box.shape == torch.Size(size) and box.reshape(-1).tolist() == list(range(s, e)), (a, b, boxes)
                got += list(range(s, e))
            assert got == list(range(a, b))
    with pytest.raises(ValueError, match="not inside"):
        flat_range_boxes(shape, 0, n + 1)


def test_owned_piece_is_the_range():
    whole = torch.arange(12.0).view(3, 4)
    assert owned_piece(whole, 5, 9).tolist() == [5.0, 6.0, 7.0, 8.0]


@pytest.mark.parametrize("saved, match", [
    ({"format": 1, "num_workers": 2, "algorithms": ["sparseloco"]}, "format 1, this version reads 2 and 3"),
    ({"format": 2, "num_workers": 4, "algorithms": ["sparseloco"]}, "--sparseloco-workers 4"),
    ({"format": 2, "num_workers": 2, "algorithms": ["diloco"]}, "--sparseloco-algorithm diloco"),
])
def test_checkpoint_metadata_mismatch_names_the_flag(saved, match):
    from megatron_sparseloco.megatron.checkpoint.outer_state import OuterStateLayoutError, check_saved_metadata
    with pytest.raises(OuterStateLayoutError, match=match):
        check_saved_metadata(saved, num_workers=2, algorithms=["sparseloco"])
    check_saved_metadata({"format": 2, "num_workers": 2, "algorithms": ["sparseloco"]}, 2, ["sparseloco"])


TENSOR = {"chunking": {"value": "tensor", "flag": "--sparseloco-chunking"}}


@pytest.mark.parametrize("saved_facts, match", [
    ({"chunking": {"value": "flat", "flag": "--sparseloco-chunking"}}, "--sparseloco-chunking flat"),
    (None, "--sparseloco-chunking flat"),  # written before chunking was recorded: those chunked flat
])
def test_checkpoint_chunking_mismatch_names_the_flag(saved_facts, match):
    from megatron_sparseloco.megatron.checkpoint.outer_state import OuterStateLayoutError, check_saved_metadata
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
    from megatron_sparseloco.megatron.checkpoint.outer_state import OuterStateLayoutError, check_saved_metadata
    base = {"format": 2, "num_workers": 2, "algorithms": ["sparseloco"], **saved}
    with pytest.raises(OuterStateLayoutError, match=match) as err:
        check_saved_metadata(base, 2, ["sparseloco"], AGG)
    assert "--no-load-optim" in str(err.value)
    # an all-gather checkpoint from before the fact was recorded resumes with all-gather
    check_saved_metadata({"format": 2, "num_workers": 2, "algorithms": ["sparseloco"],
                          "states": {"m0": ["outer.anchor", "outer.error_feedback"]}}, 2, ["sparseloco"], AGG)

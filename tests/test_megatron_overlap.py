"""Delayed application (and fragments) in the real megatron.training loop: a save inside the overlap window resumes bitwise.

2 CPU ranks = 2 SparseLoCo workers, H = 5, τ = 3: round 1 launches at iteration 5 and merges at 8,
round 2 launches at 10 and is still in flight at 12. Run A trains 12 iterations and saves at 7
(inside round 1's window: the save waits for the collective, θ_outer,2 is saved with the launch
snapshot, the merge stays due at 8) and at 12 (inside round 2's window). Run B resumes from A's
iteration-7 checkpoint. Losses 9..12 and the exact fingerprints of θ_outer and of every rank's
fp32 main params at the end must be equal; the log line reports the exposed outer time.
"""
import pytest

from test_checkpoint_resume import ITERS, _run, assert_resumed_bitwise, save_and_resume

TAU = 3


@pytest.mark.timeout(900)
def test_save_inside_overlap_window_resumes_bitwise(tmp_path, corpus):
    # the merge at 8 happens after iteration 8's loss, so B's first loss already matches A's
    res_a, sum_a, res_b, sum_b = save_and_resume(tmp_path, corpus, ["--sparseloco-overlap-steps", str(TAU)])
    assert_resumed_bitwise(res_a, sum_a, res_b, sum_b)
    assert sum_a["outer_steps"] == sum_b["outer_steps"] == ITERS // 5
    log_a = "\n".join(res_a["log_lines"])
    assert "exposed:" in log_a, log_a[-2000:]


FRAGMENTS = ["--sparseloco-fragments", "2", "--sparseloco-overlap-steps", "1"]


@pytest.mark.timeout(900)
def test_fragments_save_inside_a_fragment_window_resumes_bitwise(tmp_path, corpus):
    """P = 2 fragments with τ = 1 (H = 5: fragment 0 launches at 5, 10 and merges at 6, 11; fragment 1,
    offset 2, launches at 2, 7, 12 and merges at 3, 8). The save at 7 falls inside fragment 1's window:
    the resumed run's losses, θ_outer of both fragments and every rank's main params are bitwise A's."""
    res_a, sum_a, res_b, sum_b = save_and_resume(tmp_path, corpus, FRAGMENTS)
    assert_resumed_bitwise(res_a, sum_a, res_b, sum_b)
    assert sum_a["outer_steps"] == sum_b["outer_steps"] >= 4   # fragment syncs
    # a resume with another P is refused before training, naming the flag
    res_c, _ = _run(tmp_path, corpus, "c", ["--sparseloco-overlap-steps", "1", "--load", str(tmp_path / "ckpt_b")],
                    expect_ok=False)
    assert res_c["returncode"] != 0
    assert "--sparseloco-fragments 2" in "\n".join(res_c["log_lines"]), "\n".join(res_c["log_lines"][-30:])


# ---------------------------------------------------------------------------- τ (and P) with TP2 / PP2
def _theta_outer_identical_by_place(ranks):
    by_place = {}
    for r in ranks:
        by_place.setdefault((r["pp_rank"], r["tp_rank"], r["ep_rank"]), []).append(r)
    for place, group in by_place.items():
        assert group[0]["theta_outer"], place
        assert all(o["theta_outer"] == group[0]["theta_outer"] for o in group[1:]), place


SMALL_CODEC = ["--sparseloco-topk", "8", "--sparseloco-chunk-size", "256"]


@pytest.mark.multirank
@pytest.mark.megatron
@pytest.mark.timeout(600)
def test_overlap_tp2_two_workers_identical(tmp_path):
    """TP 2 × W 2 (4 ranks), SparseLoCo with τ = 1 and the lerp merge at α = 0 (θ ← θ_outer,k+1): the run
    ends right after round 2's merge (H = 4, 9 iterations), so every worker holds exactly θ_outer."""
    from test_megatron_semantics import assert_identical_replicas, launch, tail
    res, ranks = launch(tmp_path, "tp2_tau", nproc=4, workers=2, H=4, iters=9,
                        extra=["--tensor-model-parallel-size", "2", "--sparseloco-overlap-steps", "1",
                               "--sparseloco-overlap-merge", "lerp", "--sparseloco-overlap-alpha", "0"] + SMALL_CODEC)
    assert res["returncode"] == 0, tail(res)
    assert len(ranks) == 4 and all(r["outer_steps"] == 2 for r in ranks)
    _theta_outer_identical_by_place(ranks)
    assert_identical_replicas(ranks)


@pytest.mark.multirank
@pytest.mark.megatron
@pytest.mark.timeout(600)
def test_overlap_and_fragments_pp2_tied_two_workers(tmp_path):
    """PP 2 × W 2 (4 ranks, tied embedding / output layer on different stages), SparseLoCo with P = 2
    fragments and τ = 1, H = 4: fragment 0 (embedding, layer 0, the tied output-layer copy) launches at 4,
    8 and merges at 5, 9; fragment 1 (layer 1, final norm) at 2, 6 and 3, 7. After 9 iterations θ_outer
    is identical on both workers and each worker's tied copies are bitwise equal."""
    from test_megatron_semantics import launch, tail
    res, ranks = launch(tmp_path, "pp2_tau_frag", nproc=4, workers=2, H=4, iters=9,
                        extra=["--pipeline-model-parallel-size", "2"] + FRAGMENTS + SMALL_CODEC)
    assert res["returncode"] == 0, tail(res)
    assert len(ranks) == 4 and all(r["outer_steps"] == 4 for r in ranks), [r["outer_steps"] for r in ranks]
    _theta_outer_identical_by_place(ranks)
    for w in (0, 1):
        mine = [r for r in ranks if r["worker_of"][str(r["rank"])] == w]
        emb = [r["tied"]["embedding"] for r in mine if r["pp_rank"] == 0]
        out = [r["tied"]["output"] for r in mine if r["pp_rank"] == 1]
        assert len(emb) == len(out) == 1 and emb == out, (w, emb, out)


@pytest.mark.multirank
@pytest.mark.megatron
@pytest.mark.timeout(600)
def test_overlap_and_fragments_dp2_inside_each_worker(tmp_path):
    """W 2 × DP 2 inside each worker (4 ranks, the distributed optimizer shards each worker's state over
    its 2 ranks), DiLoCo with P = 2 fragments and τ = 1, H = 4: 4 fragment syncs, θ_outer identical
    across the workers at every place, and the two ranks of each worker hold the same model (the merge
    is published inside the worker)."""
    from test_megatron_semantics import launch, tail
    res, ranks = launch(tmp_path, "dp2_tau_frag", nproc=4, workers=2, algorithm="diloco", H=4, iters=9,
                        extra=FRAGMENTS)
    assert res["returncode"] == 0, tail(res)
    assert len(ranks) == 4 and all(r["outer_steps"] == 4 for r in ranks), [r["outer_steps"] for r in ranks]
    by_worker = [sorted((r for r in ranks if r["worker_of"][str(r["rank"])] == w), key=lambda r: r["rank"])
                 for w in (0, 1)]
    for shard in (0, 1):  # the i-th rank of each worker holds the same shard of θ_outer
        a, b = by_worker[0][shard], by_worker[1][shard]
        assert a["theta_outer"] and a["theta_outer"] == b["theta_outer"], (a["rank"], b["rank"])
    assert by_worker[0][0]["theta_outer"] != by_worker[0][1]["theta_outer"]  # two different shards
    for mine in by_worker:
        assert mine[0]["params"] and mine[0]["params"] == mine[1]["params"], [r["rank"] for r in mine]
    assert by_worker[0][0]["params"] != by_worker[1][0]["params"]  # the workers' local progress differs


@pytest.mark.multirank
@pytest.mark.megatron
@pytest.mark.timeout(600)
@pytest.mark.parametrize("cell", [
    dict(name="ep2_moe", num_layers=2, extra=["--expert-model-parallel-size", "2"]),
    dict(name="pp2_vpp2", num_layers=4, extra=["--pipeline-model-parallel-size", "2",
                                               "--num-virtual-stages-per-pipeline-rank", "2"]),
], ids=["W2-DP2-EP2-moe", "W2-PP2-VPP2"])
def test_fragments_with_experts_and_virtual_pipeline(tmp_path, cell):
    """SparseLoCo with P = 2 fragments and τ = 1, H = 4, 9 iterations (4 fragment syncs), on 4 ranks:
    MoE with EP 2 inside each worker (expert and dense params of one layer in the same fragment), and
    PP 2 × 2 virtual stages (each rank's two model chunks hold layers of both fragments: layers 0, 2 on
    stage 0, 1, 3 on stage 1). θ_outer is identical across the workers at every place; with VPP each
    worker's tied embedding / output-layer copies are bitwise equal."""
    from test_megatron_semantics import MOE, assert_tied_copies_identical, launch, tail
    extra = cell["extra"] + FRAGMENTS + SMALL_CODEC + (MOE if cell["name"] == "ep2_moe" else [])
    res, ranks = launch(tmp_path, cell["name"], nproc=4, workers=2, H=4, iters=9, num_layers=cell["num_layers"],
                        extra=extra)
    assert res["returncode"] == 0, tail(res)
    # 4 syncs in 9 iterations: 2 fragments × 2 rounds (without fragments: 2 outer steps)
    assert len(ranks) == 4 and all(r["outer_steps"] == 4 for r in ranks), [r["outer_steps"] for r in ranks]
    _theta_outer_identical_by_place(ranks)
    if cell["name"] == "pp2_vpp2":
        assert all(any(k.startswith("1.") for k in r["params"]) for r in ranks)  # two model chunks per rank
        for w in (0, 1):
            assert_tied_copies_identical([r for r in ranks if r["worker_of"][str(r["rank"])] == w])
    else:
        assert {r["ep_rank"] for r in ranks} == {0, 1}

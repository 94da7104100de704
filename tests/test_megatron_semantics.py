"""Semantics in the real megatron.training loop (examples/pretrain_gpt.py, --mock-data, CPU gloo).

Each run goes through ``tests/semantics_launcher.py``: megatron_sparseloco.run plus a collective spy
over the training loop and per-rank sha256 of every model parameter after training. What is
checked (issue 16):

- single_worker: W = 1 (given, or the default when DP > 1) trains with outer steps, every algorithm
  that allows it;
- inner_isolation: no collective whose group spans two workers between outer steps (loss
  reduction, timer barriers, rerun-machine flags are worker-local);
- stalled: a worker stopped with SIGSTOP (or killed) is named at the next outer step's arrival
  barrier: tests/test_megatron_faults.py (two launchers, the sbatch's watchdog settings);
- tied / virtual_pipeline: PP 2 (and 2 virtual stages per rank) keep the tied embedding and
  output layer bitwise identical;
- precision_aware: --use-precision-aware-optimizer / --optimizer-cpu-offload refused by flag
  validation, and a missing fp32 main param is an error, never skipped;
- inner_steps_changed / plain_megatron: resuming with another H is announced; the plugin off opens
  a plugin checkpoint (model + worker 0's optimizer state) naming the flags that continue the loop;
- checkpoint_model: the model part of a checkpoint saved mid-round is θ_outer (gasloc: the
  workers' mean), read back bit for bit by a plain Megatron load of the model alone;
- matrix cells: gasloc × TP 2, average × W = 1 × EP 2 (MoE);
- per-worker inner steps: a worker's inactive iterations run no forward/backward and are logged
  as skipped.
"""
from __future__ import annotations

import glob
import json
import os
import re

import pytest

from megatron_sparseloco.demo import build_command, run_training
from megatron_sparseloco.testing.prefork import use_prefork

LAUNCHER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "semantics_launcher.py")


def launch(tmp_path, name, *, nproc=2, workers=2, algorithm="sparseloco", H=2, iters=4, extra=(), env=None,
           timeout=240, workers_flag=True, num_layers=2):
    """One real pretrain run under the semantics launcher; returns (parsed log, per-rank reports)."""
    out = str(tmp_path / name)
    cmd = build_command({"train": "unused", "valid": "unused"}, nproc=nproc, workers=workers, algorithm=algorithm,
                        inner_steps=H, train_iters=iters, eval_interval=1000, eval_iters=1, log_interval=1,
                        micro_batch_size=2, seq_length=32,
                        extra=["--num-layers", str(num_layers), "--hidden-size", "64", "--mock-data",
                               "--split", "98,1,1"] + list(extra))
    i = cmd.index("--train-data-path")
    del cmd[i:i + 4]
    if "--sparseloco-inner-steps-per-worker" in extra and "auto" not in extra:  # it replaces H
        i = cmd.index("--sparseloco-inner-steps")
        del cmd[i:i + 2]
    if not workers_flag:
        i = cmd.index("--sparseloco-workers")
        del cmd[i:i + 2]
    i = cmd.index("megatron_sparseloco.run")
    cmd[i - 1:i + 1] = [LAUNCHER]
    saved = {k: os.environ.get(k) for k in ["SEMANTICS_OUT"] + list(env or {})}
    os.environ.update({"SEMANTICS_OUT": out, **(env or {})})
    try:
        res = run_training(use_prefork(cmd), out + "/train.log", out + "/summary.json", timeout=timeout, echo=lambda *_: None)
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    ranks = [json.load(open(p)) for p in sorted(glob.glob(out + "/rank*.json"), key=lambda p: int(p[-6:-5]))]
    return res, ranks


def tail(res, n=60):
    return "\n".join(res["log_lines"][-n:])


def crossing_inner_calls(ranks):
    """(rank, call, where) of every collective outside outer steps whose group spans two workers."""
    out = []
    for r in ranks:
        worker_of = {int(k): v for k, v in r["worker_of"].items()}
        for name, group, where in r["inner_calls"]:
            if len({worker_of[g] for g in group}) > 1:
                out.append((r["rank"], name, tuple(group), where))
    return out


def assert_outer_step_stays_at_its_position(ranks):
    """Every outer-step collective joins this rank only to ranks of *other* workers (with W = 1: to
    no one); a group holding two ranks of one worker would mix different shards."""
    for r in ranks:
        worker_of = {int(k): v for k, v in r["worker_of"].items()}
        for group in r["outer_groups"]:
            workers = [worker_of[g] for g in group]
            assert r["rank"] in group and len(set(workers)) == len(workers), (r["rank"], group, workers)


def assert_identical_replicas(ranks):
    """Ranks at the same (PP, TP, EP) position hold bitwise identical model params (all workers)."""
    by_place = {}
    for r in ranks:
        by_place.setdefault((r["pp_rank"], r["tp_rank"], r["ep_rank"]), []).append(r)
    for place, group in by_place.items():
        first = group[0]["params"]
        assert first, place
        for other in group[1:]:
            diff = sorted(k for k in first if first[k] != other["params"].get(k))
            assert not diff, (place, group[0]["rank"], other["rank"], diff)


def assert_tied_copies_identical(ranks):
    """The first stage's word embeddings equal the last stage's output layer (same TP rank)."""
    emb = {r["tp_rank"]: r["tied"]["embedding"] for r in ranks if "embedding" in r["tied"] and "output" not in r["tied"]}
    out = {r["tp_rank"]: r["tied"]["output"] for r in ranks if "output" in r["tied"]}
    assert emb and out and set(emb) == set(out), (emb, out)
    for tp, h in emb.items():
        assert out[tp] == h, f"tied embedding / output layer differ on TP rank {tp}"


# ------------------------------------------------------------------------------------------ W = 1
@pytest.mark.multirank
@pytest.mark.megatron
@pytest.mark.timeout(300)
@pytest.mark.parametrize("algorithm,given", [("sparseloco", False), ("diloco", True)])
def test_single_worker_trains_with_outer_steps(tmp_path, algorithm, given):
    """W = 1 on 2 ranks (DP 2 inside the one worker): the default when --sparseloco-workers is not
    given, and given explicitly. Used to fail after the model was built (outer group = world)."""
    res, ranks = launch(tmp_path, algorithm, workers=1, algorithm=algorithm, workers_flag=given)
    assert res["returncode"] == 0, tail(res)
    assert len(ranks) == 2 and all(r["outer_steps"] == 2 for r in ranks), [r["outer_steps"] for r in ranks]
    assert all(set(r["worker_of"].values()) == {0} for r in ranks)
    assert_outer_step_stays_at_its_position(ranks)  # before: the outer step ran over both ranks' shards
    assert_identical_replicas(ranks)  # both DP ranks of the one worker hold the same model
    assert all(r["inner_calls"] for r in ranks)


# ------------------------------------------------------------------------------------------ isolation
@pytest.mark.multirank
@pytest.mark.megatron
@pytest.mark.timeout(300)
def test_inner_isolation_no_cross_worker_collective_in_training_loop(tmp_path):
    """2 workers × 1 rank, 4 iterations, H = 2: between outer steps megatron.training (loss
    reduction, timers, rerun machine) must not issue one collective spanning both workers."""
    res, ranks = launch(tmp_path, "iso", workers=2, algorithm="sparseloco")
    assert res["returncode"] == 0, tail(res)
    assert [r["outer_steps"] for r in ranks] == [2, 2]
    assert all(r["outer_calls"] > 0 and len(r["inner_calls"]) > 0 for r in ranks)
    crossing = crossing_inner_calls(ranks)
    assert not crossing, crossing[:20]
    assert_outer_step_stays_at_its_position(ranks)
    assert_identical_replicas(ranks)
    # Megatron's line still reports a finite loss (now the worker's own).
    assert res["train_loss"] and all(loss == loss for _, loss in res["train_loss"]), tail(res)


# ------------------------------------------------------------------------------------------ tied
@pytest.mark.multirank
@pytest.mark.megatron
@pytest.mark.timeout(300)
def test_tied_embeddings_identical_across_pipeline_stages(tmp_path):
    """PP 2 with tied embeddings (Megatron's default), 2 SparseLoCo workers (4 ranks): after the
    last outer step the first stage's word embeddings and the last stage's output layer are
    bitwise identical (before: each copy was compressed with its own error feedback)."""
    res, ranks = launch(tmp_path, "tied", nproc=4, workers=2, algorithm="sparseloco",
                        extra=["--pipeline-model-parallel-size", "2", "--sparseloco-topk", "8",
                               "--sparseloco-chunk-size", "256"])
    assert res["returncode"] == 0, tail(res)
    assert all(r["outer_steps"] == 2 for r in ranks)
    assert_tied_copies_identical(ranks)
    assert_identical_replicas(ranks)
    assert not crossing_inner_calls(ranks)


# ------------------------------------------------------------------------------------------ precision-aware
@pytest.mark.parametrize("flags,named", [
    (["--use-precision-aware-optimizer"], "--use-precision-aware-optimizer"),
    (["--use-precision-aware-optimizer", "--optimizer-cpu-offload"], "--optimizer-cpu-offload"),
])
def test_precision_aware_optimizer_and_cpu_offload_refused_by_flag_validation(flags, named, monkeypatch):
    """Their masters live in the optimizer state: refused by the flag validation (before any model
    is built), naming the flag. Before: accepted, and the outer step silently covered nothing."""
    import sys

    from megatron.training.arguments import parse_args

    from megatron_sparseloco.megatron.args import (SparseLoCoArgumentError, add_sparseloco_args,
                                                        validate_sparseloco_args)
    argv = ["--use-distributed-optimizer", "--sparseloco-algorithm", "sparseloco", "--sparseloco-workers", "2"] + flags
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *argv])
    args = parse_args(add_sparseloco_args)
    if named == "--optimizer-cpu-offload":
        args.use_precision_aware_optimizer = False  # the offload flag alone must be named too
    with pytest.raises(SparseLoCoArgumentError, match=named + ".*Fix: drop " + named):
        validate_sparseloco_args(args, world_size=2)


def test_precision_aware_main_params_never_skipped_silently():
    """A distributed optimizer without fp32 main shards (precision-aware: None) is an error naming
    the flags, not an outer step that skips the parameter."""
    import torch

    from megatron_sparseloco.megatron.main_params import main_param_shards

    class Range:
        def __init__(self, n):
            self.start, self.end, self.size = 0, n, n

    p = torch.nn.Parameter(torch.zeros(8, dtype=torch.bfloat16))
    fake = type("DistributedOptimizer", (), {})()
    fake.model_float16_groups, fake.shard_fp32_from_float16_groups = [[p]], [[None]]
    fake.model_fp32_groups, fake.shard_fp32_groups = [[]], [[]]
    fake.buffers, fake.data_parallel_group = [], None
    fake._get_model_param_range_map = lambda param: {"param": Range(param.numel())}
    with pytest.raises(AssertionError, match="--use-precision-aware-optimizer"):
        main_param_shards(fake)


# ------------------------------------------------------------------------------------------ VPP
@pytest.mark.multirank
@pytest.mark.megatron
@pytest.mark.timeout(300)
def test_virtual_pipeline_two_workers_in_example_script(tmp_path):
    """examples/pretrain_gpt.py with PP 2 × 2 virtual stages per rank (4 layers), 2 workers (plain
    averaging): trains (before: get_batch read no vp_stage through the DDP wrapper and called
    next(None) on a middle virtual stage), workers identical, tied copies identical, no
    cross-worker inner traffic."""
    res, ranks = launch(tmp_path, "vpp", nproc=4, workers=2, algorithm="average", num_layers=4,
                        extra=["--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "2"])
    assert res["returncode"] == 0, tail(res)
    assert all(r["outer_steps"] == 2 for r in ranks)
    assert all(any(k.startswith("1.") for k in r["params"]) for r in ranks)  # two model chunks per rank
    assert_tied_copies_identical(ranks)
    assert_identical_replicas(ranks)
    assert not crossing_inner_calls(ranks)


# ------------------------------------------------------------------------------------------ resume
@pytest.mark.multirank
@pytest.mark.megatron
@pytest.mark.timeout(1200)
def test_inner_steps_changed_on_resume_and_plain_megatron_opening_plugin_checkpoint(tmp_path):
    """One 2-worker checkpoint (H = 2, saved at iteration 3, one step into round 2), then:
    - inner_steps_changed: resuming with H = 3 is announced (old and new H, where the next outer
      step falls, the flag to keep the saved rounds) and the outer step comes at inner step 6;
    - plain_megatron: loading it with the plugin off (no --sparseloco-algorithm) trains on, with a
      message naming the flags that continue the outer loop (before: a bare assert len(steps) == 1)."""
    ckpt = str(tmp_path / "ckpt")
    # Same --train-iters in every run (Megatron's LR schedule refuses a change); the later runs
    # start from the iteration-3 checkpoint alone (as tests/test_checkpoint_resume.py does).
    import shutil
    full = str(tmp_path / "ckpt_full")
    res, _ = launch(tmp_path, "save", workers=2, algorithm="diloco", H=2, iters=6, timeout=400,
                    extra=["--save", full, "--save-interval", "3", "--ckpt-format", "torch_dist"])
    assert res["returncode"] == 0, tail(res)
    os.makedirs(ckpt)
    shutil.copytree(os.path.join(full, "iter_0000003"), os.path.join(ckpt, "iter_0000003"))
    with open(os.path.join(ckpt, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("3")

    res, ranks = launch(tmp_path, "resume_h3", workers=2, algorithm="diloco", H=3, iters=6, timeout=400,
                        extra=["--load", ckpt, "--ckpt-format", "torch_dist"])
    assert res["returncode"] == 0, tail(res)
    log = "\n".join(res["log_lines"])
    assert ("saved with --sparseloco-inner-steps 2 at inner step 3" in log
            and "this run uses --sparseloco-inner-steps 3" in log
            and "the next outer step runs after 3 more inner step(s) (at inner step 6)" in log
            and "Resume with --sparseloco-inner-steps 2" in log), tail(res)
    assert [r["outer_steps"] for r in ranks] == [2, 2]  # 1 before the save, 1 at inner step 6
    assert_identical_replicas(ranks)

    cmd_extra = ["--load", ckpt, "--ckpt-format", "torch_dist"]
    res, _ = launch(tmp_path, "plain", workers=2, algorithm="none", iters=6, extra=cmd_extra, timeout=400)
    assert res["returncode"] == 0, tail(res)
    log = "\n".join(res["log_lines"])
    assert "this checkpoint was written with the outer loop on (2 workers" in log, tail(res)
    assert "--sparseloco-algorithm diloco --sparseloco-workers 2 --sparseloco-inner-steps 2" in log, tail(res)
    assert sorted(i for i, _ in res["train_loss"]) == [4, 5, 6], tail(res)


# ------------------------------------------------------------------------------------------ checkpoint model
def _load_dumps(out_dir, name):
    import torch
    paths = sorted(glob.glob(os.path.join(out_dir, f"{name}_rank*.pt")), key=lambda p: int(p.split("rank")[-1][:-3]))
    return [torch.load(p) for p in paths]


@pytest.mark.multirank
@pytest.mark.megatron
@pytest.mark.timeout(400)
@pytest.mark.parametrize("cell", [
    dict(nproc=4, workers=2, algorithm="sparseloco"),   # 2 ranks per worker: DP 2 inside each
    dict(nproc=2, workers=2, algorithm="gasloc"),
], ids=["sparseloco-W2-DP2", "gasloc-W2"])
def test_checkpoint_model_is_theta_outer_when_saved_mid_round(tmp_path, cell):
    """H = 2, saved at iteration 3 (one inner step into round 2, the workers' params differ): a
    plain Megatron run (plugin off) loading the model alone (--no-load-optim) starts from θ_outer
    of outer step 1 bit for bit (gasloc: the workers' mean of it); before, each shard was whichever
    data-parallel replica the save strategy picked, a model no worker ever had."""
    import torch
    ckpt = str(tmp_path / "ckpt")
    env = {"SEMANTICS_DUMP": "1"}
    res, ranks = launch(tmp_path, "save", H=2, iters=3, timeout=300, env=env,
                        extra=["--save", ckpt, "--save-interval", "3", "--ckpt-format", "torch_dist"], **cell)
    assert res["returncode"] == 0, tail(res)
    assert all(r["outer_steps"] == 1 for r in ranks)
    theta_outer = _load_dumps(str(tmp_path / "save"), "outer1")
    assert len(theta_outer) == cell["nproc"]
    worker_of = {int(k): v for k, v in ranks[0]["worker_of"].items()}
    if cell["algorithm"] == "gasloc":
        assert worker_of == {0: 0, 1: 1}
        mean = {k: (theta_outer[0][k] + theta_outer[1][k]) / 2 for k in theta_outer[0]}
        expected = [mean, mean]
    else:
        expected = theta_outer
    # the saved iteration is mid-round: the workers' params at the save differ from θ_outer
    by_worker = {}
    for r in ranks:
        by_worker.setdefault(worker_of[r["rank"]], r["params"])
    assert by_worker[0] != by_worker[1]

    res, _ = launch(tmp_path, "model_only", algorithm="none", H=2, iters=3, timeout=300, env=env,
                    nproc=cell["nproc"], workers=cell["workers"],
                    extra=["--load", ckpt, "--no-load-optim", "--ckpt-format", "torch_dist"])
    assert res["returncode"] == 0, tail(res)
    loaded = _load_dumps(str(tmp_path / "model_only"), "start")
    assert len(loaded) == cell["nproc"]
    for rank, (got, want) in enumerate(zip(loaded, expected)):
        assert sorted(got) == sorted(want), rank
        diff = [k for k in want if not torch.equal(got[k], want[k])]
        assert not diff, (rank, diff)


# ------------------------------------------------------------------------------------------ matrix
def assert_identical_within_worker(ranks):
    """gasloc: workers differ by design; ranks of one worker at one place still agree."""
    by_key = {}
    for r in ranks:
        worker = {int(k): v for k, v in r["worker_of"].items()}[r["rank"]]
        by_key.setdefault((worker, r["pp_rank"], r["tp_rank"], r["ep_rank"]), []).append(r)
    for group in by_key.values():
        for other in group[1:]:
            assert other["params"] == group[0]["params"], (group[0]["rank"], other["rank"])


MOE = ["--num-experts", "4", "--moe-ffn-hidden-size", "64", "--moe-router-topk", "2",
       "--moe-token-dispatcher-type", "alltoall", "--no-bias-gelu-fusion", "--disable-bias-linear"]


@pytest.mark.multirank
@pytest.mark.megatron
@pytest.mark.timeout(400)
@pytest.mark.parametrize("cell", [
    dict(nproc=4, workers=2, algorithm="gasloc", extra=["--tensor-model-parallel-size", "2",
                                                         "--sparseloco-gossip-rule", "mixed-nesterov",
                                                         "--sparseloco-gossip-rounds", "2"]),
    dict(nproc=2, workers=1, algorithm="average", extra=["--expert-model-parallel-size", "2"] + MOE),
    # reduce-scatter aggregation: its owners are per shard position (issue 20)
    dict(nproc=4, workers=2, algorithm="sparseloco",
         extra=["--tensor-model-parallel-size", "2", "--sparseloco-aggregation", "reduce-scatter"]),
    dict(nproc=4, workers=2, algorithm="sparseloco",
         extra=["--expert-model-parallel-size", "2", "--sparseloco-aggregation", "reduce-scatter"] + MOE),
    # hierarchical aggregation: W = 4 in 2 site groups (rail exchange between sites, site gather)
    dict(nproc=4, workers=4, algorithm="sparseloco",
         extra=["--sparseloco-aggregation", "hierarchical", "--sparseloco-aggregation-groups", "2"]),
], ids=["gasloc-mixed_nesterov-R2-W2-TP2", "average-single_worker-EP2-moe", "sparseloco-reduce_scatter-W2-TP2",
        "sparseloco-reduce_scatter-W2-DP2-EP2-moe", "sparseloco-hierarchical-W4-G2"])
def test_matrix_single_worker_and_inner_isolation_cells(tmp_path, cell):
    """The configuration cells the other tests here do not cover (together with them every algorithm
    meets W ∈ {1, 2}, DP2-in-worker, TP2, PP2 tied, VPP, EP2): 4 iterations, 2 outer steps each."""
    res, ranks = launch(tmp_path, cell["algorithm"], **cell)
    assert res["returncode"] == 0, tail(res)
    assert all(r["outer_steps"] == 2 for r in ranks)
    if "reduce-scatter" in cell["extra"]:
        assert "aggregation: reduce-scatter" in "\n".join(res["log_lines"]), tail(res)
    if "hierarchical" in cell["extra"]:
        assert "aggregation: hierarchical" in "\n".join(res["log_lines"]), tail(res)
        assert "aggregation-groups: 2" in "\n".join(res["log_lines"]), tail(res)
    assert not crossing_inner_calls(ranks)
    assert_outer_step_stays_at_its_position(ranks)
    if cell["algorithm"] == "gasloc":
        assert_identical_within_worker(ranks)
        assert "rule: mixed-nesterov" in "\n".join(res["log_lines"]) or "mixed-nesterov" in "\n".join(res["log_lines"]), \
            tail(res)
    else:
        assert_identical_replicas(ranks)


# ------------------------------------------------------------------------------ per-worker H
@pytest.mark.multirank
@pytest.mark.megatron
@pytest.mark.timeout(300)
def test_inactive_iterations_run_no_forward_backward(tmp_path):
    """gasloc W = 2, --sparseloco-inner-steps-per-worker 4,2 (H = 4), 8 iterations: worker 0 computes
    every iteration, worker 1 only the first 2 of each round; its other iterations read no batch,
    cost no forward/backward (what lets a slow GPU keep pace) and appear in Megatron's log as skipped
    iterations; both workers still run both outer steps. Used to run the forward/backward of every
    iteration and discard its gradients."""
    res, ranks = launch(tmp_path, "per_worker", algorithm="gasloc", iters=8,
                        extra=["--sparseloco-inner-steps-per-worker", "4,2"])
    assert res["returncode"] == 0, tail(res)
    worker_of = {int(k): v for k, v in ranks[0]["worker_of"].items()}
    assert worker_of == {0: 0, 1: 1}
    assert [r["iterations"] for r in ranks] == [8, 8]
    assert [r["outer_steps"] for r in ranks] == [2, 2]
    micro = ranks[0]["forward_calls"] // 8          # microbatches per iteration (global batch / DP / mbs)
    assert micro >= 1 and ranks[0]["forward_calls"] == 8 * micro, ranks[0]["forward_calls"]
    assert ranks[1]["forward_calls"] == 4 * micro, ranks[1]["forward_calls"]
    # Megatron prints the log line on the last rank (worker 1): 2 of every 4 iterations skipped
    skipped = [int(m.group(1)) for m in re.finditer(r"number of skipped iterations:\s+(\d+)", "\n".join(res["log_lines"]))]
    assert skipped == [0, 0, 1, 1, 0, 0, 1, 1], (skipped, tail(res))
    assert not crossing_inner_calls(ranks)


@pytest.mark.multirank
@pytest.mark.megatron
@pytest.mark.timeout(300)
def test_auto_inner_steps_slow_worker_computes_fewer_iterations(tmp_path):
    """gasloc W = 2, --sparseloco-inner-steps-per-worker auto, H = 4, 12 iterations; worker 1's
    forward step sleeps 0.3 s (a slower GPU). Round 0 runs H everywhere; from the first agreement on,
    worker 1's measured iteration is the longer one, so H_1 = ⌊4 t_0 / t_1⌋ <= 3 and it computes at
    most 4 + 3 + 3 of the 12 iterations, while worker 0 computes all 12."""
    res, ranks = launch(tmp_path, "auto", algorithm="gasloc", H=4, iters=12,
                        extra=["--sparseloco-inner-steps-per-worker", "auto"],
                        env={"SLOW_RANK": "1", "SLOW_FORWARD_S": "0.3"})
    assert res["returncode"] == 0, tail(res)
    assert [r["outer_steps"] for r in ranks] == [3, 3]
    micro = ranks[0]["forward_calls"] // 12
    assert micro >= 1 and ranks[0]["forward_calls"] == 12 * micro, ranks[0]["forward_calls"]
    slow = ranks[1]["forward_calls"] // micro
    assert 4 + 1 + 1 <= slow <= 4 + 3 + 3, ranks[1]["forward_calls"]
    # between outer steps the only cross-worker traffic is the step-time agreement after each one:
    # one point-to-point exchange per outer step (the spy counts calls inside outer_step apart)
    crossing = crossing_inner_calls(ranks)
    assert {name for _, name, _, _ in crossing} <= {"batch_isend_irecv", "isend", "irecv"}, crossing
    assert all(where.startswith("megatron_sparseloco/comm/p2p.py") for *_, where in crossing), crossing
    for rank in (0, 1):
        assert sum(1 for r, name, _, _ in crossing if r == rank and name == "batch_isend_irecv") == 3, crossing

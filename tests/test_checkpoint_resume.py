"""torch_dist checkpoints with outer state: resume mid inner loop continues bitwise identically.

Real megatron.training loop (examples/pretrain_gpt.py under megatron_sparseloco.run), 2 CPU ranks =
2 SparseLoCo workers, H = 5. Run A trains 12 iterations and saves at 7 (two inner steps into the
second round) and at 12. Run B loads A's iteration-7 checkpoint and trains to 12. Their losses at
iterations 8..12 and the exact fingerprints of θ_outer and of every rank's fp32 main params at the
end must be equal, and both must differ from a run that resumes without the outer state.
"""
import json
import os
import shutil

import pytest

from megatron_sparseloco.demo import build_command, run_training
from megatron_sparseloco.testing.prefork import use_prefork

H, ITERS, SAVE_AT = 5, 12, 7


def _run(tmp_path, data, name, extra, expect_ok=True, env=None, launcher=None):
    cmd = build_command({"train": data.prefix("train"), "valid": data.prefix("valid")}, nproc=2, workers=2,
                        algorithm="sparseloco", inner_steps=H, train_iters=ITERS, eval_interval=100, eval_iters=1,
                        log_interval=1, micro_batch_size=2, seq_length=64,
                        extra=["--num-layers", "2", "--hidden-size", "64", "--ckpt-format", "torch_dist"] + extra)
    if launcher is not None:  # replace "-m megatron_sparseloco.run" by a test launcher script
        i = cmd.index("megatron_sparseloco.run")
        cmd[i - 1:i + 1] = [launcher]
    summary = str(tmp_path / f"{name}.json")
    old_env = {k: os.environ.get(k) for k in (env or {})}
    os.environ.update(env or {})
    try:
        res = run_training(use_prefork(cmd), str(tmp_path / f"{name}.log"), summary, timeout=280, echo=lambda *_: None)
    finally:
        for k, v in old_env.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    if not expect_ok:
        return res, None
    assert res["returncode"] == 0, "\n".join(res["log_lines"][-60:])
    with open(summary) as f:
        return res, json.load(f)


def save_and_resume(tmp_path, data, flags):
    """Run A (with ``flags``) saves at SAVE_AT and at ITERS into ``tmp_path/ckpt_a``; run B loads only
    A's SAVE_AT checkpoint (copied to ``tmp_path/ckpt_b``) and trains to ITERS. Returns
    (res_a, sum_a, res_b, sum_b)."""
    ckpt_a = tmp_path / "ckpt_a"
    res_a, sum_a = _run(tmp_path, data, "a", flags + ["--save", str(ckpt_a), "--save-interval", str(SAVE_AT)])
    assert (ckpt_a / f"iter_{SAVE_AT:07d}").is_dir() and (ckpt_a / f"iter_{ITERS:07d}").is_dir()
    ckpt_b = tmp_path / "ckpt_b"
    ckpt_b.mkdir()
    shutil.copytree(ckpt_a / f"iter_{SAVE_AT:07d}", ckpt_b / f"iter_{SAVE_AT:07d}")
    (ckpt_b / "latest_checkpointed_iteration.txt").write_text(str(SAVE_AT))
    res_b, sum_b = _run(tmp_path, data, "b", flags + ["--load", str(ckpt_b), "--save", str(ckpt_b),
                                                      "--save-interval", "100"])
    return res_a, sum_a, res_b, sum_b


def assert_resumed_bitwise(res_a, sum_a, res_b, sum_b):
    """B logs exactly the iterations after SAVE_AT; its losses equal A's at SAVE_AT + 1 and from
    SAVE_AT + 3 on (SAVE_AT + 2: Megatron averages it with the first after a restart, see
    test_resume_mid_inner_loop_is_bitwise_identical), and every rank ends with A's θ_outer, fp32
    main params and bytes sent."""
    losses_a, losses_b = dict(res_a["train_loss"]), dict(res_b["train_loss"])
    assert sorted(losses_b) == list(range(SAVE_AT + 1, ITERS + 1)), sorted(losses_b)
    assert losses_b[SAVE_AT + 1] == losses_a[SAVE_AT + 1]
    for it in range(SAVE_AT + 3, ITERS + 1):
        assert losses_a[it] == losses_b[it], (it, losses_a[it], losses_b[it])
    for ra, rb in zip(sum_a["per_rank"], sum_b["per_rank"]):
        assert ra["rank"] == rb["rank"]
        assert ra["theta_outer_fingerprint"] == rb["theta_outer_fingerprint"]
        assert ra["main_params_fingerprint"] == rb["main_params_fingerprint"]
        assert ra["bytes_sent"] == rb["bytes_sent"]


@pytest.mark.timeout(900)
def test_resume_mid_inner_loop_is_bitwise_identical(tmp_path, corpus):
    res_a, sum_a, res_b, sum_b = save_and_resume(tmp_path, corpus, [])
    assert_resumed_bitwise(res_a, sum_a, res_b, sum_b)
    # Megatron's training_log does not reset its loss accumulators on the first iteration after a
    # (re)start, so B's second logged loss is the mean of its first two iterations; every other
    # logged loss is that iteration's own.
    losses_a, losses_b = dict(res_a["train_loss"]), dict(res_b["train_loss"])
    first, second = SAVE_AT + 1, SAVE_AT + 2
    assert losses_b[second] == pytest.approx((losses_a[first] + losses_a[second]) / 2, abs=2e-6)
    assert sum_a["outer_steps"] == sum_b["outer_steps"] == ITERS // H
    for ra, rb in zip(sum_a["per_rank"], sum_b["per_rank"]):
        assert ra["inner_calls"] == rb["inner_calls"] == ITERS

    # C: the state was saved with per-tensor chunking (the default); a flat-chunking resume is refused
    res_c, _ = _run(tmp_path, corpus, "c", ["--load", str(tmp_path / "ckpt_b"), "--sparseloco-chunking", "flat"],
                    expect_ok=False)
    log_c = "\n".join(res_c["log_lines"])
    assert res_c["returncode"] != 0
    assert "--sparseloco-chunking tensor" in log_c and "--no-load-optim" in log_c, log_c[-3000:]


def test_megatron_workarounds_still_needed():
    """Fails when a megatron-core upgrade fixes what checkpointing.py works around (then drop them)."""
    import inspect

    from megatron.core.optimizer import distrib_optimizer as do
    import megatron.core.optimizer as mopt

    src_state = inspect.getsource(do.DistributedOptimizer.state_dict)
    assert 's["step"].item()' in src_state  # ensure_adam_step_state: asserts a step torch creates lazily
    src_init = inspect.getsource(mopt._get_megatron_optimizer_based_on_param_groups)
    assert "opt.state[p]['exp_avg'] = torch.zeros_like" in src_init and "'step'" not in src_init
    src_load = inspect.getsource(do.DistributedOptimizer.load_state_dict)
    assert 's["step"] = step' in src_load  # one shared step tensor for every param state


@pytest.mark.timeout(900)
def test_crash_inside_outer_step_resumes_from_last_complete_checkpoint(tmp_path, corpus):
    """Worker 1 dies inside outer step 2 (iteration 10), after the iteration-5 checkpoint, when the
    workers' states are mixed. (torchrun then stops the other rank at once; that a surviving worker
    names the dead one is tested in test_megatron_faults.py.) The tracker still names iteration 5,
    no later checkpoint exists, and resuming from it ends bitwise where an uninterrupted run ends."""
    data = corpus
    _, ref = _run(tmp_path, data, "ref", [])
    ckpt = tmp_path / "ckpt"
    launcher = os.path.join(os.path.dirname(os.path.abspath(__file__)), "crash_launcher.py")
    common = ["--save", str(ckpt), "--load", str(ckpt), "--save-interval", str(H), "--sparseloco-outer-timeout", "30"]
    crashed, _ = _run(tmp_path, data, "crash", common, expect_ok=False, launcher=launcher,
                      env={"CRASH_OUTER_STEP": "2", "CRASH_RANK": "1"})
    log = "\n".join(crashed["log_lines"])
    assert crashed["returncode"] != 0
    assert "rank 1 dies inside outer step 2" in log
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == str(H)
    assert not (ckpt / f"iter_{2 * H:07d}").exists()
    _, resumed = _run(tmp_path, data, "resumed", common)
    for ra, rb in zip(ref["per_rank"], resumed["per_rank"]):
        assert ra["theta_outer_fingerprint"] == rb["theta_outer_fingerprint"]
        assert ra["main_params_fingerprint"] == rb["main_params_fingerprint"]


@pytest.mark.timeout(900)
def test_anchor_on_cpu_trains_and_resumes_bitwise_like_the_device_anchor(tmp_path, corpus):
    """--sparseloco-anchor-on-cpu in the real loop: the run with θ_outer in host memory ends with the
    very θ_outer, fp32 main params and losses of the run with θ_outer on the params' device, and a
    resume from its mid-round checkpoint (θ_outer saved from and loaded into host memory) ends bitwise
    the same again."""
    _, plain = _run(tmp_path, corpus, "plain", [])
    res_a, sum_a, res_b, sum_b = save_and_resume(tmp_path, corpus, ["--sparseloco-anchor-on-cpu"])
    assert_resumed_bitwise(res_a, sum_a, res_b, sum_b)
    assert "θ_outer" in "\n".join(res_a["log_lines"]) and "pinned host memory" in "\n".join(res_a["log_lines"])
    for rp, ra in zip(plain["per_rank"], sum_a["per_rank"]):
        assert rp["theta_outer_fingerprint"] == ra["theta_outer_fingerprint"]
        assert rp["main_params_fingerprint"] == ra["main_params_fingerprint"]

"""Resume with a different intra-worker data-parallel size keeps the outer state bit for bit.

Real megatron.training runs (examples/pretrain_gpt.py), 2 SparseLoCo workers, H = 5, global batch 4:

- A: 4 ranks (each worker = 2 data-parallel ranks, micro-batch 1) trains 12 iterations, saving at 7
  (two inner steps into round 2: error feedback, θ_outer, Adam moments all non-trivial).
- B: 2 ranks (each worker = 1 rank, micro-batch 2) loads A@7 and saves it again without training:
  every worker's per-element outer and inner state must come out bitwise equal to A's, although
  each rank now holds a whole worker's elements instead of half of them; θ_outer, identical on
  both workers, is in the checkpoint once.
- C: 4 ranks again load B@7 and train to 12: the same iterations, θ_outer and main-param
  fingerprints as A — the state survived 2 → 1 → 2 ranks per worker.
- D: 2 ranks as *one* worker asked to load A@7: refused before anything is read, naming the flag.
"""
import json
import shutil

import pytest
import torch

from megatron_sparseloco.demo import build_command, run_training
from megatron_sparseloco.testing.prefork import use_prefork

H, ITERS, SAVE_AT = 5, 12, 7
PREFIX = "optimizer.sparseloco."


def _run(tmp_path, data, name, nproc, extra, train_iters=ITERS, workers=2, expect_ok=True):
    cmd = build_command({"train": data.prefix("train"), "valid": data.prefix("valid")}, nproc=nproc, workers=workers,
                        algorithm="sparseloco", inner_steps=H, train_iters=train_iters, eval_interval=100, eval_iters=1,
                        log_interval=1, micro_batch_size=4 // nproc, seq_length=64,
                        extra=["--num-layers", "2", "--hidden-size", "64", "--ckpt-format", "torch_dist",
                               "--lr-warmup-iters", "1"] + extra)
    summary = str(tmp_path / f"{name}.json")
    res = run_training(use_prefork(cmd), str(tmp_path / f"{name}.log"), summary, timeout=400, echo=lambda *_: None)
    if not expect_ok:
        return res, None
    assert res["returncode"] == 0, "\n".join(res["log_lines"][-60:])
    with open(summary) as f:
        return res, json.load(f)


def _checkpoint_tensors(path, out_file):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    dcp_to_torch_save(str(path), str(out_file))
    sd = torch.load(str(out_file), weights_only=False)
    return {k: v for k, v in sd.items() if torch.is_tensor(v)}


def _only_iteration(src_dir, iteration, dst_dir):
    dst_dir.mkdir()
    shutil.copytree(src_dir / f"iter_{iteration:07d}", dst_dir / f"iter_{iteration:07d}")
    (dst_dir / "latest_checkpointed_iteration.txt").write_text(str(iteration))


@pytest.mark.timeout(1200)
def test_resume_with_other_intra_worker_dp_size_keeps_outer_state(tmp_path, corpus):
    data = corpus

    ckpt_a = tmp_path / "ckpt_a"
    res_a, sum_a = _run(tmp_path, data, "a", 4, ["--save", str(ckpt_a), "--save-interval", str(SAVE_AT)])

    # B: 2 ranks (1 per worker) load A@7 and save it again at once
    ckpt_b_in, ckpt_b = tmp_path / "ckpt_b_in", tmp_path / "ckpt_b"
    _only_iteration(ckpt_a, SAVE_AT, ckpt_b_in)
    _run(tmp_path, data, "b", 2, ["--load", str(ckpt_b_in), "--save", str(ckpt_b), "--save-interval", "100",
                                  "--use-checkpoint-opt_param-scheduler"], train_iters=SAVE_AT)
    tens_a = _checkpoint_tensors(ckpt_a / f"iter_{SAVE_AT:07d}", tmp_path / "a7.pt")
    tens_b = _checkpoint_tensors(ckpt_b / f"iter_{SAVE_AT:07d}", tmp_path / "b7.pt")
    outer_keys = sorted(k for k in tens_a if k.startswith(PREFIX))
    assert outer_keys == sorted(k for k in tens_b if k.startswith(PREFIX))
    states = {k[len(PREFIX):].split(".")[0] + "." + ".".join(k[len(PREFIX):].split(".")[1:3]) for k in outer_keys}
    for w in (0, 1):
        for s in ("outer.error_feedback", "inner.main_param", "inner.exp_avg", "inner.exp_avg_sq"):
            assert f"worker{w}.{s}" in states, (w, s, sorted(states))
    # θ_outer, identical on both workers, is written once (no per-worker copy)
    assert any(k.startswith(PREFIX + "outer.anchor.") for k in outer_keys)
    assert not any(".outer.anchor." in k for k in outer_keys if ".worker" in k), outer_keys
    for k in outer_keys:
        assert tens_a[k].dtype == tens_b[k].dtype and torch.equal(tens_a[k].view(torch.uint8),
                                                                 tens_b[k].view(torch.uint8)), k
    # the state is not trivial: the workers differ, error feedback is non-zero mid-round
    ef0 = [k for k in outer_keys if ".worker0.outer.error_feedback." in k]
    assert any(tens_a[k].abs().sum() > 0 for k in ef0)
    assert any(not torch.equal(tens_a[k], tens_a[k.replace("worker0", "worker1")])
               for k in outer_keys if ".worker0.inner.main_param." in k)

    # C: back to 2 ranks per worker, from B's re-saved checkpoint, train to 12
    ckpt_c = tmp_path / "ckpt_c"
    _only_iteration(ckpt_b, SAVE_AT, ckpt_c)
    res_c, sum_c = _run(tmp_path, data, "c", 4, ["--load", str(ckpt_c), "--save", str(ckpt_c), "--save-interval", "100"])
    losses_a, losses_c = dict(res_a["train_loss"]), dict(res_c["train_loss"])
    assert sorted(losses_c) == list(range(SAVE_AT + 1, ITERS + 1))
    assert losses_c[SAVE_AT + 1] == losses_a[SAVE_AT + 1]
    for it in range(SAVE_AT + 3, ITERS + 1):  # (SAVE_AT + 2: Megatron averages it with the first, see resume test)
        assert losses_c[it] == losses_a[it], (it, losses_a[it], losses_c[it])
    assert sum_a["outer_steps"] == sum_c["outer_steps"] == ITERS // H
    for ra, rc in zip(sum_a["per_rank"], sum_c["per_rank"]):
        assert ra["theta_outer_fingerprint"] == rc["theta_outer_fingerprint"]
        assert ra["main_params_fingerprint"] == rc["main_params_fingerprint"]
    # per worker (ranks 0,1 and 2,3) the cumulative bytes are kept; after resharding on its first rank
    for w in (0, 1):
        pair_a = sum_a["per_rank"][2 * w:2 * w + 2]
        pair_c = sum_c["per_rank"][2 * w:2 * w + 2]
        assert sum(r["bytes_sent"] for r in pair_a) == sum(r["bytes_sent"] for r in pair_c) > 0

    # D: one worker cannot take a two-worker checkpoint
    ckpt_d = tmp_path / "ckpt_d"
    _only_iteration(ckpt_a, SAVE_AT, ckpt_d)
    res_d, _ = _run(tmp_path, data, "d", 2, ["--load", str(ckpt_d)], workers=1, expect_ok=False)
    log = "\n".join(res_d["log_lines"])
    assert res_d["returncode"] != 0
    assert "OuterStateLayoutError" in log and "--sparseloco-workers 2" in log, log[-3000:]


@pytest.mark.timeout(900)
def test_plain_megatron_checkpoint_continues_with_outer_loop(tmp_path, corpus):
    """A checkpoint of a plain Megatron run (no outer state) resumed with 2 SparseLoCo workers: Megatron's
    state loads, θ_outer is anchored on the *loaded* params (not the random init the optimizer was built
    from), so the first outer step does not throw the model back: the loss after it stays near the
    loss at resume. Warned about in the log."""
    data = corpus
    ckpt = tmp_path / "ckpt"
    end = SAVE_AT + H + 2
    cmd_args = dict(nproc=2, inner_steps=H, train_iters=end, eval_interval=100, eval_iters=1, log_interval=1,
                    micro_batch_size=2, seq_length=64, lr=4e-3,
                    extra=["--num-layers", "2", "--hidden-size", "64", "--ckpt-format", "torch_dist",
                           "--lr-warmup-iters", "1"])
    prefixes = {"train": data.prefix("train"), "valid": data.prefix("valid")}
    plain = build_command(prefixes, workers=2, algorithm="none", **cmd_args)
    plain += ["--save", str(ckpt), "--save-interval", str(SAVE_AT), "--exit-interval", str(SAVE_AT)]
    res = run_training(use_prefork(plain), str(tmp_path / "plain.log"), str(tmp_path / "plain.json"), timeout=300, echo=lambda *_: None)
    assert res["returncode"] == 0, "\n".join(res["log_lines"][-60:])
    outer = build_command(prefixes, workers=2, algorithm="sparseloco", **cmd_args)
    outer += ["--load", str(ckpt)]
    res = run_training(use_prefork(outer), str(tmp_path / "outer.log"), str(tmp_path / "outer.json"), timeout=300, echo=lambda *_: None)
    assert res["returncode"] == 0, "\n".join(res["log_lines"][-60:])
    log = "\n".join(res["log_lines"])
    assert "checkpoint has no sparseloco outer state" in log
    losses = dict(res["train_loss"])
    assert sorted(losses) == list(range(SAVE_AT + 1, end + 1))
    first_outer = SAVE_AT + H  # the inner-call counter starts at the resume
    after = losses[first_outer + 1]
    # random init scores ln(257) ≈ 5.55 on bytes; a stale θ_outer would land near it
    assert after < losses[SAVE_AT + 1] + 0.3 and after < 4.5, (losses, after)
    with open(tmp_path / "outer.json") as f:
        summary = json.load(f)
    fps = {r["theta_outer_fingerprint"] for r in summary["per_rank"]}
    assert len(fps) == 1 and summary["outer_steps"] == 1


MOE_FLAGS = ["--num-experts", "4", "--moe-ffn-hidden-size", "64", "--moe-router-topk", "2",
             "--moe-token-dispatcher-type", "alltoall", "--no-bias-gelu-fusion", "--disable-bias-linear"]


@pytest.mark.timeout(900)
def test_moe_dense_and_expert_state_reshard_bitwise(tmp_path):
    """MoE: the outer loop wraps two distributed optimizers (dense params, expert params; each with its
    own data-parallel group). 4 ranks (2 per worker) save mid round; 2 ranks (1 per worker) load and
    re-save: both optimizers' per-element state, expert weights included, comes out bitwise equal."""
    from megatron_sparseloco.data.build import build_dataset
    data = build_dataset(str(tmp_path / "data"), max_bytes=200_000, valid_percent=10.0, log=lambda *_: None)
    moe_h, moe_save = 2, 3
    ckpt_a = tmp_path / "ckpt_a"

    def run(name, nproc, extra, train_iters):
        cmd = build_command({"train": data.prefix("train"), "valid": data.prefix("valid")}, nproc=nproc, workers=2,
                            algorithm="sparseloco", inner_steps=moe_h, train_iters=train_iters, eval_interval=100,
                            eval_iters=1, log_interval=1, micro_batch_size=4 // nproc, seq_length=32,
                            extra=["--num-layers", "2", "--hidden-size", "64", "--ckpt-format", "torch_dist",
                                   "--lr-warmup-iters", "1"] + MOE_FLAGS + extra)
        res = run_training(use_prefork(cmd), str(tmp_path / f"{name}.log"), str(tmp_path / f"{name}.json"), timeout=300,
                           echo=lambda *_: None)
        assert res["returncode"] == 0, "\n".join(res["log_lines"][-60:])

    run("a", 4, ["--save", str(ckpt_a), "--save-interval", str(moe_save)], moe_save)
    ckpt_b_in, ckpt_b = tmp_path / "ckpt_b_in", tmp_path / "ckpt_b"
    _only_iteration(ckpt_a, moe_save, ckpt_b_in)
    run("b", 2, ["--load", str(ckpt_b_in), "--save", str(ckpt_b), "--save-interval", "100"], moe_save)
    tens_a = _checkpoint_tensors(ckpt_a / f"iter_{moe_save:07d}", tmp_path / "a.pt")
    tens_b = _checkpoint_tensors(ckpt_b / f"iter_{moe_save:07d}", tmp_path / "b.pt")
    outer_keys = sorted(k for k in tens_a if k.startswith(PREFIX))
    assert outer_keys == sorted(k for k in tens_b if k.startswith(PREFIX))
    expert = [k for k in outer_keys if "experts" in k]
    assert any(".worker1.outer.error_feedback." in k for k in expert) and any(".inner.exp_avg_sq." in k for k in expert)
    for k in outer_keys:
        assert torch.equal(tens_a[k].view(torch.uint8), tens_b[k].view(torch.uint8)), k

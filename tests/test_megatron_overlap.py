"""Delayed application in the real megatron.training loop: a save inside the overlap window resumes bitwise.

2 CPU ranks = 2 SparseLoCo workers, H = 5, τ = 3: round 1 launches at iteration 5 and merges at 8,
round 2 launches at 10 and is still in flight at 12. Run A trains 12 iterations and saves at 7
(inside round 1's window: the save waits for the collective, θ_outer,2 is saved with the launch
snapshot, the merge stays due at 8) and at 12 (inside round 2's window). Run B resumes from A's
iteration-7 checkpoint. Losses 9..12 and the exact fingerprints of θ_outer and of every rank's
fp32 main params at the end must be equal; the log line reports the exposed outer time.
"""
import shutil

import pytest

from test_checkpoint_resume import ITERS, SAVE_AT, _run

TAU = 3


@pytest.mark.timeout(900)
def test_save_inside_overlap_window_resumes_bitwise(tmp_path):
    from megatron_sparseloco.data.build import build_dataset
    data = build_dataset(str(tmp_path / "data"), max_bytes=300_000, valid_percent=10.0, log=lambda *_: None)
    overlap = ["--sparseloco-overlap-steps", str(TAU)]
    ckpt_a = tmp_path / "ckpt_a"
    res_a, sum_a = _run(tmp_path, data, "a", overlap + ["--save", str(ckpt_a), "--save-interval", str(SAVE_AT)])
    ckpt_b = tmp_path / "ckpt_b"
    ckpt_b.mkdir()
    shutil.copytree(ckpt_a / f"iter_{SAVE_AT:07d}", ckpt_b / f"iter_{SAVE_AT:07d}")
    (ckpt_b / "latest_checkpointed_iteration.txt").write_text(str(SAVE_AT))
    res_b, sum_b = _run(tmp_path, data, "b", overlap + ["--load", str(ckpt_b), "--save", str(ckpt_b),
                                                        "--save-interval", "100"])
    losses_a, losses_b = dict(res_a["train_loss"]), dict(res_b["train_loss"])
    assert sorted(losses_b) == list(range(SAVE_AT + 1, ITERS + 1))
    assert losses_b[SAVE_AT + 1] == losses_a[SAVE_AT + 1]  # the merge at 8 happened after this iteration's loss
    for it in range(SAVE_AT + 3, ITERS + 1):               # (9 is the mean of two after a restart, see there)
        assert losses_a[it] == losses_b[it], (it, losses_a[it], losses_b[it])
    assert sum_a["outer_steps"] == sum_b["outer_steps"] == ITERS // 5
    for ra, rb in zip(sum_a["per_rank"], sum_b["per_rank"]):
        assert ra["theta_outer_fingerprint"] == rb["theta_outer_fingerprint"]
        assert ra["main_params_fingerprint"] == rb["main_params_fingerprint"]
        assert ra["bytes_sent"] == rb["bytes_sent"]
    log_a = "\n".join(res_a["log_lines"])
    assert "exposed:" in log_a, log_a[-2000:]

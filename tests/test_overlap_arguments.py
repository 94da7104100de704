"""--sparseloco-overlap-* flags: defaults, one clear error per bad value (before any model is built),
what reaches OuterLoopConfig, and the exposed time on the sparseloco | line."""
import sys

import pytest

from megatron.training.arguments import parse_args

from megatron_sparseloco.megatron.args import SparseLoCoArgumentError, add_sparseloco_args, validate_sparseloco_args
from megatron_sparseloco.megatron.metrics import format_log_line

BASE = ["--use-distributed-optimizer", "--sparseloco-workers", "2", "--sparseloco-inner-steps", "8"]


def _args(argv, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *BASE, *argv])
    args = parse_args(add_sparseloco_args)
    return validate_sparseloco_args(args, world_size=4)


def test_defaults_blocking(monkeypatch):
    a = _args(["--sparseloco-algorithm", "diloco"], monkeypatch)
    assert (a.sparseloco_loop_config.overlap_steps, a.sparseloco_loop_config.overlap_merge,
            a.sparseloco_loop_config.overlap_alpha) == (0, "replay", 0.5)


@pytest.mark.parametrize("algo", ["sparseloco", "diloco", "average"])
def test_valid_overlap(algo, monkeypatch):
    a = _args(["--sparseloco-algorithm", algo, "--sparseloco-overlap-steps", "7", "--sparseloco-overlap-merge", "lerp",
               "--sparseloco-overlap-alpha", "0.25"], monkeypatch)
    assert (a.sparseloco_loop_config.overlap_steps, a.sparseloco_loop_config.overlap_merge,
            a.sparseloco_loop_config.overlap_alpha) == (7, "lerp", 0.25)


@pytest.mark.parametrize("argv,flag,words", [
    (["--sparseloco-overlap-steps", "8"], "--sparseloco-overlap-steps", "must be < --sparseloco-inner-steps H=8"),
    (["--sparseloco-overlap-steps", "-1"], "--sparseloco-overlap-steps", "must be >= 0"),
    (["--sparseloco-overlap-merge", "lerp"], "--sparseloco-overlap-merge", "--sparseloco-overlap-steps >= 1"),
    (["--sparseloco-overlap-steps", "2", "--sparseloco-overlap-alpha", "0.3"], "--sparseloco-overlap-alpha",
     "only applies to --sparseloco-overlap-merge lerp"),
    (["--sparseloco-overlap-steps", "2", "--sparseloco-overlap-merge", "lerp", "--sparseloco-overlap-alpha", "1.5"],
     "--sparseloco-overlap-alpha", "must be in [0, 1]"),
])
def test_bad_values_name_the_flag(argv, flag, words, monkeypatch):
    with pytest.raises(SparseLoCoArgumentError) as exc:
        _args(["--sparseloco-algorithm", "sparseloco", *argv], monkeypatch)
    msg = str(exc.value)
    assert msg.startswith(flag) and words in msg and "Fix:" in msg, msg


def test_gasloc_refused(monkeypatch):
    with pytest.raises(SparseLoCoArgumentError, match="--sparseloco-overlap-steps: gasloc cannot delay"):
        _args(["--sparseloco-algorithm", "gasloc", "--sparseloco-overlap-steps", "2"], monkeypatch)


def test_without_algorithm_is_stray(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", "--sparseloco-overlap-steps", "2"])
    with pytest.raises(SparseLoCoArgumentError, match="--sparseloco-overlap-steps given without --sparseloco-algorithm"):
        validate_sparseloco_args(parse_args(add_sparseloco_args), world_size=4)


def test_outer_loop_config_validates_tau():
    from megatron_sparseloco.megatron.optimizer import OuterLoopConfig
    from megatron_sparseloco.outer import ConfigError

    OuterLoopConfig(inner_steps=5, overlap_steps=4).validate()
    with pytest.raises(ConfigError, match="τ=5 must be < inner steps H=5"):
        OuterLoopConfig(inner_steps=5, overlap_steps=5).validate()


def test_log_line_shows_exposed_time():
    totals = {"outer_steps": 2.0, "bytes_sent_per_worker": 100.0, "bytes_sent_last_outer_step": 50.0,
              "compression_ratio_vs_fp32": 4.0, "compression_ratio_vs_bf16": 2.0, "pseudo_grad_norm": 1.0,
              "error_feedback_norm": 0.0, "update_norm": 1.0, "time_compress_s": 0.001, "time_communicate_s": 0.5,
              "time_apply_s": 0.002, "time_exposed_s": 0.012, "time_wait_s": 0.004}
    line = format_log_line(totals, "diloco")
    assert "c/comm/apply: 1.0/500.0/2.0 ms | exposed: 12.0 ms |" in line, line

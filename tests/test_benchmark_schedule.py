"""The quality benchmark's Megatron-style inner schedule (benchmarks/common.inner_lr_scheduler): the lr each inner
step runs at is linear warmup from 0, then cosine decay to --min-lr, computed here independently; a constant
run gets no scheduler (its results stay what they were), and the schedule is part of the run's label and key."""
from __future__ import annotations

import argparse
import math
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import common  # noqa: E402
import quality  # noqa: E402


class _Groups:
    """What the scheduler touches of an optimizer: its param groups."""

    def __init__(self, n: int, lr: float):
        self.param_groups = [{"lr": lr, "weight_decay": 0.1} for _ in range(n)]


def _expected_lr(step_index: int, steps: int, peak: float, floor: float, warmup: int) -> float:
    """The lr of the inner step after ``step_index`` completed steps: warmup from 0, then cosine to ``floor``."""
    if warmup and step_index <= warmup:
        return peak * step_index / warmup
    progress = (step_index - warmup) / (steps - warmup)
    return floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def test_each_inner_step_runs_at_the_warmup_then_cosine_lr():
    steps, peak, floor = 120, 1e-3, 1e-4
    run = common.RunCfg("ddp", steps=steps, lr=peak, lr_warmup_fraction=0.1, lr_decay_style="cosine", min_lr=floor)
    opt = _Groups(2, peak)
    scheduler = common.inner_lr_scheduler(opt, run)
    seen = []
    for _ in range(steps):
        seen.append([g["lr"] for g in opt.param_groups])   # what the step uses
        scheduler.step(increment=1)                          # then advanced, as Megatron's loop does
    for i, lrs in enumerate(seen):
        assert lrs == pytest.approx([_expected_lr(i, steps, peak, floor, 12)] * 2, rel=1e-12, abs=1e-15), i
    assert seen[0] == [0.0, 0.0] and max(max(s) for s in seen) == pytest.approx(peak)
    assert seen[-1][0] == pytest.approx(_expected_lr(steps - 1, steps, peak, floor, 12)) and seen[-1][0] > floor


def test_a_constant_run_has_no_scheduler_and_an_unknown_style_is_refused():
    assert common.inner_lr_scheduler(_Groups(1, 1e-3), common.RunCfg("diloco")) is None
    with pytest.raises(ValueError, match="lr_decay_style"):
        common.inner_lr_scheduler(_Groups(1, 1e-3), common.RunCfg("diloco", lr_decay_style="exp"))


def test_the_schedule_is_in_the_label_the_key_and_the_files_inner_config():
    plain = common.RunCfg("sparseloco", k=64)
    sched = common.RunCfg("sparseloco", k=64, lr_warmup_fraction=0.1, lr_decay_style="cosine", min_lr=1e-4,
                          clip_grad=1.0)
    assert plain.label() == "sparseloco k=64 H=15"
    assert sched.label() == "sparseloco k=64 warmup0.1 cosine→0.0001 clip1 H=15"
    assert quality._run_key(plain) != quality._run_key(sched)
    args = argparse.Namespace(lr=1e-3, mbs=4, lr_warmup_fraction=0.1, lr_decay_style="cosine", min_lr=1e-4,
                              clip_grad=1.0)
    inner = quality.inner_config(args, common.ModelCfg())
    assert (inner["lr_warmup_fraction"], inner["lr_decay_style"], inner["min_lr"], inner["clip_grad"]) == (
        0.1, "cosine", 1e-4, 1.0)
    assert inner["schedule"] == "linear warmup over 0.1 of the steps from 0, then cosine decay to 0.0001 at the last step"
    constant = quality.inner_config(argparse.Namespace(lr=1e-3, mbs=4, lr_warmup_fraction=0.0,
                                                       lr_decay_style="constant", min_lr=0.0, clip_grad=0.0),
                                    common.ModelCfg())
    assert constant["schedule"] == "constant" and constant["clip_grad"] is None

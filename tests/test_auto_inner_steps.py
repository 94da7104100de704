"""--sparseloco-inner-steps-per-worker auto: H_w from measured step times (megatron/auto_steps.py).

The rule H_w = clamp(⌊H·t_min/t_w⌋, 1, H) in isolation, then 3 gloo ranks (one rank per worker)
running lockstep rounds where worker 2's steps sleep 3× longer: after the first agreement it runs
about H/3 steps per round, the others H, every rank sees the same table, and the agreement is
point-to-point only (collective spy).
"""
from __future__ import annotations

import time

import pytest

from megatron_sparseloco.megatron.auto_steps import steps_for
from megatron_sparseloco.testing.multirank import run_ranks

H = 12
BASE_S = 0.02


def test_steps_for_rule():
    assert steps_for(12, [1.0, 1.0, 3.0], 2, 12) == 4
    assert steps_for(12, [1.0, 1.0, 3.0], 0, 12) == 12
    assert steps_for(12, [1.0, 2.0], 1, 12) == 6
    assert steps_for(12, [1.0, 100.0], 1, 12) == 1           # never below one step
    assert steps_for(12, [None, 2.0], 1, 7) == 12             # only measured workers count
    assert steps_for(12, [1.0, None], 1, 7) == 7              # nothing measured: keep the current H_w
    assert steps_for(10, [0.3, 0.1 * 3], 1, 10) == 10         # float rounding of equal times: still H


def _rank_fn(rank, world_size):
    import torch

    from megatron_sparseloco.megatron.auto_steps import AutoInnerSteps
    from megatron_sparseloco.testing import collective_spy

    collective_spy._ALIASES = ()
    auto = AutoInnerSteps(H, None, None, world_size, torch.device("cpu"))
    hist, tables = [], []
    with collective_spy.CollectiveSpy() as spy:
        for _ in range(3):
            hist.append(auto.active)
            for it in range(H):
                if it < auto.active:  # lockstep round: an inactive iteration costs nothing here
                    t0 = time.perf_counter()
                    time.sleep(BASE_S * (3.0 if rank == 2 else 1.0))
                    auto.record(time.perf_counter() - t0)
            auto.agree()
            tables.append(list(auto.times))
    hist.append(auto.active)
    return {"hist": hist, "tables": tables, "calls": sorted({c[0] for c in spy.calls}),
            "kinds": dict(auto.counter.by_kind)}


def test_slow_worker_runs_fewer_steps():
    out = run_ranks(_rank_fn, world_size=3, timeout=300)
    for r in range(3):
        assert out[r]["hist"][0] == H                    # round 0: nothing measured yet
        assert out[r]["tables"] == out[0]["tables"]      # the same table on every worker
        assert set(out[r]["calls"]) <= {"batch_isend_irecv", "isend", "irecv"}
        assert out[r]["kinds"] == {"p2p_steptime": 3}
    for h in out[2]["hist"][1:]:                         # 3x slower: about H/3 = 4 steps
        assert 2 <= h <= 5, out[2]["hist"]
    for r in (0, 1):                                     # the fast ones keep (nearly) H
        assert min(out[r]["hist"][1:]) >= H - 3, out[r]["hist"]
    t = out[0]["tables"][-1]
    assert t[2] / min(t[0], t[1]) == pytest.approx(3.0, rel=0.35)


def _parse(argv, monkeypatch):
    import sys

    from megatron.training.arguments import parse_args

    from megatron_sparseloco.megatron.args import add_sparseloco_args
    monkeypatch.setattr(sys, "argv", ["x", "--use-distributed-optimizer", "--sparseloco-algorithm", "gasloc",
                                      "--sparseloco-workers", "2"] + argv)
    return parse_args(add_sparseloco_args)


def test_auto_flag_parsed_and_h_kept(monkeypatch):
    from megatron_sparseloco.megatron.args import validate_sparseloco_args

    args = _parse(["--sparseloco-inner-steps", "20", "--sparseloco-inner-steps-per-worker", "auto"], monkeypatch)
    validate_sparseloco_args(args, world_size=4)
    loop = args.sparseloco_loop_config
    assert loop.inner_steps_per_worker == "auto" and loop.inner_steps == 20
    assert loop.auto_inner_steps and loop.inner_steps_for(1) == 20   # measured at run time, H until then


@pytest.mark.parametrize("argv, flag", [
    (["--sparseloco-inner-steps-per-worker", "auto", "--sparseloco-overlap-steps", "2"], "--sparseloco-inner-steps-per-worker"),
    (["--sparseloco-inner-steps-per-worker", "aut"], "--sparseloco-inner-steps-per-worker"),
])
def test_auto_flag_errors_name_the_flag(argv, flag, monkeypatch):
    from megatron_sparseloco.megatron.args import SparseLoCoArgumentError, validate_sparseloco_args

    args = _parse(argv, monkeypatch)
    with pytest.raises(SparseLoCoArgumentError) as err:
        validate_sparseloco_args(args, world_size=4)
    assert flag in str(err.value), str(err.value)

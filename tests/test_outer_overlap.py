"""Delayed application of the outer step (``outer/overlap.py``) on 2 and 4 gloo ranks.

* a single-process reference of the delayed step (replay and lerp merges) for sparseloco, diloco
  and average: every worker's params after every inner step, bit for bit (dense all-reduce sums of
  4 are order-dependent in fp32, so for dense W = 4 the bitwise check is against a blocking
  "shadow" strategy fed with the launch-time params on its own group, plus the reference to 1e-6);
* a deliberately slow peer: the other worker's inner steps go on during the window;
* a collective that stalls in flight fails after the group timeout instead of hanging.
"""
from __future__ import annotations

import pytest
import torch

from megatron_sparseloco.compress import decode, decode_dense, encode
from megatron_sparseloco.outer import ConfigError, build_outer_strategy
from megatron_sparseloco.outer.overlap import DelayedOuter, OverlapConfig
from megatron_sparseloco.outer.sparseloco import SparseLoCoConfig

from outer_testlib import SHAPES, drift, flat, make_params

NUMEL = sum(torch.Size(s).numel() for s in SHAPES)  # 190
H, TAU, ROUNDS = 4, 2, 3
SPARSE = dict(chunk=64, k=4, bucket_numel=150, chunking="flat")
JOBS = {
    "sparse_replay": dict(name="sparseloco", config=SPARSE, merge="replay"),
    "sparse_lerp": dict(name="sparseloco", config=dict(SPARSE, lr=0.8, momentum=0.9, nesterov=True), merge="lerp",
                        alpha=0.25),
    "sparse_tensor": dict(name="sparseloco", config=dict(chunk=64, k=4), merge="replay"),
    "sparse_entropy": dict(name="sparseloco", config=dict(chunk=64, k=4, index_coding="entropy"), merge="replay"),
    "sparse_rs": dict(name="sparseloco", config=dict(chunk=64, k=4, aggregation="reduce-scatter"), merge="replay"),
    "sparse_rs_put_back": dict(name="sparseloco", config=dict(chunk=64, k=4, aggregation="reduce-scatter",
                                                              owner_residual="workers"), merge="replay"),
    "sparse_hier": dict(name="sparseloco", config=dict(chunk=64, k=4, aggregation="hierarchical", aggregation_groups=2),
                        merge="replay"),
    "diloco_replay": dict(name="diloco", config=dict(bucket_numel=64), merge="replay"),
    "diloco_lerp": dict(name="diloco", config=dict(bucket_numel=64), merge="lerp", alpha=0.5),
    "average_replay": dict(name="average", config=dict(bucket_numel=64), merge="replay"),
    "average_lerp": dict(name="average", config=dict(bucket_numel=64), merge="lerp", alpha=0.75),
}
REFERENCED = ("sparse_replay", "sparse_lerp", "diloco_replay", "diloco_lerp", "average_replay", "average_lerp")


def _jobs(world: int) -> dict:
    jobs = {k: dict(v, H=H, tau=TAU, rounds=ROUNDS) for k, v in JOBS.items()}
    jobs["tau_max"] = dict(JOBS["sparse_replay"], H=H, tau=H - 1, rounds=ROUNDS)
    if world == 2:
        jobs["nan_skip"] = dict(JOBS["sparse_replay"], H=H, tau=TAU, rounds=ROUNDS, nan_at=(1, 2 * H))
        jobs["diloco_nan_skip"] = dict(JOBS["diloco_replay"], H=H, tau=TAU, rounds=ROUNDS, nan_at=(0, H))
        jobs["resumed"] = dict(JOBS["sparse_lerp"], H=H, tau=TAU, rounds=ROUNDS, state_at=2 * H + 1)
        jobs["resumed_replay"] = dict(JOBS["diloco_replay"], H=H, tau=TAU, rounds=ROUNDS, state_at=H)
    return jobs


@pytest.fixture(scope="module")
def runs():
    from megatron_sparseloco.testing.multirank import run_ranks
    from overlap_testlib import drive_many

    out = {}
    for world in (2, 4):
        jobs = _jobs(world)
        per_rank = run_ranks(drive_many, world, args=(list(jobs.values()),), timeout=300)
        out[world] = {k: [per_rank[r][i] for r in range(world)] for i, k in enumerate(jobs)}
    return out


# ---------------------------------------------------------------------------------- reference
def _sparse_update(cfg: SparseLoCoConfig, anchor, deltas, errors, opt, p):
    """One SparseLoCo outer step (flat chunking) from the workers' Δ, plain torch (test_outer_sparseloco)."""
    codec, b = cfg.codec(), cfg.effective_bucket_numel
    grad = torch.zeros(NUMEL)
    for s in range(0, NUMEL, b):
        e = min(NUMEL, s + b)
        total, count = torch.zeros(e - s), torch.zeros(e - s)
        for r, delta in enumerate(deltas):
            errors[r][s:e] = cfg.ef_beta * errors[r][s:e] + delta[s:e]
            payload = encode(errors[r][s:e].clone(), codec, "reference")
            sent = decode_dense(payload)
            errors[r][s:e] -= sent
            mask = torch.zeros(e - s)
            mask[decode(payload).indices] = 1.0
            total, count = total + sent, count + mask
        grad[s:e] = total / count.clamp(min=1) if cfg.reduce == "contributors" else total / len(deltas)
    p.grad = grad
    opt.step()


def reference(job: str, world: int, tau: int = TAU, nan_at=None):
    """Every worker's params after every inner step of the delayed run, single process."""
    spec = JOBS[job]
    algo, cfg = spec["name"], dict(spec["config"])
    merge, alpha = spec["merge"], spec.get("alpha", 0.5)
    if algo == "sparseloco":
        scfg = SparseLoCoConfig(**cfg).validate()
        lr, mom, nest = scfg.lr, scfg.momentum, scfg.nesterov
    elif algo == "diloco":
        lr, mom, nest = cfg.get("lr", 0.7), cfg.get("momentum", 0.9), cfg.get("nesterov", True)
    else:
        lr, mom, nest = 1.0, 0.0, False
    p = torch.nn.Parameter(flat(make_params(0)).clone())
    opt = torch.optim.SGD([p], lr=lr, momentum=mom, nesterov=nest, foreach=False)
    theta = [flat(make_params(0)).clone() for _ in range(world)]
    errors = [torch.zeros(NUMEL) for _ in range(world)]
    pending, launch = None, None
    trace = [[] for _ in range(world)]
    for i in range(1, ROUNDS * H + tau + 1):
        for r in range(world):
            theta[r] = theta[r] + flat(drift(r, i))
            if nan_at == (r, i):
                theta[r][3] = float("nan")
        if i % H == 0 and i // H <= ROUNDS:
            anchor = p.detach().clone()
            if any(not torch.isfinite(t).all() for t in theta):
                # skipped: the non-finite worker resets at once, the others keep training from where
                # they are; at the merge every worker replays its window on θ_outer,k (unchanged)
                theta = [t if torch.isfinite(t).all() else anchor.clone() for t in theta]
                pending = None
            else:
                pending = [anchor - t for t in theta]
            launch = [t.clone() for t in theta]
        if i % H == tau and i > H:
            with torch.no_grad():
                if pending is not None:
                    if algo == "sparseloco":
                        _sparse_update(scfg, None, pending, errors, opt, p)
                    else:
                        acc = pending[0].clone()
                        for d in pending[1:]:
                            acc = acc + d
                        p.grad = acc / world
                        opt.step()
                new = p.detach()
                for r in range(world):
                    theta[r] = (theta[r] - launch[r]) + new if merge == "replay" else torch.lerp(new, theta[r], alpha)
        for r in range(world):
            trace[r].append(theta[r].clone())
    return trace


def _check_shadow(res):
    for r, rr in enumerate(res):
        assert rr["shadow_ok"] and all(rr["shadow_ok"]), f"rank {r}: θ_outer differs from the blocking step's"
        assert rr["merge_ok"] and all(rr["merge_ok"]), f"rank {r}: merged params differ from the merge formula"


# ---------------------------------------------------------------------------------- tests
@pytest.mark.multirank
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("job", REFERENCED)
def test_delayed_step_matches_single_process_reference(runs, world, job):
    res = runs[world][job]
    _check_shadow(res)
    ref = reference(job, world)
    exact = world == 2 or JOBS[job]["name"] == "sparseloco"
    for r in range(world):
        for i, (got, want) in enumerate(zip(res[r]["params"], ref[r])):
            if exact:
                assert torch.equal(got, want), f"rank {r} inner step {i + 1}: max diff {(got - want).abs().max():.3e}"
            else:
                torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    # θ_outer identical on every worker after every completion
    for i, a in res[0]["anchor"].items():
        for r in range(1, world):
            assert torch.equal(res[r]["anchor"][i], a)


@pytest.mark.multirank
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("job", ["sparse_tensor", "sparse_entropy", "sparse_rs", "sparse_rs_put_back", "sparse_hier",
                                 "tau_max"])
def test_delayed_step_equals_blocking_step_on_launch_params(runs, world, job):
    """Per-tensor chunking, entropy coding, reduce-scatter (its put-back too: a wrong EF after round 1
    shows in round 2), hierarchical (also bitwise the all-gather run), τ = H − 1: θ_outer,k+1 bitwise
    the blocking step's."""
    res = runs[world][job]
    _check_shadow(res)
    for i, a in res[0]["anchor"].items():
        for r in range(1, world):
            assert torch.equal(res[r]["anchor"][i], a)
        if job == "sparse_hier":
            assert torch.equal(a, runs[world]["sparse_tensor"][0]["anchor"][i])
    stats = [s for s in res[0]["stats"] if s is not None]
    assert len(stats) == ROUNDS and all(s["bytes_sent"] > 0 and s["time_exposed_s"] > 0 for s in stats)


@pytest.mark.multirank
@pytest.mark.parametrize("job,ref_job,nan_at", [("nan_skip", "sparse_replay", (1, 2 * H)),
                                                ("diloco_nan_skip", "diloco_replay", (0, H))])
def test_nonfinite_round_skipped_consistently(runs, job, ref_job, nan_at):
    res = runs[2][job]
    _check_shadow(res)
    skipped = [s["skipped"] for s in res[0]["stats"]]
    assert skipped == [s["skipped"] for s in res[1]["stats"]]
    assert sum(skipped) == 1
    ref = reference(ref_job, 2, nan_at=nan_at)
    for r in range(2):
        for got, want in zip(res[r]["params"], ref[r]):
            assert torch.equal(got, want)


@pytest.mark.multirank
@pytest.mark.parametrize("job,base", [("resumed", "sparse_lerp"), ("resumed_replay", "diloco_replay")])
def test_state_dict_inside_window_resumes_bitwise(runs, job, base):
    for r in range(2):
        for got, want in zip(runs[2][job][r]["params"], runs[2][base][r]["params"]):
            assert torch.equal(got, want)


def test_slow_peer_does_not_stall_inner_steps():
    from megatron_sparseloco.testing.multirank import run_ranks
    from overlap_testlib import drive_slow_peer

    Hs, taus, step_s, delay = 4, 3, 0.05, 0.6
    res = run_ranks(drive_slow_peer, 2, args=("diloco", dict(), Hs, taus, 2, step_s, 1, delay), timeout=120)
    fast = res[0]
    for i, end in fast["comm_end"].items():
        launch = fast["launch"][i - taus]
        window = [fast["step_times"][j] for j in range(i - taus + 1, i + 1)]
        # the collective needed the slow peer, so it ended at least ``delay`` after the launch ...
        assert end - launch >= delay * 0.9
        # ... and the fast worker's inner steps of the window ran while it was in flight
        assert all(launch < t < end for t in window[:-1]), (launch, window, end)
        # what it waited for is the delay minus the window's compute, not the whole delay
        assert fast["wait"][i] < delay - (taus - 1) * step_s * 0.8
    assert torch.equal(res[0]["anchor"], res[1]["anchor"])


def test_agreement_waits_on_the_comm_thread_not_in_the_launch():
    """The non-finite agreement waits for the slowest worker, so it runs on the comm thread: a
    worker that reaches the end of its round ``late`` seconds after its peer makes the peer's
    agreement (``time_agree_s``) wait that long, but not the peer's launch (the main thread)."""
    from megatron_sparseloco.testing.multirank import run_ranks
    from overlap_testlib import drive_slow_peer

    Hs, taus, step_s, late = 4, 2, 0.02, 0.5
    res = run_ranks(drive_slow_peer, 2, args=("diloco", dict(), Hs, taus, 2, step_s, 1, 0.0, late), timeout=120)
    on_time, late_worker = res[0]["agree"], res[1]["agree"]
    assert on_time and set(on_time) == set(late_worker)
    for i in on_time:
        assert on_time[i] >= late * 0.8, on_time      # the agreement waited for the late worker ...
        assert res[0]["launch_s"][i] < late * 0.3, res[0]["launch_s"]   # ... the launch did not
        assert late_worker[i] < late * 0.5, late_worker  # found its peer there already
    assert torch.equal(res[0]["anchor"], res[1]["anchor"])


@pytest.mark.multirank
@pytest.mark.parametrize("name,config", [("sparseloco", SPARSE), ("diloco", dict(bucket_numel=64))])
def test_nonfinite_abort_raises_at_completion_everywhere(name, config):
    """Policy abort with τ: every worker raises at the round's completion, naming the tensor on the
    worker that saw it and the worker on the other; θ_outer and the error feedback are as before the
    launch (the launch's EF update is undone)."""
    from megatron_sparseloco.testing.multirank import run_ranks
    from overlap_testlib import drive_abort

    res = run_ranks(drive_abort, 2, args=(name, config, H, TAU, 1), timeout=120)
    assert res[0]["raised_at"] == res[1]["raised_at"] == 2 * H + TAU
    assert "in worker 1" in res[0]["error"] and "tensor 'p1' on this worker" in res[1]["error"]
    for r in range(2):
        assert not res[r]["in_flight"]
        before, after = res[r]["state_before"], res[r]["state_after"]
        assert set(before) == set(after)
        kept = [k for k in before if k != "overlap_launch"]   # (the launch snapshot is the new launch's)
        assert ("error_feedback" in kept) == (name == "sparseloco") and "anchor" in kept
        for k in kept:
            assert torch.equal(before[k], after[k]), (r, k)


def test_stalled_collective_times_out():
    from megatron_sparseloco.testing.multirank import run_ranks
    from overlap_testlib import drive_timeout

    res = run_ranks(drive_timeout, 2, args=(2.0,), timeout=60)
    assert res[0][1][0] is None and res[1][1][0] is None
    err, elapsed = res[0][2]
    assert err is not None and elapsed < 15, res[0]


def test_config_errors():
    with pytest.raises(ConfigError, match="τ=4 must be < inner steps H=4"):
        OverlapConfig(steps=4).validate(inner_steps=4)
    with pytest.raises(ConfigError, match="merge"):
        OverlapConfig(steps=1, merge="avg").validate()
    with pytest.raises(ConfigError, match="alpha"):
        OverlapConfig(steps=1, merge="lerp", alpha=1.5).validate()
    strat = build_outer_strategy("diloco", make_params(0), None)
    with pytest.raises(ConfigError, match="τ >= 1"):
        DelayedOuter(strat, OverlapConfig(steps=0))

"""The round lifecycle (``outer/round.py``): pipelined buckets, the held schedule, rollback, host syncs.

* pipelined_buckets: in a blocking step bucket b+1 is compressed while bucket b's collective is in
  flight (the recorded order of events), and the result is bitwise the held schedule's (compress
  every bucket, exchange every bucket, apply every bucket), on real gloo ranks;
* a held round cancelled after its compress leaves every piece of state as before it;
* host_sync: the dense outer step's host synchronisations do not grow with the number of buckets
  or of workers (counted on the CPU through the same code, ``testing.host_syncs``).
"""
from __future__ import annotations

import pytest
import torch

from outer_testlib import drift, make_params

SPARSE = dict(k=8, chunk=64, bucket_numel=64)        # SHAPES (190 elements) → several buckets
DENSE = dict(bucket_numel=48)


def _pipelined_vs_held(rank, world, name, config, steps):
    """Each step twice from the same state: pipelined (recording the phase order) and held."""
    from megatron_sparseloco.outer import build_outer_strategy

    params, twin = make_params(0), make_params(0)
    strat = build_outer_strategy(name, params, None, **config)
    other = build_outer_strategy(name, twin, None, **config)
    out = {"events": [], "equal": [], "buckets": len(list(strat.buckets()))}
    for step in range(1, steps + 1):
        for p, q, d in zip(params, twin, drift(rank, step)):
            p.add_(d)
            q.add_(d)
        events = []
        plan = strat.begin_round(strat.new_stats(), None, held=False)
        compress, start = plan.compress, plan.start_exchange

        def recorded_compress(b, compress=compress, events=events):
            events.append(("compress", b))
            return compress(b)

        def recorded_start(b, start=start, events=events):
            pending = start(b)
            events.append(("start", b))
            wait = pending.wait

            def recorded_wait():
                events.append(("wait", b))
                return wait()
            pending.wait = recorded_wait
            return pending

        plan.compress, plan.start_exchange = recorded_compress, recorded_start
        plan.run_pipelined(write_back=True)
        strat.outer_steps += 1
        held = other.begin_round(other.new_stats(), None, held=True)
        held.compress_all()
        held.exchange_all()
        held.commit(write_back=True)
        other.outer_steps += 1
        out["events"].append(events)
        out["equal"].append(torch.equal(strat.anchor, other.anchor)
                            and all(torch.equal(a, b) for a, b in zip(params, twin)))
    return out


@pytest.mark.multirank
@pytest.mark.parametrize("name,config", [("sparseloco", SPARSE), ("diloco", DENSE)])
def test_pipelined_buckets_overlap_compress_with_the_collective_and_match_the_held_schedule(name, config):
    from megatron_sparseloco.testing.multirank import run_ranks

    res = run_ranks(_pipelined_vs_held, 2, args=(name, config, 3), timeout=120)
    for r in res:
        n = r["buckets"]
        assert n >= 3
        assert all(r["equal"]), r["equal"]                     # bitwise the held schedule
        for ev in r["events"]:
            at = {e: i for i, e in enumerate(ev)}
            for b in range(n - 1):
                # bucket b+1 is compressed after b's collective started and before it is waited for
                assert at[("start", b)] < at[("compress", b + 1)] < at[("wait", b)], ev


def test_held_round_cancelled_after_compress_restores_the_state():
    from megatron_sparseloco.outer import build_outer_strategy

    params = make_params(0)
    strat = build_outer_strategy("sparseloco", params, None, **SPARSE)
    for p, d in zip(params, drift(0, 1)):
        p.add_(d)
    strat.step()                      # a non-zero error feedback to restore
    for p, d in zip(params, drift(0, 2)):
        p.add_(d)
    before = {k: v.clone() for k, v in strat.elementwise_state().items()}
    local = [p.clone() for p in params]
    plan = strat.begin_round(strat.new_stats(), None, held=True)
    plan.compress_all()
    assert not torch.equal(strat.error_feedback, before["error_feedback"])   # compress moved it
    plan.cancel()
    for k, v in strat.elementwise_state().items():
        assert torch.equal(v, before[k]), k
    assert all(torch.equal(a, b) for a, b in zip(params, local))


def _count_dense_syncs(rank, world, buckets):
    from megatron_sparseloco.outer import build_outer_strategy
    from megatron_sparseloco.testing.host_syncs import HostSyncCounter

    params = [torch.randn(64, generator=torch.Generator().manual_seed(i)) for i in range(buckets)]
    strat = build_outer_strategy("diloco", params, None, bucket_numel=64)
    for p in params:
        p.add_(0.01 * (rank + 1))
    with HostSyncCounter() as syncs:
        strat.step()
    return syncs.total, dict(syncs.sites)


@pytest.mark.multirank
def test_host_syncs_of_the_dense_step_do_not_grow_with_buckets_or_workers():
    from megatron_sparseloco.testing.multirank import run_ranks

    counts = {}
    for world in (2, 4):
        for buckets in (2, 8):
            res = run_ranks(_count_dense_syncs, world, args=(buckets,), timeout=120)
            counts[(world, buckets)] = res[0][0]
    assert len(set(counts.values())) == 1, counts


def _mixed_params(n):
    """n × (a tile-aligned 16x16 weight, a 1-D norm sent whole, a 12x20 weight with edge tiles): every
    segment kind, kernel-path and torch-path alike."""
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        out += [torch.randn(16, 16, generator=g), torch.randn(16, generator=g), torch.randn(12, 20, generator=g)]
    return out


def _drifted_sparseloco(rank, groups, kernels):
    """SparseLoCo over ``_mixed_params(groups)`` (buckets of 512), each worker drifted its own way."""
    import os
    if kernels:
        os.environ["SPARSELOCO_INTERPRET_KERNELS"] = "1"
    from megatron_sparseloco.outer import build_outer_strategy

    params = _mixed_params(groups)
    strat = build_outer_strategy("sparseloco", params, None, bucket_numel=512, k=8, chunk=64)
    for i, p in enumerate(params):
        p.add_(0.01 * (rank + 1) * torch.randn(p.shape, generator=torch.Generator().manual_seed(100 + i)))
    return strat


def _count_sparse_syncs(rank, world, groups, kernels):
    from megatron_sparseloco.compress import fast_segments
    from megatron_sparseloco.testing.host_syncs import HostSyncCounter

    strat = _drifted_sparseloco(rank, groups, kernels)
    with HostSyncCounter() as syncs:
        strat.step()
    return syncs.total, len(list(strat.buckets())), dict(fast_segments.last_dispatch)


@pytest.mark.multirank
@pytest.mark.parametrize("kernels", [False, True], ids=["torch", "triton-interpreted"])
def test_host_syncs_of_the_sparseloco_step_do_not_grow_with_buckets_or_workers(kernels):
    """The codec's checks are read once per round (``compress.checks``), so an outer step's host
    synchronisations are the same at 2 and 6 buckets and at 2 and 4 workers, on the torch path and on
    the kernels' (interpreted here: the CUDA path's code)."""
    from megatron_sparseloco.testing.multirank import run_ranks

    env = {"TRITON_INTERPRET": "1", "SPARSELOCO_INTERPRET_KERNELS": "1"} if kernels else {}
    counts, buckets = {}, set()
    for world in (2, 4):
        for groups in (2, 6):
            total, n, dispatch = run_ranks(_count_sparse_syncs, world, args=(groups, kernels), env=env,
                                           timeout=300)[0]
            counts[(world, groups)] = total
            buckets.add(n)
            assert (dispatch.get("decode_scatter_add") == "mixed") == kernels, dispatch
    assert len(buckets) == 2, buckets
    assert len(set(counts.values())) == 1, counts


def _corrupt_bucket0(rank, world):
    from megatron_sparseloco.compress.errors import PayloadError
    from megatron_sparseloco.outer import build_outer_strategy

    params = _mixed_params(2)
    strat = build_outer_strategy("sparseloco", params, None, bucket_numel=512, k=8, chunk=64)
    for p in params:
        p.add_(0.01 * (rank + 1))
    before = strat.anchor.clone()
    if rank == 1:
        compress = strat._compress

        def corrupt(s, e, plan, delta):
            payload, local = compress(s, e, plan, delta)
            if s == 0:
                payload = payload.clone()
                payload[0] ^= 1          # the magic: the header no longer matches the plan
            return payload, local
        strat._compress = corrupt
    try:
        strat.step()
        error = None
    except PayloadError as exc:
        error = str(exc)
    s0, e0 = next(iter(strat.buckets()))
    return {"error": error, "bucket0_unchanged": torch.equal(strat.anchor[s0:e0], before[s0:e0]),
            "rest_moved": not torch.equal(strat.anchor[e0:], before[e0:])}


@pytest.mark.multirank
def test_a_malformed_payload_is_refused_and_its_bucket_applies_nothing():
    from megatron_sparseloco.testing.multirank import run_ranks

    res = run_ranks(_corrupt_bucket0, 2, timeout=120)
    r0 = res[0]
    assert r0["error"] is not None and "payload 1: bucket payload magic" in r0["error"], r0
    assert "bucket [0:" in r0["error"], r0          # the bucket named, as the immediate check names it
    assert r0["bucket0_unchanged"] and r0["rest_moved"], r0


def _step_transient(rank, world, groups, kernels):
    from megatron_sparseloco.testing.tensor_accounting import TensorAccounting

    strat = _drifted_sparseloco(rank, groups, kernels)
    with TensorAccounting() as acc:
        strat.begin_round(strat.new_stats(), None, held=False).run_pipelined(write_back=True)
    return acc.peak["cpu"], len(list(strat.buckets()))


@pytest.mark.multirank
@pytest.mark.parametrize("kernels", [False, True], ids=["torch", "triton-interpreted"])
def test_pipelined_buckets_transient_memory_does_not_grow_with_buckets(kernels):
    """A blocking SparseLoCo step holds the work buffers of at most two buckets: the codec's deferred checks
    keep only their evidence (a few scalars), never a bucket's payloads or index tensors, until the round's
    end. The peak of tensor storage allocated by the step is the same at 3 and 12 buckets."""
    from megatron_sparseloco.testing.multirank import run_ranks

    env = {"TRITON_INTERPRET": "1", "SPARSELOCO_INTERPRET_KERNELS": "1"} if kernels else {}
    peaks = {}
    for groups in (2, 8):
        peak, buckets = run_ranks(_step_transient, 2, args=(groups, kernels), env=env, timeout=300)[0]
        peaks[buckets] = peak
    few, many = sorted(peaks)
    assert many >= 4 * few, peaks
    # per extra bucket: the checks' flags and evidence (a few scalars per segment and worker), less than one
    # worker's int64 index tensor of the bucket (64 kept values: 512 B), which the checks used to keep
    assert (peaks[many] - peaks[few]) / (many - few) < 512, peaks

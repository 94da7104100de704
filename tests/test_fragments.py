"""Streaming-DiLoCo fragments (``--sparseloco-fragments P``, megatron/fragments.py) in real megatron-core (CPU, gloo).

- the schedule helpers: offsets ⌊p·H/P⌋, which inner steps sync / have a merge due;
- W=2 workers, 4 layers, P=2 and 3 (blocking and τ=1): fragment p syncs exactly after the inner
  steps ≡ o_p (mod H) (with τ: its merge τ steps later), each sync sends ≈ 1/P of the bytes of a
  P=1 round and the P syncs of a round add up to it (± the non-finite flags), θ_outer is identical
  on both workers after every fragment sync; P=1 given explicitly is bitwise the default run;
- PP2 × W2 (tied embedding / output layer on different stages): the layer number is global (the
  last stage's local ``decoder.layers.0`` is global layer 1), the last stage's tied output-layer
  copy is in fragment 0 with the embedding, and the copies stay bitwise identical;
- the flags: defaults, and each bad combination refused naming the flag(s) before training.
"""
from __future__ import annotations

import sys

import pytest
import torch
import torch.distributed as dist

from megatron_sparseloco.megatron.fragments import fragment_offsets, layer_fragment, round_in_flight, syncs_at
from megatron_sparseloco.megatron.schedule import RoundSchedule
from megatron_sparseloco.testing.megatron_harness import tiny_gpt_parameter_counts
from megatron_sparseloco.testing.multirank import run_ranks

SEQ, MBS, VOCAB = 32, 2, 128


def test_schedule_helpers():
    assert fragment_offsets(6, 1) == [0]
    assert fragment_offsets(6, 3) == [0, 2, 4]
    assert fragment_offsets(10, 3) == [0, 3, 6]
    assert [layer_fragment(l, 4, 3) for l in range(4)] == [0, 1, 2, 2]
    assert [layer_fragment(l, 5, 2) for l in range(5)] == [0, 0, 1, 1, 1]
    assert [layer_fragment(l, 4, 4) for l in range(4)] == [0, 1, 2, 3]
    assert [layer_fragment(l, 7, 1) for l in range(7)] == [0] * 7
    for L in range(1, 9):
        for P in range(1, L + 1):
            groups = [layer_fragment(l, L, P) for l in range(L)]
            assert groups == sorted(groups) and set(groups) == set(range(P))   # contiguous, none empty
            assert {groups.count(p) for p in range(P)} <= {L // P, -(-L // P)}
    # fragment with offset 2 in rounds of 6: syncs after inner steps 2, 8, 14 ...
    assert [t for t in range(0, 20) if syncs_at(t, 2, 6)] == [2, 8, 14]
    assert [t for t in range(0, 20) if syncs_at(t, 0, 6)] == [6, 12, 18]
    # τ = 1: merge due right after a launch only (and never before the first launch)
    assert [t for t in range(0, 16) if round_in_flight(t, 2, 6, 1)] == [2, 8, 14]
    assert [t for t in range(0, 16) if round_in_flight(t, 0, 6, 2)] == [6, 7, 12, 13]
    assert not any(round_in_flight(t, 0, 6, 0) for t in range(20))
    # the next inner step after which any fragment's round launches (an elastic header's ``last_round``)
    s = RoundSchedule(6, 1, 3)   # offsets 0, 2, 4
    assert [s.next_launch(t) for t in (0, 1, 2, 3, 4, 5, 6, 13)] == [2, 2, 4, 4, 6, 6, 8, 14]
    assert [RoundSchedule(5).next_launch(t) for t in (0, 4, 5, 9)] == [5, 5, 10, 10]


def _fragment_run(P, H, tau, steps, algorithm, fields, tp=1, pp=1, W=2, num_layers=4):
    from megatron.core import parallel_state

    from megatron_sparseloco.megatron.args.model_size import model_parameter_count
    from megatron_sparseloco.megatron.optimizer import OuterLoopConfig, OuterLoopOptimizer
    from megatron_sparseloco.outer.registry import build_outer_strategy
    from megatron_sparseloco.testing.megatron_harness import (build_tiny_gpt, init_megatron, params_fingerprint,
                                                               synthetic_batches, train_step, wrap_ddp_and_optimizer)

    init_megatron(tp=tp, pp=pp, num_distributed_optimizer_instances=W)
    chunks = build_tiny_gpt(num_layers=num_layers, seq_len=SEQ, vocab=VOCAB)
    ddp, opt = wrap_ddp_and_optimizer(chunks, lr=1e-3, num_distributed_optimizer_instances=W)
    batches = synthetic_batches(7, MBS, SEQ, VOCAB, parallel_state.get_data_parallel_rank())

    def factory(params, group, names, slices=None):
        return build_outer_strategy(algorithm, params, group, names=names, slices=slices, **fields)

    config = OuterLoopConfig(inner_steps=H, overlap_steps=tau) if P is None else \
        OuterLoopConfig(inner_steps=H, overlap_steps=tau, fragments=P)
    outer = OuterLoopOptimizer(opt, ddp, factory, config)
    frags = outer.fragment_strategies
    names = {p: sorted(n for s in ss for n in s.names) for p, ss in enumerate(frags)}
    syncs = []   # (inner step, fragment, bytes sent, θ_outer of the fragment)
    seen = [[s.outer_steps for s in ss] for ss in frags]
    sent = [[s.counter.bytes_sent for s in ss] for ss in frags]
    losses = []
    for i in range(1, steps + 1):
        losses.append(train_step(ddp, outer, batches, seq_len=SEQ, micro_batch_size=MBS))
        for p, ss in enumerate(frags):
            now = [s.outer_steps for s in ss]
            if now != seen[p]:
                assert all(a == b + 1 for a, b in zip(now, seen[p])), (i, p, now, seen[p])
                b = sum(s.counter.bytes_sent for s in ss) - sum(sent[p])
                syncs.append((i, p, b, torch.cat([s.anchor for s in ss]).clone()))
                seen[p], sent[p] = now, [s.counter.bytes_sent for s in ss]
    outer.wait_outer_step()
    tied = {}
    for chunk in ddp:
        for name, prm in chunk.named_parameters():
            if getattr(prm, "shared_embedding", False):
                tied[name] = prm.detach().clone()
    return {"syncs": syncs, "names": names, "numel": {p: sum(s.params.numel for s in ss) for p, ss in enumerate(frags)}, "offsets": outer.fragment_offsets, "losses": losses,
            "params": params_fingerprint(ddp), "tied": tied, "pp_rank": parallel_state.get_pipeline_model_parallel_rank(),
            "group": sorted(dist.get_process_group_ranks(outer.group)), "fragment_syncs": list(outer.fragment_syncs),
            "log_outer_steps": outer.log.outer_steps,
            "worker": outer.worker_index, "model_numel": model_parameter_count(ddp)}


def _dp_rank(rank, world):
    diloco = dict(lr=0.7, momentum=0.9, nesterov=True)
    out = {"p1": _fragment_run(1, 6, 0, 12, "diloco", diloco),
           "default": _fragment_run(None, 6, 0, 12, "diloco", diloco),
           "p2": _fragment_run(2, 6, 0, 12, "diloco", diloco),
           "p3": _fragment_run(3, 6, 0, 12, "diloco", diloco),
           "p2_tau1": _fragment_run(2, 6, 1, 12, "sparseloco", {})}
    return out


@pytest.mark.timeout(1600)
def test_fragments_sync_at_offsets_with_their_bytes_and_identical_theta():
    res = run_ranks(_dp_rank, 2, timeout=1500)
    # P = 1 given explicitly is the default run, bit for bit
    for r in res:
        assert r["p1"]["losses"] == r["default"]["losses"]
        for name, t in r["p1"]["params"].items():
            assert torch.equal(t, r["default"]["params"][name]), name
    round_bytes = res[0]["p1"]["syncs"][0][2]
    assert [s[:3] for s in res[0]["p1"]["syncs"]] == [(6, 0, round_bytes), (12, 0, round_bytes)]
    for key, P, H, tau in (("p2", 2, 6, 0), ("p3", 3, 6, 0), ("p2_tau1", 2, 6, 1)):
        r0 = res[0][key]
        offsets = r0["offsets"]
        assert offsets == [p * H // P for p in range(P)]
        # every layer group is a fragment of its own; the embedding with fragment 0, the final norm with the last
        assert any("embedding" in n for n in r0["names"][0])
        assert any("final_layernorm" in n for n in r0["names"][P - 1])
        assert all(r0["names"][p] for p in range(P))
        want = sorted((t + tau, p) for p, o in enumerate(offsets) for t in range(1, 13) if syncs_at(t, o, H)
                      and t + tau <= 12)
        assert [(i, p) for i, p, _, _ in r0["syncs"]] == want, (key, r0["syncs"])
        assert r0["fragment_syncs"] == [sum(1 for t in range(1, 13) if syncs_at(t, o, H)) for o in offsets]
        assert r0["log_outer_steps"] == len(want) + sum(1 for p, o in enumerate(offsets)
                                                        if round_in_flight(12, o, H, tau))
        # all workers' θ_outer identical after every fragment sync
        for a, b in zip(res[0][key]["syncs"], res[1][key]["syncs"]):
            assert a[:2] == b[:2] and torch.equal(a[3], b[3]), (key, a[:2])
        if key.startswith("p2_tau"):
            continue
        # bytes: a sync sends its fragment's dense fp32 Δ (+ the 4-byte non-finite flag), a round's P syncs
        # add up to the P=1 round (± one flag per extra sync)
        per_fragment = {p: b for _, p, b, _ in r0["syncs"][-P:]}
        assert per_fragment == {p: 4 * n + 4 for p, n in r0["numel"].items()}, (per_fragment, r0["numel"])
        assert sum(per_fragment.values()) == round_bytes + 4 * (P - 1), (per_fragment, round_bytes)
        if P == 2:  # two equal layer groups, the embedding in fragment 0: each ≈ 1/P of the round
            for p, b in per_fragment.items():
                assert 0.75 * round_bytes / P < b < 1.25 * round_bytes / P, (key, p, b, round_bytes)


def _pp_rank(rank, world):
    return _fragment_run(2, 4, 1, 8, "sparseloco", {}, pp=2, num_layers=2)


@pytest.mark.timeout(1600)
def test_fragments_pp2_global_layers_and_tied_copies():
    res = run_ranks(_pp_rank, 4, timeout=1500)
    for r in res:
        if r["pp_rank"] == 1:
            # the last stage's local decoder.layers.0 is global layer 1: fragment 1; the tied
            # output-layer copy goes with the embedding (fragment 0)
            assert any("decoder.layers.0." in n for n in r["names"][1]), r["names"]
            assert not any("decoder.layers" in n for n in r["names"][0]), r["names"]
            assert any("output_layer" in n for n in r["names"][0]), r["names"]
        else:
            assert any("decoder.layers.0." in n for n in r["names"][0]) and not r["names"][1], r["names"]
    # θ_outer identical across the two workers of each outer group after every fragment sync
    for rank, r in enumerate(res):
        peer = res[[g for g in r["group"] if g != rank][0]]
        assert [s[:2] for s in r["syncs"]] == [s[:2] for s in peer["syncs"]]
        for a, b in zip(r["syncs"], peer["syncs"]):
            assert torch.equal(a[3], b[3])
    # tied copies (first stage's embedding, last stage's output layer) bitwise identical in each worker
    for w in (0, 1):
        emb = [t for r in res if r["worker"] == w and r["pp_rank"] == 0 for t in r["tied"].values()]
        out = [t for r in res if r["worker"] == w and r["pp_rank"] == 1 for t in r["tied"].values()]
        assert len(emb) == len(out) == 1, (w, len(emb), len(out))
        assert torch.equal(emb[0], out[0]), w
    # N of the outer-lr rule (megatron/args/model_size.py): the whole model's parameters on every rank of both stages,
    # the last stage's tied copy not counted twice
    whole, counted = run_ranks(tiny_gpt_parameter_counts, 1, args=(dict(num_layers=2, seq_len=SEQ, vocab=VOCAB),),
                               timeout=300)[0]
    assert whole == counted and {r["model_numel"] for r in res} == {whole}, (whole, [r["model_numel"] for r in res])


# ---------------------------------------------------------------------------- flags
BASE = ["--use-distributed-optimizer", "--sparseloco-workers", "2", "--sparseloco-inner-steps", "12",
        "--num-layers", "4"]


def _args(argv, monkeypatch):
    from megatron.training.arguments import parse_args

    from megatron_sparseloco.megatron.args import add_sparseloco_args, validate_sparseloco_args
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *BASE, *argv])
    return validate_sparseloco_args(parse_args(add_sparseloco_args), world_size=4)


def test_fragment_flag_default_and_valid(monkeypatch):
    assert _args(["--sparseloco-algorithm", "diloco"], monkeypatch).sparseloco_loop_config.fragments == 1
    a = _args(["--sparseloco-algorithm", "sparseloco", "--sparseloco-fragments", "3", "--sparseloco-overlap-steps",
               "3"], monkeypatch)
    assert (a.sparseloco_loop_config.fragments, a.sparseloco_loop_config.overlap_steps) == (3, 3)
    assert _args(["--sparseloco-algorithm", "gasloc", "--sparseloco-fragments", "1"], monkeypatch).sparseloco_loop_config.fragments == 1


@pytest.mark.parametrize("argv,words", [
    (["--sparseloco-algorithm", "diloco", "--sparseloco-fragments", "0"], ["--sparseloco-fragments", ">= 1"]),
    (["--sparseloco-algorithm", "diloco", "--sparseloco-fragments", "5"], ["--sparseloco-fragments", "--num-layers 4"]),
    (["--sparseloco-algorithm", "gasloc", "--sparseloco-fragments", "2"], ["--sparseloco-fragments", "gasloc"]),
    (["--sparseloco-algorithm", "diloco", "--sparseloco-fragments", "3", "--sparseloco-overlap-steps", "4"],
     ["--sparseloco-fragments", "--sparseloco-overlap-steps τ=4", "H/P = 12/3"]),
])
def test_fragment_flag_refusals(argv, words, monkeypatch):
    from megatron_sparseloco.megatron.args import SparseLoCoArgumentError
    with pytest.raises(SparseLoCoArgumentError) as info:
        _args(argv, monkeypatch)
    for w in words:
        assert w in str(info.value), str(info.value)


def test_fragment_checkpoint_fact_refuses_other_P():
    from megatron_sparseloco.megatron.checkpoint.outer_state import OuterStateLayoutError, check_saved_metadata
    from megatron_sparseloco.megatron.checkpoint.outer_state import FORMAT_VERSION
    saved = {"format": FORMAT_VERSION, "num_workers": 2, "algorithms": ["diloco"], "facts": {}}
    facts = {"fragments": {"value": 2, "flag": "--sparseloco-fragments"}}
    with pytest.raises(OuterStateLayoutError, match="--sparseloco-fragments 1"):
        check_saved_metadata(saved, 2, ["diloco"], facts)   # a checkpoint from before fragments: P = 1
    saved["facts"] = {"fragments": {"value": 2}}
    check_saved_metadata(saved, 2, ["diloco"], facts)

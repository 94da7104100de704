"""Elastic mode's integration with megatron.training, without launching jobs: the flags through Megatron's
real parser (every bad value refused before the model is built, naming the flag and the fix), and the
data slots through Megatron's real data loader (worker I of W reads what single-job mode's worker I reads).
The real-loop scenarios are in tests/test_elastic_megatron.py."""
import argparse
import sys
from types import SimpleNamespace

import pytest
from megatron.training.arguments import parse_args

from megatron_sparseloco.megatron.args import (SparseLoCoArgumentError, add_sparseloco_args, elastic_job_batch,
                                                    validate_sparseloco_args)


def parse(argv, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *argv])
    return parse_args(add_sparseloco_args)


def elastic(token, *more, workers=3, algorithm="sparseloco"):
    return ["--use-distributed-optimizer", "--micro-batch-size", "2", "--global-batch-size", "12",
            "--sparseloco-algorithm", algorithm, "--sparseloco-workers", str(workers),
            "--sparseloco-lighthouse", "http://lighthouse:29510", "--sparseloco-worker-index", "1",
            "--sparseloco-elastic-token-file", token, *more]


def test_elastic_job_is_one_worker_of_w_slots_with_the_runs_batch(token, monkeypatch):
    """W = 3 slots on a job of 2 ranks (single-job mode would refuse: 3 workers do not divide DP 2); the
    job stays one distributed-optimizer instance and trains 1/W of the run's --global-batch-size."""
    args = validate_sparseloco_args(parse(elastic(token), monkeypatch), world_size=2)
    assert args.num_distributed_optimizer_instances == 1 and args.sparseloco_workers == 3
    assert (args.global_batch_size, args.sparseloco_run_global_batch_size) == (4, 12)
    assert args.sparseloco_elastic.worker_index == 1
    elastic_job_batch(args)        # idempotent: the batch is divided once
    assert args.global_batch_size == 4
    with pytest.raises(SparseLoCoArgumentError, match="--sparseloco-workers"):
        validate_sparseloco_args(parse(elastic(token)[:-6], monkeypatch), world_size=2)


@pytest.mark.parametrize("more,named", [
    (["--global-batch-size", "10"], "--global-batch-size 10"),
    (["--train-samples", "1000"], "--train-samples"),
    (["--rampup-batch-size", "4", "4", "100"], "--rampup-batch-size"),
    (["--sparseloco-consistency-check-interval", "5"], "--sparseloco-consistency-check-interval"),
    (["--num-distributed-optimizer-instances", "2"], "--num-distributed-optimizer-instances"),
])
def test_integration_flags_refused_in_elastic_mode(token, more, named, monkeypatch):
    with pytest.raises(SparseLoCoArgumentError) as exc:
        validate_sparseloco_args(parse(elastic(token, *more), monkeypatch), world_size=2)
    msg = str(exc.value)
    assert named in msg and "Fix:" in msg, msg


@pytest.mark.parametrize("more,flag", [
    (["--sparseloco-gossip-compress"], "--sparseloco-gossip-compress"),
    (["--sparseloco-gossip-topology", "bandwidth"], "--sparseloco-gossip-topology"),
])
def test_gossip_modes_indexed_by_a_fixed_worker_list_are_refused(token, more, flag, monkeypatch):
    with pytest.raises(SparseLoCoArgumentError) as exc:
        validate_sparseloco_args(parse(elastic(token, *more, algorithm="gasloc"), monkeypatch), world_size=2)
    assert str(exc.value).startswith(flag) and "elastic mode" in str(exc.value), exc.value


def test_after_failed_round_takes_keep_or_discard(token, monkeypatch):
    args = validate_sparseloco_args(parse(elastic(token, "--sparseloco-elastic-after-failed-round", "discard"),
                                          monkeypatch), world_size=2)
    assert args.sparseloco_elastic.after_failed_round == "discard"
    assert validate_sparseloco_args(parse(elastic(token), monkeypatch),
                                    world_size=2).sparseloco_elastic.after_failed_round == "keep"
    with pytest.raises(SystemExit):
        parse(elastic(token, "--sparseloco-elastic-after-failed-round", "forget"), monkeypatch)
    args = parse(elastic(token), monkeypatch)
    args.sparseloco_elastic_after_failed_round = "forget"   # (a value set without the parser)
    with pytest.raises(SparseLoCoArgumentError, match="--sparseloco-elastic-after-failed-round"):
        validate_sparseloco_args(args, world_size=2)


def test_elastic_flags_reach_the_flag_reference():
    from megatron_sparseloco.megatron.args import help as flag_help
    text = flag_help.help_text()
    assert flag_help.ELASTIC_TITLE in text
    for flag in ("--sparseloco-lighthouse", "--sparseloco-worker-index", "--sparseloco-elastic-after-failed-round"):
        assert flag in text


# ------------------------------------------------------------------------------------------ data slots
class _ParallelState:
    """The data-parallel rank and size Megatron's samplers ask ``mpu`` for."""

    def __init__(self, rank, size):
        self.rank, self.size = rank, size

    def get_data_parallel_rank(self):
        return self.rank

    def get_data_parallel_world_size(self):
        return self.size


def _batches(loader, n):
    it = iter(loader)
    return [next(it).tolist() for _ in range(n)]


@pytest.mark.parametrize("consumed", [0, 24])
def test_worker_i_reads_slot_i_of_the_runs_data(consumed, monkeypatch):
    """Megatron's real data loader: elastic job I's rank r (its own DP rank r of d, its own consumed
    samples) reads the micro-batches single-job mode's DP rank I·d + r of W·d reads at the run's
    consumed samples (W × the job's); the W slots together read each sample once."""
    import megatron.training.global_vars as gv
    from megatron.training.datasets import data_samplers

    from megatron_sparseloco.megatron.elastic.data_slots import wrap_data_loader, wrap_num_samples

    W, d, mbs = 3, 2, 2
    dataset = list(range(1000))
    base = dict(micro_batch_size=mbs, dataloader_type="single", num_workers=0, hybrid_context_parallel=False,
                full_validation=False, exit_signal_handler=False, sparseloco_algorithm="sparseloco",
                sparseloco_workers=W)
    single = argparse.Namespace(**base, global_batch_size=W * d * mbs)
    monkeypatch.setattr(gv, "_GLOBAL_ARGS", single)
    reference = {}
    for q in range(W * d):
        monkeypatch.setattr(data_samplers, "mpu", _ParallelState(q, W * d))
        reference[q] = _batches(data_samplers.build_pretraining_data_loader(dataset, consumed * W), 3)
    read = []
    for index in range(W):
        job = argparse.Namespace(**base, global_batch_size=d * mbs, sparseloco_elastic=SimpleNamespace(worker_index=index))
        monkeypatch.setattr(gv, "_GLOBAL_ARGS", job)
        build = wrap_data_loader(data_samplers.build_pretraining_data_loader, lambda: job)
        for r in range(d):
            monkeypatch.setattr(data_samplers, "mpu", _ParallelState(r, d))
            got = _batches(build(dataset, consumed), 3)
            assert got == reference[index * d + r], (index, r)
            read += [i for b in got for i in b]
    assert len(read) == len(set(read)) == 3 * W * d * mbs
    assert sorted(read) == list(range(consumed * W, consumed * W + 3 * W * d * mbs))
    sizes = wrap_num_samples(lambda: (100, 8, None), lambda: job)()
    assert sizes == (100 * W, 8 * W, None)


# ------------------------------------------------------------------------------------------ heal state
def test_heal_state_never_carries_error_feedback_and_restarts_it_at_zero():
    """SparseLoCo's heal state: θ_outer (and the round counter), no error feedback; loading it puts
    θ_outer in place, zeroes the error feedback and sets θ_local ← θ_outer."""
    import torch

    from megatron_sparseloco.megatron.elastic.heal_state import HealState
    from megatron_sparseloco.megatron.rounds import OuterRounds
    from megatron_sparseloco.megatron.schedule import RoundSchedule
    from megatron_sparseloco.outer.overlap import OverlapConfig
    from megatron_sparseloco.outer.sparseloco import SparseLoCo, SparseLoCoConfig

    def job(seed):
        g = torch.Generator().manual_seed(seed)
        params = [torch.randn(64, 64, generator=g), torch.randn(64, generator=g)]
        s = SparseLoCo(params, None, SparseLoCoConfig(chunk=1024, k=32, lr=1.0))
        s.error_feedback.normal_(generator=g)
        s.outer_steps = seed
        rounds = OuterRounds([[s]], RoundSchedule(10), OverlapConfig(), 0, True, hooks=None)  # type: ignore[arg-type]
        rounds.restore_counters(seed, [seed], 10 * seed)
        s.outer_steps = seed
        opt = SimpleNamespace(strategies=[s], shards=[], members=[], inner_calls=10 * seed, outer_steps=seed,
                              fragment_syncs=[seed], rounds=rounds, _anchor_at_first_step=True)
        return s, opt, HealState(opt, lambda: None)

    peer, _, peer_heal = job(3)
    joiner, joiner_opt, joiner_heal = job(5)
    sent = peer_heal.state()
    assert "error_feedback" not in sent["outer"][0] and "anchor" in sent["outer"][0]
    assert sent["loop"] == {"inner_calls": 30, "outer_steps": 3, "fragment_syncs": [3]}
    joiner_heal.load({k: v for k, v in sent.items()})
    assert torch.equal(joiner.anchor, peer.anchor) and not joiner.error_feedback.any()
    assert torch.equal(torch.cat([t.reshape(-1) for t in joiner.params.tensors]), joiner.anchor)
    assert (joiner.outer_steps, joiner_opt.inner_calls, joiner_opt.rounds.log.outer_steps) == (3, 30, 3)
    assert joiner_opt.rounds.fragment_syncs == [3]     # every fragment's round counter comes with the heal
    assert joiner_opt._anchor_at_first_step is False


def test_the_run_ends_for_a_job_only_when_every_other_participant_ends_with_it():
    """``run_ends_here``: a job a round behind the others ends with their last round when it committed; not
    with min-workers 1 (it can go on alone), not after a round that did not commit here (it would not hold
    the run's last θ_outer), not at its own last round (it ends anyway), not while one participant goes on,
    and not when the ending peer was given fewer --train-iters (a live job left out of this round may still
    come)."""
    from megatron_sparseloco.megatron.elastic.rounds import run_ends_here

    def header(last, train_iters=80):
        return {"extra": {"iteration": 0, "last_round": int(last), "train_iters": train_iters}}

    assert run_ends_here(header(False), [header(True)], 2, True)
    assert run_ends_here(header(False), [header(True), header(True, 100)], 3, True)
    assert not run_ends_here(header(False), [header(True)], 1, True)
    assert not run_ends_here(header(False), [header(True)], 2, False)
    assert not run_ends_here(header(True), [header(True)], 2, True)
    assert not run_ends_here(header(False), [header(True), header(False)], 2, True)
    assert not run_ends_here(header(False), [header(True, 8)], 2, True)
    assert not run_ends_here(header(False), [], 2, True) and not run_ends_here(None, [header(True)], 2, True)

"""A worker job of the elastic protocol without Megatron: SparseLoCo on simulated inner steps.

    python -m megatron_sparseloco.testing.elastic_toy_job --index I --lighthouse URL --token-file P --out DIR ...

Each rank of the job (RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT as torchrun sets them) owns a
shard of a toy model (shard position = rank, the same initial values in every job) and an
``ElasticSession``. A round: H simulated inner steps (θ_local += a drift drawn from (worker index,
iteration, rank), so every worker moves differently), then ``begin_round`` → SparseLoCo's
communicate over ``session.comm`` when ``rnd.exchange`` (as a contributor iff the round counts this
job among its contributors) → ``session.agree(verdict)`` → ``finish_round`` → commit (θ_outer
update, θ_local ← θ_outer) or roll back (error feedback restored, θ_outer untouched, θ_local kept).
A job's first round contributes nothing: it is where a (re)started job joins and heals.

A joining job receives θ_outer, the outer momentum and the iteration; the error feedback starts
at zero. The job stops once the run has committed ``--rounds`` rounds, ``--final-members`` verified
jobs take part (refused participants do not count) and every one of them has contributed to
``--min-contributions`` committed rounds since it (re)started or last healed (``extra["more"]`` in
the round header) — and, with ``--stop-file``, that file exists; past ``--deadline`` seconds it
exits with an error.

Every round appends one JSON line to ``DIR/job<I>.rank<r>.<pid>.jsonl``; at the end θ_outer's
raw bytes go to ``DIR/final.job<I>.rank<r>.bin``. Faults: ``--pause-at-step S`` makes rank 0 sleep
``--pause-seconds`` inside round S+1 before its collectives (``DIR/paused.job<I>`` tells when), for a
test to kill or stop it mid-round; ``--fail-vote-at-step S`` makes the job report an error before its
commit vote in round S+1 (it rolls back while the others commit); ``--veto-at-step S`` makes its
verdict "not ok" in the first ``--veto-rounds`` rounds at step S (every job that verifies it rolls back);
``--corrupt-at-step S`` adds 1e-3 to its θ_outer before its first round at step S (its fingerprint
then differs from the others');
``--corrupt-payload S:MODE[,S:MODE...]`` damages what the round after committed step S receives:
``bit`` flips one bit of this job's tagged payload on the wire (every job receives it), ``truncate``
cuts this job's payload to half before it is tagged (entropy-coded indices, whose sizes are
exchanged: it arrives authentic but does not decode), ``link`` flips a bit of another contributor's
payload as this job alone receives it; ``--nonfinite-sum-at-step S`` (diloco) puts an
Inf into the sum this job receives in that round. ``--max-failed-rounds N`` is
``--sparseloco-elastic-max-failed-rounds``.

The strategy is today's SparseLoCo (``--algorithm diloco``: DiLoCo) built on ``session.comm`` (an
``OuterComm``); the round is its ``RoundPlan`` on the held schedule: compress and exchange, then the
validation (decode, the codec's checks, a finite aggregate: this job's verdict in ``session.agree``),
then ``commit`` (apply, θ_local ← θ_outer) or ``cancel`` (error feedback restored). The session's
contributors are set on the comm, so the mean runs over them (a non-contributor sends a payload
nobody decodes): SparseLoCo's result ignores whatever the non-contributors send, so its rounds commit
with refused participants present (``ignores_non_contributors``).
"""
from __future__ import annotations

import argparse
import json
import os
import time
from typing import List

import torch

from megatron_sparseloco.elastic.config import ElasticConfig
from megatron_sparseloco.elastic.session import ElasticSession, Round
from megatron_sparseloco.megatron.consistency import fingerprint
from megatron_sparseloco.outer.base import OuterConfig, OuterStrategy
from megatron_sparseloco.outer.diloco import DiLoCo, DiLoCoConfig
from megatron_sparseloco.outer.sparseloco import SparseLoCo, SparseLoCoConfig
from megatron_sparseloco.testing.elastic_jobs import ensure_job_store


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for name, kind, default in [("--index", int, None), ("--lighthouse", str, None), ("--token-file", str, None),
                                ("--out", str, None), ("--min-workers", int, 1), ("--rounds", int, 8),
                                ("--final-members", int, 3), ("--min-contributions", int, 2),
                                ("--inner-steps", int, 3), ("--step-seconds", float, 0.02),
                                ("--outer-timeout", float, 5.0), ("--quorum-timeout", float, 60.0),
                                ("--barrier", str, None), ("--barrier-count", int, 0), ("--pause-at-step", int, -1),
                                ("--pause-seconds", float, 600.0), ("--stop-file", str, None),
                                ("--deadline", float, 600.0), ("--fail-vote-at-step", int, -1),
                                ("--veto-at-step", int, -1), ("--veto-rounds", int, 1),
                                ("--max-failed-rounds", int, 0), ("--corrupt-at-step", int, -1),
                                ("--algorithm", str, "sparseloco"), ("--index-coding", str, "packed"),
                                ("--corrupt-payload", str, ""),
                                ("--nonfinite-sum-at-step", int, -1)]:
        p.add_argument(name, type=kind, default=default,
                       required=default is None and name not in ("--barrier", "--stop-file"))
    return p.parse_args(argv)


def build_params(rank: int) -> List[torch.Tensor]:
    """Shard ``rank`` of the toy model: the same values in every job."""
    g = torch.Generator().manual_seed(1000 + rank)
    return [torch.randn(64, 128, generator=g), torch.randn(128, generator=g), torch.randn(32, 64, generator=g)]


def inner_steps(params: List[torch.Tensor], index: int, rank: int, first_iteration: int, steps: int,
                step_seconds: float) -> None:
    for it in range(first_iteration, first_iteration + steps):
        g = torch.Generator().manual_seed(((index * 100003 + it) * 31 + rank) % (1 << 62))
        for p in params:
            p.add_(torch.randn(p.shape, generator=g), alpha=0.01)
        time.sleep(step_seconds)


class ToyWorker:
    """The job's state and its round loop (module docstring)."""

    def __init__(self, args: argparse.Namespace):
        self.args, self.rank = args, int(os.environ.get("RANK", "0"))
        self.params = build_params(self.rank)
        self._cfg: OuterConfig = (DiLoCoConfig(lr=0.7, momentum=0.5) if args.algorithm == "diloco" else
                                  SparseLoCoConfig(chunk=1024, k=32, lr=1.0, momentum=0.5,
                                                   index_coding=args.index_coding))
        self.iteration, self.contributed, self.first = 0, 0, True
        self.deadline = time.monotonic() + args.deadline
        self.log_path = os.path.join(args.out, f"job{args.index}.rank{self.rank}.{os.getpid()}.jsonl")
        config = ElasticConfig(lighthouse=args.lighthouse, worker_index=args.index, min_workers=args.min_workers,
                               token_file=args.token_file, quorum_timeout=args.quorum_timeout, connect_timeout=30.0,
                               heartbeat_interval=0.2, max_failed_rounds=args.max_failed_rounds).validate()
        self.session = ElasticSession(config, group_rank=self.rank, group_world_size=int(os.environ["WORLD_SIZE"]),
                                      store_addr=os.environ["MASTER_ADDR"], store_port=int(os.environ["MASTER_PORT"]),
                                      state_fn=self.state, load_fn=self.load, outer_timeout=args.outer_timeout)
        kind: type = DiLoCo if args.algorithm == "diloco" else SparseLoCo
        self.strategy: OuterStrategy = kind(self.params, self.session.comm, self._cfg)   # (state / load need it)

    def state(self) -> dict:
        """θ_outer and the outer buffers but those a heal never carries (SparseLoCo's error feedback)."""
        s = self.strategy
        return {"outer": {k: v for k, v in s.elementwise_state().items() if k not in s.heal_excluded_buffers},
                "iteration": self.iteration}

    def load(self, state: dict) -> None:
        s = self.strategy
        live = s.elementwise_state()
        for k, v in state["outer"].items():
            live[k].copy_(v)
        for k in s.heal_excluded_buffers:  # never copied: starts at zero
            if live.get(k) is not None:
                live[k].zero_()
        s.reset_to_anchor()                # θ_local ← θ_outer
        self.iteration = int(state["iteration"])
        self.contributed = 0               # what it contributed before the heal went into a stale θ_outer

    def write(self, record: dict) -> None:
        with open(self.log_path, "a") as f:
            f.write(json.dumps(dict(record, t=time.time(), pid=os.getpid())) + "\n")

    def barrier(self) -> None:
        a = self.args
        if a.barrier is None:
            return
        open(os.path.join(a.barrier, f"ready.{a.index}.{self.rank}"), "w").close()
        deadline = time.monotonic() + 300
        while len(os.listdir(a.barrier)) < a.barrier_count and time.monotonic() < deadline:
            time.sleep(0.05)

    def done(self, rnd: Round) -> bool:
        a, peers = self.args, [h for h in rnd.peers if h is not None]
        return rnd.step >= a.rounds and len(peers) == a.final_members and \
            all(h["extra"].get("more", 1) == 0 for h in peers)

    def run(self) -> None:
        self.barrier()
        while True:
            if not self.first:
                inner_steps(self.params, self.args.index, self.rank, self.iteration, self.args.inner_steps,
                            self.args.step_seconds)
                self.iteration += self.args.inner_steps
            if time.monotonic() > self.deadline:
                raise SystemExit(f"elastic toy job {self.args.index}: --deadline {self.args.deadline} s passed")
            stop = self.args.stop_file is None or os.path.exists(self.args.stop_file)
            more = int(self.contributed < self.args.min_contributions or not stop)
            finite = self.strategy.first_nonfinite_tensor() is None
            self.maybe_corrupt()
            rnd = self.session.begin_round(contributes=not self.first, finite=finite, samples=self.args.inner_steps,
                                           fingerprint=lambda: fingerprint([self.strategy.anchor]),
                                           extra={"more": more},
                                           ignores_non_contributors=self.strategy.capabilities.ignores_non_contributors)
            self.first = False
            if self.done(rnd):
                break
            committed = self.one_round(rnd)
            self.contributed += int(committed and rnd.contributes)
        self.write({"final": True, "step": self.session.step, "fp": fingerprint([self.strategy.anchor])})
        with open(os.path.join(self.args.out, f"final.job{self.args.index}.rank{self.rank}.bin"), "wb") as f:
            f.write(self.strategy.anchor.numpy().tobytes())
        self.session.close()

    def maybe_corrupt(self) -> None:
        """``--corrupt-at-step S``: θ_outer off by 1e-3 before the first round at step S (a silent divergence)."""
        if self.session.step == self.args.corrupt_at_step:
            self.args.corrupt_at_step = -1
            self.strategy.anchor.add_(1e-3)

    def maybe_pause(self, rnd: Round) -> None:
        """``--pause-at-step S``: rank 0 sleeps ``--pause-seconds`` inside round S+1, before its collectives
        (where a test injects its fault: the other jobs are waiting in the all-gather)."""
        if rnd.step == self.args.pause_at_step and self.rank == 0:
            self.args.pause_at_step = -1
            open(os.path.join(self.args.out, f"paused.job{self.args.index}"), "w").close()
            time.sleep(self.args.pause_seconds)

    def verdict(self, rnd: Round, plan) -> bool:
        """This job's verdict on the round: everything received validated (tags, decode, the codec's
        checks, a finite aggregate; ``RoundPlan.validate_all``), as the Megatron job's; ``--veto-at-step``:
        "not ok" in the first ``--veto-rounds`` rounds at that step."""
        comm = self.session.comm
        ok = not comm.failed and comm.rejected is None
        if plan is not None and ok:
            try:
                plan.validate_all()
                ok = plan.aggregate_finite()
            except Exception as exc:  # a payload that does not decode: "not ok", the round rolls back everywhere
                print(f"elastic toy job {self.args.index}: round {rnd.step + 1} does not validate: {exc}", flush=True)
                ok = False
        if rnd.step != self.args.veto_at_step or self.args.veto_rounds <= 0:
            return ok
        self.args.veto_rounds -= 1
        return False

    def exchange(self, rnd: Round, plan) -> None:
        """``plan.exchange_all()`` with the payload faults of the module docstring in their round."""
        a = self.args
        if rnd.step == a.nonfinite_sum_at_step:
            a.nonfinite_sum_at_step = -1
            plan.exchange_all()
            plan.received[0][0] = float("inf")        # the sum this job received (a dense round's bucket 0)
            return
        faults = dict(f.split(":") for f in a.corrupt_payload.split(",") if f)
        mode = faults.pop(str(rnd.step), None)
        if mode is None:
            plan.exchange_all()
            return
        a.corrupt_payload = ",".join(f"{k}:{v}" for k, v in faults.items())   # once per step
        import megatron_sparseloco.elastic.comm as ftcomm
        sign, open_ = ftcomm.sign_payload, ftcomm.open_payloads

        def damaged_sign(key, context, position, payload):
            if mode == "truncate":
                return sign(key, context, position, payload[: payload.numel() // 2])
            signed = sign(key, context, position, payload).clone()
            signed[3] ^= 1 << 5                         # "bit": on the wire, after the tag was made
            return signed

        def damaged_open(key, context, signed, check):
            other = next(r for r in check if r != self.session.comm.rank)
            signed = list(signed)
            signed[other] = signed[other].clone()
            signed[other][0] ^= 1                       # "link": what this job alone received
            return open_(key, context, signed, check)

        if mode == "link":
            ftcomm.open_payloads = damaged_open
        else:
            ftcomm.sign_payload = damaged_sign
        try:
            plan.exchange_all()
        finally:
            ftcomm.sign_payload, ftcomm.open_payloads = sign, open_

    def one_round(self, rnd: Round) -> bool:
        """Communicate (when the round exchanges), agree, vote, commit or roll back; log the round."""
        plan = None
        if rnd.exchange:
            self.session.comm.set_contributors(rnd.contributors)
            plan = self.strategy.begin_round(self.strategy.new_stats(), None, held=True, snapshot=True)
            plan.compress_all()
            self.maybe_pause(rnd)
            self.exchange(rnd, plan)
        verdict = self.verdict(rnd, plan)
        self.session.agree(verdict)
        if rnd.step == self.args.fail_vote_at_step:   # after the verdicts, this job alone: the others commit
            self.session.report_error(RuntimeError("injected fault before the commit vote"))
        committed = self.session.finish_round()
        if plan is not None and committed:
            plan.commit(write_back=True)
        elif plan is not None:
            plan.cancel()
        heals = [vars(r) for r in self.session.transport.records]
        self.session.transport.records.clear()
        self.write(dict(rnd.summary(), committed=committed, after=self.session.step, heals=heals,
                        fp=fingerprint([self.strategy.anchor]), failed=self.session.comm.failed, verdict=verdict))
        return committed


def main(argv=None) -> None:
    args = parse_args(argv)
    store = ensure_job_store()  # noqa: F841  (rank 0 of a directly launched job hosts the job's store)
    ToyWorker(args).run()


if __name__ == "__main__":
    main()

"""``OuterLoopOptimizer``: a megatron-core optimizer wrapper that adds the DiLoCo outer loop.

Megatron's training loop calls ``optimizer.step()`` once per iteration. The wrapper runs the
wrapped optimizer's step (the inner AdamW step, worker-local) every call, then whatever outer
rounds the schedule puts after this inner step (``megatron/rounds.py``):

    for each fragment p whose round is due (P = 1: every H-th call):
        for each member optimizer m holding params of p (dense / expert DistributedOptimizer ...):
            its strategy's round: Δ = θ_outer − θ_local, communicate, update θ_outer,
            θ_local ← θ_outer on m's fp32 main-param shards (τ ≥ 1: launched now, merged τ calls later)
        copy tied params (embedding / output layer) from the first pipeline stage (``tied``)
        m._copy_main_params_to_model_params()      # fp32 main → bf16/fp32 model params (param buffer)
        all-gather params inside the worker        # DDP start_param_sync(force_sync=True)

The inner optimizer state (Adam moments) is kept across outer steps, as in DiLoCo. On
construction it makes inner steps worker-local (``placement.WorkerPlacement``) and asserts that
all workers start from identical parameters (θ_outer is initialised from them). ``close()`` waits
for a round in flight and ends the comm thread; the plugin calls it at Megatron's exit. The rounds
object comes from a ``rounds.RoundsFactory`` (default: a single job's ``OuterRounds``; the plugin
passes the one of the job's mode), which chooses the comm the strategies are built on (``build_strategies``).

The members Megatron's loop, checkpointing and logging use (``zero_grad``, ``scale_loss``,
``get_loss_scale``, ``param_groups`` ...; ``FORWARDED_METHODS`` / ``FORWARDED_ATTRIBUTES``) are
forwarded to the wrapped optimizer by name; any other member raises ``AttributeError`` naming it
and where to add it. ``state_dict`` / ``sharded_state_dict`` / ``load_state_dict`` add the outer
state (``megatron/checkpoint/save_load.py``).
"""
from __future__ import annotations

import time
from typing import Callable, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_sparseloco.comm.collectives import collective_device
from megatron_sparseloco.comm.interface import OuterComm
from megatron_sparseloco.megatron.args.loop_config import OuterLoopConfig
from megatron_sparseloco.megatron.auto_steps import AutoInnerSteps
from megatron_sparseloco.megatron.checkpoint import save_load
from megatron_sparseloco.megatron.consistency import DivergenceError, check_identical_across_workers, check_outer
from megatron_sparseloco.megatron.forwarding import FORWARDED_ATTRIBUTES, FORWARDED_METHODS, ForwardingOptimizer
from megatron_sparseloco.megatron.fragments import build_member_strategies
from megatron_sparseloco.megatron.main_params import main_param_shards, member_optimizers
from megatron_sparseloco.megatron.placement.gradient_isolation import (any_in_worker, intra_worker_group,
                                                                       start_param_sync_all)
from megatron_sparseloco.megatron.placement.outer_group import WorkerLostError
from megatron_sparseloco.megatron.placement.worker_placement import WorkerPlacement
from megatron_sparseloco.megatron.rounds import OuterLog, Rounds, RoundsFactory, lost_worker_named, single_job_rounds
from megatron_sparseloco.megatron.schedule import RoundSchedule
from megatron_sparseloco.megatron.tied import TiedParamSync
from megatron_sparseloco.outer.base import OuterStepStats, OuterStrategy

#: (params, group, names, slices) -> OuterStrategy; ``slices`` (``compress.segments.TensorSlice``,
#: one per tensor) say which model parameter, of which shape, each fp32 shard is a piece of
StrategyFactory = Callable[[List[torch.Tensor], Optional[dist.ProcessGroup], List[str], list], OuterStrategy]


class OuterLoopOptimizer(ForwardingOptimizer):
    """Wraps a megatron-core optimizer (Distributed / Float16 / FP32 / Chained) with an outer loop."""

    def __init__(self, optimizer, model_chunks: Sequence, strategy_factory: StrategyFactory,
                 config: OuterLoopConfig, group: Optional[dist.ProcessGroup] = None,
                 rounds_factory: RoundsFactory = single_job_rounds):
        self.optimizer = optimizer
        self.model_chunks = list(model_chunks)
        self.config = config.validate()
        self.placement = WorkerPlacement.build(self.model_chunks, group, config.outer_timeout_s,
                                               own_group=config.overlap_steps > 0)
        self.inner_calls = 0
        #: --sparseloco-inner-steps-per-worker auto: H_w re-agreed at every outer step
        self.auto: Optional[AutoInnerSteps] = None
        self._iteration_end: Optional[float] = None
        if config.auto_inner_steps and self.num_workers > 1:
            self.auto = AutoInnerSteps(config.inner_steps, self.group, intra_worker_group(), self.num_workers,
                                       collective_device())
        self.members = [m for m in member_optimizers(optimizer) if not getattr(m, "is_stub_optimizer", False)]
        self.shards = [main_param_shards(m) for m in self.members]
        if config.check_identical_start and self.num_workers > 1:
            for shards in self.shards:
                check_identical_across_workers(shards.tensors, self.group, what="initial parameters",
                                               fix="initialise every worker from the same seed / checkpoint")
        self._strategy_factory = strategy_factory
        self.schedule = RoundSchedule(config.inner_steps, config.overlap_steps, config.fragments)
        self.fragment_offsets = self.schedule.offsets
        # the rounds object builds the strategies on the comm of its mode (``build_strategies``)
        self.rounds: Rounds = rounds_factory(self)
        # Params Megatron ties across pipeline stages (embedding / output layer): copied from the
        # first stage after every outer step, so the copies stay bitwise identical.
        self.tied = TiedParamSync(self.shards, self.strategy_of)
        # θ_outer is (re-)anchored on the params at the first step unless a checkpoint's outer
        # state was loaded: Megatron may load params after building the optimizer (checkpoint
        # without outer state, --no-load-optim, --finetune).
        self._anchor_at_first_step = True
        self._param_keys: Dict[int, str] = {}   # id(model param) -> checkpoint key, set by sharded_state_dict
        #: per member, while a checkpoint save has put θ_outer in the params: the live tensors that hold
        #: θ_outer and θ_local then (``checkpoint.outer_state.build_save_state``'s ``overrides``)
        self._save_overrides: Optional[List[Dict[str, List[torch.Tensor]]]] = None

    def build_strategies(self, comm: Optional[OuterComm | dist.ProcessGroup]) -> List[List[OuterStrategy]]:
        """Every fragment's strategies on ``comm`` (``rounds.RoundsHost``; called once, by the rounds factory)."""
        self.strategy_of, self.fragment_strategies = build_member_strategies(
            self.shards, self.model_chunks, self._strategy_factory, comm, self.config.fragments)
        self.strategies: List[OuterStrategy] = [s for ss in self.fragment_strategies for s in ss]
        identical = self.config.identical_across_workers
        if identical is None:
            identical = all(s.capabilities.identical_across_workers for s in self.strategies)
        self.identical_across_workers = identical
        return self.fragment_strategies

    # ------------------------------------------------------------------ placement and counters
    num_workers = property(lambda self: self.placement.num_workers, doc="W, the workers of the job.")
    group = property(lambda self: self.placement.group, doc="The outer group (``placement``).")
    worker_index = property(lambda self: self.placement.worker_index, doc="This worker's index.")
    worker_rank = property(lambda self: self.placement.worker_rank, doc="This rank's index in its worker.")
    worker_size = property(lambda self: self.placement.worker_size, doc="Ranks per worker.")
    watch = property(lambda self: self.placement.watch, doc="Arrival markers naming a lost worker.")
    log = property(lambda self: self.rounds.log, doc="Counters for logging (``rounds.OuterLog``).")
    delayed = property(lambda self: self.rounds.delayed, doc="The delayed-application drivers (τ ≥ 1).")
    outer_steps = property(lambda self: self.rounds.log.outer_steps,
                           doc="Outer rounds completed (``OuterLog.outer_steps``; saved in checkpoints).")
    fragment_syncs = property(lambda self: self.rounds.fragment_syncs,
                              doc="Rounds begun per fragment, the same on every rank.")
    algorithms = property(lambda self: sorted({s.name for s in self.strategies}), doc="The strategies' names.")
    overlap = property(lambda self: self.config.overlap(), doc="Delayed application (τ, merge rule).")
    consistency_check_interval = property(lambda self: self.config.consistency_check_interval,
                                          doc="Outer steps between θ_outer comparisons (0: off).")
    outer_timeout_s = property(lambda self: self.config.outer_timeout_s,
                               doc="--sparseloco-outer-timeout (None: unset).")

    # ------------------------------------------------------------------ the loop
    def is_inner_step_active(self) -> bool:
        """False for the iterations a faster-configured round leaves to slower workers (see ``step``)."""
        active = self.config.active_inner_steps or self.config.inner_steps
        return self.inner_calls % self.config.inner_steps < active

    @torch.no_grad()
    def step(self):
        """Inner step; then the outer rounds due after it (``rounds.OuterRounds``). Returns the inner step's result.

        Heterogeneous workers (``active_inner_steps`` = H_w < H): Megatron's loop runs every
        worker in lockstep iterations, so a round is H iterations for everyone; worker w applies
        its inner optimizer on the first H_w of them and skips the rest, as a slower worker
        would have done only H_w steps in the time the others did H. In megatron.training's loop
        the skipped iterations run no forward/backward (``auto_steps.skip_inactive_iterations``);
        a loop that computes them anyway has its gradients discarded here.
        """
        if self._anchor_at_first_step:
            for s in self.strategies:
                s.reset_anchor()
            self._anchor_at_first_step = False
        active = self.is_inner_step_active()
        if active:
            result = self.optimizer.step()
        else:
            self.optimizer.zero_grad()
            result = (True, None, None)
        self.inner_calls += 1
        if self.auto is not None and active and self._iteration_end is not None:
            self.auto.record(time.perf_counter() - self._iteration_end)   # since the previous step() returned
        self.rounds.after_inner_step(self.inner_calls, self._blocking_round)
        if self.auto is not None:
            self._iteration_end = time.perf_counter()
        return result

    def _blocking_round(self, fragment: int) -> None:
        if self.config.fragments == 1:
            self.outer_step()
            if self.auto is not None:
                self.config.active_inner_steps = self.auto.agree()
        else:
            self.outer_step(fragment)

    @torch.no_grad()
    def outer_step(self, fragment: Optional[int] = None) -> List[OuterStepStats]:
        """The blocking round of every strategy (``fragment``: of that fragment's only)."""
        return self.rounds.step(0 if fragment is None else fragment)

    def wait_outer_step(self, fragment: Optional[int] = None) -> None:
        """Wait for the round in flight and commit it (θ_outer,k+1; no merge). Idempotent.
        ``fragment``: that fragment's round only (default: every fragment's)."""
        if fragment is None:
            self.rounds.wait_all()
        else:
            self.rounds.wait(fragment)

    def close(self) -> None:
        """Wait for every round in flight and end the comm thread (Megatron's exit calls it)."""
        self.rounds.close()

    # ------------------------------------------------------------------ hooks of a committed round
    def sync_tied(self) -> None:
        self.tied.sync(self.shards, self.strategy_of)

    def publish(self) -> None:
        """fp32 main params → model params, then the synchronous param all-gather inside the worker."""
        for m in self.members:
            if hasattr(m, "_copy_main_params_to_model_params"):
                m._copy_main_params_to_model_params()
        start_param_sync_all(self.model_chunks)

    def any_reset_in_worker(self, reset: bool) -> bool:
        """Did a launch reset a shard of this worker (its params were not finite)? Every rank of the
        worker must agree, since publishing the params is a collective inside it (``any_in_worker``)."""
        return any_in_worker(reset) if self.num_workers > 1 and self.worker_size > 1 else reset

    def megatron_timer(self):
        """Megatron's ``sparseloco-outer-sync`` timer when the training loop set ``config.timers`` (else None)."""
        timers = getattr(getattr(self.members[0], "config", None), "timers", None) if self.members else None
        return timers("sparseloco-outer-sync", log_level=1) if timers is not None else None

    def lost_worker_named(self, step_no: int, begin: Optional[str] = None):
        return lost_worker_named(self.num_workers, self.watch, self.config.outer_timeout_s or 0.0, step_no, begin)

    def wait_all(self, step_no: int) -> None:
        self.watch.wait_all(step_no)

    def check_consistency(self) -> None:
        """Raise ``DivergenceError`` when θ_outer differs between workers (``consistency.check_outer``)."""
        check_outer(self.strategies, self.group, self.outer_steps, self.num_workers)

    # ------------------------------------------------------------------ checkpoints (``checkpoint/save_load.py``)
    def model_holds_outer_params(self):
        """Inside the block the model holds θ_outer (``save_load.save_with_outer_params``)."""
        return save_load.save_with_outer_params(self)

    def checkpoint_metadata(self) -> dict:
        return save_load.metadata(self)

    def checkpoint_facts(self) -> dict:
        return save_load.facts(self)

    def state_dict(self):
        raise RuntimeError(
            "OuterLoopOptimizer.state_dict: Megatron's 'torch' checkpoint format saves the optimizer only from "
            "data-parallel rank 0 and would lose the other workers' outer state (error feedback). "
            "Fix: use --ckpt-format torch_dist")

    def sharded_state_dict(self, model_sharded_state_dict, is_loading: bool = False, **kwargs):
        return save_load.sharded_state_dict(self, model_sharded_state_dict, is_loading, **kwargs)

    def load_state_dict(self, state_dict) -> None:
        save_load.load_state_dict(self, state_dict)

__all__ = ["OuterLoopOptimizer", "OuterLoopConfig", "OuterLog", "DivergenceError", "WorkerLostError",
           "FORWARDED_METHODS", "FORWARDED_ATTRIBUTES"]

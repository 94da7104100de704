"""``OuterLoopOptimizer``: a megatron-core optimizer wrapper that adds the DiLoCo outer loop.

Megatron's training loop calls ``optimizer.step()`` once per iteration. The wrapper runs the
wrapped optimizer's step (the inner AdamW step, worker-local) every call, and after every H-th
call the outer step of the chosen strategy:

    for each member optimizer m (dense / expert DistributedOptimizer ...):
        strategy_m.step()                      # Δ = θ_outer − θ_local, communicate, update θ_outer,
                                               # θ_local ← θ_outer on m's fp32 main-param shards
    copy tied params (embedding / output layer) from the first pipeline stage (``tied``)
    m._copy_main_params_to_model_params()      # fp32 main → bf16/fp32 model params (param buffer)
    all-gather params inside the worker        # DDP start_param_sync(force_sync=True)

The inner optimizer state (Adam moments) is kept across outer steps, as in DiLoCo.

With ``fragments`` P > 1 (Streaming DiLoCo, ``megatron/fragments.py``) each member's shards are
split by layer group and fragment p's strategies step after the inner steps ≡ ⌊p·H/P⌋ (mod H)
(with ``overlap_steps`` τ: launched there, merged τ steps later); the tied-param copy follows the
fragment holding the embedding (fragment 0), the publish follows every fragment's sync.

The members Megatron's loop, checkpointing and logging use (``zero_grad``, ``scale_loss``,
``get_loss_scale``, ``param_groups`` ...; ``FORWARDED_METHODS`` / ``FORWARDED_ATTRIBUTES``) are
forwarded to the wrapped optimizer by name; any other member raises ``AttributeError`` naming it
and where to add it. ``state_dict`` / ``sharded_state_dict`` / ``load_state_dict`` add the outer
state (see ``checkpointing``).

On construction it makes inner steps worker-local (``worker_isolation.isolate_workers``) and
asserts that all workers start from identical parameters (θ_outer is initialised from them).
"""
from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_sparseloco.megatron import checkpointing as ckpt
from megatron_sparseloco.megatron.fragments import (MemberFragments, fragment_offsets, param_fragments,
                                                    round_in_flight, syncs_at)
from megatron_sparseloco.megatron.auto_steps import AutoInnerSteps
from megatron_sparseloco.megatron.consistency import DivergenceError, check_identical_across_workers
from megatron_sparseloco.megatron.main_params import main_param_shards, member_optimizers
from megatron_sparseloco.megatron.outer_group import (OuterStepWatch, WorkerLostError, build_outer_group,
                                                       single_rank_group)
from megatron_sparseloco.megatron.tied import TiedParamSync
from megatron_sparseloco.megatron.worker_isolation import (
    collective_device,
    cross_worker_group,
    intra_worker_group,
    isolate_workers,
    start_param_sync_all,
)
from megatron_sparseloco.outer.base import NonFiniteError, OuterStepStats, OuterStrategy
from megatron_sparseloco.outer.overlap import CommThread, DelayedOuter, OverlapConfig

logger = logging.getLogger(__name__)

#: (params, group, names, slices) -> OuterStrategy; ``slices`` (``compress.segments.TensorSlice``,
#: one per tensor) say which model parameter, of which shape, each fp32 shard is a piece of
StrategyFactory = Callable[[List[torch.Tensor], Optional[dist.ProcessGroup], List[str], list], OuterStrategy]


@dataclass
class OuterLoopConfig:
    inner_steps: int = 15                       # H: iterations per outer round (all workers)
    active_inner_steps: Optional[int] = None    # this worker's real inner steps per round (<= H;
                                                # heterogeneous GASLoC workers), None: H
    outer_timeout_s: Optional[float] = None     # own cross-worker group with this timeout (None: Megatron's)
    consistency_check_interval: int = 0         # outer steps between θ_outer hash checks (0: off)
    check_identical_start: bool = True          # assert identical params across workers at start
    identical_across_workers: bool = True       # False for gossip (workers legitimately differ)
    overlap_steps: int = 0                      # τ: delayed application (outer/overlap.py), 0: blocking
    overlap_merge: str = "replay"               # "replay" or "lerp"
    overlap_alpha: float = 0.5                  # lerp weight of the local params
    fragments: int = 1                          # P: Streaming-DiLoCo fragments (megatron/fragments.py)
    auto_inner_steps: bool = False              # H_w from measured step times (megatron/auto_steps.py)

    def validate(self) -> "OuterLoopConfig":
        if self.inner_steps < 1:
            raise ValueError(f"inner_steps must be >= 1, got {self.inner_steps}")
        if self.active_inner_steps is not None and not (1 <= self.active_inner_steps <= self.inner_steps):
            raise ValueError(f"active_inner_steps must be in [1, inner_steps={self.inner_steps}], got {self.active_inner_steps}")
        if self.outer_timeout_s is not None and not self.outer_timeout_s > 0:
            raise ValueError(f"outer_timeout_s must be > 0, got {self.outer_timeout_s}")
        if self.consistency_check_interval < 0:
            raise ValueError(f"consistency_check_interval must be >= 0, got {self.consistency_check_interval}")
        self.overlap().validate(self.inner_steps)
        if not isinstance(self.fragments, int) or not 1 <= self.fragments <= self.inner_steps:
            raise ValueError(f"fragments must be in [1, inner_steps={self.inner_steps}], got {self.fragments}")
        if self.fragments > 1 and self.overlap_steps * self.fragments >= self.inner_steps:
            raise ValueError(f"overlap_steps τ={self.overlap_steps} must be < inner_steps / fragments = "
                             f"{self.inner_steps}/{self.fragments} (one fragment in flight at a time)")
        if self.auto_inner_steps and (self.overlap_steps > 0 or self.active_inner_steps is not None
                                      or self.fragments > 1):
            raise ValueError("auto_inner_steps needs overlap_steps=0, fragments=1 and no fixed active_inner_steps")
        return self

    def overlap(self) -> OverlapConfig:
        return OverlapConfig(steps=self.overlap_steps, merge=self.overlap_merge, alpha=self.overlap_alpha)


@dataclass
class OuterLog:
    """Cumulative counters for logging (per rank). ``outer_steps`` is the loop's one count of
    completed outer syncs (every rank follows the schedule, with or without strategies; with
    fragments each fragment's sync counts once), read through ``OuterLoopOptimizer.outer_steps``;
    a strategy counts only its own syncs (its fragment's), restored from the loop's on load."""

    outer_steps: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    numel: int = 0
    last: Dict[str, float] = field(default_factory=dict)


class OuterLoopOptimizer:
    """Wraps a megatron-core optimizer (Distributed / Float16 / FP32 / Chained) with an outer loop."""

    def __init__(self, optimizer, model_chunks: Sequence, strategy_factory: StrategyFactory,
                 config: OuterLoopConfig, group: Optional[dist.ProcessGroup] = None):
        self.optimizer = optimizer
        self.model_chunks = list(model_chunks)
        self.config = config.validate()
        self.num_workers = isolate_workers(self.model_chunks)
        base_group = group if group is not None else cross_worker_group(self.model_chunks)
        if self.num_workers == 1:
            # One worker: the outer step runs on this rank's shard alone (see single_rank_group).
            self.group = single_rank_group()
        elif self.config.outer_timeout_s is not None or self.config.overlap_steps > 0:
            # a group of its own: with overlap its collectives run on the comm thread, never
            # interleaved with any other collective (Megatron's default timeout: 10 min)
            self.group = build_outer_group(base_group, self.config.outer_timeout_s or 600.0)
        else:
            self.group = base_group
        if self.num_workers > 1:
            worker_ranks = intra_worker_group()
            self.worker_rank, self.worker_size = dist.get_rank(worker_ranks), dist.get_world_size(worker_ranks)
            self.worker_index = dist.get_rank(self.group)
        else:
            self.worker_rank = dist.get_rank() if dist.is_initialized() else 0
            self.worker_size = dist.get_world_size() if dist.is_initialized() else 1
            self.worker_index = 0
        self.watch = OuterStepWatch(self.group if self.num_workers > 1 else None, self.worker_rank,
                                    self.config.outer_timeout_s or 600.0)
        self.inner_calls = 0
        #: --sparseloco-inner-steps-per-worker auto: H_w re-agreed at every outer step
        self.auto: Optional[AutoInnerSteps] = None
        self._iteration_end: Optional[float] = None
        if self.config.auto_inner_steps and self.num_workers > 1:
            self.auto = AutoInnerSteps(self.config.inner_steps, self.group, intra_worker_group(), self.num_workers,
                                       collective_device())
        self.log = OuterLog()
        self.members = [m for m in member_optimizers(optimizer) if not getattr(m, "is_stub_optimizer", False)]
        self.shards = [main_param_shards(m) for m in self.members]
        if self.config.check_identical_start and self.num_workers > 1:
            for shards in self.shards:
                check_identical_across_workers(shards.tensors, self.group, what="initial parameters",
                                               fix="initialise every worker from the same seed / checkpoint")
        P = self.config.fragments
        #: o_p, the inner step within a round at which fragment p syncs (``fragments``)
        self.fragment_offsets = fragment_offsets(self.config.inner_steps, P)
        #: per fragment, its strategies (one per member optimizer holding params of it here)
        self.fragment_strategies: List[List[OuterStrategy]] = [[] for _ in range(P)]
        #: per member optimizer, its strategy (None where this rank holds none of its params; with
        #: P > 1 fragments a ``MemberFragments`` of one strategy per fragment)
        self.strategy_of: List[Optional[object]] = []
        if P == 1:
            self.strategy_of = [strategy_factory(s.tensors, self.group, s.names, s.slices()) if s.tensors else None
                                for s in self.shards]
            self.fragment_strategies[0] = [s for s in self.strategy_of if s is not None]
        else:
            where = param_fragments(self.model_chunks, P)
            for sh in self.shards:
                frag = [where[id(p)] for p in sh.model_params]
                by_fragment = {}
                slices = sh.slices()
                for f in sorted(set(frag)):
                    idx = [i for i, g in enumerate(frag) if g == f]
                    by_fragment[f] = strategy_factory([sh.tensors[i] for i in idx], self.group,
                                                      [sh.names[i] for i in idx], [slices[i] for i in idx])
                    self.fragment_strategies[f].append(by_fragment[f])
                self.strategy_of.append(MemberFragments(frag, by_fragment) if by_fragment else None)
        self.strategies: List[OuterStrategy] = [s for ss in self.fragment_strategies for s in ss]
        #: syncs (blocking steps or launches) of each fragment so far, the same on every rank
        self.fragment_syncs: List[int] = [0] * P
        #: per fragment, a launched round not yet waited for (every rank, with or without strategies
        #: of it: with P > 1 the outer-step count follows the schedule, not this rank's strategies)
        self._unwaited: List[bool] = [False] * P
        # Params Megatron ties across pipeline stages (embedding / output layer): copied from the
        # first stage after every outer step, so the copies stay bitwise identical.
        self.tied = TiedParamSync(self.shards, self.strategy_of)
        # θ_outer is (re-)anchored on the params at the first step unless a checkpoint's outer
        # state was loaded: Megatron may load params after building the optimizer (checkpoint
        # without outer state, --no-load-optim, --finetune).
        self._anchor_at_first_step = True
        self._param_keys: Dict[int, str] = {}   # id(model param) -> checkpoint key, set by sharded_state_dict
        #: per member, while a checkpoint save has put θ_outer in the params: the live tensors that hold
        #: θ_outer and θ_local then (``checkpointing.build_save_state``'s ``overrides``)
        self._save_overrides: Optional[List[Dict[str, List[torch.Tensor]]]] = None
        # Delayed application (τ >= 1): one driver per strategy, one comm thread for all of them
        # (their collectives are issued in the same order on every rank).
        self.delayed: List[DelayedOuter] = []
        self._exposed_at_launch = 0.0
        #: per fragment, the drivers of its strategies
        self.fragment_delayed: List[List[DelayedOuter]] = [[] for _ in range(P)]
        #: the outer step whose round was launched last (its collectives wait for every rank: ``_wait_all``)
        self._launched_step = 0
        if self.config.overlap_steps > 0 and self.strategies:
            comm = CommThread(self.strategies[0].device)
            self.fragment_delayed = [[DelayedOuter(s, self.config.overlap(), comm, before_communicate=self._wait_all)
                                      for s in ss] for ss in self.fragment_strategies]
            self.delayed = [d for dd in self.fragment_delayed for d in dd]

    # ------------------------------------------------------------------ the loop
    @property
    def outer_steps(self) -> int:
        """Outer syncs completed (``OuterLog.outer_steps``, the loop's one count; saved in checkpoints)."""
        return self.log.outer_steps

    def is_outer_step_due(self) -> bool:
        return self.inner_calls % self.config.inner_steps == 0

    def is_inner_step_active(self) -> bool:
        """False for the iterations a faster-configured round leaves to slower workers (see ``step``)."""
        active = self.config.active_inner_steps or self.config.inner_steps
        return self.inner_calls % self.config.inner_steps < active

    @torch.no_grad()
    def step(self):
        """Inner step; then, every H calls, the outer step. Returns the inner step's result.

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
        H, tau, calls = self.config.inner_steps, self.config.overlap_steps, self.inner_calls
        if self.auto is not None:
            now = time.perf_counter()
            if active and self._iteration_end is not None:  # this iteration: since the previous step() returned
                self.auto.record(now - self._iteration_end)
        if self.config.fragments == 1:
            if tau == 0:
                if self.is_outer_step_due():
                    self.fragment_syncs[0] += 1
                    self.outer_step()
                    if self.auto is not None:
                        self.config.active_inner_steps = self.auto.agree()
            else:
                phase = calls % H
                # every rank follows the counter (not its drivers: a rank may hold no strategy, and
                # the tied-param sync and the param all-gather after the merge involve every rank)
                if phase == tau and calls > H:
                    self.complete_outer_step()
                if phase == 0:
                    self.fragment_syncs[0] += 1
                    self.launch_outer_step()
            if self.auto is not None:
                self._iteration_end = time.perf_counter()
            return result
        # fragments (``fragments``): fragment p's rounds end at inner steps ≡ o_p (mod H); with τ
        # the merges due first, then the launches (τ < H/P: never the same fragment)
        if tau > 0:
            for p, o in enumerate(self.fragment_offsets):
                if syncs_at(calls - tau, o, H):
                    self.complete_outer_step(p)
        for p, o in enumerate(self.fragment_offsets):
            if syncs_at(calls, o, H):
                self.fragment_syncs[p] += 1
                if tau == 0:
                    self.outer_step(p)
                else:
                    self.launch_outer_step(p)
        return result

    def _megatron_timer(self, name: str):
        """Megatron's timer ``name`` when the training loop set ``config.timers`` (else None)."""
        timers = getattr(getattr(self.members[0], "config", None), "timers", None) if self.members else None
        return timers(name, log_level=1) if timers is not None else None

    @contextlib.contextmanager
    def _lost_worker_named(self, step_no: int):
        """A collective failure inside the block (timeout, closed peer) becomes the watch's
        ``WorkerLostError`` naming the workers that never reached outer step ``step_no`` (W > 1);
        ``NonFiniteError``, the arrival barrier's own ``WorkerLostError`` and single-worker errors pass
        through unchanged."""
        try:
            yield
        except (RuntimeError, dist.DistBackendError) as exc:
            if self.num_workers > 1 and not isinstance(exc, (NonFiniteError, WorkerLostError)):
                raise self.watch.fail(step_no, exc, self.config.outer_timeout_s or 0.0) from exc
            raise

    @torch.no_grad()
    def outer_step(self, fragment: Optional[int] = None) -> List[OuterStepStats]:
        """The blocking outer step of every strategy (``fragment``: of that fragment's only)."""
        strategies = self.strategies if fragment is None else self.fragment_strategies[fragment]
        timer = self._megatron_timer("sparseloco-outer-sync")
        if timer is not None:
            timer.start()
        t0 = time.perf_counter()
        step_no = self.outer_steps + 1
        self.watch.barrier(step_no)   # every rank arrived, or WorkerLostError naming who did not
        with self._lost_worker_named(step_no):
            stats = [s.step() for s in strategies]
        if fragment in (None, 0):  # tied params are in fragment 0
            self.tied.sync(self.shards, self.strategy_of)
        self._publish_main_params()
        if timer is not None:
            timer.stop()
        if self.config.fragments > 1:
            self.log.outer_steps += 1       # on every rank, with or without strategies of the fragment
        if stats or self.config.fragments == 1:
            self._record(stats)
        self.log.last["time_exposed_s"] = time.perf_counter() - t0
        interval = self.config.consistency_check_interval
        if interval and self.config.identical_across_workers and self.outer_steps % interval == 0:
            self.check_consistency()
        return stats

    # ------------------------------------------------------------------ delayed application
    def launch_outer_step(self, fragment: Optional[int] = None) -> None:
        """End of a round with τ >= 1: every strategy's Δ / payload, then its collective on the comm thread.

        ``fragment``: that fragment's strategies only (``--sparseloco-fragments``)."""
        delayed = self.delayed if fragment is None else self.fragment_delayed[fragment]
        if fragment is not None:
            self._unwaited[fragment] = True
        timer = self._megatron_timer("sparseloco-outer-sync")
        if timer is not None:
            timer.start()
        t0 = time.perf_counter()
        step_no = self.outer_steps + 1
        self.watch.arrive(step_no)   # the round's collectives wait for every rank first (``_wait_all``)
        self._launched_step = step_no
        with self._lost_worker_named(step_no):
            # every round goes to the comm thread in the same order on every rank: see DelayedOuter.launch
            for d in delayed:
                d.launch()
        if self._any_reset_in_worker(delayed):  # some shard of this worker reset θ_local ← θ_outer,k
            if fragment in (None, 0):
                self.tied.sync(self.shards, self.strategy_of)
            self._publish_main_params()
        self._exposed_at_launch = time.perf_counter() - t0
        if timer is not None:
            timer.stop()

    def _wait_all(self) -> None:
        """On the comm thread, before a launched round's first collective: every rank arrived at it."""
        self.watch.wait_all(self._launched_step)

    def _any_reset_in_worker(self, delayed: Sequence[DelayedOuter]) -> bool:
        """Did a launch reset a shard of this worker (its params were not finite)? Every rank of the
        worker must agree, since publishing the params is a collective inside the worker (one
        all-reduce MAX on the intra-worker group, whose ranks run in lockstep anyway)."""
        reset = any(d.reset_at_launch for d in delayed)
        if self.num_workers > 1 and self.worker_size > 1:
            flag = torch.tensor([1.0 if reset else 0.0], device=collective_device())
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=intra_worker_group())
            reset = bool(flag.item())
        return reset

    def wait_outer_step(self, fragment: Optional[int] = None) -> None:
        """Wait for the round in flight and compute θ_outer,k+1 (no merge); records its stats. Idempotent.

        ``fragment``: that fragment's round only (default: every fragment's, each recorded apart)."""
        if fragment is None and self.config.fragments > 1:
            for p in range(self.config.fragments):
                self.wait_outer_step(p)
            return
        delayed = self.delayed if fragment is None else self.fragment_delayed[fragment]
        if fragment is not None and self.config.fragments > 1:
            if not self._unwaited[fragment]:
                return
            self._unwaited[fragment] = False
            self.log.outer_steps += 1       # (``_record`` counts only with P = 1)
        if not any(d.in_flight for d in delayed):
            return
        step_no = self.outer_steps + 1
        with self._lost_worker_named(step_no):
            stats = [d.wait() for d in delayed]
        stats = [s for s in stats if s is not None]
        if stats:
            self._record(stats)

    def complete_outer_step(self, fragment: Optional[int] = None) -> None:
        """τ inner steps after the launch: wait, merge, tied params, publish, consistency check.

        ``fragment``: that fragment's round only (``--sparseloco-fragments``)."""
        delayed = self.delayed if fragment is None else self.fragment_delayed[fragment]
        timer = self._megatron_timer("sparseloco-outer-sync")
        if timer is not None:
            timer.start()
        t0 = time.perf_counter()
        waited = any(d.in_flight for d in delayed)
        self.wait_outer_step(fragment)
        for d in delayed:
            d.merge()
        if fragment in (None, 0):  # tied params are in fragment 0
            self.tied.sync(self.shards, self.strategy_of)
        self._publish_main_params()
        if timer is not None:
            timer.stop()
        if waited:  # the round's exposed time: launch + wait + apply + merge + publish
            self.log.last["time_exposed_s"] = self._exposed_at_launch + time.perf_counter() - t0
            self.log.last["time_launch_s"] = self._exposed_at_launch   # of which the launch (local check, Δ, payloads)
        interval = self.config.consistency_check_interval
        if interval and self.config.identical_across_workers and self.outer_steps % interval == 0:
            self.check_consistency()

    def _overlap_merge_due(self, fragment: int = 0) -> bool:
        """A round of ``fragment`` launched before ``inner_calls`` whose merge is still to come (from the counter)."""
        H, tau = self.config.inner_steps, self.config.overlap_steps
        return round_in_flight(self.inner_calls, self.fragment_offsets[fragment], H, tau)

    def _publish_main_params(self) -> None:
        """fp32 main params → model params, then the synchronous param all-gather inside the worker."""
        for m in self.members:
            if hasattr(m, "_copy_main_params_to_model_params"):
                m._copy_main_params_to_model_params()
        start_param_sync_all(self.model_chunks)

    def check_consistency(self) -> None:
        """Raise ``DivergenceError`` when θ_outer differs between workers; global rank 0 prints a pass line."""
        fps = [check_identical_across_workers([s.anchor], self.group, what=f"θ_outer ({s.name})",
                                              fix="restart from the last checkpoint; a worker's params were altered")
               for s in self.strategies]
        if fps and None not in fps and (not dist.is_initialized() or dist.get_rank() == 0):
            print(f" sparseloco | consistency check passed at outer step {self.outer_steps}: θ_outer identical on "
                  f"all {self.num_workers} workers (rank 0's shard fingerprint "
                  f"{', '.join(f'{fp & (2**64 - 1):016x}' for fp in fps)})", flush=True)

    def _record(self, stats: List[OuterStepStats]) -> None:
        if self.config.fragments == 1:
            self.log.outer_steps += 1
        self.log.bytes_sent += sum(s.bytes_sent for s in stats)
        self.log.bytes_received += sum(s.bytes_received for s in stats)
        self.log.numel = sum(s.numel for s in stats)
        if self.config.fragments > 1:
            # a sync moves one fragment; dense-equivalent bytes (numel·4 per sync) stay per round
            self.log.numel = sum(s.params.numel for s in self.strategies) / self.config.fragments
        merged: Dict[str, float] = {}
        for key in ("bytes_sent", "bytes_received", "time_compress_s", "time_communicate_s", "time_apply_s"):
            merged[key] = float(sum(getattr(s, key) for s in stats))
        for key in ("delta_norm", "error_norm", "update_norm"):
            merged[key] = float(sum(getattr(s, key) ** 2 for s in stats) ** 0.5)
        merged["skipped"] = float(any(s.skipped for s in stats))
        merged["time_wait_s"] = float(sum(s.extra.get("time_wait_s", 0.0) for s in stats))
        merged["time_agree_s"] = float(sum(s.extra.get("time_agree_s", 0.0) for s in stats))
        merged["time_owner_s"] = float(sum(s.extra.get("time_owner_s", 0.0) for s in stats))
        merged["time_exposed_s"] = float(sum(s.time_exposed_s for s in stats))
        self.log.last = merged

    # ------------------------------------------------------------------ checkpoint model = θ_outer
    @contextlib.contextmanager
    def model_holds_outer_params(self):
        """Inside the block the model (and the fp32 main params) hold θ_outer; after it, θ_local again.

        Megatron keeps one data-parallel replica of each model shard in a checkpoint, and which
        replica writes a shard is the save strategy's choice; mid-round the workers' θ_local differ,
        so the model part would be a mixture no worker ever had. ``megatron.training``'s
        ``save_checkpoint`` runs inside this block (``plugin.install``), so the model part — what
        ``--no-load-optim``, ``--finetune``, export and evaluation read, and the wrapped optimizer's
        own fp32 master copies — is

            θ_outer                     (sparseloco, diloco, average: identical on every worker)
            (1/W) Σ_w θ_outer,w         (gasloc: the workers' mean, which gossip preserves;
                                         one all-reduce over the workers at each save)

        while each worker's own θ_local goes into its per-worker outer state
        (``inner.main_param``), so a resume with the plugin stays bitwise. Costs two in-worker param
        all-gathers per save (memory: below). With ``--sparseloco-overlap-steps``
        and a round in flight the save waits for it and the model part is θ_outer,k+1. Nothing changes before
        the first step (θ_outer is anchored on the params then) or for a rank without shards.

        Memory: where θ_outer is identical on every worker the shards and the anchor trade contents
        one shard tensor at a time (``checkpointing.exchange_outer_and_local``; extra memory one tensor,
        at most the largest parameter) and trade back afterwards; gasloc keeps θ_local in host memory
        for the duration of the save (one shard of fp32 on the host) while the shards hold the mean.
        """
        if self._anchor_at_first_step or self._save_overrides is not None or not self.strategies:
            yield
            return
        # τ >= 1 with a round in flight: θ_outer,k+1 first (what sharded_state_dict would do), so
        # the model part is the newest synced model; the merge stays due at H·k+τ.
        self.wait_outer_step()
        mean = not self.config.identical_across_workers and self.num_workers > 1
        local: List[List[torch.Tensor]] = []
        with torch.no_grad():
            if mean:
                pin = self.strategies[0].device.type == "cuda"
                local = [[torch.empty(t.shape, dtype=t.dtype, pin_memory=pin).copy_(t) for t in sh.tensors]
                         for sh in self.shards]
                for strategy in self.strategies:
                    strategy.params.write(0, strategy.params.numel, strategy.anchor)
                for sh in self.shards:
                    for t in sh.tensors:
                        dist.all_reduce(t, group=self.group)
                        t.div_(self.num_workers)
                self._save_overrides = [{"inner.main_param": lc} for lc in local]
            else:
                for strategy in self.strategies:
                    ckpt.exchange_outer_and_local(strategy)
                self._save_overrides = ckpt.outer_in_shards_overrides(self.shards, self.strategy_of)
            self._publish_main_params()
        try:
            yield
        finally:
            with torch.no_grad():
                if mean:
                    for shards, lc in zip(self.shards, local):
                        for t, saved in zip(shards.tensors, lc):
                            t.copy_(saved)
                else:
                    for strategy in self.strategies:
                        ckpt.exchange_outer_and_local(strategy)
                self._save_overrides = None
                self._publish_main_params()

    # ------------------------------------------------------------------ state
    @property
    def algorithms(self) -> List[str]:
        return sorted({s.name for s in self.strategies})

    def checkpoint_metadata(self) -> dict:
        """Job-wide outer-loop facts stored in Megatron's checkpoint content metadata."""
        return {"format": ckpt.FORMAT_VERSION, "num_workers": self.num_workers, "algorithms": self.algorithms,
                "states": {key: sorted(ckpt.elementwise_state(sh, st))
                           for key, sh, st in zip(ckpt.member_keys(self.shards), self.shards, self.strategy_of)},
                "inner_calls": self.inner_calls, "outer_steps": self.outer_steps,
                "fragment_syncs": list(self.fragment_syncs),
                "facts": self.checkpoint_facts(),
                "inner_steps": self.config.inner_steps}

    def checkpoint_facts(self) -> dict:
        """The strategies' settings a resume must keep (e.g. SparseLoCo's chunking), with their flags."""
        facts = {}
        for s in self.strategies:
            for key, value in s.checkpoint_facts().items():
                facts[key] = {"value": value, "flag": s.checkpoint_fact_flags[key]}
        # a round in flight / a merge due means something only under the same τ and merge rule
        facts["overlap_steps"] = {"value": self.config.overlap_steps, "flag": "--sparseloco-overlap-steps"}
        # fragment p's state and schedule exist only with the same P (the layout is P-independent)
        facts["fragments"] = {"value": self.config.fragments, "flag": "--sparseloco-fragments"}
        if self.config.overlap_steps > 0:
            facts["overlap_merge"] = {"value": self.config.overlap_merge, "flag": "--sparseloco-overlap-merge"}
        return facts

    def _outer_shared(self) -> bool:
        """θ_outer is identical on every worker, so checkpoints keep one copy per shard position."""
        return bool(self.strategies) and all(s.identical_across_workers for s in self.strategies)

    def state_dict(self):
        raise RuntimeError(
            "OuterLoopOptimizer.state_dict: Megatron's 'torch' checkpoint format saves the optimizer only from "
            "data-parallel rank 0 and would lose the other workers' outer state (error feedback). "
            "Fix: use --ckpt-format torch_dist")

    def sharded_state_dict(self, model_sharded_state_dict, is_loading: bool = False, **kwargs):
        """The wrapped optimizer's sharded state plus the outer state (see ``checkpointing``).

        ``metadata`` (Megatron's content metadata, passed by megatron.training): on save the
        outer-loop facts are added to it; on load they are read from it, checked, and decide what
        to request — nothing when the checkpoint has no outer state.
        """
        metadata = kwargs.get("metadata")
        if not is_loading:
            # A round in flight: wait for its collective and compute θ_outer,k+1 now (bitwise what
            # the completion would compute); the merge stays due at H·k+τ and is derived on load
            # from the saved inner-call counter, with the launch snapshot saved as outer state.
            self.wait_outer_step()
        # Load: megatron-core needs a ``step`` in every Adam state; save: the model-space state needs
        # the Adam moments to exist (a save before the first step stores fresh zeros).
        ckpt.ensure_adam_step_state(self.members)
        sd = self.optimizer.sharded_state_dict(model_sharded_state_dict, is_loading, **kwargs)
        if not isinstance(sd, dict):
            raise TypeError(f"expected a dict from {type(self.optimizer).__name__}.sharded_state_dict, got {type(sd)}")
        metas = ckpt.model_param_metadata(model_sharded_state_dict)
        self._param_keys = ckpt.param_keys(metas)
        if is_loading:
            saved = metadata.get(ckpt.METADATA_KEY) if isinstance(metadata, dict) else None
            if saved is None and isinstance(metadata, dict):
                return sd  # a checkpoint without outer state
            if saved is not None:
                ckpt.check_saved_metadata(saved, self.num_workers, self.algorithms, self.checkpoint_facts())
                change = ckpt.describe_inner_steps_change(saved, self.config.inner_steps)
                if change:
                    logger.warning(change)
                    if not dist.is_initialized() or dist.get_rank() == 0:
                        print(change, flush=True)
            sd[ckpt.OUTER_KEY] = {"tensors": ckpt.build_load_request(self.strategy_of, self.shards, self.worker_index,
                                                                     metas, saved, shared=self._outer_shared())}
            return sd
        facts = self.checkpoint_metadata()
        if isinstance(metadata, dict):
            metadata[ckpt.METADATA_KEY] = facts
        record = ckpt.rank_record(self.shards, self.worker_index, self.worker_rank, self.worker_size, self.log,
                                  self._param_keys)
        sd[ckpt.OUTER_KEY] = {
            "tensors": ckpt.build_save_state(self.strategy_of, self.shards, self.worker_index, metas,
                                             self._save_overrides, shared=self._outer_shared()),
            "ranks": ckpt.gather_rank_records(record),
            "scalars": facts,
        }
        return sd

    def load_state_dict(self, state_dict):
        outer = state_dict.pop(ckpt.OUTER_KEY, None) if isinstance(state_dict, dict) else None
        # no_grad: megatron-core 0.19.2's DistributedOptimizer copies loaded values into fp32
        # main params that are views of model params (leaves requiring grad) in place.
        with torch.no_grad():
            self.optimizer.load_state_dict(state_dict)
        if outer is None:
            logger.warning("checkpoint has no sparseloco outer state: θ_outer is anchored on the loaded params at the "
                           "first step, error feedback / outer momentum start from zero")
            return
        scalars = outer["scalars"]
        self.inner_calls = int(scalars["inner_calls"])
        self.log.outer_steps = int(scalars["outer_steps"])
        self.fragment_syncs = [int(n) for n in scalars.get("fragment_syncs", [self.log.outer_steps])]
        for p, strategies in enumerate(self.fragment_strategies):
            for s in strategies:
                s.outer_steps = self.log.outer_steps if self.config.fragments == 1 else self.fragment_syncs[p]
        # Megatron loaded worker 0's params / moments into every worker: put each worker's back,
        # sliced for this rank's ranges (which may differ from the saving run's).
        ckpt.restore_state(self.strategy_of, self.shards, outer["tensors"], self._param_keys)
        ckpt.restore_scalars(self.shards, self.worker_index, self.worker_rank, self.worker_size, self.log,
                             outer["ranks"], self._param_keys)
        self._anchor_at_first_step = False
        for p, delayed in enumerate(self.fragment_delayed):
            due = self._overlap_merge_due(p)
            for d in delayed:
                d.merge_due = due
        self._publish_main_params()

    # ------------------------------------------------------------------ forwarding
    def __getattr__(self, name):
        # Only called for members not found on the wrapper: the explicitly forwarded ones are
        # defined below (``_forward``), so anything reaching here is a member Megatron was not
        # known to use. Refuse it rather than hand out the wrapped optimizer's (which would skip
        # the outer loop, e.g. a second ``step``-like entry point).
        if name == "optimizer" or name.startswith("__"):
            raise AttributeError(name)
        if name in FORWARDED_ATTRIBUTES:
            raise AttributeError(f"the wrapped {type(self.optimizer).__name__} has no {name!r}")
        raise AttributeError(
            f"OuterLoopOptimizer has no member {name!r}: it forwards to the wrapped {type(self.optimizer).__name__} "
            f"only the members Megatron uses ({', '.join(FORWARDED_METHODS + FORWARDED_ATTRIBUTES)}). If Megatron "
            f"(or your code) needs {name!r}, add it to FORWARDED_METHODS or FORWARDED_ATTRIBUTES in "
            "megatron_sparseloco/megatron/optimizer.py, after checking the outer loop does not need to act on it")


#: methods of the wrapped optimizer that Megatron's training loop, checkpointing and logging call on
#: the optimizer it holds (megatron-core 0.19.2 training/training.py, checkpointing.py, utils;
#: megatron-core's optimizer param scheduler), forwarded as they are
FORWARDED_METHODS = (
    "zero_grad", "scale_loss", "get_loss_scale", "reload_model_params", "prepare_model_params_for_param_sync",
    "save_parameter_state", "load_parameter_state", "save_state_dict_to_file", "load_state_dict_from_file",
    "get_parameters", "get_main_grads_for_grad_norm", "clip_grad_norm", "count_zeros", "prepare_grads",
    "step_with_ready_grads", "get_grad_stats_parallel_group",
)
#: attributes read on the optimizer (``chained_optimizers`` only where the wrapped one is chained)
FORWARDED_ATTRIBUTES = ("param_groups", "is_stub_optimizer", "chained_optimizers", "state")


def _forward_method(name: str):
    def method(self, *args, **kwargs):
        return getattr(self.optimizer, name)(*args, **kwargs)

    method.__name__ = method.__qualname__ = name
    method.__doc__ = f"The wrapped optimizer's ``{name}``."
    return method


def _forward_attribute(name: str):
    return property(lambda self: getattr(self.optimizer, name), doc=f"The wrapped optimizer's ``{name}``.")


for _name in FORWARDED_METHODS:
    setattr(OuterLoopOptimizer, _name, _forward_method(_name))
for _name in FORWARDED_ATTRIBUTES:
    setattr(OuterLoopOptimizer, _name, _forward_attribute(_name))
del _name


__all__ = ["OuterLoopOptimizer", "OuterLoopConfig", "DivergenceError", "WorkerLostError", "FORWARDED_METHODS",
           "FORWARDED_ATTRIBUTES"]

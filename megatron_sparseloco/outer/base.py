"""Common machinery of every outer strategy: the anchor θ_outer, bucketing, the non-finite guard.

A strategy is handed the fp32 tensors this rank owns (for Megatron: the distributed optimizer's
main-param shards) and the process group that joins this rank to the ranks holding the same
shard in every other worker. Between outer steps the inner optimizer moves those tensors; at an
outer step the strategy computes the pseudo-gradient

    Δ = θ_outer − θ_local                       (a descent direction, like a gradient)

bucket by bucket, communicates, updates θ_outer and writes it back into the tensors in place
(θ_local ← θ_outer). The anchor is one flat fp32 buffer the size of this rank's shard; buckets
are flat ranges of it, so the extra memory of one step is bounded by the bucket, not the model.

Non-finite guard: before anything is sent, each rank checks its tensors; one tiny all-reduce
(MAX of a flag) makes every worker agree. With ``nonfinite_policy="skip"`` all workers skip the
step consistently and reset θ_local ← θ_outer (the local progress of this round is discarded,
θ_outer is untouched); with ``"abort"`` every worker raises ``NonFiniteError`` naming the tensor
(on the worker that saw it) or the worker (on the others).
"""
from __future__ import annotations

import abc
import time
from dataclasses import dataclass, field, fields
from typing import (Any, ClassVar, Collection, Dict, Generic, Iterator, List, Mapping, Optional, Sequence, Tuple,
                    Self, TypeVar, Union)

import torch
import torch.distributed as dist

from megatron_sparseloco.comm.interface import OuterComm
from megatron_sparseloco.comm.process_group import as_outer_comm
from megatron_sparseloco.compress.segments import TensorSlice
from megatron_sparseloco.outer.config_fields import ConfigError, check_fields, check_given, config_field, flag_field
from megatron_sparseloco.outer.round import Capabilities, RoundPlan, WholeStepPlan, clock_of

NONFINITE_POLICIES = ("skip", "abort")


class NonFiniteError(RuntimeError):
    """A worker's pseudo-gradient holds NaN or Inf."""


@dataclass
class OuterConfig:
    """Fields every strategy shares. Subclasses add theirs and extend ``validate``.

    Each field is declared with ``config_fields.flag_field`` / ``config_field``: its type, default,
    choices, range and (for the Megatron integration) its ``--sparseloco-<flag>`` come from there,
    and ``validate`` checks them all (``check_fields``) before the subclass's cross-field checks.
    """

    bucket_numel: int = flag_field(1 << 24, flag="bucket-size", low=1)
    """Elements per outer-step bucket: the outer step's extra memory is one bucket (64 MiB of fp32 by
    default)."""
    nonfinite_policy: str = flag_field("skip", flag="nonfinite-policy", choices=NONFINITE_POLICIES)
    """A NaN/Inf pseudo-gradient on any worker: skip the outer step on all workers (θ_outer unchanged), or
    abort (raises ``NonFiniteError``)."""
    anchor_on_cpu: bool = flag_field(False, flag="anchor-on-cpu", store_true=True)
    """Keep θ_outer in pinned host memory instead of on the GPU (4 B less GPU memory per parameter element
    of the shard); each bucket is staged on the GPU for the outer step, results bitwise identical."""
    rule_fields: Tuple[str, ...] = config_field((), type=tuple)
    """Fields whose value ``resolve_for_workers`` set from a rule of the number of workers
    (``default_rules``): a round with fewer contributors than W evaluates the rule again."""

    #: flags this algorithm has no field for but behaves as if set to (flag → value): accepted on
    #: the command line only with that value (e.g. model averaging is outer lr 1 without momentum)
    implied_flags: ClassVar[Mapping[str, Any]] = {}
    #: fields whose default ``resolve_for_workers`` sets from the job: field → (the rule, its values in
    #: words), for the flag reference and the start-up block
    default_rules: ClassVar[Mapping[str, Tuple[str, str]]] = {}

    def validate(self) -> Self:
        check_fields(self)
        return self

    def validate_given(self, given: Collection[str]) -> Self:
        """``validate()``, then refuse any field in ``given`` (the fields set explicitly) that this
        config ignores in its current mode (a field declared with ``requires=``)."""
        self.validate()
        check_given(self, given)
        return self

    def check_workers(self, num_workers: int) -> None:
        """Checks that need the number of workers W (known only once the job layout is)."""

    def resolve_for_workers(self, num_workers: int, given: Collection[str]) -> Tuple[str, ...]:
        """Set the defaults that depend on W (known only once the job layout is) for the fields not in
        ``given`` (the fields set explicitly); returns the fields it set (none by default)."""
        return ()

    def resolve_for_model(self, num_workers: int, numel: int) -> Tuple[str, ...]:
        """Once the model is built: the defaults that also depend on its parameter count ``numel`` (N, the
        whole model's), among those ``resolve_for_workers`` set; returns the fields it set (none by default)."""
        return ()


@dataclass
class OuterStepStats:
    """What one outer step did on this rank."""

    step: int = 0
    """The step's number (1 for the first)."""
    numel: int = 0
    """Elements of this rank's shard the step covered."""
    bytes_sent: int = 0
    """Bytes this rank handed to the step's collectives (the wire bytes, bit-packed payloads)."""
    bytes_received: int = 0
    """Bytes this rank got from them."""
    collectives: int = 0
    """Collectives and point-to-point exchanges the step issued."""
    time_compress_s: float = 0.0
    """Seconds in the compress phase of the round (``round.PhaseClock``): Δ and what to send (error
    feedback, encoding)."""
    time_communicate_s: float = 0.0
    """Seconds in the communicate phase (the collectives, waits for the slowest worker included)."""
    time_apply_s: float = 0.0
    """Seconds in the apply phase (decoding, the outer optimizer, writing θ back)."""
    time_exposed_s: float = 0.0
    """Wall time the training loop spent in this outer step: blocking, the whole step; with delayed
    application (``outer/overlap.py``), launch + the wait for the collective + apply + merge."""
    delta_norm: float = 0.0
    """‖Δ‖ of this rank's shard."""
    error_norm: float = 0.0
    """‖e‖ after the step (error feedback; 0 without)."""
    update_norm: float = 0.0
    """‖lr·u‖ of the applied update."""
    skipped: bool = False
    """The round was skipped (a worker's Δ was not finite, policy skip): θ_outer unchanged."""
    extra: Dict[str, float] = field(default_factory=dict)
    """Strategy-specific figures (density, waits, bytes per phase ...)."""

    def as_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "extra"}
        d.update(self.extra)
        return d

    @staticmethod
    def merged(stats: Sequence["OuterStepStats"]) -> Dict[str, float]:
        """One round's figures over the strategies that took part in it (one per model chunk or fragment):
        bytes and seconds add (of the extras, the waits: ``ROUND_EXTRAS``), the norms add in quadrature
        (‖(a, b)‖² = ‖a‖² + ‖b‖²), and the round was skipped if any strategy skipped it."""
        out = {key: float(sum(getattr(s, key) for s in stats)) for key in ROUND_SUMS}
        out.update({key: float(sum(getattr(s, key) ** 2 for s in stats) ** 0.5) for key in ROUND_NORMS})
        out["skipped"] = float(any(s.skipped for s in stats))
        out.update({key: float(sum(s.extra.get(key, 0.0) for s in stats)) for key in ROUND_EXTRAS})
        return out


#: the figures of a round (``OuterStepStats.merged``): fields that add over strategies, fields that add in
#: quadrature, and extras (seconds spent waiting) that add
ROUND_SUMS = ("bytes_sent", "bytes_received", "time_compress_s", "time_communicate_s", "time_apply_s",
              "time_exposed_s")
ROUND_NORMS = ("delta_norm", "error_norm", "update_norm")
ROUND_EXTRAS = ("time_wait_s", "time_agree_s", "time_owner_s")


class FlatShards:
    """A list of tensors seen as one flat vector, without copying them into one.

    ``read(start, end, out)`` gathers elements [start, end) of the concatenation into ``out``;
    ``write(start, end, src)`` scatters them back. Used so that buckets may span tensors.
    """

    def __init__(self, tensors: Sequence[torch.Tensor]):
        self.tensors = [t for t in tensors]
        self.sizes = [t.numel() for t in self.tensors]
        self.offsets = [0]
        for n in self.sizes:
            self.offsets.append(self.offsets[-1] + n)
        self.numel = self.offsets[-1]

    def _segments(self, start: int, end: int) -> Iterator[Tuple[int, int, int, int]]:
        """(tensor index, offset in tensor, offset in range, length) for each overlap."""
        for i, (lo, n) in enumerate(zip(self.offsets, self.sizes)):
            hi = lo + n
            if hi <= start or lo >= end or n == 0:
                continue
            s, e = max(lo, start), min(hi, end)
            yield i, s - lo, s - start, e - s

    def read(self, start: int, end: int, out: torch.Tensor) -> torch.Tensor:
        for i, t_off, r_off, n in self._segments(start, end):
            out[r_off:r_off + n].copy_(self.tensors[i].reshape(-1)[t_off:t_off + n])
        return out

    def write(self, start: int, end: int, src: torch.Tensor) -> None:
        for i, t_off, r_off, n in self._segments(start, end):
            flat = self.tensors[i].view(-1)
            flat[t_off:t_off + n].copy_(src[r_off:r_off + n])

    def name_of(self, flat_index: int, names: Sequence[str]) -> str:
        for i, lo in enumerate(self.offsets[1:]):
            if flat_index < lo:
                return names[i]
        return names[-1]


ConfigT = TypeVar("ConfigT", bound=OuterConfig)
#: what a strategy is built on: an ``OuterComm``, or a c10d process group (None: the default group / no
#: distributed), wrapped in a ``ProcessGroupComm``
OuterGroup = Union[OuterComm, dist.ProcessGroup, None]


class OuterStrategy(abc.ABC, Generic[ConfigT]):
    """Base of all outer strategies: anchor, buckets, guard, stats, state dict.

    The extension contract (docs/design.md, "Adding an outer algorithm"): a subclass sets ``name``,
    ``config_class`` (its ``OuterConfig``; the strategy is generic over it, so ``self.config`` has
    that type), ``capabilities`` (one ``round.Capabilities`` block) and ``elementwise_buffers`` (its
    per-element state: state dict and checkpoint keys derive from it), and describes its outer step
    either

    * in the simple form, ``_outer_step(stats, nonfinite_tensor)``: compute Δ (``pseudo_gradient``),
      communicate through ``self.comm``, update ``self.anchor`` (θ_outer) — one call; or
    * as a ``round.RoundPlan`` returned by ``begin_round`` (compress / exchange / apply per bucket),
      which pipelines buckets and can overlap training (``Capabilities.supports_overlap``).

    Every collective goes through ``self.comm`` (``comm.interface.OuterComm``), never through
    ``torch.distributed``: the same strategy runs over a c10d group or an elastic (torchft) one.
    """

    #: a short name used in logs and checkpoints
    name: ClassVar[str] = "base"
    #: the config dataclass (fields, flags, defaults, validation); every registered strategy sets it
    config_class: ClassVar[type[OuterConfig]]
    #: what the strategy can do (``round.Capabilities``): the loop and the flag checks read only this
    capabilities: ClassVar[Capabilities] = Capabilities()
    #: the strategy's per-element buffers besides θ_outer (``anchor``, every strategy's), each a flat
    #: fp32 vector over ``params``: attribute name = state-dict and checkpoint name; an attribute that
    #: is None is not kept in this configuration (e.g. momentum with μ = 0)
    elementwise_buffers: ClassVar[Tuple[str, ...]] = ()
    #: the buffers of ``elementwise_buffers`` an elastic heal never copies: the joiner starts them at
    #: zero (SparseLoCo's error feedback is what this worker did not send yet, not a shared state)
    heal_excluded_buffers: ClassVar[Tuple[str, ...]] = ()
    #: checkpoint facts whose value must match on resume → the flag that sets it
    checkpoint_fact_flags: ClassVar[Dict[str, str]] = {}

    def __init__(self, params: Sequence[torch.Tensor], group: OuterGroup, config: ConfigT,
                 names: Optional[Sequence[str]] = None,
                 slices: Optional[Sequence[TensorSlice]] = None):
        self.config: ConfigT = config.validate()
        if len(params) == 0:
            raise ConfigError("an outer strategy needs at least one parameter tensor")
        for i, p in enumerate(params):
            if p.dtype != torch.float32:
                raise ConfigError(f"outer strategies work on fp32 tensors (main params); tensor {i} is {p.dtype}")
        self.params = FlatShards(params)
        self.names = list(names) if names is not None else [f"param{i}" for i in range(len(params))]
        #: what each tensor is a piece of: the model parameter's shape and the element range held
        #: (default: each tensor is a whole parameter of its own shape)
        self.slices = list(slices) if slices is not None else [TensorSlice.whole(p) for p in params]
        if len(self.slices) != len(params) or any(sl.numel != p.numel() for sl, p in zip(self.slices, params)):
            raise ConfigError("slices must describe each parameter tensor (one TensorSlice of the same numel each)")
        #: the outer group: a c10d group (wrapped) or any ``OuterComm``
        self.comm: OuterComm = as_outer_comm(group)
        self.counter = self.comm.counter
        self.device = params[0].device
        self.outer_steps = 0
        if self.config.anchor_on_cpu and not self.capabilities.supports_anchor_on_cpu:
            raise ConfigError(f"anchor_on_cpu: {self.name} reaches θ_outer on the device in its own step, it cannot "
                              "stay in host memory", "anchor_on_cpu", "drop --sparseloco-anchor-on-cpu")
        #: θ_outer: on the params' device, or (``anchor_on_cpu``) in host memory, pinned when that
        #: device is a GPU
        self.anchor = torch.empty(self.params.numel, dtype=torch.float32,
                                  device="cpu" if self.config.anchor_on_cpu else self.device,
                                  pin_memory=self.config.anchor_on_cpu and self.device.type == "cuda")
        self._anchor_copies_pending = False
        #: per-element buffers other components keep over ``params`` and want checkpointed with the
        #: strategy (the launch snapshot of delayed application, ``outer/overlap.py``)
        self.attached_state: Dict[str, torch.Tensor] = {}
        #: where ``pseudo_gradient`` reads θ_local from: None, the live params; else a flat copy of them
        #: taken earlier (an elastic delayed round compresses on its comm thread from the launch snapshot
        #: while training goes on in the params)
        self.local_source: Optional[torch.Tensor] = None
        self.reset_anchor()

    @property
    def world_size(self) -> int:
        """Workers in the outer group this round (``comm.size``; fixed over a c10d group, the round's
        participants over an elastic one)."""
        return self.comm.size

    @property
    def rank(self) -> int:
        """This worker's index in the outer group this round (``comm.rank``)."""
        return self.comm.rank

    @property
    def group(self) -> Optional[dist.ProcessGroup]:
        """The c10d process group under ``self.comm`` (None for other implementations or the default group)."""
        return getattr(self.comm, "group", None)

    def check_group_layout(self) -> None:
        """Fail early unless every rank of the outer group owns the same number of elements.

        The ranks of the outer group must hold the same shard (same parameters, same flat order)
        in their worker; a different element count means the shards do not line up and every
        collective would silently mix unrelated values. One tiny all-reduce (MAX of (n, −n)),
        counted in ``self.counter`` like every collective, but outside any step's stats.
        """
        if self.world_size == 1:
            return
        n = self.params.numel
        t = torch.tensor([n, -n], dtype=torch.int64, device=self.device)
        self.comm.all_reduce_(t, op="max")
        hi, lo = (int(v) for v in t.tolist())
        lo = -lo
        if hi != n or lo != n:
            raise ConfigError(
                f"{self.name}: the ranks of the outer group own between {lo} and {hi} elements, this rank "
                f"{n}; the group must join ranks holding the same shard in every worker (same params, same order)")

    # ------------------------------------------------------------------ anchor and buckets
    def reset_anchor(self) -> None:
        """θ_outer ← θ_local (at start, and after loading params from elsewhere)."""
        self.params.read(0, self.params.numel, self.anchor)

    def buckets(self) -> Iterator[Tuple[int, int]]:
        n, b = self.params.numel, self.config.bucket_numel
        for s in range(0, n, b):
            yield s, min(n, s + b)

    def anchor_bucket(self, start: int, end: int) -> torch.Tensor:
        """θ_outer[start:end] on the params' device: a view of the anchor, or (``anchor_on_cpu``) a copy
        staged on the device (one bucket of transient memory); an update made in place on it
        reaches θ_outer through ``store_anchor_bucket``."""
        if not self.config.anchor_on_cpu:
            return self.anchor[start:end]
        return self.anchor[start:end].to(self.device, copy=True, non_blocking=self.anchor.is_pinned())

    def store_anchor_bucket(self, start: int, end: int, bucket: torch.Tensor) -> None:
        """θ_outer[start:end] ← ``bucket`` (from ``anchor_bucket``; nothing to do for a view of it).

        From a GPU the copy into pinned memory is asynchronous on the current stream; ``anchor_ready``
        waits for it before the host reads θ_outer (every round ends with it)."""
        if not self.config.anchor_on_cpu:
            return
        pinned = self.anchor.is_pinned() and bucket.device.type == "cuda"
        self.anchor[start:end].copy_(bucket, non_blocking=pinned)
        self._anchor_copies_pending |= pinned

    def anchor_ready(self) -> None:
        """Wait for the copies ``store_anchor_bucket`` left in flight (one host sync per round)."""
        if self._anchor_copies_pending:
            torch.cuda.current_stream(self.device).synchronize()
            self._anchor_copies_pending = False

    def pseudo_gradient(self, start: int, end: int, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Δ[start:end] = θ_outer − θ_local for one bucket (fresh buffer unless ``out``); θ_local from
        ``local_source`` when set."""
        if out is None:
            out = torch.empty(end - start, dtype=torch.float32, device=self.device)
        if self.local_source is not None:
            out.copy_(self.local_source[start:end])
        else:
            self.params.read(start, end, out)
        return torch.sub(self.anchor_bucket(start, end), out, out=out)

    def write_back(self, start: int, end: int, anchor: Optional[torch.Tensor] = None) -> None:
        """θ_local ← θ_outer on one bucket (``anchor``: that bucket of θ_outer already on the device)."""
        self.params.write(start, end, self.anchor_bucket(start, end) if anchor is None else anchor)

    def reset_to_anchor(self) -> None:
        """θ_local ← θ_outer on every bucket (a skipped round discards the local progress)."""
        for s, e in self.buckets():
            self.write_back(s, e)

    def hold_local_progress(self) -> None:
        """params ← θ_local − θ_outer on every bucket: the local progress since θ_outer, kept in the params
        while θ_outer is replaced (an elastic job catching up; ``apply_local_progress`` puts it back on
        the new θ_outer). The params are no model until then. One bucket of scratch."""
        self._shift_params(-1.0)

    def apply_local_progress(self) -> None:
        """params ← params + θ_outer on every bucket: the progress ``hold_local_progress`` kept, carried
        onto the current θ_outer."""
        self._shift_params(1.0)

    def _shift_params(self, sign: float) -> None:
        for s, e in self.buckets():
            local = self.params.read(s, e, torch.empty(e - s, dtype=torch.float32, device=self.device))
            local.add_(self.anchor_bucket(s, e), alpha=sign)
            self.params.write(s, e, local)

    # ------------------------------------------------------------------ the step
    def new_stats(self) -> OuterStepStats:
        """The stats of the next outer step (its number and this rank's element count)."""
        return OuterStepStats(step=self.outer_steps + 1, numel=self.params.numel)

    def step(self) -> OuterStepStats:
        """One blocking outer step, in place on the params. Every worker must call it together.

        The non-finite verdict (``nonfinite_verdict``: this worker's check and, unless the strategy
        carries it in its exchange, the agreement of all workers), then the round's plan pipelined
        (``RoundPlan.run_pipelined``: each bucket written back once applied), then the byte counts.
        """
        stats = self.new_stats()
        before = self.counter_marks()
        proceed, nonfinite_tensor = self.nonfinite_verdict(stats)
        if proceed:
            self.begin_round(stats, nonfinite_tensor, held=False).run_pipelined(write_back=True)
        self.end_round(stats, before)
        return stats

    def counter_marks(self) -> Tuple[int, int, int]:
        """(bytes sent, bytes received, collectives) so far: ``end_round`` reports the difference."""
        return self.counter.bytes_sent, self.counter.bytes_received, self.counter.collectives

    def end_round(self, stats: OuterStepStats, before: Tuple[int, int, int]) -> None:
        """Count the round (committed or skipped) and put its bytes and collectives into ``stats``."""
        self.outer_steps += 1
        stats.bytes_sent = self.counter.bytes_sent - before[0]
        stats.bytes_received = self.counter.bytes_received - before[1]
        stats.collectives = self.counter.collectives - before[2]

    def begin_round(self, stats: OuterStepStats, nonfinite_tensor: Optional[str], held: bool,
                    snapshot: bool = False) -> RoundPlan:
        """The round's plan (``round.RoundPlan``). ``held``: every bucket's buffers kept until commit
        (delayed application, elastic rounds) instead of two at a time; ``snapshot``: the plan must be
        able to ``cancel`` after its exchange ran (elastic rounds), not only after its compress.

        Default: the simple form, ``WholeStepPlan`` over ``_outer_step``."""
        return WholeStepPlan(self, stats, nonfinite_tensor, held, snapshot=snapshot)

    def _outer_step(self, stats: OuterStepStats, nonfinite_tensor: Optional[str]) -> None:
        """The simple form of an outer step: compute Δ, communicate, update ``self.anchor`` (every
        bucket). The params are written back by the caller. ``nonfinite_tensor``: this worker's
        verdict (``nonfinite_verdict``), the name of its first tensor holding NaN / Inf, or None;
        always None where the workers agreed before the step."""
        raise NotImplementedError(f"outer strategy {self.name!r} defines neither begin_round nor _outer_step")

    def first_nonfinite_tensor(self) -> Optional[str]:
        """The name of this worker's first tensor holding NaN or Inf, or None (a local check; one
        host read whatever the number of tensors, a second to find the name when one is bad)."""
        finite = torch.stack([torch.isfinite(t).all() for t in self.params.tensors])
        if bool(finite.all()):
            return None
        return self.names[int(torch.nonzero(~finite)[0])]

    def nonfinite_verdict(self, stats: OuterStepStats) -> Tuple[bool, Optional[str]]:
        """(run the round?, this worker's first non-finite tensor or None).

        With the agreement (``capabilities.agrees_nonfinite_before_step``): ``_all_workers_finite``
        decides, and the round only ever sees None. Without it the round always runs and gets the
        local verdict.
        """
        bad_name = self.first_nonfinite_tensor()
        if not self.capabilities.agrees_nonfinite_before_step:
            return True, bad_name
        t0 = time.perf_counter()
        proceed = self._all_workers_finite(stats, bad_name)
        stats.extra["time_agree_s"] = time.perf_counter() - t0   # includes waiting for the slowest worker
        return proceed, None

    def _all_workers_finite(self, stats: OuterStepStats, bad_name: Optional[str]) -> bool:
        """True when every worker's params are finite (one all-reduce MAX of rank + 1 where not);
        otherwise apply the policy: abort raises ``NonFiniteError``, skip resets θ_local ← θ_outer."""
        culprit = self._nonfinite_culprit(bad_name)
        if culprit is None:
            return True
        if self.config.nonfinite_policy == "abort":
            raise self._nonfinite_error(culprit, bad_name)
        self.reset_to_anchor()
        stats.skipped = True
        return False

    def _nonfinite_culprit(self, bad_name: Optional[str]) -> Optional[int]:
        """The agreement itself: one all-reduce MAX of (rank + 1 where this worker's params are not
        finite, else 0). Returns the highest non-finite worker's rank, or None when all are finite."""
        if self.world_size == 1:
            return None if bad_name is None else self.rank
        worst = self.comm.agree_max(0 if bad_name is None else self.rank + 1)
        return None if worst == 0 else worst - 1

    def _nonfinite_error(self, culprit: int, bad_name: Optional[str]) -> NonFiniteError:
        """The abort policy's error: the tensor on the worker that saw it, the worker on the others."""
        where = f"tensor {bad_name!r} on this worker" if bad_name is not None else f"worker {culprit}"
        return NonFiniteError(
            f"{self.name} outer step {self.outer_steps + 1}: non-finite pseudo-gradient in {where}; "
            "θ_outer left untouched (policy 'abort'; use nonfinite_policy='skip' to skip such rounds)")

    def expected_payload_bytes(self) -> Optional[int]:
        """Bytes this rank hands to the outer step's data collectives (without the 4-byte non-finite
        flag), or None when that depends on the round (gossip) or the data (entropy coding: a bound)."""
        return None

    def _timer(self, stats: OuterStepStats, attr: str):
        """A phase of the round in ``stats.<attr>`` (``round.PhaseClock``: CUDA events read once a round)."""
        return clock_of(stats, self.device).phase(attr)

    # ------------------------------------------------------------------ state
    def checkpoint_facts(self) -> Dict[str, object]:
        """Settings that change what the saved state means (a resume with others is refused)."""
        return {}

    def elementwise_state(self) -> Dict[str, torch.Tensor]:
        """The live per-element state, each a flat vector over ``self.params`` (not copies):
        ``anchor``, the buffers of ``elementwise_buffers`` that are kept, and ``attached_state``."""
        state = {"anchor": self.anchor}
        for name in self.elementwise_buffers:
            buf = getattr(self, name)
            if buf is not None:
                state[name] = buf
        return {**state, **self.attached_state}

    @property
    def numel(self) -> int:
        """Elements of this rank's shard the strategy covers."""
        return self.params.numel

    def per_tensor_state(self) -> Dict[str, List[torch.Tensor]]:
        """``elementwise_state`` as one live view per tensor of ``params`` (the member-state protocol
        the checkpoint code and the tied-parameter sync read; ``megatron.fragments.MemberFragments``)."""
        offsets = self.params.offsets
        return {k: [v[offsets[i]:offsets[i + 1]] for i in range(len(self.params.tensors))]
                for k, v in self.elementwise_state().items()}

    def snapshot_state(self) -> Dict[str, Any]:
        """A copy of everything a round may change (per-element state and the step count), for
        ``restore_state`` when a round is rolled back."""
        return {"outer_steps": self.outer_steps, **{k: v.clone() for k, v in self.elementwise_state().items()}}

    def restore_state(self, saved: Dict[str, Any]) -> None:
        """The state of ``snapshot_state``, bit for bit."""
        self.outer_steps = int(saved["outer_steps"])
        for k, v in self.elementwise_state().items():
            v.copy_(saved[k])

    def state_dict(self) -> dict:
        sd = {"name": self.name, "outer_steps": self.outer_steps, "numel": self.params.numel}
        for k, v in self.elementwise_state().items():
            sd[k] = v.clone()
        return sd

    def load_state_dict(self, sd: dict) -> None:
        if sd.get("name") != self.name:
            raise ValueError(f"state dict is for outer strategy {sd.get('name')!r}, not {self.name!r}")
        if int(sd["numel"]) != self.params.numel:
            raise ValueError(f"state dict covers {sd['numel']} elements, this rank owns {self.params.numel}")
        self.outer_steps = int(sd["outer_steps"])
        for k, v in self.elementwise_state().items():
            if k not in sd:
                raise ValueError(f"state dict lacks {k!r} for outer strategy {self.name!r}")
            v.copy_(sd[k])

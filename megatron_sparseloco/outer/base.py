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
from typing import Any, Callable, ClassVar, Collection, Dict, Iterator, Mapping, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from megatron_sparseloco.comm.collectives import CommCounter, all_reduce_
from megatron_sparseloco.compress.segments import TensorSlice
from megatron_sparseloco.outer.config_fields import ConfigError, check_fields, check_given, config_field, flag_field

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

    bucket_numel: int = flag_field(1 << 24, flag="bucket-size", low=1,
                                   help="Elements per outer-step bucket (bounds the outer step's extra memory).")
    """Elements per bucket: the outer step's extra memory is one bucket (64 MiB of fp32 by default)."""
    nonfinite_policy: str = flag_field("skip", flag="nonfinite-policy", choices=NONFINITE_POLICIES,
                                       help="NaN/Inf pseudo-gradient on any worker: skip the outer step on all "
                                            "workers, or abort.")
    """What a NaN/Inf pseudo-gradient does (module docstring): skip the round, or raise ``NonFiniteError``."""
    anchor_on_cpu: bool = config_field(False, help="Keep θ_outer in pinned host memory (--sparseloco-anchor-on-cpu).")
    """θ_outer in (pinned) host memory instead of on the params' device; each bucket is staged on the
    device for the step (``OuterStrategy.anchor_bucket``). Set from the loop flag
    ``--sparseloco-anchor-on-cpu``; only for strategies with ``supports_anchor_on_cpu``."""

    #: flags this algorithm has no field for but behaves as if set to (flag → value): accepted on
    #: the command line only with that value (e.g. model averaging is outer lr 1 without momentum)
    implied_flags: ClassVar[Mapping[str, Any]] = {}
    #: fields whose default ``resolve_for_workers`` sets from the job: field → (the rule, its values in
    #: words), for the flag reference and the start-up block
    default_rules: ClassVar[Mapping[str, Tuple[str, str]]] = {}

    def validate(self) -> "OuterConfig":
        check_fields(self)
        return self

    def validate_given(self, given: Collection[str]) -> "OuterConfig":
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


@dataclass
class OuterStepStats:
    """What one outer step did on this rank."""

    step: int = 0
    numel: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    collectives: int = 0
    time_compress_s: float = 0.0
    time_communicate_s: float = 0.0
    time_apply_s: float = 0.0
    #: wall time the training loop spent in this outer step (blocking: the whole step; delayed
    #: application, ``outer/overlap.py``: launch + the wait for the collective + apply + merge)
    time_exposed_s: float = 0.0
    delta_norm: float = 0.0
    error_norm: float = 0.0
    update_norm: float = 0.0
    skipped: bool = False
    extra: Dict[str, float] = field(default_factory=dict)

    def as_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "extra"}
        d.update(self.extra)
        return d


class _Timer:
    def __init__(self, stats: OuterStepStats, attr: str, device: torch.device):
        self.stats, self.attr, self.device = stats, attr, device

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.t0 = time.perf_counter()

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        setattr(self.stats, self.attr, getattr(self.stats, self.attr) + time.perf_counter() - self.t0)


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

    def _segments(self, start: int, end: int) -> Iterator[Tuple[int, int, int]]:
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


class OuterStrategy(abc.ABC):
    """Base of all outer strategies: anchor, buckets, guard, stats, state dict.

    Subclasses implement ``_outer_step(stats, nonfinite_tensor)`` and declare their per-element
    state in ``elementwise_buffers`` (state dict and checkpoint keys derive from it).
    """

    #: a short name used in logs and checkpoints
    name: str = "base"
    #: the config dataclass (fields, flags, defaults, validation); every registered strategy sets it
    config_class: type
    #: after an outer step every worker holds the same θ_outer (False for gossip: workers differ,
    #: so cross-worker consistency checks do not apply)
    identical_across_workers: bool = True
    #: the fewest workers the algorithm makes sense with (gossip needs a neighbour)
    min_workers: int = 1
    #: workers may run different numbers of inner steps per round (nothing assumes equal H_w)
    per_worker_inner_steps: bool = False
    #: keeps an error-feedback buffer (its norm is logged)
    has_error_feedback: bool = False
    #: reaches θ_outer only through ``anchor_bucket`` / ``store_anchor_bucket`` / ``write_back`` /
    #: ``pseudo_gradient``, so it may live in host memory (``OuterConfig.anchor_on_cpu``)
    supports_anchor_on_cpu: bool = False

    def __init__(self, params: Sequence[torch.Tensor], group: Optional[dist.ProcessGroup],
                 config: OuterConfig, names: Optional[Sequence[str]] = None,
                 slices: Optional[Sequence[TensorSlice]] = None):
        self.config = config.validate()
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
        self.group = group
        self.device = params[0].device
        self.world_size = dist.get_world_size(group) if dist.is_initialized() else 1
        self.rank = dist.get_rank(group) if dist.is_initialized() else 0
        self.counter = CommCounter()
        self.outer_steps = 0
        if self.config.anchor_on_cpu and not self.supports_anchor_on_cpu:
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
        self.reset_anchor()

    def check_group_layout(self) -> None:
        """Fail early unless every rank of ``group`` owns the same number of elements.

        The ranks of the outer group must hold the same shard (same parameters, same flat order)
        in their worker; a different element count means the shards do not line up and every
        collective would silently mix unrelated values. One tiny all-reduce (MAX of (n, −n)),
        counted in ``self.counter`` like every collective, but outside any step's stats.
        """
        if self.world_size == 1:
            return
        n = self.params.numel
        t = torch.tensor([n, -n], dtype=torch.int64, device=self.device)
        all_reduce_(t, self.group, self.counter, op=dist.ReduceOp.MAX)
        hi, lo = int(t[0].item()), -int(t[1].item())
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
        waits for it before the host reads θ_outer (``step`` ends with it)."""
        if not self.config.anchor_on_cpu:
            return
        pinned = self.anchor.is_pinned() and bucket.device.type == "cuda"
        self.anchor[start:end].copy_(bucket, non_blocking=pinned)
        self._anchor_copies_pending |= pinned

    def anchor_ready(self) -> None:
        """Wait for the copies ``store_anchor_bucket`` left in flight (one host sync per outer step)."""
        if self._anchor_copies_pending:
            torch.cuda.current_stream(self.device).synchronize()
            self._anchor_copies_pending = False

    def pseudo_gradient(self, start: int, end: int, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Δ[start:end] = θ_outer − θ_local for one bucket (fresh buffer unless ``out``)."""
        if out is None:
            out = torch.empty(end - start, dtype=torch.float32, device=self.device)
        self.params.read(start, end, out)
        return torch.sub(self.anchor_bucket(start, end), out, out=out)

    def write_back(self, start: int, end: int, anchor: Optional[torch.Tensor] = None) -> None:
        """θ_local ← θ_outer on one bucket (``anchor``: that bucket of θ_outer already on the device)."""
        self.params.write(start, end, self.anchor_bucket(start, end) if anchor is None else anchor)

    def reset_to_anchor(self) -> None:
        """θ_local ← θ_outer on every bucket (a skipped round discards the local progress)."""
        for s, e in self.buckets():
            self.write_back(s, e)

    # ------------------------------------------------------------------ the step
    def step(self) -> OuterStepStats:
        """One outer step, in place on the params. Every worker must call it together.

        Phases: the non-finite verdict (``nonfinite_verdict``: this worker's check and, unless the
        strategy carries it in its payloads, the agreement of all workers), then ``_outer_step``
        with this worker's verdict, then the byte counts.
        """
        stats = OuterStepStats(step=self.outer_steps + 1, numel=self.params.numel)
        before = (self.counter.bytes_sent, self.counter.bytes_received, self.counter.collectives)
        proceed, nonfinite_tensor = self.nonfinite_verdict(stats)
        if proceed:
            self._outer_step(stats, nonfinite_tensor)
        self.anchor_ready()
        self.outer_steps += 1
        stats.bytes_sent = self.counter.bytes_sent - before[0]
        stats.bytes_received = self.counter.bytes_received - before[1]
        stats.collectives = self.counter.collectives - before[2]
        return stats

    #: the workers agree on the non-finite verdict before the step (one all-reduce of a flag);
    #: False where the step carries it itself (gossip: the flag rides on the proposals, and each
    #: worker hears only its neighbours)
    agrees_nonfinite_before_step: bool = True

    def first_nonfinite_tensor(self) -> Optional[str]:
        """The name of this worker's first tensor holding NaN or Inf, or None (a local check)."""
        for i, t in enumerate(self.params.tensors):
            if not torch.isfinite(t).all():
                return self.names[i]
        return None

    def nonfinite_verdict(self, stats: OuterStepStats) -> Tuple[bool, Optional[str]]:
        """(run ``_outer_step``?, this worker's first non-finite tensor or None).

        With the agreement (``agrees_nonfinite_before_step``): ``_all_workers_finite`` decides, and
        the step only ever sees None. Without it the step always runs and gets the local verdict.
        """
        bad_name = self.first_nonfinite_tensor()
        if not self.agrees_nonfinite_before_step:
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
        flag = torch.tensor([0.0 if bad_name is None else float(self.rank + 1)], device=self.device)
        all_reduce_(flag, self.group, self.counter, op=dist.ReduceOp.MAX)
        worst = int(flag.item())
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

    @abc.abstractmethod
    def _outer_step(self, stats: OuterStepStats, nonfinite_tensor: Optional[str]) -> None:
        """Compute Δ, communicate, update ``self.anchor`` and write it back (all buckets).

        ``nonfinite_tensor``: this worker's verdict (``nonfinite_verdict``), the name of its first
        tensor holding NaN / Inf, or None; always None where the workers agreed before the step.
        """

    #: set by strategies that implement ``_launch_round`` (delayed application, ``outer/overlap.py``)
    supports_overlap: bool = False

    def _launch_round(self, stats: OuterStepStats) -> Tuple[Callable[[], None], Callable[[], None], Callable[[], None]]:
        """The outer step split for delayed application: returns ``(communicate, finish, cancel)``.

        Called on the main thread when this worker's params are finite, *before* the workers agree
        on it (the agreement runs on the overlap thread, just before ``communicate``): computes Δ
        for every bucket (and any state update that depends only on it, e.g. error feedback) and
        fixes every payload's size. ``communicate()`` then runs every collective of the round (on
        the overlap thread, touching only the buffers made here); ``finish()`` (main thread, after
        it) updates θ_outer and the strategy state exactly as ``_outer_step`` does, but does *not*
        write θ_outer back into the params (the overlap driver merges instead). ``cancel()`` (main
        thread, instead of ``finish`` when another worker's Δ was not finite, so ``communicate``
        never ran) undoes the launch's state updates bit for bit.
        """
        raise ConfigError(f"outer strategy {self.name!r} does not support delayed application "
                          "(--sparseloco-overlap-steps); use 0")

    def _timer(self, stats: OuterStepStats, attr: str) -> _Timer:
        return _Timer(stats, attr, self.device)

    # ------------------------------------------------------------------ state
    #: checkpoint facts whose value must match on resume → the flag that sets it
    checkpoint_fact_flags: Dict[str, str] = {}

    def checkpoint_facts(self) -> Dict[str, object]:
        """Settings that change what the saved state means (a resume with others is refused)."""
        return {}

    #: the strategy's per-element buffers besides θ_outer (``anchor``, every strategy's), each a flat
    #: fp32 vector over ``params``: attribute name = state-dict and checkpoint name; an attribute that
    #: is None is not kept in this configuration (e.g. momentum with μ = 0)
    elementwise_buffers: ClassVar[Tuple[str, ...]] = ()

    def elementwise_state(self) -> Dict[str, torch.Tensor]:
        """The live per-element state, each a flat vector over ``self.params`` (not copies):
        ``anchor``, the buffers of ``elementwise_buffers`` that are kept, and ``attached_state``."""
        state = {"anchor": self.anchor}
        for name in self.elementwise_buffers:
            buf = getattr(self, name)
            if buf is not None:
                state[name] = buf
        return {**state, **self.attached_state}

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

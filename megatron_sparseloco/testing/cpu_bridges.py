"""CPU only: bridges that let megatron-core 0.19.2 (and megatron.training) run on CPU over gloo.

For runs without CUDA: the tests, and the CPU demo / recipes through ``megatron_sparseloco.run``,
which imports this module only when ``torch.cuda.is_available()`` is False; on a GPU machine it is
never imported. Tests call :func:`apply_cpu_bridges` inside each rank (after ``import
megatron.core``) and before building models or optimizers.

megatron-core assumes CUDA in many places (docs/design.md §3). Each assumption is answered by one
named :class:`Bridge` in :data:`BRIDGES` that records the megatron file/function it answers, why,
and a ``check()`` that re-reads the installed megatron source and says whether the workaround is
still needed. ``tests/test_cpu_bridges.py`` fails with the bridge's name when an upgrade fixes or
moves what a bridge works around.

How the bridges patch, narrowest first:

* **Per-module ``torch`` stand-in** (:class:`_CpuTorch`, a bridge's default): in each megatron
  module its evidence names (and only there) the global name ``torch`` is replaced by a proxy
  that forwards everything to the real ``torch`` except ``torch.cuda`` (→ :class:`_CpuCuda`:
  ``current_device()`` is ``'cpu'``, ``synchronize`` / ``Stream`` / ``Event`` /
  ``current_stream`` / ``stream()`` / memory statistics are CPU no-ops,
  the CUDA RNG calls use the CPU generator) and tensor factories (``zeros``, ``empty``,
  ``tensor``, ...) whose ``device='cuda'`` argument becomes ``'cpu'``. ``torch`` itself, and every
  other module, are untouched.
* **Function wrappers**: a few megatron functions call tensor *methods* that no module proxy can
  reach (``tensor.type() == 'torch.cuda.FloatTensor'``, ``tensor.cuda()``). Only while such a
  function runs, ``torch.Tensor.type`` reports CUDA type names for CPU tensors and
  ``torch.Tensor.cuda`` returns the tensor on CPU. This is the one place that patches a torch
  global, and only for the duration of the wrapped call (the ranks run single-threaded code).
* **Attribute replacements**: a module-level function is replaced or wrapped (the CUDA RNG state
  get/set, the MoE split-size host copy, ``compile_helpers``, megatron.training's
  ``initialize_megatron(allow_no_cuda=True)`` and ``get_device_arch_version``).

On a machine with CUDA :func:`apply_cpu_bridges` does nothing.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import logging
import re
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

_APPLIED: List[str] = []
_MARK = "__sparseloco_cpu_bridge__"


# --------------------------------------------------------------------------------------------
# CPU stand-ins for torch.cuda
# --------------------------------------------------------------------------------------------
class _CpuStream:
    """A CUDA stream stand-in: every operation runs in program order on CPU already."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.device = torch.device("cpu")

    def wait_stream(self, stream: Any) -> None:
        """No-op: CPU work is already ordered."""

    def wait_event(self, event: Any) -> None:
        """No-op."""

    def record_event(self, event: Any = None) -> "_CpuEvent":
        """Return a completed event."""
        return event if event is not None else _CpuEvent()

    def synchronize(self) -> None:
        """No-op."""

    def query(self) -> bool:
        """CPU work is always complete."""
        return True


class _CpuEvent:
    """A CUDA event stand-in; timing events report 0 ms."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, stream: Any = None) -> None:
        """No-op."""

    def wait(self, stream: Any = None) -> None:
        """No-op."""

    def synchronize(self) -> None:
        """No-op."""

    def query(self) -> bool:
        """Always complete."""
        return True

    def elapsed_time(self, other: "_CpuEvent") -> float:
        """No device timing on CPU."""
        return 0.0


_DEFAULT_STREAM = _CpuStream()


class _NoOpNamespace:
    """Any attribute is a function that does nothing (``torch.cuda.nvtx`` stand-in)."""

    def __getattr__(self, name: str) -> Callable[..., None]:
        return lambda *args, **kwargs: None


class _CpuCudaRandom:
    """``torch.cuda.random`` stand-in: the CPU generator plays the device generator."""

    @staticmethod
    def get_rng_state(device: Any = None) -> torch.Tensor:
        return torch.get_rng_state()

    @staticmethod
    def set_rng_state(new_state: torch.Tensor, device: Any = None) -> None:
        torch.set_rng_state(new_state)


class _CpuCuda:
    """``torch.cuda`` as seen by one bridged megatron module on a CPU-only machine."""

    Stream = _CpuStream
    Event = _CpuEvent
    nvtx = _NoOpNamespace()
    random = _CpuCudaRandom()

    def __init__(self, device_count: Optional[int] = None) -> None:
        self._device_count = device_count

    def __getattr__(self, name: str) -> Any:  # everything not overridden: the real torch.cuda
        return getattr(torch.cuda, name)

    def device_count(self) -> int:
        """The real count (0), unless this stand-in pretends one device (see megatron.training)."""
        return torch.cuda.device_count() if self._device_count is None else self._device_count

    # device placement -----------------------------------------------------------------------
    @staticmethod
    def current_device() -> str:
        return "cpu"

    @staticmethod
    def set_device(device: Any) -> None:
        """No-op."""

    @staticmethod
    def synchronize(device: Any = None) -> None:
        """No-op."""

    # streams ----------------------------------------------------------------------------------
    @staticmethod
    def current_stream(device: Any = None) -> _CpuStream:
        return _DEFAULT_STREAM

    @staticmethod
    def default_stream(device: Any = None) -> _CpuStream:
        return _DEFAULT_STREAM

    @staticmethod
    def stream(stream: Any = None) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    @staticmethod
    def is_current_stream_capturing() -> bool:
        return False

    # memory statistics -----------------------------------------------------------------------
    @staticmethod
    def empty_cache() -> None:
        """No-op."""

    @staticmethod
    def memory_allocated(device: Any = None) -> int:
        return 0

    max_memory_allocated = memory_allocated
    memory_reserved = memory_allocated
    max_memory_reserved = memory_allocated

    @staticmethod
    def memory_stats(device: Any = None) -> Dict[str, int]:
        return {}

    @staticmethod
    def reset_peak_memory_stats(device: Any = None) -> None:
        """No-op."""

    @staticmethod
    def mem_get_info(device: Any = None) -> tuple:
        return (0, 0)

    # RNG: the CPU generator stands in for the device generator (as in ``random``) ------------
    get_rng_state = staticmethod(_CpuCudaRandom.get_rng_state)
    set_rng_state = staticmethod(_CpuCudaRandom.set_rng_state)

    @staticmethod
    def manual_seed(seed: int) -> None:
        torch.manual_seed(seed)

    manual_seed_all = manual_seed


def _cpu_device(device: Any) -> Any:
    """Map a CUDA device spec (``'cuda'``, ``'cuda:0'``, an int, a cuda ``torch.device``) to CPU."""
    if device is None:
        return None
    if isinstance(device, int) and not isinstance(device, bool):
        return "cpu"
    if isinstance(device, str) and device.startswith("cuda"):
        return "cpu"
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    return device


_FACTORIES = ("zeros", "ones", "empty", "full", "tensor", "as_tensor", "arange", "rand", "randn",
              "randint", "randperm", "zeros_like", "ones_like", "empty_like", "full_like", "eye",
              "linspace")


class _CpuTorch:
    """``torch`` as seen by one bridged megatron module: CUDA placements and calls land on CPU."""

    def __init__(self, device_count: Optional[int] = None) -> None:
        self.cuda = _CpuCuda(device_count)
        for name in _FACTORIES:
            setattr(self, name, self._factory(getattr(torch, name)))

    @staticmethod
    def _factory(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> torch.Tensor:
            if "device" in kwargs:
                kwargs["device"] = _cpu_device(kwargs["device"])
            return fn(*args, **kwargs)
        return wrapper

    @staticmethod
    def device(*args: Any, **kwargs: Any) -> torch.device:
        dev = torch.device(*args, **kwargs)
        return torch.device("cpu") if dev.type == "cuda" else dev

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


_CPU_TORCH = _CpuTorch()
# megatron.training.initialize only: reports one "device" so that process groups and the
# model-parallel RNG are set up (they are skipped when torch.cuda.device_count() == 0).
_CPU_TORCH_ONE_DEVICE = _CpuTorch(device_count=1)


# --------------------------------------------------------------------------------------------
# Tensor-method patch, active only while a wrapped megatron function runs
# --------------------------------------------------------------------------------------------
_REAL_TENSOR_TYPE = torch.Tensor.type
_REAL_TENSOR_CUDA = torch.Tensor.cuda


def _type_as_cuda(self: torch.Tensor, dtype: Any = None, non_blocking: bool = False, **kwargs: Any) -> Any:
    if dtype is None and not kwargs and self.device.type == "cpu":
        name = _REAL_TENSOR_TYPE(self)
        return name.replace("torch.", "torch.cuda.", 1) if name.count(".") == 1 else name
    return _REAL_TENSOR_TYPE(self, dtype, non_blocking, **kwargs)


def _cuda_as_cpu(self: torch.Tensor, device: Any = None, non_blocking: bool = False, **kwargs: Any) -> torch.Tensor:
    return self


@contextlib.contextmanager
def _cuda_tensor_methods() -> Any:
    """While active: ``t.type()`` of a CPU tensor reads ``torch.cuda.XTensor``; ``t.cuda()`` is ``t``."""
    prev_type, prev_cuda = torch.Tensor.type, torch.Tensor.cuda
    setattr(torch.Tensor, "type", _type_as_cuda)  # setattr: a deliberate swap of the methods
    setattr(torch.Tensor, "cuda", _cuda_as_cpu)
    try:
        yield
    finally:
        setattr(torch.Tensor, "type", prev_type)
        setattr(torch.Tensor, "cuda", prev_cuda)


def _wrap_with_cuda_tensor_methods(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with _cuda_tensor_methods():
            return fn(*args, **kwargs)
    setattr(wrapper, _MARK, True)
    return wrapper


# --------------------------------------------------------------------------------------------
# Registry
# --------------------------------------------------------------------------------------------
def _resolve(target: str) -> tuple:
    """``'pkg.mod:Class.attr'`` → (owner object, attribute name, value)."""
    mod_name, _, qual = target.partition(":")
    owner: Any = importlib.import_module(mod_name)
    parts = qual.split(".")
    for part in parts[:-1]:
        owner = getattr(owner, part)
    return owner, parts[-1], inspect.getattr_static(owner, parts[-1])


def _source(target: str) -> str:
    """Source of a module (``'pkg.mod'``) or of a function/class (``'pkg.mod:Qual.name'``)."""
    if ":" not in target:
        return inspect.getsource(importlib.import_module(target))
    _, _, value = _resolve(target)
    if isinstance(value, (staticmethod, classmethod)):
        value = value.__func__
    value = inspect.unwrap(value)
    return inspect.getsource(value)


@dataclass
class Bridge:
    """One CPU workaround for one CUDA assumption in megatron.

    ``evidence`` maps a target (``'module'`` or ``'module:Qual.name'``) to regexes that must all
    match its source for the workaround to still be needed. The workaround patches what the
    evidence names, and nothing else: by default the global ``torch`` of every module in the evidence
    is replaced by ``proxy``; with ``cuda_methods`` every function in the evidence (and its
    ``aliases``) runs with ``Tensor.cuda()`` / ``.type()`` answered on CPU; ``apply_fn`` is a
    workaround of its own.
    """

    name: str
    answers: str  # the megatron file/function it answers
    why: str
    evidence: Dict[str, Sequence[str]]
    apply_fn: Optional[Callable[[], None]] = None  # None: ``proxy`` in every evidence module
    proxy: Optional[_CpuTorch] = None  # the CPU stand-in for ``torch`` there (None: _CPU_TORCH)
    cuda_methods: bool = False  # instead: the evidence functions run with ``_cuda_tensor_methods``
    aliases: Tuple[str, ...] = ()  # with cuda_methods: other names bound to an evidence function
    extra_check: Optional[Callable[[], List[str]]] = None  # more evidence than source patterns
    packaging: bool = False  # not about CUDA: needed on CUDA machines too

    @property
    def needs(self) -> Tuple[str, ...]:
        """The packages the evidence lives in (``megatron.core``, ``megatron.training``): the bridge
        patches them, so it applies only where they are installed."""
        return tuple(sorted({".".join(m.split(".")[:2]) for m in self.modules}))

    @property
    def modules(self) -> Tuple[str, ...]:
        """The modules the evidence reads, in its order."""
        return tuple(dict.fromkeys(t.split(":")[0] for t in self.evidence))

    @property
    def functions(self) -> Tuple[str, ...]:
        """The functions the evidence reads (its ``'module:Qual.name'`` targets)."""
        return tuple(t for t in self.evidence if ":" in t)

    def apply(self) -> None:
        """Put the workaround in place (class docstring)."""
        if self.apply_fn is not None:
            self.apply_fn()
        elif self.cuda_methods:
            _wrap_functions(*self.functions, *self.aliases)()
        else:
            _proxy_torch(*self.modules, proxy=self.proxy)()

    def available(self) -> bool:
        """Whether the packages the bridge patches are installed."""
        for mod in self.needs:
            try:
                importlib.import_module(mod)
            except ImportError:
                return False
        return True

    def check(self) -> List[str]:
        """Return what no longer matches (empty: the workaround is still needed, as written)."""
        problems = []
        for target, patterns in self.evidence.items():
            try:
                src = _source(target)
            except Exception as exc:  # moved / renamed / removed
                problems.append(f"{target}: cannot read source ({type(exc).__name__}: {exc})")
                continue
            for pat in patterns:
                if not re.search(pat, src):
                    problems.append(f"{target}: pattern {pat!r} not found")
        if self.extra_check is not None:
            problems.extend(self.extra_check())
        return problems


def _proxy_torch(*modules: str, proxy: Optional[_CpuTorch] = None) -> Callable[[], None]:
    """Apply: replace the global ``torch`` in each module by the CPU stand-in."""
    proxy = proxy or _CPU_TORCH

    def apply() -> None:
        for name in modules:
            mod = importlib.import_module(name)
            if getattr(mod, "torch", None) is not torch and not isinstance(getattr(mod, "torch", None), _CpuTorch):
                raise RuntimeError(f"{name}.torch is not the torch module; bridge cannot apply")
            setattr(mod, "torch", proxy)
    return apply


def _wrap_functions(*targets: str) -> Callable[[], None]:
    """Apply: run each target function with :func:`_cuda_tensor_methods` active."""
    def apply() -> None:
        for target in targets:
            owner, attr, value = _resolve(target)
            if isinstance(value, (staticmethod, classmethod)):
                fn = value.__func__
                if getattr(fn, _MARK, False):
                    continue
                setattr(owner, attr, type(value)(_wrap_with_cuda_tensor_methods(fn)))
            else:
                if getattr(value, _MARK, False):
                    continue
                setattr(owner, attr, _wrap_with_cuda_tensor_methods(value))
    return apply


# ---- RNG -----------------------------------------------------------------------------------
def _cpu_get_rng_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
    """CPU replacement for ``tensor_parallel.random._get_cuda_rng_state``."""
    return torch.get_rng_state()


def _cpu_set_rng_state(new_state: torch.Tensor, device: int = -1, graph_safe: bool = False) -> None:
    """CPU replacement for ``tensor_parallel.random._set_cuda_rng_state``."""
    torch.set_rng_state(new_state)


class _DropCpuRngChangedWarning(logging.Filter):
    """The tracker warns when the CPU RNG moves inside ``fork()``; on CPU it *is* the device RNG."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "CPU RNG state changed within GPU RNG context" not in record.getMessage()


def _apply_rng() -> None:
    rnd = importlib.import_module("megatron.core.tensor_parallel.random")
    setattr(rnd, "_get_cuda_rng_state", _cpu_get_rng_state)
    setattr(rnd, "_set_cuda_rng_state", _cpu_set_rng_state)
    _proxy_torch("megatron.core.tensor_parallel.random")()
    logger = logging.getLogger(rnd.__name__)
    if not any(isinstance(f, _DropCpuRngChangedWarning) for f in logger.filters):
        logger.addFilter(_DropCpuRngChangedWarning())


# ---- MoE all-to-all split sizes -------------------------------------------------------------
def _apply_moe_split_sizes() -> None:
    disp = importlib.import_module("megatron.core.transformer.moe.token_dispatcher")
    original = disp.maybe_move_tensor_to_cpu
    if getattr(original, _MARK, False):
        return

    @functools.wraps(original)
    def maybe_move_tensor_to_cpu(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
        out = original(tensor, as_numpy=as_numpy, record_stream=record_stream)
        if as_numpy and torch.is_tensor(out) and out.device.type == "cpu":
            out = out.numpy()
        return out

    setattr(maybe_move_tensor_to_cpu, _MARK, True)
    setattr(disp, "maybe_move_tensor_to_cpu", maybe_move_tensor_to_cpu)


# ---- megatron.training ---------------------------------------------------------------------
def _apply_allow_no_cuda() -> None:
    training = importlib.import_module("megatron.training.training")
    original = training.initialize_megatron
    if getattr(original, _MARK, False):
        return

    @functools.wraps(original)
    def initialize_megatron(*args: Any, **kwargs: Any) -> Any:
        kwargs["allow_no_cuda"] = True
        return original(*args, **kwargs)

    setattr(initialize_megatron, _MARK, True)
    setattr(training, "initialize_megatron", initialize_megatron)


def _prebuilt_dataset_helpers() -> None:
    """Stand-in for ``compile_helpers``: use the helper extension shipped in the wheel."""
    importlib.import_module("megatron.core.datasets.helpers_cpp")


def _apply_prebuilt_helpers() -> None:
    utils = importlib.import_module("megatron.core.datasets.utils")
    setattr(utils, "compile_helpers", _prebuilt_dataset_helpers)


def _no_makefile_in_datasets() -> List[str]:
    import os
    utils = importlib.import_module("megatron.core.datasets.utils")
    assert utils.__file__ is not None, "megatron.core.datasets.utils is a file in the wheel"
    here = os.path.dirname(os.path.abspath(utils.__file__))
    return [] if not os.path.exists(os.path.join(here, "Makefile")) else [f"{here}/Makefile exists now"]


def _cpu_device_arch_version() -> int:
    """No CUDA architecture on CPU: report 0."""
    return 0


def _apply_device_arch_version() -> None:
    for name in ("megatron.training.arguments", "megatron.training.utils", "megatron.training.utils.common_utils"):
        mod = importlib.import_module(name)
        if hasattr(mod, "get_device_arch_version"):
            setattr(mod, "get_device_arch_version", _cpu_device_arch_version)


# --------------------------------------------------------------------------------------------
_CORE = "megatron.core"
#: the source patterns that show a CUDA assumption, named by what the code does
_ON_CURRENT_DEVICE = (r"device=torch\.cuda\.current_device\(\)",)   # allocates on the current CUDA device
_ON_CUDA = (r"device='cuda'",)                                   # allocates on 'cuda'
_ON_CUDA_DQ = (r'device="cuda"',)                                # the same, double-quoted
_CURRENT_DEVICE = (r"torch\.cuda\.current_device\(\)",)          # asks for the CUDA device
_CUDA_SYNCHRONIZE = (r"torch\.cuda\.synchronize\(\)",)
_CUDA_RNG_STATE = (r"torch\.cuda\.get_rng_state\(\)",)
_CUDA_TYPE_NAME = (r"\.type\(\) == 'torch\.cuda\.FloatTensor'",)  # classifies params by CUDA type name
BRIDGES: List[Bridge] = [
    Bridge(
        name="rng_tracker_cpu_generator",
        answers="core/tensor_parallel/random.py: _get_cuda_rng_state, _set_cuda_rng_state, "
                "CudaRNGStatesTracker.add/fork, model_parallel_cuda_manual_seed",
        why="The model-parallel RNG tracker saves/restores CUDA generator states "
            "(torch.cuda.get_rng_state, default_generators, _lazy_call); on CPU the CPU generator "
            "plays that role and the 'CPU RNG changed inside fork' warning is meaningless.",
        evidence={
            f"{_CORE}.tensor_parallel.random:_get_cuda_rng_state": [r"torch\.cuda\.random\.get_rng_state"],
            f"{_CORE}.tensor_parallel.random:_set_cuda_rng_state":
                [r"torch\.cuda\.default_generators|_cuda_setRNGState"],
            f"{_CORE}.tensor_parallel.random:CudaRNGStatesTracker.add": _CUDA_RNG_STATE,
            f"{_CORE}.tensor_parallel.random:model_parallel_cuda_manual_seed": [r"torch\.cuda\.manual_seed\("],
        },
        apply_fn=_apply_rng,
    ),
    Bridge(
        name="ddp_buffers_streams_on_cpu",
        answers="core/distributed/param_and_grad_buffer.py: _ParamAndGradBuffer.__init__ "
                "(device=torch.cuda.current_device(), device='cuda'), _ParamAndGradBucketGroup."
                "start_grad_sync/finish_grad_sync (torch.cuda.current_stream/stream); "
                "core/distributed/distributed_data_parallel.py: DistributedDataParallel.__init__ "
                "(torch.cuda.Stream for several distributed-optimizer instances)",
        why="Gradient/param buffers are allocated on the current CUDA device and the inter-instance "
            "all-reduce runs on a CUDA communication stream.",
        evidence={
            f"{_CORE}.distributed.param_and_grad_buffer:_ParamAndGradBuffer.__init__":
                _ON_CURRENT_DEVICE,
            f"{_CORE}.distributed.param_and_grad_buffer:_ParamAndGradBucketGroup.start_grad_sync":
                [r"torch\.cuda\.(current_stream|stream)\("],
            f"{_CORE}.distributed.distributed_data_parallel:DistributedDataParallel.__init__":
                [r"torch\.cuda\.Stream\("],
        },
    ),
    Bridge(
        name="optimizer_cuda_allocations",
        answers="core/optimizer/optimizer.py (MegatronOptimizer/_get_param_groups... device='cuda', "
                "ChainedOptimizer.get_loss_scale current_device), core/optimizer/distrib_optimizer.py "
                "(shard buffers on current_device), core/optimizer/clip_grads.py (norm tensors on "
                "'cuda'), core/optimizer/grad_scaler.py",
        why="Scalars and buffers of the optimizer wrappers are allocated with device='cuda' or "
            "torch.cuda.current_device().",
        evidence={
            f"{_CORE}.optimizer.optimizer:ChainedOptimizer.get_loss_scale": _CURRENT_DEVICE,
            f"{_CORE}.optimizer.optimizer:MixedPrecisionOptimizer.__init__": _ON_CUDA,
            f"{_CORE}.optimizer.clip_grads:get_grad_norm_fp32": _ON_CUDA,
            f"{_CORE}.optimizer.clip_grads:clip_grad_by_total_norm_fp32": _ON_CUDA,
            f"{_CORE}.optimizer.grad_scaler": _ON_CUDA,
            f"{_CORE}.optimizer.distrib_optimizer": _CURRENT_DEVICE,
        },
    ),
    Bridge(
        name="cuda_tensor_type_names",
        answers="core/optimizer/distrib_optimizer.py: DistributedOptimizer."
                "_build_model_and_main_param_groups; core/optimizer/optimizer.py: "
                "Float16OptimizerWithFloat16Params.__init__; core/optimizer/clip_grads.py: "
                "clip_grad_by_total_norm_fp32 (also bound by name in core/optimizer/optimizer.py)",
        why="Parameters are classified by tensor.type() against 'torch.cuda.FloatTensor' / "
            "'torch.cuda.HalfTensor' / 'torch.cuda.BFloat16Tensor'; CPU tensors report "
            "'torch.FloatTensor' and are rejected as 'wrong param type'.",
        evidence={
            f"{_CORE}.optimizer.distrib_optimizer:DistributedOptimizer._build_model_and_main_param_groups":
                _CUDA_TYPE_NAME,
            f"{_CORE}.optimizer.optimizer:Float16OptimizerWithFloat16Params.__init__":
                _CUDA_TYPE_NAME,
            f"{_CORE}.optimizer.clip_grads:clip_grad_by_total_norm_fp32":
                _CUDA_TYPE_NAME,
        },
        cuda_methods=True,
        aliases=(f"{_CORE}.optimizer.optimizer:clip_grad_by_total_norm_fp32",),  # imported by name there
    ),
    Bridge(
        name="model_comm_buffers_on_cpu",
        answers="core/utils.py: GlobalMemoryBuffer.get_tensor (attention matmul buffer on "
                "torch.cuda.current_device()); core/tensor_parallel/mappings.py: "
                "_gather_along_last_dim/_gather_along_first_dim/_reduce_scatter_along_first_dim; "
                "core/tensor_parallel/layers.py (sequence-parallel gather buffers); "
                "core/transformer/utils.py: get_default_causal_mask (device='cuda')",
        why="The local attention's baddbmm buffer and the tensor-parallel gather / reduce-scatter "
            "outputs are allocated on the current CUDA device.",
        evidence={
            f"{_CORE}.utils:GlobalMemoryBuffer.get_tensor": _ON_CURRENT_DEVICE,
            f"{_CORE}.tensor_parallel.mappings:_gather_along_last_dim": _ON_CURRENT_DEVICE,
            f"{_CORE}.tensor_parallel.mappings:_gather_along_first_dim": _ON_CURRENT_DEVICE,
            f"{_CORE}.tensor_parallel.layers": _ON_CURRENT_DEVICE,
            f"{_CORE}.transformer.utils:get_default_causal_mask": _ON_CUDA_DQ,
        },
    ),
    Bridge(
        name="rotary_embedding_on_cpu",
        answers="core/models/common/embeddings/rotary_pos_embedding.py: RotaryEmbedding.get_emb "
                "(moves inv_freq to torch.cuda.current_device() on first use)",
        why="RoPE models (--position-embedding-type rope, the Llama-style recipes) move the "
            "inverse frequencies to the current CUDA device in the forward pass.",
        evidence={
            f"{_CORE}.models.common.embeddings.rotary_pos_embedding:RotaryEmbedding.get_emb":
                _ON_CURRENT_DEVICE,
        },
    ),
    Bridge(
        name="pipeline_schedules_on_cpu",
        answers="core/pipeline_parallel/schedules.py: forward_backward_* (total_num_tokens on "
                "device='cuda'); core/pipeline_parallel/p2p_communication.py: _communicate / "
                "_communicate_shapes (receive buffers on torch.cuda.current_device(), "
                "torch.cuda.synchronize)",
        why="The schedules count tokens in a CUDA tensor and the P2P layer allocates receive "
            "buffers on the current CUDA device.",
        evidence={
            f"{_CORE}.pipeline_parallel.schedules:forward_backward_no_pipelining":
                _ON_CUDA_DQ,
            f"{_CORE}.pipeline_parallel.p2p_communication":
                [r"device=torch\.cuda\.current_device\(\)", r"torch\.cuda\.synchronize\(\)"],
        },
    ),
    Bridge(
        name="moe_alltoall_split_sizes_on_host",
        answers="core/transformer/moe/moe_utils.py: maybe_move_tensor_to_cpu, as used by "
                "core/transformer/moe/token_dispatcher.py: MoEAlltoAllTokenDispatcher."
                "_maybe_dtoh_and_synchronize",
        why="The all-to-all split sizes become host numpy arrays only 'if tensor.is_cuda'; on CPU "
            "they stay tensors and all_to_all_single rejects tensor split sizes.",
        evidence={
            f"{_CORE}.transformer.moe.moe_utils:maybe_move_tensor_to_cpu": [r"tensor\.is_cuda"],
            f"{_CORE}.transformer.moe.token_dispatcher:MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize":
                [r"maybe_move_tensor_to_cpu\(\s*self\.input_splits, as_numpy=True"],
        },
        apply_fn=_apply_moe_split_sizes,
    ),
    Bridge(
        name="moe_router_dispatcher_on_cpu",
        answers="core/transformer/moe/router.py (aux-loss tensors on torch.cuda.current_device()), "
                "core/transformer/moe/token_dispatcher.py: MoEAlltoAllTokenDispatcher "
                "(torch.cuda.Stream for device-to-host copies, device='cuda'), "
                "core/transformer/moe/moe_layer.py (torch.cuda.Event/Stream)",
        why="The router allocates on the current CUDA device; the all-to-all dispatcher moves "
            "split sizes to host on a side CUDA stream.",
        evidence={
            f"{_CORE}.transformer.moe.router": _ON_CURRENT_DEVICE,
            f"{_CORE}.transformer.moe.token_dispatcher": [r"torch\.cuda\.Stream\(\)"],
            f"{_CORE}.transformer.moe.moe_layer": [r"torch\.cuda\.(Event|Stream)\("],
        },
    ),
    Bridge(
        name="dataset_helpers_prebuilt",
        answers="core/datasets/utils.py: compile_helpers (called by megatron/training/initialize.py: "
                "_compile_dependencies)",
        why="Packaging, not CUDA: compile_helpers runs 'make' in the installed package, but the wheel "
            "ships the built helpers_cpp extension and no Makefile, so rank 0 exits. Also applies "
            "on CUDA machines (see apply_packaging_bridges).",
        evidence={f"{_CORE}.datasets.utils:compile_helpers": [r'\["make", "-C"']},
        extra_check=_no_makefile_in_datasets,
        apply_fn=_apply_prebuilt_helpers,
        packaging=True,
    ),
    Bridge(
        name="training_initialize_allow_no_cuda",
        answers="training/training.py: pretrain → training/initialize.py: initialize_megatron",
        why="initialize_megatron asserts torch.cuda.is_available() unless allow_no_cuda=True, and "
            "pretrain never passes it.",
        evidence={
            "megatron.training.initialize:initialize_megatron":
                [r"if not allow_no_cuda:\s*\n\s*#[^\n]*\n\s*assert torch\.cuda\.is_available\(\)"],
            "megatron.training.training:pretrain": [r"initialize_megatron\("],
        },
        apply_fn=_apply_allow_no_cuda,
    ),
    Bridge(
        name="training_initialize_device_count",
        answers="training/initialize.py: _initialize_distributed (model-parallel groups), "
                "_set_random_seed (model_parallel_cuda_manual_seed), finish_mpu_init",
        why="Model-parallel groups and the model-parallel RNG tracker are only set up when "
            "torch.cuda.device_count() > 0; inside this module torch.cuda reports one (CPU) device.",
        evidence={
            "megatron.training.initialize:_initialize_distributed":
                [r"device_count = torch\.cuda\.device_count\(\)",
                 r"if device_count > 0 and not skip_model_parallel_init"],
            "megatron.training.initialize:_set_random_seed": [r"if torch\.cuda\.device_count\(\) > 0:"],
        },
        proxy=_CPU_TORCH_ONE_DEVICE,
    ),
    Bridge(
        name="training_loop_cuda_allocations",
        answers="training/training.py: pretrain (start-time all-reduce on device='cuda'), "
                "build_train_valid_test_data_loaders (flags on 'cuda'), train/train_step/"
                "training_log (torch.cuda memory statistics, synchronize); core/timers.py: "
                "Timer.start/stop (torch.cuda.synchronize)",
        why="The training loop allocates small reduction tensors on 'cuda' and queries CUDA memory.",
        evidence={
            "megatron.training.training:pretrain": _ON_CUDA,
            "megatron.training.training:build_train_valid_test_data_loaders": _ON_CUDA,
            f"{_CORE}.timers:Timer.start": _CUDA_SYNCHRONIZE,
        },
    ),
    Bridge(
        name="training_get_model_module_cuda",
        answers="training/training.py: get_model (model_module.cuda(torch.cuda.current_device()))",
        why="get_model moves every chunk with Module.cuda() unless --init-model-with-meta-device; "
            "while it runs, Tensor.cuda() leaves tensors on CPU.",
        evidence={"megatron.training.training:get_model": [r"model_module\.cuda\("]},
        cuda_methods=True,
    ),
    Bridge(
        name="rerun_state_machine_rng",
        answers="core/rerun_state_machine.py: RerunStateMachine._save_state/_restore_state",
        why="Before each training step megatron.training saves torch.cuda.get_rng_state() so a step "
            "can be re-run; the CPU generator plays that role.",
        evidence={f"{_CORE}.rerun_state_machine:RerunStateMachine._save_state": _CUDA_RNG_STATE},
    ),
    Bridge(
        name="training_utils_cuda_allocations",
        answers="training/utils/common_utils.py: logical_and_across_model_parallel_group, "
                "reduce_max_stat_across_model_parallel_group, calc_params_l2_norm, "
                "report_memory; training/checkpointing.py: get_rng_state/save/load (CUDA RNG "
                "state, iteration tensor on 'cuda')",
        why="Small reduction tensors are created on torch.cuda.current_device() / 'cuda', memory "
            "reports read torch.cuda statistics, and checkpoints save torch.cuda.get_rng_state().",
        evidence={
            "megatron.training.utils.common_utils:logical_and_across_model_parallel_group":
                _ON_CURRENT_DEVICE,
            "megatron.training.checkpointing": [r"'cuda_rng_state': torch\.cuda\.get_rng_state\(\)"],
        },
    ),
    Bridge(
        name="training_device_arch_version",
        answers="training/arguments.py: validate_args → training/utils/common_utils.py: "
                "get_device_arch_version (torch.cuda.get_device_properties('cuda:0'))",
        why="With tensor or context parallelism > 1 argument validation reads the GPU's compute "
            "capability; on CPU it reports 0 (pre-Blackwell behaviour).",
        evidence={
            "megatron.training.utils.common_utils:get_device_arch_version":
                [r"torch\.cuda\.get_device_properties\("],
            "megatron.training.arguments:validate_args": [r"get_device_arch_version\(\)"],
        },
        apply_fn=_apply_device_arch_version,
    ),
    Bridge(
        name="dist_checkpointing_on_cpu",
        answers="core/dist_checkpointing/strategies/filesystem_async.py: preload_tensors "
                "(torch.cuda.synchronize); strategies/state_dict_saver.py (verification flags on "
                "'cuda'); strategies/async_utils.py, strategies/fully_parallel.py (synchronize, "
                "current_device); tensor_aware_state_dict.py",
        why="torch_dist checkpoint save synchronises the CUDA device and all-reduces small flags "
            "allocated on it.",
        evidence={
            f"{_CORE}.dist_checkpointing.strategies.filesystem_async:FileSystemWriterAsync.preload_tensors":
                _CUDA_SYNCHRONIZE,
            f"{_CORE}.dist_checkpointing.strategies.state_dict_saver": _ON_CUDA,
            f"{_CORE}.dist_checkpointing.strategies.async_utils": _CUDA_SYNCHRONIZE,
            f"{_CORE}.dist_checkpointing.strategies.fully_parallel": _CUDA_SYNCHRONIZE,
            f"{_CORE}.dist_checkpointing.tensor_aware_state_dict": _CUDA_SYNCHRONIZE,
        },
    ),
    Bridge(
        name="tied_embedding_init_cuda",
        answers="core/models/common/language_module/language_module.py: LanguageModule."
                "setup_embeddings_and_output_layer (weight.data = weight.data.cuda())",
        why="With pipeline parallelism and tied embeddings the last stage's output weight is "
            "moved to CUDA before the first/last-stage all-reduce that initialises it.",
        evidence={f"{_CORE}.models.common.language_module.language_module:LanguageModule."
                  "setup_embeddings_and_output_layer": [r"weight\.data = weight\.data\.cuda\(\)"]},
        cuda_methods=True,
    ),
]


def bridge_names() -> List[str]:
    """Names of all registered bridges, in apply order."""
    return [b.name for b in BRIDGES]


def _apply(bridges: Sequence[Bridge]) -> List[str]:
    for bridge in bridges:
        if bridge.name in _APPLIED or not bridge.available():
            continue
        bridge.apply()
        _APPLIED.append(bridge.name)
    return list(_APPLIED)


def apply_packaging_bridges() -> List[str]:
    """Apply only the bridges that are not about CUDA (e.g. ``compile_helpers``); for CUDA runs."""
    return _apply([b for b in BRIDGES if b.packaging])


def apply_cpu_bridges(force: bool = False) -> List[str]:
    """Apply every bridge (idempotent). No-op on a CUDA machine unless ``force``.

    Returns the names of the bridges in effect in this process (empty on CUDA machines).
    """
    if torch.cuda.is_available() and not force:
        return []
    return _apply(BRIDGES)

"""Every CPU bridge still answers a real CUDA assumption in the installed megatron, and applying
the bridges is idempotent. A megatron-core upgrade that fixes or moves what a bridge works around
fails here with the bridge's name."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron_sparseloco.testing import cpu_bridges as cb  # noqa: E402

pytestmark = pytest.mark.megatron


@pytest.mark.parametrize("bridge", cb.BRIDGES, ids=[b.name for b in cb.BRIDGES])
def test_bridge_still_needed(bridge):
    if not bridge.available():
        pytest.skip(f"{bridge.needs} not installed")
    problems = bridge.check()
    assert not problems, (f"CPU bridge {bridge.name!r} ({bridge.answers}) no longer matches the "
                          f"installed megatron: " + "; ".join(problems))


def test_bridge_names_unique_and_documented():
    names = cb.bridge_names()
    assert len(names) == len(set(names))
    for b in cb.BRIDGES:
        assert b.answers and b.why and (b.evidence or b.extra_check), b.name


def test_check_detects_a_fixed_source():
    """A bridge whose evidence pattern is absent reports it (the check can fail)."""
    fake = cb.Bridge(name="fake", answers="x", why="y",
                     evidence={"megatron.core.tensor_parallel.random:_get_cuda_rng_state": [r"no_such_call\("]},
                     apply_fn=lambda: None)
    assert fake.check() and "no_such_call" in fake.check()[0]
    moved = cb.Bridge(name="moved", answers="x", why="y",
                      evidence={"megatron.core.tensor_parallel.random:_no_such_function": [r"."]},
                      apply_fn=lambda: None)
    assert "cannot read source" in moved.check()[0]


@pytest.mark.skipif(torch.cuda.is_available(), reason="bridges are a no-op with CUDA")
def test_apply_twice_is_harmless():
    import megatron.core.optimizer.distrib_optimizer as dopt
    import megatron.core.tensor_parallel.random as rnd
    from megatron.core.distributed import param_and_grad_buffer as pgb

    first = cb.apply_cpu_bridges()
    build = dopt.DistributedOptimizer.__dict__["_build_model_and_main_param_groups"].__func__
    second = cb.apply_cpu_bridges()
    assert first == second == [b.name for b in cb.BRIDGES if b.available()]
    # not wrapped twice
    assert dopt.DistributedOptimizer.__dict__["_build_model_and_main_param_groups"].__func__ is build
    assert not getattr(build.__wrapped__, cb._MARK, False)
    # effects: CPU stand-ins in the bridged modules; torch itself untouched
    assert pgb.torch.cuda.current_device() == "cpu"
    assert pgb.torch.zeros(2, device="cuda").device.type == "cpu"
    assert torch.Tensor.type is cb._REAL_TENSOR_TYPE and torch.Tensor.cuda is cb._REAL_TENSOR_CUDA
    torch.manual_seed(3)
    state = rnd._get_cuda_rng_state()
    a = torch.rand(3)
    rnd._set_cuda_rng_state(state)
    assert torch.equal(torch.rand(3), a)


def test_cuda_tensor_type_names_only_inside_wrapped_calls():
    t = torch.zeros(2)
    with cb._cuda_tensor_methods():
        assert t.type() == "torch.cuda.FloatTensor"
        assert t.to(torch.bfloat16).type() == "torch.cuda.BFloat16Tensor"
        assert t.cuda() is t
    assert t.type() == "torch.FloatTensor"


def test_a_bridge_without_apply_fn_patches_exactly_its_evidence_modules(monkeypatch):
    """The common workaround reads its targets from the evidence: those modules get the stand-in, no other."""
    import sys
    import types

    mods = {name: types.ModuleType(name) for name in ("_bridge_a", "_bridge_b", "_bridge_c")}
    for name, mod in mods.items():
        mod.torch = torch
        monkeypatch.setitem(sys.modules, name, mod)
    stand_in = cb._CpuTorch(device_count=1)
    bridge = cb.Bridge(name="t", answers="x", why="y", proxy=stand_in,
                       evidence={"_bridge_a:f": [r"."], "_bridge_b": [r"."], "_bridge_a:g": [r"."]})
    assert bridge.modules == ("_bridge_a", "_bridge_b")
    bridge.apply()
    assert mods["_bridge_a"].torch is stand_in and mods["_bridge_b"].torch is stand_in
    assert mods["_bridge_c"].torch is torch


def test_a_cuda_methods_bridge_wraps_exactly_its_evidence_functions_and_aliases(monkeypatch):
    """With cuda_methods the evidence functions (and the aliases) see CUDA tensor methods; the module's
    torch and its other functions stay as they were."""
    import sys
    import types

    mod = types.ModuleType("_bridge_w")
    mod.torch = torch

    def kind():
        return torch.zeros(1).type()

    mod.f, mod.g, mod.h, mod.f_alias = kind, kind, kind, kind
    monkeypatch.setitem(sys.modules, "_bridge_w", mod)
    bridge = cb.Bridge(name="w", answers="x", why="y", cuda_methods=True, aliases=("_bridge_w:f_alias",),
                       evidence={"_bridge_w:f": [r"."], "_bridge_w:g": [r"."], "_bridge_w": [r"."]})
    assert bridge.functions == ("_bridge_w:f", "_bridge_w:g")
    bridge.apply()
    assert (mod.f(), mod.g(), mod.f_alias()) == ("torch.cuda.FloatTensor",) * 3
    assert mod.h() == "torch.FloatTensor" and mod.torch is torch

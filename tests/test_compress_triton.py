"""GPU fast path (Triton) against the torch codec: the same payload bytes, EF state and scatter-add sums.

Without a GPU the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``, numpy on CPU tensors)
on small inputs. The ``cuda`` tests run the compiled kernels and compare them with the CPU torch path.
They are skipped when no GPU is present. The interpreter checks the kernels' logic but not the compiled
code's arithmetic, e.g. FMA contraction: the kernels are launched with ``enable_fp_fusion=False``.
"""

from __future__ import annotations

import os

import pytest
import torch

from megatron_sparseloco.compress import (
    CodecConfig,
    NonFiniteInputError,
    PayloadError,
    decode,
    encode,
    error_feedback_step,
)

HAS_CUDA = torch.cuda.is_available()

# Triton builds its own @jit helpers (tl.sum, tl.cumsum, ...) when it is first imported, so the
# interpreter mode must be on at that moment. Without a GPU, turn it on for the import only. The
# `interp` fixture sets it again around each interpreter test, which is what fast_path checks.
_saved = os.environ.get("TRITON_INTERPRET")
if not HAS_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"
try:
    triton = pytest.importorskip("triton")
finally:
    if _saved is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = _saved
from megatron_sparseloco.compress import fast_path as fp  # noqa: E402

INTERPRETED = fp._triton_interpreted()


@pytest.fixture
def interp(monkeypatch):
    if not INTERPRETED:
        pytest.skip("triton was imported in compiled mode (GPU present, or imported before this module)")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv(fp.INTERPRETER_SWITCH, "1")
    yield


def _inputs(kind: str, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if kind == "randn":
        return torch.randn(n, generator=g)
    if kind == "ties":  # many equal |x| across the Top-k boundary; exact fp64 sums
        return torch.randint(-3, 4, (n,), generator=g).float()
    if kind == "halves":  # codes land exactly on .5 (round half to even)
        return (torch.randint(-4, 5, (n,), generator=g).float() * 0.5).contiguous()
    if kind == "zeros_chunk":
        x = torch.randn(n, generator=g)
        x[: min(n, 300)] = 0.0
        x[1] = -0.0
        return x
    if kind == "constant":
        return torch.full((n,), -1.25)
    raise ValueError(kind)


# (chunk, k, numel, value_bits): ragged tails of several sizes, non-power-of-two chunk, k = 1
CASES = [
    (256, 8, 256 * 3 + 37, 2),
    (256, 8, 256 * 2, 2),  # no tail
    (256, 8, 256 * 2 + 1, 2),  # one-element tail keeps 1
    (64, 1, 64 * 2 + 5, 2),
    (100, 7, 333, 4),
    (4096, 64, 4096 * 2 + 1000, 2),
    (4096, 64, 1000, 2),  # a single ragged chunk
]
KINDS = ["randn", "ties", "halves", "zeros_chunk", "constant"]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "C{}-k{}-n{}-b{}".format(*c))
@pytest.mark.parametrize("kind", KINDS)
def test_encode_bytes_match_torch(interp, case, kind):
    chunk, k, n, bits = case
    if chunk == 4096 and kind not in ("randn", "ties"):
        pytest.skip("kept small for the interpreter")
    cfg = CodecConfig(chunk=chunk, k=k, value_bits=bits)
    x = _inputs(kind, n, seed=sum(case) + 1000 * KINDS.index(kind))
    got = fp.encode_fast(x, cfg)
    assert fp.last_dispatch["encode"] == "triton"
    want = encode(x, cfg)
    assert got.dtype == torch.uint8 and got.shape == want.shape
    assert torch.equal(got, want)


def test_ties_take_lowest_positions(interp):
    cfg = CodecConfig(chunk=64, k=4)
    x = torch.zeros(64)
    x[[5, 9, 20, 33, 40, 63]] = 1.0  # six equal magnitudes for four slots
    x[[9, 40]] = -1.0
    dec = decode(fp.encode_fast(x, cfg))
    assert dec.indices.tolist() == [5, 9, 20, 33]


@pytest.mark.parametrize("beta", [0.0, 0.95, 1.0])
@pytest.mark.parametrize("case", [(256, 8, 805, 2), (100, 7, 333, 4)], ids=["C256", "C100-b4"])
def test_error_feedback_matches_torch(interp, case, beta):
    chunk, k, n, bits = case
    cfg = CodecConfig(chunk=chunk, k=k, value_bits=bits)
    g = torch.Generator().manual_seed(7)
    err, delta = torch.randn(n, generator=g), torch.randn(n, generator=g)
    e_fast, e_ref = err.clone(), err.clone()
    p_fast, d_fast = fp.error_feedback_step_fast(e_fast, delta, beta, cfg)
    assert fp.last_dispatch["error_feedback_step"] == "triton"
    p_ref, d_ref = error_feedback_step(e_ref, delta, beta, cfg)
    assert torch.equal(p_fast, p_ref)
    assert torch.equal(e_fast, e_ref)
    assert torch.equal(d_fast.indices, d_ref.indices) and torch.equal(d_fast.values, d_ref.values)
    assert d_fast.numel == d_ref.numel and d_fast.config == d_ref.config


def _payloads(cfg, n, workers, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [encode(torch.randn(n, generator=g) * (w + 1), cfg) for w in range(workers)]


@pytest.mark.parametrize("with_scales", [False, True])
@pytest.mark.parametrize("count_dtype", [None, torch.int32, torch.float32])
def test_scatter_add_matches_torch(interp, with_scales, count_dtype):
    cfg = CodecConfig(chunk=256, k=8)
    n = 256 * 3 + 37
    payloads = _payloads(cfg, n, workers=3)
    out0 = torch.randn(n)
    scales = torch.tensor([0.5, 1.0, 0.3]) if with_scales else None
    counts0 = torch.zeros(n, dtype=count_dtype) if count_dtype else None
    got, want = out0.clone(), out0.clone()
    c_got = counts0.clone() if counts0 is not None else None
    c_want = counts0.clone() if counts0 is not None else None
    fp.decode_scatter_add_fast(payloads, got, scales, c_got)
    assert fp.last_dispatch["decode_scatter_add"] == "triton"
    fp._torch_scatter_add(payloads, want, scales, c_want)
    assert torch.equal(got, want)
    if counts0 is not None:
        assert torch.equal(c_got, c_want)


def test_scatter_add_accepts_a_2d_buffer(interp):
    cfg = CodecConfig(chunk=100, k=7, value_bits=4)
    payloads = _payloads(cfg, 333, workers=2, seed=3)
    got, want = torch.zeros(333), torch.zeros(333)
    fp.decode_scatter_add_fast(torch.stack(payloads), got)
    assert fp.last_dispatch["decode_scatter_add"] == "triton"
    for p in payloads:
        d = decode(p)
        want.index_add_(0, d.indices, d.values)
    assert torch.equal(got, want)


def test_corrupt_indices_raise_like_torch_and_leave_out_untouched(interp):
    cfg = CodecConfig(chunk=256, k=8)
    n = 256 * 3 + 1
    payloads = _payloads(cfg, n, workers=2)
    geo = fp._geometry(n, cfg)
    out0 = torch.randn(n)
    raised = 0
    for pos in range(geo.index_at, geo.nbytes, 3):
        bad = payloads[1].clone()
        bad[pos] ^= 0x81
        try:
            decode(bad)
            torch_raises = False
        except PayloadError:
            torch_raises = True
        out = out0.clone()
        if torch_raises:
            with pytest.raises(PayloadError):
                fp.decode_scatter_add_fast([payloads[0], bad], out)
            assert torch.equal(out, out0)
            raised += 1
        else:
            want = out0.clone()
            fp._torch_scatter_add([payloads[0], bad], want, None, None)
            fp.decode_scatter_add_fast([payloads[0], bad], out)
            assert torch.equal(out, want)
    assert raised > 0


def test_bad_header_and_side_info(interp):
    cfg = CodecConfig(chunk=256, k=8)
    n = 600
    payloads = _payloads(cfg, n, workers=2)
    bad = payloads[1].clone()
    bad[0] = ord("X")  # magic
    with pytest.raises(PayloadError, match="magic"):
        fp.decode_scatter_add_fast([payloads[0], bad], torch.zeros(n))
    bad = payloads[1].clone()
    bad[64:68] = torch.tensor([0, 0, 0xC0, 0x7F], dtype=torch.uint8)  # shift = NaN
    out = torch.zeros(n)
    with pytest.raises(PayloadError, match="NaN or Inf"):
        fp.decode_scatter_add_fast([payloads[0], bad], out)
    assert not out.any()
    with pytest.raises(PayloadError):
        fp.decode_scatter_add_fast(payloads, torch.zeros(n + 1))


@pytest.mark.filterwarnings("ignore:invalid value encountered")
def test_non_finite_input_raises(interp):
    cfg = CodecConfig(chunk=256, k=8)
    x = torch.randn(700)
    x[300] = float("inf")
    with pytest.raises(NonFiniteInputError, match="'w1'"):
        fp.encode_fast(x, cfg, name="w1")


def test_fallback_reasons(interp):
    x = torch.randn(1000)
    cases = {
        "chunk_mode": CodecConfig(chunk_mode="tile", chunk=64 * 64),
        "index_coding": CodecConfig(chunk=256, k=8, index_coding="entropy"),
        "value_bits": CodecConfig(chunk=256, k=8, value_bits=8),
        "quant_group_chunks": CodecConfig(chunk=256, k=8, quant_group_chunks=2),
        "chunk=8192": CodecConfig(chunk=8192, k=64),
        "dense": CodecConfig(chunk=16, k=16),
    }
    for word, cfg in cases.items():
        got = fp.encode_fast(x.view(20, 50), cfg)
        assert word in fp.last_dispatch["encode"], (word, fp.last_dispatch)
        assert torch.equal(got, encode(x.view(20, 50), cfg))
    cfg = CodecConfig(chunk=256, k=8)
    assert torch.equal(fp.encode_fast(x.to(torch.bfloat16), cfg), encode(x.to(torch.bfloat16), cfg))
    assert "bfloat16" in fp.last_dispatch["encode"]
    err, delta = torch.randn(1000), torch.randn(1000, dtype=torch.bfloat16)
    e2 = err.clone()
    p1, _ = fp.error_feedback_step_fast(err, delta, 0.9, cfg)
    assert "delta dtype" in fp.last_dispatch["error_feedback_step"]
    p2, _ = error_feedback_step(e2, delta, 0.9, cfg)
    assert torch.equal(p1, p2) and torch.equal(err, e2)


def test_cpu_without_interpreter_falls_back(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cfg = CodecConfig(chunk=256, k=8)
    x = torch.randn(600)
    assert torch.equal(fp.encode_fast(x, cfg), encode(x, cfg))
    assert "cpu" in fp.last_dispatch["encode"]
    out = torch.zeros(600)
    fp.decode_scatter_add_fast([encode(x, cfg)], out)
    assert "cpu" in fp.last_dispatch["decode_scatter_add"]
    assert torch.equal(out, decode_dense_ref(encode(x, cfg)))


def decode_dense_ref(p):
    d = decode(p)
    out = torch.zeros(d.numel)
    out[d.indices] = d.values
    return out


# ----------------------------------------------------------------------------------------- real GPU
cuda = pytest.mark.skipif(not HAS_CUDA or INTERPRETED, reason="needs a CUDA GPU and compiled (not interpreted) triton")


@cuda
@pytest.mark.parametrize("n", [4096 * 64 + 777, 1 << 22])
@pytest.mark.parametrize("kind", ["randn", "ties"])
def test_cuda_bytes_match_cpu_torch(monkeypatch, n, kind):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cfg = CodecConfig()
    x = _inputs(kind, n, seed=11)
    got = fp.encode_fast(x.cuda(), cfg)
    assert fp.last_dispatch["encode"] == "triton"
    assert torch.equal(got.cpu(), encode(x, cfg))


@cuda
def test_cuda_error_feedback_and_scatter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cfg = CodecConfig()
    n = 4096 * 100 + 123
    g = torch.Generator().manual_seed(5)
    err, delta = torch.randn(n, generator=g), torch.randn(n, generator=g)
    e_gpu = err.cuda()
    p_gpu, d_gpu = fp.error_feedback_step_fast(e_gpu, delta.cuda(), 0.95, cfg)
    assert fp.last_dispatch["error_feedback_step"] == "triton"
    e_cpu = err.clone()
    p_cpu, d_cpu = error_feedback_step(e_cpu, delta, 0.95, cfg)
    assert torch.equal(p_gpu.cpu(), p_cpu)
    assert torch.equal(e_gpu.cpu(), e_cpu)  # catches an FMA-contracted beta*e + delta
    assert torch.equal(d_gpu.indices.cpu(), d_cpu.indices) and torch.equal(d_gpu.values.cpu(), d_cpu.values)

    payloads = _payloads(cfg, n, workers=5, seed=9)
    out0 = torch.randn(n, generator=g)
    scales = torch.rand(5, generator=g)
    want, c_want = out0.clone(), torch.zeros(n, dtype=torch.int32)
    fp._torch_scatter_add(payloads, want, scales, c_want)
    got, c_got = out0.cuda(), torch.zeros(n, dtype=torch.int32, device="cuda")
    fp.decode_scatter_add_fast([p.cuda() for p in payloads], got, scales.cuda(), c_got)
    assert fp.last_dispatch["decode_scatter_add"] == "triton"
    assert torch.equal(got.cpu(), want) and torch.equal(c_got.cpu(), c_want)


# ------------------------------------------------------------------- ahead-of-time compile (no GPU)
_AOT = r'''
import json, sys, triton
from triton.compiler import ASTSource
from triton.backends.compiler import GPUTarget
from megatron_sparseloco.compress import triton_kernels as K
p, i32 = "*fp32", "i32"
jobs = [
    (K.select_kernel, dict(x_ptr=p, delta_ptr=p, vals_ptr=p, idx_ptr="*i32", psum_ptr="*fp64", n_chunks=i32,
                           tail=i32, k=i32, k_last=i32, beta="fp32"), dict(C=4096, BLOCK=4096, FUSE_EF=True), 8),
    (K.select_kernel, dict(x_ptr=p, delta_ptr=p, vals_ptr=p, idx_ptr="*i32", psum_ptr="*fp64", n_chunks=i32,
                           tail=i32, k=i32, k_last=i32, beta="fp32"), dict(C=100, BLOCK=128, FUSE_EF=False), 4),
    (K.sumsq_kernel, dict(vals_ptr=p, stats_ptr="*fp64", part_ptr="*fp64", K=i32), dict(BLOCK=1024), 4),
    (K.quant_kernel, dict(vals_ptr=p, stats_ptr="*fp64", codes_ptr="*u8", bsum_ptr="*fp64", bcnt_ptr="*i32", K=i32),
     dict(N_BINS=4, BLOCK=1024), 4),
    (K.pack_kernel, dict(src_ptr="*u8", dst_ptr="*u8", count=i32, n_bytes=i32), dict(W=2, NV=5, BLOCK=1024), 4),
    (K.pack_kernel, dict(src_ptr="*i32", dst_ptr="*u8", count=i32, n_bytes=i32), dict(W=12, NV=2, BLOCK=1024), 4),
    (K.ef_apply_kernel, dict(vals_ptr=p, idx_ptr="*i32", codes_ptr="*u8", side_ptr=p, err_ptr=p, dec_idx_ptr="*i64",
                             dec_val_ptr=p, K=i32, k=i32), dict(C=4096, UPDATE_ERR=True, BLOCK=1024), 4),
    (K.validate_kernel, dict(pay_ptr="*u8", row_stride=i32, bad_ptr="*u8", n_chunks=i32, tail=i32, k=i32, k_last=i32,
                             index_at=i32, index_bytes=i32), dict(C=4096, KB=64, WI=12, NBI=3), 1),
    (K.scatter_add_kernel, dict(pay_ptr="*u8", row_stride=i32, side_ptr=p, scale_ptr=p, out_ptr=p, cnt_ptr="*i32",
                                n_workers=i32, n_chunks=i32, tail=i32, k=i32, k_last=i32, values_at=i32, value_bytes=i32,
                                index_at=i32, index_bytes=i32),
     dict(C=4096, KB=64, WI=12, NBI=3, VB=2, N_BINS=4, HAS_SCALE=True, HAS_COUNT=True), 1),
]
report = {}
for fn, sig, const, warps in jobs:
    sig = {**sig, **{name: "constexpr" for name in const}}
    ck = triton.compile(ASTSource(fn, sig, const), target=GPUTarget("cuda", 90, 32),
                        options={"num_warps": warps, "enable_fp_fusion": False})
    ptx = ck.asm["ptx"]
    report[f"{fn.__name__}{sorted(const.items())}"] = {"fma": ptx.count("fma.rn"), "div_f32": ptx.count("div.full.f32")}
print(json.dumps(report))
'''


def test_kernels_compile_for_sm90_without_fma():
    """Compile every kernel for sm_90 (no GPU needed) in a fresh process (compiled, not interpreted)."""
    import json
    import pathlib
    import subprocess
    import sys

    ptxas = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not ptxas.exists():
        pytest.skip("triton's bundled ptxas is missing")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", _AOT], capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    report = json.loads(res.stdout.strip().splitlines()[-1])
    assert len(report) == 9
    for name, counts in report.items():
        assert counts == {"fma": 0, "div_f32": 0}, (name, counts)

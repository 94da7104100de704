import os

import pytest

# Keep each test process to one thread: multi-rank tests share 2 cores.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# megatron-core decorates its fused elementwise functions (bias-GeLU, bias-dropout-add) with
# torch.compile, and megatron.training warms them up before training: on CPU inductor's C++
# compile costs 2–4 s per launch, more than a test's training. The tests run them eagerly (dynamo
# reads this when megatron is imported, so it is set before anything imports it). The tests that
# launch exactly as a user does (tests/test_recipes_cpu_run.py, the example-script test) unset it.
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

# Without a GPU, Triton kernels can only run in its CPU interpreter, and Triton reads
# TRITON_INTERPRET once, at its first import (megatron-core imports triton early). Set it for the
# whole session so tests/test_compress_triton.py checks the kernels instead of skipping.
if "TRITON_INTERPRET" not in os.environ:
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    """The byte-level corpus (300 kB, 10 % validation) the real-loop checkpoint tests train on,
    built once per session. Megatron keeps its sample-index caches beside it; they are keyed by
    the dataset config, so runs with other settings do not share them."""
    from megatron_sparseloco.data.build import build_dataset
    return build_dataset(str(tmp_path_factory.mktemp("corpus")), max_bytes=300_000, valid_percent=10.0,
                         log=lambda *_: None)


@pytest.fixture
def token(tmp_path):
    """An elastic run's secret file (``--sparseloco-elastic-token-file``): 32 characters, mode 600."""
    path = tmp_path / "token"
    path.write_text("0123456789abcdef0123456789abcdef\n")
    os.chmod(path, 0o600)
    return str(path)

import os

# Keep each test process to one thread: multi-rank tests share 2 cores.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# Without a GPU, Triton kernels can only run in its CPU interpreter, and Triton reads
# TRITON_INTERPRET once, at its first import (megatron-core imports triton early). Set it for the
# whole session so tests/test_compress_triton.py checks the kernels instead of skipping.
if "TRITON_INTERPRET" not in os.environ:
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"

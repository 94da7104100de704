"""``python tools/gpu_launch.py <pretrain script> <args>``: megatron_sparseloco.run for the GPU check.

Applies only the packaging bridge (megatron-core's wheel ships the dataset helper but no Makefile,
so ``compile_helpers``' ``make`` fails; not a CUDA matter), then runs the script like
``python -m megatron_sparseloco.run``. A Megatron-LM checkout does not need it.
"""
import sys

from megatron_sparseloco.testing.cpu_bridges import apply_packaging_bridges
from megatron_sparseloco.run import main

if __name__ == "__main__":
    apply_packaging_bridges()
    main(sys.argv[1:])

"""Run an unmodified Megatron pretrain script with the plugin installed.

    torchrun ... -m megatron_sparseloco.run pretrain_gpt.py <megatron args> --sparseloco-algorithm sparseloco ...

    python -m megatron_sparseloco.run --sparseloco-help     # the --sparseloco-* flag reference

Installs the plugin and executes the script as ``__main__`` (``megatron.plugin.run_pretrain_script``).
On a machine without CUDA (tests, the CPU demo) it first applies the CPU bridges for megatron-core
(``testing/cpu_bridges.py``); with CUDA they are never imported.
"""
from __future__ import annotations

import os
import sys


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--sparseloco-help" in argv:
        from megatron_sparseloco.megatron.args.help import help_text
        print(help_text())
        sys.exit(0)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        sys.exit(0 if argv else 2)
    script, rest = argv[0], argv[1:]
    if not os.path.isfile(script):
        sys.exit(f"megatron_sparseloco.run: pretrain script {script!r} not found. Fix: give the path of a "
                 "pretrain script with Megatron's CLI (e.g. $MEGATRON_LM/pretrain_gpt.py or this repo's "
                 "examples/pretrain_gpt.py)")
    import torch
    if not torch.cuda.is_available():
        from megatron_sparseloco.testing.cpu_bridges import apply_cpu_bridges
        apply_cpu_bridges()
    from megatron_sparseloco.megatron.plugin import run_pretrain_script
    run_pretrain_script(script, rest)


if __name__ == "__main__":
    main()

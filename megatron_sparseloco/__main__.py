"""``python -m megatron_sparseloco [--help | --markdown | --write-readme README.md]``: the flag reference."""
import sys

from megatron_sparseloco.megatron.args.help import main

if __name__ == "__main__":
    sys.exit(main())

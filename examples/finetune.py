"""`python -m examples.finetune` in a source checkout: the same as `fucina finetune` (fucina/cli/finetune.py)."""
import sys

from fucina.cli.finetune import main

if __name__ == "__main__":
    sys.exit(main())

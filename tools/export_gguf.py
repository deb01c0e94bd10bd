"""`python -m tools.export_gguf` in a source checkout: the same as `fucina export` (fucina/cli/export.py)."""
import sys

from fucina.cli.export import main

if __name__ == "__main__":
    sys.exit(main())

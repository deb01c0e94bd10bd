"""`python -m tools.prewarm` in a source checkout: the same as `fucina prewarm` (fucina/cli/prewarm.py)."""
import sys

from fucina.cli.prewarm import main

if __name__ == "__main__":
    sys.exit(main())

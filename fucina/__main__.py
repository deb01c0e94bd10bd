"""`python -m fucina ...`: the `fucina` command (fucina/cli)."""
import sys

from .cli import main

sys.exit(main())

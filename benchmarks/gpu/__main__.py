"""`python -m benchmarks.gpu ...`: benchmarks/gpu/run.py's main."""

import sys

from benchmarks.gpu.run import main, parse_args  # noqa: F401 -- parse_args: the flags main reads

if __name__ == "__main__":
    sys.exit(main())

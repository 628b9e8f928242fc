"""`python -m benchmarks.ep`: see the package docstring."""

import sys

from benchmarks.ep.cli import main

if __name__ == "__main__":
    sys.exit(main())

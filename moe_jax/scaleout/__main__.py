"""`python -m moe_jax.scaleout`: see `moe_jax.scaleout.cli`."""

import sys

from moe_jax.scaleout.cli import main

sys.exit(main())

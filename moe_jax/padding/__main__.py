"""`python -m moe_jax.padding`: see `moe_jax.padding.cli`."""

import sys

from moe_jax.padding.cli import main

sys.exit(main())

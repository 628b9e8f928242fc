"""Repository-wide pytest setup (tests/ and parity/)."""

import os

# Forced host devices for shard_map tests on CPU (EP x expert-DP up to 8); must precede the first
# jax import and is ignored by GPU backends.
_flag = "--xla_force_host_platform_device_count=8"
if _flag not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()

"""Process and device setup: fake CPU devices, `jax.distributed`, the EP mesh, batch placement."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from moe_jax.parallel import activation_spec, make_mesh


def init_runtime(args) -> None:
    """Fake CPU devices and join the distributed job; must run before any JAX computation."""
    if args.host_devices is not None:
        try:
            jax.config.update("jax_num_cpu_devices", args.host_devices)
        except RuntimeError:
            # JAX is already running (e.g. main() called in a process that used JAX before).
            have = len(jax.devices("cpu"))
            if have != args.host_devices:
                raise SystemExit(
                    f"--host-devices {args.host_devices}: JAX already started with {have} CPU devices "
                    "in this process; run the example in a fresh process."
                ) from None
    if args.distributed:
        jax.distributed.initialize(
            coordinator_address=args.coordinator, num_processes=args.num_processes, process_id=args.process_id
        )


def build_mesh(args):
    """The `("data", "ep")` mesh for `--ep`, or None for a single-device run; checks the batch."""
    if args.ep is None:
        return None
    if args.ep_strategy == "ragged" and jax.default_backend() == "cpu":
        raise SystemExit("--ep-strategy ragged needs a GPU (XLA:CPU has no ragged_all_to_all); use padded")
    try:
        mesh = make_mesh(ep=args.ep)
    except ValueError as error:
        raise SystemExit(f"--ep {args.ep}: {error} (use --host-devices on CPU)") from None
    if args.batch % mesh.size:
        raise SystemExit(f"--batch {args.batch} must be a multiple of the {mesh.size} devices (it is split over all)")
    return mesh


def to_device(array: np.ndarray, mesh):
    """Place a host batch: whole on the default device, or split over `activation_spec()`.

    Every process builds the same global batch (it depends only on seed and step), so
    `make_array_from_callback` also works on many hosts.
    """
    if mesh is None:
        return jnp.asarray(array)
    sharding = jax.sharding.NamedSharding(mesh, activation_spec())
    return jax.make_array_from_callback(array.shape, sharding, lambda index: array[index])

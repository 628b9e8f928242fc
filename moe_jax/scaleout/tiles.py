"""The tiles of the grouped GEMM that would run: `moe_jax.ops.plan` under an abstract H200 mesh.

Legend: M packed rows (the static buffer the kernel is planned for), N output width, K reduction
width, G groups (the rank's local experts or slots).

`kernel_plan` asks the library's own chooser what it would run for a forward grouped GEMM
(`gmm_nt`) of that shape on the named device, lowering for a GPU from any host (the abstract mesh
carries the device kind; nothing is compiled or run). It asks first as the layer does by default
(`gemm_kernel="auto"`, `config="auto"`: the on-device selector, which picks among the candidates
of the tuned table's row for M from each call's histogram). When that row holds one candidate,
that candidate is what runs and its tiles are exact; every row of the committed H200 tables
(`moe_jax/ops/gmm/pallas_triton/tables.py`) holds one today (`rt128x256` at the planner's
prefill sizes). When a row holds several, the pick is only known on the device; the plan then
falls back to the **static** plan (`config=None`, the backend's rule from the shape, what
`gemm_kernel="static"` runs) and says so in `Tiles.how`. `moe_jax.ops.executed(plan, sizes)` on
the returned plan gives the rows it executes.

A backend whose tiling is its own (`xla`) claims no padding: tiles of 1.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

__all__ = ["Tiles", "kernel_plan", "kernel_tiles", "padded"]


class Tiles(NamedTuple):
    """What one planned kernel multiplies in: `block_m` rows per tile (the padding of each
    group's last tile), `block_n` output columns, `block_k` reduction step; `kernel` names the
    candidate, `backend` the backend, `how` which plan gave it ("selector" when the on-device
    selector has this one candidate, else "static")."""

    block_m: int
    block_n: int
    block_k: int
    kernel: str
    backend: str
    how: str


def padded(size, tile: int):
    """`tile * ceil(size / tile)` (numpy or int): what a kernel with `tile`-sized blocks runs."""
    return -(-size // tile) * tile


def _tile_config(config):
    """The `TileConfig` inside a backend's resolved configuration, or None."""
    if hasattr(config, "configs"):  # pallas_triton: Launches(names, configs, table)
        return config.configs[0].tiles
    if hasattr(config, "tiles"):  # a GmmConfig
        return config.tiles
    if hasattr(config, "block_m"):  # a TileConfig (triton)
        return config
    return None


@functools.lru_cache(maxsize=4096)
def kernel_plan(m: int, n: int, k: int, groups: int, dtype: str = "bfloat16", device_kind: str = "NVIDIA H200"):
    """`(Plan, how)`: the plan that runs a forward grouped GEMM of M x N x K over `groups` on
    `device_kind` (module docstring), how being "selector" or "static"."""
    import jax  # noqa: PLC0415 (jax only where a plan is asked for)

    from moe_jax import ops  # noqa: PLC0415

    for name, value in (("m", m), ("n", n), ("k", k), ("groups", groups)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive int; got {value!r}.")
    device = jax.sharding.AbstractDevice(device_kind=device_kind, num_cores=None, platform="cuda")
    mesh = jax.sharding.AbstractMesh((1,), ("scaleout",), None, abstract_device=device)
    problem = ops.resolved_problem("gmm_nt", m, n, k, groups, dtype)
    with jax.sharding.use_abstract_mesh(mesh):
        auto = ops.plan(problem, config="auto")
        if len(getattr(auto.config, "configs", ())) == 1:
            return auto, "selector"
        return ops.plan(problem), "static"


def kernel_tiles(m: int, n: int, k: int, groups: int, dtype: str = "bfloat16",
                 device_kind: str = "NVIDIA H200") -> Tiles:
    """The `Tiles` of `kernel_plan(m, n, k, groups, dtype, device_kind)`."""
    plan, how = kernel_plan(m, n, k, groups, dtype, device_kind)
    tiles = _tile_config(plan.config)
    if plan.backend == "xla" or tiles is None:
        return Tiles(1, 1, 1, str(plan.config), plan.backend, how)
    names = getattr(plan.config, "names", (None,))
    kernel = names[0] if names and names[0] else f"{tiles.block_m}x{tiles.block_n}"
    return Tiles(int(tiles.block_m), int(tiles.block_n), int(tiles.block_k), str(kernel), plan.backend, how)

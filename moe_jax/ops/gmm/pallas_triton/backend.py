"""The `pallas_triton` backend: our Pallas kernels lowered through Triton, compiled on GPU and
interpreted elsewhere. It runs every kernel, every dtype and every shape, so `auto` ends on it.

Forward and input gradient (`gmm_nt`, `gmm_nn`): a `Launches` plan, either one candidate
(`config=None`: the static table `gmm_config`; a `GmmConfig`; a `TileConfig`, the row-tile family
with those tiles) or the on-device selector (`config="auto"`: the tuned table nearest to the shape,
`selector_table`; or a `SelectorTable`), which runs one gated launch per candidate of M's row,
chained through one output buffer, of which only the chosen one does any work. Weight gradient
(`tgmm`): a `TileConfig` (`config=None` or `"auto"`: `tgmm_config`).

Every configuration is fitted to the device's shared memory (`moe_jax.ops.gmm.tiles.fit_tiles`):
tuned ones fall back to the nearest tiles that fit, an explicit `GmmConfig`/`TileConfig` that does
not fit raises. With row ids the row-tile and weight-gradient kernels read `lhs` through them in
their loads; the group-major and split-K families gather the rows first.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax.numpy as jnp

from moe_jax.ops.gather import gather_rows
from moe_jax.ops.gmm.pallas_triton.candidates import CANDIDATES, GmmConfig, candidate_index, gmm_config, tgmm_config
from moe_jax.ops.gmm.pallas_triton.group_major import gmm_group_major_pallas
from moe_jax.ops.gmm.pallas_triton.row_tile import gmm_row_tile_pallas
from moe_jax.ops.gmm.pallas_triton.selector import SelectorTable, select, selector_table
from moe_jax.ops.gmm.pallas_triton.tile import Gate
from moe_jax.ops.gmm.pallas_triton.wgrad import tgmm_pallas
from moe_jax.ops.gmm.problem import Executed, GemmBackend, Plan, Problem, useful_rows
from moe_jax.ops.gmm.schedule import clamp_group_sizes, executed_at
from moe_jax.ops.gmm.tiles import TileConfig, fit_tiles, tile_name
from moe_jax.ops.platform import DeviceFacts, interpret

__all__ = ["BACKEND", "Launches", "PallasTriton"]


class Launches(NamedTuple):
    """A forward plan of the `pallas_triton` backend: the candidates it launches (their
    `CANDIDATES` names, None for a configuration outside the family, and their configurations,
    fitted to the device) and the selector table that picks one on the device (None: one launch)."""

    names: tuple[str | None, ...]
    configs: tuple[GmmConfig, ...]
    table: SelectorTable | None = None

    def __str__(self) -> str:
        picked = ", ".join(name or config.name for name, config in zip(self.names, self.configs))
        return f"selector {self.table.shape} over [{picked}]" if self.table is not None else picked


def _fitted(config: GmmConfig, problem: Problem, device: DeviceFacts, *, explicit: bool):
    """`(config with tiles that fit device, bytes, notes)` (`tiles.fit_tiles`)."""
    tiles, need, notes = fit_tiles(config.tiles, wgrad=False, dtype=problem.dtype, ieee_fp32=problem.ieee_fp32,
                                   device=device, explicit=explicit, what=config.name)
    return dataclasses.replace(config, tiles=tiles), need, notes


class PallasTriton(GemmBackend):
    name = "pallas_triton"
    fuses_gather = True

    def config_types(self, kernel: str) -> tuple[type, ...]:
        return (TileConfig,) if kernel == "tgmm" else (GmmConfig, TileConfig, SelectorTable)

    def configure(self, problem: Problem, config, device: DeviceFacts):
        p = problem
        if p.kernel == "tgmm":
            explicit = isinstance(config, TileConfig)
            tiles = config if explicit else tgmm_config(p.m, p.n, p.k, p.num_groups)
            fitted, need, notes = fit_tiles(tiles, wgrad=True, dtype=p.dtype, ieee_fp32=p.ieee_fp32, device=device,
                                            explicit=explicit, what=f"{tile_name(tiles)} (weight gradient)")
            return fitted, (need,), notes
        if isinstance(config, str) or isinstance(config, SelectorTable):  # "auto": the on-device selector
            table = config if isinstance(config, SelectorTable) else selector_table(p.n, p.k, p.num_groups,
                                                                                    device=device.kind)
            names = table.candidates_for(p.m)
            fitted = [_fitted(CANDIDATES[name], p, device, explicit=False) for name in names]
            return (Launches(names, tuple(f[0] for f in fitted), table), tuple(f[1] for f in fitted),
                    tuple(note for f in fitted for note in f[2]))
        if config is None:
            config, explicit = gmm_config(p.m, p.n, p.k, p.num_groups), False
        else:
            config, explicit = (GmmConfig("row_tile", config) if isinstance(config, TileConfig) else config), True
        index = candidate_index(config)
        fitted, need, notes = _fitted(config, p, device, explicit=explicit)
        return Launches((list(CANDIDATES)[index] if index >= 0 else None,), (fitted,)), (need,), notes

    def run(self, plan: Plan, lhs, rhs, group_sizes, row_ids):
        p = plan.problem
        if p.kernel == "tgmm":
            return tgmm_pallas(lhs, rhs, clamp_group_sizes(group_sizes, p.m), tiles=plan.config, out_dtype=p.out_dtype,
                               precision=p.precision, interpret=interpret(), row_ids=row_ids)
        common = dict(transpose_rhs=p.kernel == "gmm_nt", out_dtype=p.out_dtype, precision=p.precision,
                      interpret=interpret())
        packed = functools.cache(lambda: lhs if row_ids is None else gather_rows(lhs, row_ids))

        def launch(config: GmmConfig, **gated):
            # With row ids, the row-tile kernel gathers in its loads; the group-major one reads the
            # gathered rows (built once per call).
            if config.family in ("group_major", "split_k"):
                return gmm_group_major_pallas(packed(), rhs, group_sizes, splits=config.splits, tiles=config.tiles,
                                              **common, **gated)
            return gmm_row_tile_pallas(lhs, rhs, group_sizes, tiles=config.tiles, row_ids=row_ids, **common, **gated)

        launches: Launches = plan.config
        if launches.table is None or len(launches.configs) == 1:
            return launch(launches.configs[0])
        # One gated launch per candidate of this row, chained through one output buffer: the chosen
        # launch writes every element, the others return at once (no XLA conditional, which on GPU
        # copies its predicate to the host and waits for it).
        choice_1 = select(group_sizes, p.m, launches.table).branch.reshape(1)
        out = None
        for i, config in enumerate(launches.configs):
            out = launch(config, gate=Gate(choice_1, i), out_init=out)
        return out

    def executed(self, plan: Plan, group_sizes) -> Executed:
        p = plan.problem
        if p.kernel == "tgmm":
            return super().executed(plan, group_sizes)
        launches: Launches = plan.config
        if launches.table is not None:
            pick = select(group_sizes, p.m, launches.table)
            return Executed(pick.executed_rows, pick.features.useful_rows, pick.candidate)
        index = -1 if launches.names[0] is None else list(CANDIDATES).index(launches.names[0])
        return Executed(executed_at(group_sizes, p.m, launches.configs[0].tiles.block_m),
                        useful_rows(group_sizes, p.m), jnp.int32(index))


BACKEND = PallasTriton()


"""The `pallas_triton` backend of the grouped GEMM: its plan and launches (`backend`), candidates
and static tables (`candidates`), the on-device selector (`selector`) and its tuned tables
(`tables`), and one module per kernel family (`row_tile`, `group_major` with split-K, `wgrad`;
`tile` holds their shared in-kernel body)."""

from moe_jax.ops.gmm.pallas_triton.backend import BACKEND, Launches
from moe_jax.ops.gmm.pallas_triton.candidates import (CANDIDATES, FAMILIES, GmmConfig, candidate_index, gmm_config,
                                                      tgmm_config)
from moe_jax.ops.gmm.pallas_triton.selector import (Features, Selection, SelectorTable, histogram_features, select,
                                                    selector_table)

__all__ = ["BACKEND", "CANDIDATES", "FAMILIES", "Features", "GmmConfig", "Launches", "Selection", "SelectorTable",
           "candidate_index", "gmm_config", "histogram_features", "select", "selector_table", "tgmm_config"]

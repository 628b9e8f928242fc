"""The MoE layer's option groups: how its grouped GEMMs run (`GemmOptions`), its shared experts
(`SharedExperts`) and the experts' FP8 quantization (`Fp8Blockwise`). Expert parallelism
has its own group, `moe_jax.parallel.EPOptions`.

Each group is a frozen dataclass checked when it is built (a bad value is an error naming the
field and what it accepts), hashable, so a layer holding one stays a static part of its graph.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from jax import lax

from moe_jax.ops import FP8_INPUT_GRADIENTS, FP8_LINEAR_BACKENDS, BackendTable, resolve_backend
from moe_jax.validation import check_bool, check_int, is_int

__all__ = ["FP8_WEIGHTS", "GEMM_KERNELS", "ROW_GATHERS", "Fp8Blockwise", "GemmOptions", "SharedExperts"]

GEMM_KERNELS = ("auto", "static")
ROW_GATHERS = ("auto", "fused", "separate")
FP8_WEIGHTS = ("master", "stored")


@dataclasses.dataclass(frozen=True)
class GemmOptions:
    """How the routed experts' grouped GEMMs run (and the row gathers and EP send plan beside them).

    backend: `"auto"` (on GPU per kernel from `moe_jax.ops.H200_BACKENDS`; XLA elsewhere),
      `"pallas_triton"`, `"triton"` (official Triton through jax_triton, GPU only), `"mosaic_gpu"`
      (Pallas Mosaic GPU grouped GEMMs) or `"xla"`; the row gathers and EP's send plan use it too
      (on `pallas_triton` where the backend has no kernel of its own). A
      `moe_jax.ops.BackendTable` is `"auto"` with a per-kernel table of its own, e.g.
      `H200_BACKENDS.replace({("gmm_nn", "prefill"): ("mosaic_gpu", "triton", "pallas_triton")})`
      to run the input gradient on Mosaic GPU where it takes the shapes.
    kernel: how the Pallas backend picks each grouped GEMM's kernel: `"auto"` (default), the
      per-device tuned selector (`moe_jax.ops.gmm.pallas_triton.selector`: from the packed rows and, where the
      table says it pays, the routing histogram, on device); `"static"`, the shape table
      (`moe_jax.ops.gmm_config`; reproducible across histograms). `MoEStats.kernel_counts_C` says
      which ran.
    row_gather: how the routed rows reach the gate/up GEMM: `"fused"`, the GEMM reads each row
      through the packing's ids inside its kernel (no packed copy in memory;
      `moe_jax.ops.grouped_linear(rows=...)`): the token rows off expert parallelism, the receive
      buffer under it (`ep_moe(fuse_regroup=True)`; the pairwise transport's two sources are
      still regrouped first); `"separate"`, a row gather writes the packed rows first; `"auto"`
      (default), fused on the backends where that measured faster (`moe_jax.ops.AUTO_FUSED_GATHER`,
      none on the H200 yet; always for FP8 experts, which quantize each token row once and
      gather its e4m3 bytes). Equal results.
    precision: a `jax.lax.Precision` for the expert, shared-expert and latent GEMMs (default None:
      HIGHEST for fp32 operands).
    fused_gate_up: run gate and up as one grouped GEMM of 2F columns. This is also the parameter
      layout: the layer then holds `w_gate_up [E, 2F, Din]` (gate rows first; under expert tensor
      parallelism of size n, in n per-shard blocks, `moe_jax.experts.fuse_gate_up(..., shards=n)`)
      instead of `w_gate`/`w_up [E, F, Din]` (`moe_jax.convert` reads and writes either).
    quantization: `Fp8Blockwise()`: the routed and shared experts' projections in DeepSeek-V3's
      blockwise FP8 (master weights stay in `param_dtype`, quantized in each call;
      `Fp8Blockwise(weights="stored")`: the routed experts' e4m3 weights and block scales held as
      they are, for inference; docs/fp8.md); needs a backend
      of `moe_jax.ops.FP8_LINEAR_BACKENDS` and `fused_gate_up=False`. None (default): the compute
      dtype.
    """

    backend: str | BackendTable = "auto"
    kernel: str = "auto"
    row_gather: str = "auto"
    precision: lax.Precision | None = None
    fused_gate_up: bool = False
    quantization: Fp8Blockwise | None = None

    def __post_init__(self):
        if isinstance(self.backend, Mapping) and not isinstance(self.backend, BackendTable):
            raise TypeError(
                "GemmOptions.backend got a plain mapping; wrap a per-kernel table as "
                "moe_jax.ops.BackendTable.of({(kernel, shape class): (backend, ...), ...}), or pass a backend name."
            )
        if not isinstance(self.backend, (str, BackendTable)):
            raise TypeError(f"GemmOptions.backend must be a backend name or a moe_jax.ops.BackendTable; got "
                            f"{type(self.backend).__name__} {self.backend!r}.")
        resolve_backend(self.backend)  # ValueError naming the choices for an unknown name
        if self.kernel not in GEMM_KERNELS:
            raise ValueError(f"GemmOptions.kernel={self.kernel!r}: use one of {GEMM_KERNELS} ('auto': the tuned "
                             "on-device selector picks each GEMM's kernel from the routing histogram; 'static': "
                             "from the shape).")
        if self.row_gather not in ROW_GATHERS:
            raise ValueError(f"GemmOptions.row_gather={self.row_gather!r}: use one of {ROW_GATHERS} ('fused': the "
                             "gate/up GEMM reads token rows through the packing's ids; 'separate': pack the rows "
                             "first).")
        if self.precision is not None and not isinstance(self.precision, lax.Precision):
            raise TypeError(f"GemmOptions.precision={self.precision!r}: use None or a jax.lax.Precision (e.g. "
                            "jax.lax.Precision.HIGHEST).")
        object.__setattr__(self, "fused_gate_up", check_bool("GemmOptions.fused_gate_up", self.fused_gate_up))
        if self.quantization is not None:
            self._check_quantization()

    def _check_quantization(self) -> None:
        if not isinstance(self.quantization, Fp8Blockwise):
            raise TypeError(f"GemmOptions.quantization must be None or a moe_jax.layers.Fp8Blockwise(); got "
                            f"{type(self.quantization).__name__} {self.quantization!r}.")
        if isinstance(self.backend, BackendTable):
            raise ValueError(f"GemmOptions(quantization=Fp8Blockwise()) runs the FP8 recipe's grouped GEMMs, which "
                             f"backend={self.backend!r} (16-bit backends per kernel) does not run; use one of "
                             f"{FP8_LINEAR_BACKENDS} ('auto': the FP8 kernels where they run, else the dequantized "
                             "reference path).")
        if self.fused_gate_up:
            raise ValueError(f"GemmOptions(quantization={self.quantization!r}) needs separate gate and up weights "
                             "(each is quantized in its own 128 x 128 blocks); use fused_gate_up=False.")


@dataclasses.dataclass(frozen=True)
class SharedExperts:
    """Shared experts that see every real token (DeepSeekMoE; Qwen2-MoE's gated one).

    count: how many shared experts (>= 1); they are merged into one SwiGLU of width `d_ff`.
    d_ff: that SwiGLU's hidden width (default: the routed experts' `d_ff` times `count`).
    gate: scale the shared output per token by `sigmoid(x W_sg^T)`, `w_shared_gate [1, D]`
      (Qwen2-MoE's `shared_expert_gate`).
    """

    count: int = 1
    d_ff: int | None = None
    gate: bool = False

    def __post_init__(self):
        if is_int(self.count) and self.count == 0:
            raise ValueError("SharedExperts.count=0: a layer without shared experts takes shared_experts=None.")
        object.__setattr__(self, "count", check_int("SharedExperts.count", self.count))
        if self.d_ff is not None:
            object.__setattr__(self, "d_ff", check_int("SharedExperts.d_ff", self.d_ff))
        object.__setattr__(self, "gate", check_bool("SharedExperts.gate", self.gate))

    def width(self, d_ff: int) -> int:
        """The merged SwiGLU's hidden width for routed experts of width `d_ff`."""
        return self.d_ff if self.d_ff is not None else d_ff * self.count


@dataclasses.dataclass(frozen=True)
class Fp8Blockwise:
    """The experts' gate/up and down projections in DeepSeek-V3's blockwise FP8
    (arXiv:2412.19437, section 3.3; `moe_jax.ops.fp8_grouped_linear`): rows quantized per 1 x 128
    tile, the master weights (in `param_dtype`, trainable as ever) quantized per 128 x 128 block in
    each call, gradients to them by the straight-through estimator. The shared experts follow the
    same recipe (`moe_jax.layers.dense.swiglu_fp8`, one group of every token), from master or
    stored weights alike. The router, combine, shared-expert gate
    and latent projections are unchanged. On `auto` its products run the FP8 kernel where
    the GPU has e4m3 tensor cores (its forward faster than bf16's), else the reference path
    (dequantized fp32 grouped GEMMs, slower than bf16); docs/fp8.md.

    weights: where the weights of the FP8 GEMMs come from.
      `"master"` (default): the layer holds master weights `w_gate`, `w_up`, `w_down` as
      `nnx.Param`s in `param_dtype`, quantized from their own values (no compute-dtype cast
      first, as `stored_fp8` quantizes them) in each call and trained by the straight-through
      estimator above.
      `"stored"` (inference): the layer holds the quantized weights themselves, e4m3 `w_gate`,
      `w_up` `[E, F, Din]`, `w_down` `[E, Din, F]` with fp32 block scales `w_gate_scale`,
      `w_up_scale` `[E, ceil(F/128), ceil(Din/128)]`, `w_down_scale` `[E, ceil(Din/128),
      ceil(F/128)]` (`moe_jax.layers.Fp8Stored` variables, not `nnx.Param`: optimizers never see
      them; the shared experts' alike, `moe_jax.layers.Fp8SwiGLU`), used in every call as they
      are: no per-call quantization, the layout of a Hugging Face
      FP8 checkpoint's `weight`/`weight_scale_inv` pairs (`moe_jax.convert` reads them bit for bit).
      Input gradients flow through them (`dx`, e.g. for adapters); they have no gradient of their
      own. `moe_jax.layers.stored_fp8(moe)` quantizes a layer's master weights once into them.

    input_gradient: how the experts' input gradients are computed (`moe_jax.ops.fp8_grouped_linear`).
      `"fp8"` (default): the recipe's FP8 products; the backward keeps an e4m3 copy of each master
      weight (half their bytes in bf16), which the 16-bit layer does not have.
      `"master"`: from the master weights on the 16-bit kernels; no e4m3 weights are kept, so the
      step's peak memory holds no weight bytes beyond the 16-bit layer's, for 16-bit products in
      the input gradient (docs/fp8.md, "Memory"). Master weights only.

    Needs `GemmOptions(backend=...)` of `moe_jax.ops.FP8_LINEAR_BACKENDS` and separate gate and up
    weights (`fused_gate_up=False`). With the row gather fused (`GemmOptions.row_gather`), each
    token row is quantized once and the FP8 kernel reads it through the packing's ids.
    """

    weights: str = "master"
    input_gradient: str = "fp8"

    def __post_init__(self):
        if self.weights not in FP8_WEIGHTS:
            raise ValueError(f"Fp8Blockwise.weights={self.weights!r}: use one of {FP8_WEIGHTS} ('master': trainable "
                             "weights in param_dtype quantized in each call; 'stored': e4m3 weights with fp32 block "
                             "scales, frozen, e.g. from an FP8 checkpoint).")
        if self.input_gradient not in FP8_INPUT_GRADIENTS:
            raise ValueError(f"Fp8Blockwise.input_gradient={self.input_gradient!r}: use one of {FP8_INPUT_GRADIENTS} "
                             "('fp8': the recipe's FP8 products; 'master': from the master weights in 16 bits, no "
                             "e4m3 copy kept for the backward).")
        if self.stored and self.input_gradient != "fp8":
            raise ValueError(f"Fp8Blockwise(weights='stored', input_gradient={self.input_gradient!r}): stored FP8 "
                             "weights have no master weights; use input_gradient='fp8'.")

    @property
    def stored(self) -> bool:
        """True when the layer holds e4m3 weights and block scales (`weights="stored"`)."""
        return self.weights == "stored"

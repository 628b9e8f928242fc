"""The byte-level decoder-only transformer whose FFNs are `moe_jax.layers.MoE` layers.

`MoETransformer(cfg)` maps `tokens_BS int32 -> (logits_BSV float32, stats)`; `ModelConfig`
holds the architecture and execution settings (`ModelConfig.from_args` reads them from the
command line's namespace).
"""

from __future__ import annotations

import argparse
import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from moe_jax import routing
from moe_jax.layers import Fp8Blockwise, GemmOptions, MoE, SharedExperts
from moe_jax.ops import BACKENDS as GEMM_BACKENDS
from moe_jax.parallel import EPOptions

VOCAB_SIZE = 256  # bytes

# The choices of --router, --backend and --dtype.
ROUTERS = ("selected_softmax", "softmax_topk", "sigmoid_grouped")
BACKENDS = ("auto", *GEMM_BACKENDS)
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def make_router(name: str, top_k: int, n_group: int, topk_group: int):
    """The `moe_jax.routing` router for a `--router` choice."""
    if name == "selected_softmax":
        return routing.SelectedSoftmax(top_k)
    if name == "softmax_topk":
        return routing.SoftmaxTopK(top_k, renormalize=True)
    if name == "sigmoid_grouped":
        return routing.SigmoidGroupedTopK(top_k, n_group=n_group, topk_group=topk_group)
    raise ValueError(f"router={name!r}: choose one of {', '.join(ROUTERS)}")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture and execution settings of `MoETransformer` (see the CLI help for each)."""

    seq_len: int
    d_model: int
    num_layers: int
    num_heads: int
    num_experts: int
    top_k: int
    d_ff: int
    num_shared_experts: int = 0
    latent_dim: int | None = None
    router: str = "softmax_topk"
    n_group: int = 1
    topk_group: int = 1
    tied_head: bool = True
    dtype: str = "float32"
    backend: str = "auto"
    fp8: bool = False
    ep_strategy: str = "padded"
    capacity_factor: float | None = None
    ep_chunks: int = 1

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ModelConfig:
        return cls(
            seq_len=args.seq, d_model=args.d_model, num_layers=args.layers, num_heads=args.heads,
            num_experts=args.experts, top_k=args.top_k, d_ff=args.d_ff,
            num_shared_experts=args.shared_experts, latent_dim=args.latent_dim, router=args.router,
            n_group=args.n_group, topk_group=args.topk_group, tied_head=args.tied_head,
            dtype=args.dtype, backend=args.backend, fp8=args.fp8, ep_strategy=args.ep_strategy,
            capacity_factor=args.capacity_factor, ep_chunks=args.ep_chunks,
        )


class CausalSelfAttention(nnx.Module):
    """Multi-head causal self-attention: `[B, S, D] -> [B, S, D]`."""

    def __init__(self, d_model: int, num_heads: int, *, dtype, rngs: nnx.Rngs):
        self.num_heads = num_heads
        self.qkv = nnx.Linear(d_model, 3 * d_model, use_bias=False, dtype=dtype, rngs=rngs)
        self.out = nnx.Linear(d_model, d_model, use_bias=False, dtype=dtype, rngs=rngs)

    def __call__(self, x_BSD: jax.Array) -> jax.Array:
        b, s, d = x_BSD.shape
        qkv_BS3HDh = self.qkv(x_BSD).reshape(b, s, 3, self.num_heads, d // self.num_heads)
        q, k, v = (qkv_BS3HDh[:, :, i] for i in range(3))
        y_BSHDh = jax.nn.dot_product_attention(q, k, v, is_causal=True)
        return self.out(y_BSHDh.reshape(b, s, d))


class Block(nnx.Module):
    """Pre-norm block: `x + attn(norm(x))`, then `x + moe(norm(x))`; returns `(x, MoEStats)`."""

    def __init__(self, cfg: ModelConfig, *, mesh, placement=None, rngs: nnx.Rngs):
        dtype = DTYPES[cfg.dtype]
        self.attn_norm = nnx.RMSNorm(cfg.d_model, dtype=dtype, rngs=rngs)
        self.attn = CausalSelfAttention(cfg.d_model, cfg.num_heads, dtype=dtype, rngs=rngs)
        self.ffn_norm = nnx.RMSNorm(cfg.d_model, dtype=dtype, rngs=rngs)
        ep_kwargs = {}
        if mesh is not None:
            expert_parallel = EPOptions(strategy=cfg.ep_strategy, capacity_factor=cfg.capacity_factor,
                                        chunks=cfg.ep_chunks, placement=placement)
            ep_kwargs = dict(mesh=mesh, expert_parallel=expert_parallel)
        self.moe = MoE(
            cfg.d_model, cfg.d_ff, cfg.num_experts, cfg.top_k,
            router=make_router(cfg.router, cfg.top_k, cfg.n_group, cfg.topk_group),
            shared_experts=SharedExperts(cfg.num_shared_experts) if cfg.num_shared_experts else None,
            latent_dim=cfg.latent_dim, dtype=dtype, rngs=rngs, **ep_kwargs,
            gemm=GemmOptions(backend=cfg.backend, quantization=Fp8Blockwise() if cfg.fp8 else None),
        )

    def __call__(self, x_BSD: jax.Array, return_routing: bool = False):
        x_BSD = x_BSD + self.attn(self.attn_norm(x_BSD))
        y_BSD, stats, *routing = self.moe(self.ffn_norm(x_BSD), return_routing=return_routing)
        return (x_BSD + y_BSD, stats, *routing)


class MoETransformer(nnx.Module):
    """Byte-level decoder-only LM: `tokens_BS int32 -> (logits_BSV float32, stats)`.

    `stats` is the layers' `MoEStats` stacked along a leading layer axis L (`counts_E` becomes
    `[L, E]`, every scalar field `[L]`). `placements`: one `moe_jax.parallel.placement.Placement`
    per layer (needs `mesh`), or None for the contiguous expert layout.
    """

    def __init__(self, cfg: ModelConfig, *, mesh=None, placements=None, rngs: nnx.Rngs):
        dtype = DTYPES[cfg.dtype]
        self.embed = nnx.Embed(VOCAB_SIZE, cfg.d_model, dtype=dtype, rngs=rngs)
        self.pos_embed = nnx.Embed(cfg.seq_len, cfg.d_model, dtype=dtype, rngs=rngs)
        placements = placements or (None,) * cfg.num_layers
        self.blocks = nnx.List([Block(cfg, mesh=mesh, placement=p, rngs=rngs) for p in placements])
        self.final_norm = nnx.RMSNorm(cfg.d_model, dtype=dtype, rngs=rngs)
        self.head = None if cfg.tied_head else nnx.Linear(cfg.d_model, VOCAB_SIZE, use_bias=False, dtype=dtype, rngs=rngs)

    def __call__(self, tokens_BS: jax.Array, return_routing: bool = False):
        """`(logits_BSV, stats)`, and with `return_routing` a third item: each layer's
        `moe_jax.routing.Routing` over the B*S tokens (for routing traces)."""
        x_BSD = self.embed(tokens_BS) + self.pos_embed(jnp.arange(tokens_BS.shape[1]))
        layer_stats, routings = [], []
        for block in self.blocks:
            x_BSD, stats, *routing = block(x_BSD, return_routing)
            layer_stats.append(stats)
            routings += routing
        x_BSD = self.final_norm(x_BSD)
        logits_BSV = self.embed.attend(x_BSD) if self.head is None else self.head(x_BSD)
        stacked = jax.tree.map(lambda *leaves: jnp.stack(leaves), *layer_stats)
        return (logits_BSV.astype(jnp.float32), stacked) + ((routings,) if return_routing else ())

"""Train a small byte-level decoder-only transformer whose FFNs are `moe_jax.layers.MoE` layers.

    PYTHONPATH=. python examples/train_moe.py                      # CPU: a few minutes on 2 cores
    PYTHONPATH=. python examples/train_moe.py --data my.txt --steps 2000 --dtype bfloat16   # GPU
    PYTHONPATH=. python examples/train_moe.py --host-devices 2 --ep 2   # expert parallel on CPU
    PYTHONPATH=. python examples/train_moe.py --resume             # continue the run in --out

The default corpus is text that ships with Python: a fixed, sorted list of standard-library
sources read from the running interpreter's stdlib directory, as bytes (vocabulary 256). The
last `--val-fraction` of the bytes is held out for the validation loss.

Each step is one `nnx.jit`-compiled function: forward, cross-entropy plus the balancing terms,
backward, AdamW update and, for `--balance loss_free`, the selection-bias update from the step's
expert counts (after the gradient, so the bias is feedback and never differentiated). The run
writes into `--out`: `metrics.json` (per-step loss and per-layer expert statistics, validation
losses), `train_moe.png` (loss curve and per-expert load over training), `config.json` and
orbax checkpoints (model state including the selection biases, optimizer state and step) under
`checkpoints/`.

Parallelism: `--ep N` builds a `("data", "ep")` mesh over all devices (`moe_jax.parallel.
make_mesh`), hands it to every MoE layer (experts split over `ep`, tokens exchanged inside
`shard_map`) and shards the batch over `activation_spec()`; the rest of the model is replicated and
partitioned by XLA. `--distributed` calls `jax.distributed.initialize()` first, for multi-host
runs (every process runs this same command; only process 0 prints and writes files other than
checkpoints). `--host-devices N` fakes N CPU devices so `--ep` can be tried on a laptop.

Legend (shape suffixes): B batch (sequences), S sequence length, D model width, V vocabulary (256),
H attention heads, Dh head width, L MoE layers, E experts.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import sys
import sysconfig
import time
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx
from tqdm.auto import tqdm

from moe_jax import routing
from moe_jax.layers import MoE, MoEStats
from moe_jax.ops import BACKENDS as GEMM_BACKENDS
from moe_jax.ops import resolve_backend
from moe_jax.parallel import STRATEGIES as EP_STRATEGIES
from moe_jax.parallel import activation_spec, make_mesh

VOCAB_SIZE = 256  # bytes

# Standard-library modules that make up the default corpus (about 1 MB of Python). Paths are
# relative to the stdlib directory; files a given Python version lacks are skipped.
DEFAULT_CORPUS_FILES = tuple(
    sorted(
        (
            "argparse.py",
            "ast.py",
            "calendar.py",
            "collections/__init__.py",
            "dataclasses.py",
            "difflib.py",
            "enum.py",
            "fractions.py",
            "functools.py",
            "heapq.py",
            "inspect.py",
            "json/decoder.py",
            "json/encoder.py",
            "random.py",
            "shutil.py",
            "statistics.py",
            "string.py",
            "textwrap.py",
            "threading.py",
            "typing.py",
        )
    )
)

ROUTERS = ("selected_softmax", "softmax_topk", "sigmoid_grouped")
BALANCE_METHODS = ("aux", "seq_aux", "loss_free", "none")
BACKENDS = ("auto", *GEMM_BACKENDS)
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}

# Architecture fields a checkpoint must agree with on --resume.
_ARCH_FIELDS = (
    "seq", "d_model", "layers", "heads", "experts", "top_k", "d_ff", "shared_experts",
    "latent_dim", "router", "n_group", "topk_group", "tied_head",
)


# ----------------------------------------------------------------------------------- CLI


def _number_type(convert: type, *, positive: bool):
    """An argparse `type` for a finite `convert(text)` (`int` or `float`) >= 0, or > 0 if `positive`."""
    noun, qualifier = ("an integer", "") if convert is int else ("a number", "a finite number ")

    def parse(text: str):
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {noun}") from None
        if not 0 <= value < math.inf:
            raise argparse.ArgumentTypeError(f"{value} must be {qualifier}>= 0")
        if positive and value == 0:
            raise argparse.ArgumentTypeError(f"{value} must be {'>= 1' if convert is int else '> 0'}")
        return value

    return parse


_nonnegative_int = _number_type(int, positive=False)
_positive_int = _number_type(int, positive=True)
_nonnegative_float = _number_type(float, positive=False)
_positive_float = _number_type(float, positive=True)


def _fraction(text: str) -> float:
    value = _nonnegative_float(text)
    if not 0.0 < value < 1.0:
        raise argparse.ArgumentTypeError(f"{value} must lie strictly between 0 and 1")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="train_moe.py",
        description="Train a byte-level MoE transformer (moe_jax MoE FFNs, optax AdamW).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        epilog="Writes OUT/metrics.json, OUT/train_moe.png, OUT/config.json and orbax checkpoints in "
        "OUT/checkpoints/.",
    )
    g = p.add_argument_group("training")
    g.add_argument("--steps", type=_positive_int, default=300, help="total optimizer steps (resume continues up to this)")
    g.add_argument("--batch", type=_positive_int, default=16, help="sequences per step (global)")
    g.add_argument("--seq", type=_positive_int, default=128, help="tokens (bytes) per sequence")
    g.add_argument("--lr", type=_positive_float, default=3e-3, help="peak learning rate (warmup, then cosine decay)")
    g.add_argument("--warmup", type=_nonnegative_int, default=20, help="linear warmup steps")
    g.add_argument("--weight-decay", type=_nonnegative_float, default=0.1, help="AdamW decay of matrices")
    g.add_argument("--seed", type=_nonnegative_int, default=0, help="seed of the parameters and of the batch order")

    g = p.add_argument_group("model")
    g.add_argument("--d-model", type=_positive_int, default=128, help="model width D")
    g.add_argument("--layers", type=_positive_int, default=2, help="transformer blocks (each with an MoE FFN)")
    g.add_argument("--heads", type=_positive_int, default=4, help="attention heads (must divide --d-model)")
    g.add_argument("--experts", type=_positive_int, default=8, help="routed experts E per layer")
    g.add_argument("--top-k", type=_positive_int, default=2, help="experts per token K")
    g.add_argument("--d-ff", type=_positive_int, default=256, help="hidden width F of each routed expert")
    g.add_argument("--shared-experts", type=_nonnegative_int, default=0, help="shared (always-on) SwiGLU experts of width --d-ff")
    g.add_argument("--latent-dim", type=_positive_int, default=None, help="LatentMoE: routed experts work at this width")
    g.add_argument("--tied-head", action=argparse.BooleanOptionalAction, default=True,
                   help="output head shares the byte embedding")
    g.add_argument("--dtype", choices=tuple(DTYPES), default="float32", help="compute dtype (params stay float32)")

    g = p.add_argument_group("routing and balancing")
    g.add_argument("--router", choices=ROUTERS, default="softmax_topk",
                   help="selected_softmax: Mixtral; softmax_topk: Qwen3-MoE (renormalised); "
                        "sigmoid_grouped: DeepSeek-V3 group-limited")
    g.add_argument("--n-group", type=_positive_int, default=1, help="sigmoid_grouped: expert groups")
    g.add_argument("--topk-group", type=_positive_int, default=1, help="sigmoid_grouped: groups kept per token")
    g.add_argument("--balance", choices=BALANCE_METHODS, default="aux",
                   help="aux: Switch/Megatron loss; seq_aux: per-sequence loss; loss_free: selection-bias "
                        "feedback; none")
    g.add_argument("--aux-coef", type=_nonnegative_float, default=1e-2, help="weight of the aux/seq_aux loss per layer")
    g.add_argument("--z-coef", type=_nonnegative_float, default=1e-3, help="weight of the router z-loss per layer")
    g.add_argument("--bias-rate", type=_nonnegative_float, default=1e-3, help="loss_free: bias step size per step")

    g = p.add_argument_group("execution")
    g.add_argument("--backend", choices=BACKENDS, default="auto",
                   help="grouped-GEMM backend (auto: Pallas kernels on GPU, XLA ragged_dot elsewhere)")
    g.add_argument("--ep", type=_positive_int, default=None,
                   help="expert-parallel size: mesh ('data', 'ep') over all devices; batch is split over all")
    g.add_argument("--ep-strategy", choices=EP_STRATEGIES, default="padded",
                   help="EP exchange (ragged needs a GPU)")
    g.add_argument("--capacity-factor", type=_positive_float, default=None,
                   help="EP rows per rank pair as a multiple of the balanced load; unset: dropless")
    g.add_argument("--host-devices", type=_positive_int, default=None,
                   help="number of CPU devices to fake (sets jax_num_cpu_devices before JAX starts)")
    g.add_argument("--distributed", action="store_true",
                   help="call jax.distributed.initialize() first (multi-host; needs --ep); the three "
                        "options below default to the cluster's auto-detection (SLURM, Open MPI, ...)")
    g.add_argument("--coordinator", default=None, help="--distributed: coordinator host:port of process 0")
    g.add_argument("--num-processes", type=_positive_int, default=None, help="--distributed: processes in the job")
    g.add_argument("--process-id", type=_nonnegative_int, default=None, help="--distributed: this process's index")

    g = p.add_argument_group("data and output")
    g.add_argument("--data", type=Path, default=None, help="train on this text file instead of the stdlib corpus")
    g.add_argument("--val-fraction", type=_fraction, default=0.1, help="tail of the corpus held out for validation")
    g.add_argument("--out", type=Path, default=Path("runs/train_moe"), help="output directory")
    g.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --out")
    g.add_argument("--log-every", type=_positive_int, default=25, help="steps between log lines")
    g.add_argument("--eval-every", type=_positive_int, default=100, help="steps between validation losses")
    g.add_argument("--eval-batches", type=_positive_int, default=4, help="batches per validation loss")
    g.add_argument("--ckpt-every", type=_positive_int, default=100, help="steps between checkpoints")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    """Parse and cross-check the command line; inconsistent settings exit through `parser.error`."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.top_k > args.experts:
        parser.error(f"--top-k {args.top_k} exceeds --experts {args.experts}")
    if args.d_model % args.heads:
        parser.error(f"--heads {args.heads} must divide --d-model {args.d_model}")
    if args.router != "sigmoid_grouped" and (args.n_group, args.topk_group) != (1, 1):
        parser.error("--n-group/--topk-group only apply to --router sigmoid_grouped")
    if args.router == "sigmoid_grouped":
        if args.topk_group > args.n_group:
            parser.error(f"--topk-group {args.topk_group} exceeds --n-group {args.n_group}")
        if args.experts % args.n_group:
            parser.error(f"--n-group {args.n_group} must divide --experts {args.experts}")
        kept = args.topk_group * (args.experts // args.n_group)
        if args.top_k > kept:
            parser.error(
                f"--top-k {args.top_k} exceeds the {kept} experts of the --topk-group {args.topk_group} "
                f"kept groups of {args.experts // args.n_group}"
            )
    if args.ep is not None and args.experts % args.ep:
        parser.error(f"--ep {args.ep} must divide --experts {args.experts}")
    if args.ep is None:
        if args.capacity_factor is not None:
            parser.error("--capacity-factor needs --ep (it sizes the EP exchange buffers)")
        if args.ep_strategy != "padded":
            parser.error("--ep-strategy needs --ep")
        if args.distributed:
            parser.error("--distributed needs --ep (use --ep 1 for pure data parallelism)")
    if not args.distributed and (args.coordinator, args.num_processes, args.process_id) != (None, None, None):
        parser.error("--coordinator/--num-processes/--process-id need --distributed")
    if args.data is not None and not args.data.is_file():
        parser.error(f"--data {args.data}: no such file")
    return args


# ----------------------------------------------------------------------------------- data


def default_corpus_files() -> list[Path]:
    """The stdlib sources of the default corpus that exist for the running interpreter, sorted."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return [stdlib / name for name in DEFAULT_CORPUS_FILES if (stdlib / name).is_file()]


def load_corpus(path: Path | None) -> np.ndarray:
    """Bytes of `path` (or of the default stdlib corpus) as a uint8 array."""
    if path is not None:
        return np.frombuffer(path.read_bytes(), dtype=np.uint8)
    files = default_corpus_files()
    if not files:
        raise FileNotFoundError(
            f"none of the default corpus files were found under {sysconfig.get_paths()['stdlib']}; "
            "pass --data PATH to train on your own text."
        )
    return np.frombuffer(b"".join(f.read_bytes() for f in files), dtype=np.uint8)


class Split(NamedTuple):
    train: np.ndarray  # uint8 [N_train]
    val: np.ndarray  # uint8 [N_val]


def split_corpus(data: np.ndarray, val_fraction: float, seq: int) -> Split:
    """Hold out the tail of `data`; both parts must fit at least one sequence of `seq + 1` bytes."""
    n_val = int(len(data) * val_fraction)
    split = Split(data[: len(data) - n_val], data[len(data) - n_val :])
    if min(len(split.train), len(split.val)) < seq + 1:
        raise ValueError(
            f"corpus of {len(data)} bytes split {len(split.train)}/{len(split.val)} (train/val) is too "
            f"small for --seq {seq}: each part needs >= {seq + 1} bytes; use a larger --data or a "
            "smaller --seq."
        )
    return split


def sample_batch(tokens: np.ndarray, batch: int, seq: int, key: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """`batch` random windows of `tokens`, chosen by `np.random.default_rng(key)`.

    Returns `(inputs_BS, targets_BS)` int32, targets shifted by one byte. The windows depend only
    on `key`, so a resumed run sees the same batches as an uninterrupted one.
    """
    rng = np.random.default_rng(key)
    starts_B = rng.integers(0, len(tokens) - seq, size=batch)
    windows = tokens[starts_B[:, None] + np.arange(seq + 1)].astype(np.int32)
    return windows[:, :-1], windows[:, 1:]


def train_batch(tokens, args, step: int):
    return sample_batch(tokens, args.batch, args.seq, (args.seed, 0, step))


def val_batches(tokens, args):
    return [sample_batch(tokens, args.batch, args.seq, (args.seed, 1, i)) for i in range(args.eval_batches)]


# ----------------------------------------------------------------------------------- model


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
    ep_strategy: str = "padded"
    capacity_factor: float | None = None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ModelConfig:
        return cls(
            seq_len=args.seq, d_model=args.d_model, num_layers=args.layers, num_heads=args.heads,
            num_experts=args.experts, top_k=args.top_k, d_ff=args.d_ff,
            num_shared_experts=args.shared_experts, latent_dim=args.latent_dim, router=args.router,
            n_group=args.n_group, topk_group=args.topk_group, tied_head=args.tied_head,
            dtype=args.dtype, backend=args.backend, ep_strategy=args.ep_strategy,
            capacity_factor=args.capacity_factor,
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

    def __init__(self, cfg: ModelConfig, *, mesh, rngs: nnx.Rngs):
        dtype = DTYPES[cfg.dtype]
        self.attn_norm = nnx.RMSNorm(cfg.d_model, dtype=dtype, rngs=rngs)
        self.attn = CausalSelfAttention(cfg.d_model, cfg.num_heads, dtype=dtype, rngs=rngs)
        self.ffn_norm = nnx.RMSNorm(cfg.d_model, dtype=dtype, rngs=rngs)
        ep_kwargs = {}
        if mesh is not None:
            ep_kwargs = dict(mesh=mesh, ep_strategy=cfg.ep_strategy, capacity_factor=cfg.capacity_factor)
        self.moe = MoE(
            cfg.d_model, cfg.d_ff, cfg.num_experts, cfg.top_k,
            router=make_router(cfg.router, cfg.top_k, cfg.n_group, cfg.topk_group),
            num_shared_experts=cfg.num_shared_experts, latent_dim=cfg.latent_dim,
            dtype=dtype, backend=cfg.backend, rngs=rngs, **ep_kwargs,
        )

    def __call__(self, x_BSD: jax.Array):
        x_BSD = x_BSD + self.attn(self.attn_norm(x_BSD))
        y_BSD, stats = self.moe(self.ffn_norm(x_BSD))
        return x_BSD + y_BSD, stats


class MoETransformer(nnx.Module):
    """Byte-level decoder-only LM: `tokens_BS int32 -> (logits_BSV float32, stats)`.

    `stats` is the layers' `MoEStats` stacked along a leading layer axis L (`counts_E` becomes
    `[L, E]`, every scalar field `[L]`).
    """

    def __init__(self, cfg: ModelConfig, *, mesh=None, rngs: nnx.Rngs):
        dtype = DTYPES[cfg.dtype]
        self.embed = nnx.Embed(VOCAB_SIZE, cfg.d_model, dtype=dtype, rngs=rngs)
        self.pos_embed = nnx.Embed(cfg.seq_len, cfg.d_model, dtype=dtype, rngs=rngs)
        self.blocks = nnx.List([Block(cfg, mesh=mesh, rngs=rngs) for _ in range(cfg.num_layers)])
        self.final_norm = nnx.RMSNorm(cfg.d_model, dtype=dtype, rngs=rngs)
        self.head = None if cfg.tied_head else nnx.Linear(cfg.d_model, VOCAB_SIZE, use_bias=False, dtype=dtype, rngs=rngs)

    def __call__(self, tokens_BS: jax.Array):
        x_BSD = self.embed(tokens_BS) + self.pos_embed(jnp.arange(tokens_BS.shape[1]))
        layer_stats = []
        for block in self.blocks:
            x_BSD, stats = block(x_BSD)
            layer_stats.append(stats)
        x_BSD = self.final_norm(x_BSD)
        logits_BSV = self.embed.attend(x_BSD) if self.head is None else self.head(x_BSD)
        stacked = jax.tree.map(lambda *leaves: jnp.stack(leaves), *layer_stats)
        return logits_BSV.astype(jnp.float32), stacked


# ----------------------------------------------------------------------------------- steps


class StepMetrics(NamedTuple):
    """What one training step reports (device arrays; L layers, E experts)."""

    loss: jax.Array  # total objective
    ce: jax.Array  # next-byte cross-entropy (nats)
    grad_norm: jax.Array
    lr: jax.Array
    stats: MoEStats  # per layer, stacked: counts_E [L, E], scalars [L] (all logged whatever --balance is)


def make_schedule(args) -> optax.Schedule:
    warmup = min(args.warmup, args.steps)
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=args.lr, warmup_steps=warmup,
        decay_steps=max(args.steps, warmup + 1), end_value=args.lr * 0.1,
    )


def make_optimizer(model: MoETransformer, args) -> nnx.Optimizer:
    """AdamW (decay on matrices only) after global-norm clipping, on the model's `nnx.Param`s.

    The selection biases are `SelectionBias` variables, not `Param`s, so the optimizer never
    touches them.
    """
    decay_mask = lambda params: jax.tree.map(lambda p: p.ndim > 1, params)  # noqa: E731
    tx = optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(make_schedule(args), b1=0.9, b2=0.95, weight_decay=args.weight_decay, mask=decay_mask),
    )
    return nnx.Optimizer(model, tx, wrt=nnx.Param)


def cross_entropy(logits_BSV: jax.Array, targets_BS: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(logits_BSV, targets_BS).mean()


def make_train_step(args):
    """The jitted step `(model, optimizer, inputs_BS, targets_BS) -> StepMetrics` (updates in place)."""
    schedule = make_schedule(args)
    balance, aux_coef, z_coef, bias_rate = args.balance, args.aux_coef, args.z_coef, args.bias_rate

    def loss_fn(model, inputs_BS, targets_BS):
        logits_BSV, stats = model(inputs_BS)
        ce = cross_entropy(logits_BSV, targets_BS)
        loss = ce + z_coef * stats.z_loss.sum()
        if balance == "aux":
            loss = loss + aux_coef * stats.aux_loss.sum()
        elif balance == "seq_aux":
            loss = loss + aux_coef * stats.seq_aux_loss.sum()
        return loss, (ce, stats)

    @nnx.jit
    def train_step(model, optimizer, inputs_BS, targets_BS):
        step = optimizer.step[...]
        grad_fn = nnx.value_and_grad(loss_fn, has_aux=True)  # w.r.t. nnx.Param only
        (loss, (ce, stats)), grads = grad_fn(model, inputs_BS, targets_BS)
        optimizer.update(model, grads)
        if balance == "loss_free":
            for block, counts_E in zip(model.blocks, stats.counts_E):
                block.moe.update_selection_bias(counts_E, bias_rate)
        return StepMetrics(loss=loss, ce=ce, grad_norm=optax.tree.norm(grads), lr=schedule(step), stats=stats)

    return train_step


@nnx.jit
def eval_step(model, inputs_BS, targets_BS):
    logits_BSV, _ = model(inputs_BS)
    return cross_entropy(logits_BSV, targets_BS)


# ----------------------------------------------------------------------------------- runtime


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


# ----------------------------------------------------------------------------------- checkpoints


class Checkpoints:
    """Orbax checkpoints of `{"model": state incl. selection biases, "optimizer": state}` by step."""

    def __init__(self, directory: Path, *, keep: int = 2):
        self.manager = ocp.CheckpointManager(
            directory.absolute(), options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True)
        )

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, model, optimizer) -> None:
        state = {"model": nnx.state(model), "optimizer": nnx.state(optimizer)}
        self.manager.save(step, args=ocp.args.StandardSave(state))

    def restore(self, model, optimizer) -> int:
        """Load the latest checkpoint into `model` and `optimizer` (same shapes and shardings)."""
        step = self.latest_step()
        target = {"model": nnx.state(model), "optimizer": nnx.state(optimizer)}
        restored = self.manager.restore(step, args=ocp.args.StandardRestore(target))
        nnx.update(model, restored["model"])
        nnx.update(optimizer, restored["optimizer"])
        return step

    def __enter__(self) -> Checkpoints:
        return self

    def __exit__(self, *exc_info) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


# ----------------------------------------------------------------------------------- logging


def history_record(step: int, m: StepMetrics, ep: int) -> dict:
    """One JSON-able record of a step's (host) metrics."""
    layers = []
    for i, counts_E in enumerate(np.asarray(m.stats.counts_E)):
        layer = {
            "aux": float(m.stats.aux_loss[i]),
            "seq_aux": float(m.stats.seq_aux_loss[i]),
            "z": float(m.stats.z_loss[i]),
            # fraction of routes per expert; 1/E each when balanced
            "load": [round(float(c), 6) for c in counts_E / max(counts_E.sum(), 1)],
            "padding_fraction": float(m.stats.padding_fraction[i]),
            "dropped": int(m.stats.dropped[i]),
        }
        if ep > 1:
            # The slowest EP rank sets the layer's latency: its routed rows over the mean rank's
            # (contiguous placement, E/ep experts per rank, before tile padding; host numpy).
            rows = counts_E.reshape(ep, -1).sum(axis=1)
            layer["rank_rows"] = [int(r) for r in rows]
            layer["rank_imbalance"] = float(rows.max() / rows.mean()) if rows.sum() else 1.0
        layers.append(layer)
    return {
        "step": step, "loss": float(m.loss), "ce": float(m.ce), "lr": float(m.lr),
        "grad_norm": float(m.grad_norm), "layers": layers,
    }


def format_log(record: dict, tokens_per_s: float) -> str:
    lines = [
        f"step {record['step']:>6} | loss {record['loss']:.4f} ce {record['ce']:.4f} | "
        f"lr {record['lr']:.2e} | grad {record['grad_norm']:.3f} | {tokens_per_s:,.0f} tok/s"
    ]
    for i, layer in enumerate(record["layers"]):
        load = np.asarray(layer["load"])
        cv = load.std() / max(load.mean(), 1e-12)
        lines.append(
            f"    layer {i}: aux {layer['aux']:.3f} seq_aux {layer['seq_aux']:.3f} z {layer['z']:.3f} | "
            f"load min {load.min():.3f} max {load.max():.3f} cv {cv:.3f} | "
            f"padding {layer['padding_fraction']:.3f} | dropped {layer['dropped']}"
            + (f" | rank rows max/mean {layer['rank_imbalance']:.2f}" if "rank_imbalance" in layer else "")
        )
    return "\n".join(lines)


def plot_metrics(history: list[dict], val: list[dict], path: Path) -> None:
    """Loss curves, padding fraction and per-layer expert load (heatmap) over steps, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = np.array([r["step"] for r in history])
    num_layers = len(history[0]["layers"])
    fig, axes = plt.subplots(
        2 + num_layers, 1, figsize=(9, 5 + 2.2 * num_layers), sharex=True, squeeze=False,
        gridspec_kw={"height_ratios": [2, 1] + [1.2] * num_layers},
    )
    axes = axes[:, 0]
    ax = axes[0]
    ce = np.array([r["ce"] for r in history])
    ax.plot(steps, ce, lw=0.6, alpha=0.35, color="C0")
    window = max(1, len(ce) // 30)
    smooth = np.convolve(ce, np.ones(window) / window, mode="valid")
    ax.plot(steps[window - 1 :], smooth, lw=1.5, color="C0", label=f"train cross-entropy ({window}-step mean)")
    if val:
        ax.plot([v["step"] for v in val], [v["loss"] for v in val], "o-", color="C1", label="val cross-entropy")
    ax.set_ylabel("nats / byte")
    ax.set_title("Loss")
    ax.legend()
    ax.grid(alpha=0.3)

    ax = axes[1]
    for i in range(num_layers):
        ax.plot(steps, [r["layers"][i]["padding_fraction"] for r in history], lw=1, color=f"C{i}",
                label=f"layer {i} padding")
        load_NE = np.array([r["layers"][i]["load"] for r in history])
        cv = load_NE.std(axis=1) / np.maximum(load_NE.mean(axis=1), 1e-12)
        ax.plot(steps, cv, lw=1, ls="--", color=f"C{i}", label=f"layer {i} load CV")
    ax.set_ylabel("fraction / CV")
    ax.set_title("Grouped-GEMM padding fraction and expert-load coefficient of variation")
    ax.legend(fontsize="small", ncol=2)
    ax.grid(alpha=0.3)

    for i in range(num_layers):
        ax = axes[2 + i]
        load_EN = np.array([r["layers"][i]["load"] for r in history]).T
        num_experts = load_EN.shape[0]
        image = ax.imshow(
            load_EN * num_experts, aspect="auto", interpolation="nearest", cmap="viridis", origin="lower",
            extent=(steps[0] - 0.5, steps[-1] + 0.5, -0.5, num_experts - 0.5),
        )
        ax.set_ylabel("expert")
        ax.set_title(f"Layer {i}: expert load x E (1 = balanced)")
        # An inset colorbar keeps this axis as wide as the line plots above it.
        fig.colorbar(image, cax=ax.inset_axes((1.01, 0.0, 0.015, 1.0)))
    axes[-1].set_xlabel("step")
    fig.tight_layout(rect=(0, 0, 0.95, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def load_metrics(path: Path, upto_step: int) -> tuple[list[dict], list[dict]]:
    """History and validation records of a previous run, up to its checkpointed step."""
    if not path.is_file():
        return [], []
    saved = json.loads(path.read_text())
    history = [r for r in saved.get("history", []) if r["step"] <= upto_step]
    val = [v for v in saved.get("val", []) if v["step"] <= upto_step]
    return history, val


def check_resumable(out: Path, args) -> None:
    """On --resume, the saved architecture must match the command line."""
    path = out / "config.json"
    if not path.is_file():
        return
    saved = json.loads(path.read_text())["args"]
    current = vars(args)
    diff = [f"--{k.replace('_', '-')}: saved {saved.get(k)!r}, now {current[k]!r}" for k in _ARCH_FIELDS if saved.get(k) != current[k]]
    if diff:
        raise SystemExit("cannot --resume: the checkpoint's model differs:\n  " + "\n  ".join(diff))


def _json_args(args) -> dict:
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}


# ----------------------------------------------------------------------------------- main


def run(args: argparse.Namespace) -> dict:
    """Train as configured; returns the metrics dict that is also written to `metrics.json`."""
    init_runtime(args)
    is_main = jax.process_index() == 0
    say = tqdm.write if is_main else (lambda msg: None)
    mesh = build_mesh(args)
    out = args.out
    out.mkdir(parents=True, exist_ok=True)

    split = split_corpus(load_corpus(args.data), args.val_fraction, args.seq)
    source = str(args.data) if args.data else f"{len(default_corpus_files())} stdlib files"
    say(
        f"corpus: {source}, {len(split.train):,} train / {len(split.val):,} val bytes | "
        f"devices: {jax.device_count()} x {jax.devices()[0].platform}"
        + (f" | mesh {dict(mesh.shape)}" if mesh is not None else "")
        + f" | grouped GEMM: {resolve_backend(args.backend)}"
    )

    with Checkpoints(out / "checkpoints") as ckpt:
        resume_from = ckpt.latest_step()
        if resume_from is not None and not args.resume:
            raise SystemExit(
                f"{out} already holds checkpoints (latest step {resume_from}); pass --resume to continue "
                "that run, or choose another --out."
            )
        if resume_from is not None:
            check_resumable(out, args)
        elif args.resume:
            say(f"--resume: no checkpoint in {out / 'checkpoints'}; starting from step 0")
        with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
            metrics = _train(args, split, mesh, ckpt, resume_from, say, is_main)
    if is_main and metrics["history"]:
        plot_metrics(metrics["history"], metrics["val"], out / "train_moe.png")
        history, val = metrics["history"], metrics["val"]
        say(
            f"done: steps {metrics['start_step']}..{args.steps} in {metrics['train_wall_s']:.1f} s | "
            f"loss {history[0]['loss']:.3f} -> {history[-1]['loss']:.3f}"
            + (f" | val {val[-1]['loss']:.3f}" if val else "") + f" | {out / 'train_moe.png'}"
        )
    return metrics


def _train(args, split: Split, mesh, ckpt: Checkpoints, resume_from: int | None, say, is_main: bool) -> dict:
    """Build (or restore) model and optimizer and run the steps; writes metrics at checkpoints."""
    out = args.out
    cfg = ModelConfig.from_args(args)
    # One compiled initialiser instead of a dispatch (and a compilation) per parameter.
    model = nnx.jit(lambda: MoETransformer(cfg, mesh=mesh, rngs=nnx.Rngs(args.seed)))()
    optimizer = make_optimizer(model, args)
    num_params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    say(f"model: {num_params:,} parameters, {args.layers} MoE layers of {args.experts} experts (top-{args.top_k})")

    start, history, val = 0, [], []
    if resume_from is not None:
        start = ckpt.restore(model, optimizer)
        history, val = load_metrics(out / "metrics.json", start)
        say(f"resumed from step {start}")
    if is_main:
        (out / "config.json").write_text(json.dumps({"args": _json_args(args)}, indent=2))

    train_step = make_train_step(args)
    val_data = [tuple(to_device(a, mesh) for a in b) for b in val_batches(split.val, args)]
    pending: list[tuple[int, StepMetrics]] = []  # device metrics not yet copied to the host
    t_start = t_log = time.perf_counter()
    last_log = start

    def metrics() -> dict:
        return {
            "args": _json_args(args), "history": history, "val": val, "start_step": start,
            "train_wall_s": time.perf_counter() - t_start,
        }

    def collect() -> None:
        # One host transfer per log interval keeps the device queue full in between.
        history.extend(history_record(done, m, args.ep or 1) for done, m in jax.device_get(pending))
        pending.clear()

    bar = tqdm(range(start, args.steps), initial=start, total=args.steps, desc="train", disable=not is_main)
    for step in bar:
        inputs, targets = (to_device(a, mesh) for a in train_batch(split.train, args, step))
        done = step + 1  # updates applied after this step: the numbering of logs and checkpoints
        pending.append((done, train_step(model, optimizer, inputs, targets)))
        last = done == args.steps
        if done % args.log_every == 0 or last:
            collect()
            now = time.perf_counter()
            say(format_log(history[-1], (done - last_log) * args.batch * args.seq / max(now - t_log, 1e-9)))
            t_log, last_log = now, done
            bar.set_postfix(loss=f"{history[-1]['loss']:.3f}")
        if done % args.eval_every == 0 or last:
            loss = float(np.mean([float(eval_step(model, x, y)) for x, y in val_data]))
            val.append({"step": done, "loss": loss})
            say(f"step {done:>6} | val loss {loss:.4f}")
        if done % args.ckpt_every == 0 or last:
            collect()
            ckpt.save(done, model, optimizer)
            if is_main:  # metrics up to the checkpoint survive a crash; --resume truncates to it
                (out / "metrics.json").write_text(json.dumps(metrics()))
    bar.close()
    return metrics()


def main(argv=None) -> int:
    run(parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())

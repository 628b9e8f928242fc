"""The command line of `examples/train_moe.py`: parser, cross-checks, `run` and `main`.

See the package docstring (`moe_lm/__init__.py`) for what a run does and writes.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
from pathlib import Path

import jax
from tqdm.auto import tqdm

from moe_jax.ops import resolve_backend
from moe_jax.ops.platform import on_gpu
from moe_jax.parallel import STRATEGIES as EP_STRATEGIES

from .checkpoints import Checkpoints
from .data import default_corpus_files, load_corpus, split_corpus
from .model import BACKENDS, DTYPES, ROUTERS
from .plots import plot_metrics, require_matplotlib
from .runtime import build_mesh, init_runtime
from .steps import BALANCE_METHODS
from .train import train

# Architecture fields a checkpoint must agree with on --resume.
_ARCH_FIELDS = (
    "seq", "d_model", "layers", "heads", "experts", "top_k", "d_ff", "shared_experts",
    "latent_dim", "router", "n_group", "topk_group", "tied_head",
)


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


def _backend_line(backend: str) -> str:
    """What the grouped GEMMs run on here: `auto` is per kernel on a GPU (`H200_BACKENDS`)."""
    if backend == "auto" and on_gpu():
        return "auto (per kernel: Pallas forward, official Triton gradients at prefill where jax_triton imports)"
    return resolve_backend(backend)


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
        epilog="Writes OUT/metrics.json, OUT/train_moe.png (unless --no-plot), OUT/config.json and orbax "
        "checkpoints in OUT/checkpoints/.",
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
                   help="grouped-GEMM backend (auto: per kernel on a GPU, moe_jax.ops.H200_BACKENDS: Pallas forward, "
                        "official Triton gradients at prefill; XLA ragged_dot elsewhere)")
    g.add_argument("--fp8", action="store_true",
                   help="routed experts in DeepSeek-V3's blockwise FP8 (GemmOptions(quantization=Fp8Blockwise()): "
                        "e4m3 operands, products promoted in fp32 every 128, master weights unchanged) on --backend's "
                        "FP8 kernels (auto: the Mosaic GPU or Triton kernel per GEMM; moe_jax.ops.gmm_fp8)")
    g.add_argument("--ep", type=_positive_int, default=None,
                   help="expert-parallel size: mesh ('data', 'ep') over all devices; batch is split over all")
    g.add_argument("--ep-strategy", choices=EP_STRATEGIES, default="padded",
                   help="EP exchange (ragged needs a GPU)")
    g.add_argument("--capacity-factor", type=_positive_float, default=None,
                   help="EP rows per rank pair as a multiple of the balanced load; unset: dropless")
    g.add_argument("--ep-chunks", type=_positive_int, default=1,
                   help="with --ep: split each device's exchange into this many token chunks that XLA may overlap "
                        "with the expert GEMMs (EPOptions(chunks=...); the same results)")
    g.add_argument("--rebalance-every", type=_positive_int, default=None,
                   help="with --ep: every N steps re-plan each layer's expert placement from the last N steps' "
                        "expert counts (replicas of hot experts) and move the expert weights and optimizer state "
                        "to it on device (recompiles the step; not with --resume)")
    g.add_argument("--redundant-slots", type=_nonnegative_int, default=None,
                   help="--rebalance-every: spare expert slots per layer for replicas (default: one per ep rank; "
                        "rounded up to fill every rank alike)")
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
    g.add_argument("--plot", action=argparse.BooleanOptionalAction, default=True,
                   help="draw OUT/train_moe.png at the end (needs matplotlib, the examples extra)")
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
        if args.ep_chunks != 1:
            parser.error("--ep-chunks needs --ep (it splits the EP exchange)")
        if args.distributed:
            parser.error("--distributed needs --ep (use --ep 1 for pure data parallelism)")
    if args.rebalance_every is not None:
        if args.ep is None or args.ep < 2:
            parser.error("--rebalance-every needs --ep of 2 or more (it places experts on the ep ranks)")
        if args.resume:
            parser.error("--rebalance-every cannot --resume: the expert placements are not checkpointed")
    elif args.redundant_slots is not None:
        parser.error("--redundant-slots needs --rebalance-every")
    if not args.distributed and (args.coordinator, args.num_processes, args.process_id) != (None, None, None):
        parser.error("--coordinator/--num-processes/--process-id need --distributed")
    if args.data is not None and args.data.is_dir():
        parser.error(f"--data {args.data}: is a directory; pass one text file (concatenate several first)")
    if args.data is not None and not args.data.is_file():
        parser.error(f"--data {args.data}: no such file")
    return args


def check_resumable(out: Path, args) -> None:
    """On --resume, the saved architecture must match the command line."""
    path = out / "config.json"
    if not path.is_file():
        return
    saved = json.loads(path.read_text())["args"]
    current = vars(args)
    why = {"seq": " (it sizes the learned position table)"}
    diff = [f"--{k.replace('_', '-')}: saved {saved.get(k)!r}, now {current[k]!r}{why.get(k, '')}"
            for k in _ARCH_FIELDS if saved.get(k) != current[k]]
    if diff:
        raise SystemExit("cannot --resume: the checkpoint's model differs:\n  " + "\n  ".join(diff))


def run(args: argparse.Namespace) -> dict:
    """Train as configured; returns the metrics dict that is also written to `metrics.json`."""
    if args.plot:
        require_matplotlib()  # before training: a missing extra must not end a finished run
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
        + f" | grouped GEMM: {_backend_line(args.backend)}" + (" | routed experts in FP8" if args.fp8 else "")
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
            metrics = train(args, split, mesh, ckpt, resume_from, say, is_main)
    if is_main and metrics["history"]:
        if args.plot:
            plot_metrics(metrics["history"], metrics["val"], out / "train_moe.png")
        history, val = metrics["history"], metrics["val"]
        say(
            f"done: steps {metrics['start_step']}..{args.steps} in {metrics['train_wall_s']:.1f} s | "
            f"loss {history[0]['loss']:.3f} -> {history[-1]['loss']:.3f}"
            + (f" | val {val[-1]['loss']:.3f}" if val else "") + (f" | {out / 'train_moe.png'}" if args.plot else "")
        )
    return metrics


def main(argv=None) -> int:
    run(parse_args(argv))
    return 0

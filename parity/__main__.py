"""`python -m parity`: compare moe_jax with the torch reference on one configuration, or time both.

Parity (default): builds the problem from the configuration's random seed, runs both layers with the same injected
routing and upstream gradient, compares the routers on the same logits, prints a table and exits
with 1 if any tensor misses its threshold (the message names the tensor, the configuration and the
error figures). `--time` (GPU only) instead times one forward+backward step of each side.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys

# parity.config imports neither jax nor torch: --help stays instant and the environment can
# still be prepared before jax starts.
from parity.config import BACKENDS, DTYPES, EP_STRATEGIES, ROUTERS, SKEWS

EPILOG = """\
examples:
  python -m parity --skew zipf --top-k 8 --experts 16 --dtype bfloat16
  python -m parity --shared-experts 2 --latent-dim 16 --router sigmoid_grouped
  python -m parity --ep-size 4            # our side on a 4-device mesh (CPU: forced host devices)
  python -m parity --fp8 --d-model 160 --d-ff 136 --dtype bfloat16   # blockwise FP8 on both sides
  python -m parity --time --tokens 4096 --d-model 2048 --d-ff 768 --experts 128 --top-k 8 \\
      --dtype bfloat16 --json benchmarks/results/parity_timing.json   # GPU only

thresholds (relative Frobenius error): float32 1e-5 (HIGHEST / TF32 off), bfloat16 1e-2;
--fp8 layers 1e-3 in float32 and 1e-2 in bfloat16 (same e4m3 bits on both sides; 1e-2 in both where our side
runs the FP8 kernel, whose tensor-core step sums carry fewer bits than fp32), and their fp8_vs_unquantized.*
rows (our FP8 layer against the unquantized one: what FP8 gives up) within 0.125;
router comparisons are fp32 on both sides (1e-5), the router's choice must match exactly.
"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m parity",
        description=__doc__.split("\n\n")[0].removeprefix("`python -m parity`: "),
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--tokens", type=int, default=64, help="T, tokens per call (default 64)")
    p.add_argument("--d-model", type=int, default=32, help="D, model width (default 32)")
    p.add_argument("--d-ff", type=int, default=32, help="F, routed-expert hidden width (default 32)")
    p.add_argument("--experts", type=int, default=8, help="E, routed experts (default 8)")
    p.add_argument("--top-k", type=int, default=2, help="K, experts per token (default 2)")
    p.add_argument("--dtype", choices=DTYPES, default="float32")
    p.add_argument("--skew", choices=SKEWS, default="balanced", help="injected-routing skew (default balanced)")
    p.add_argument("--router", choices=ROUTERS, default="softmax_topk", help="router compared on the same logits")
    p.add_argument("--shared-experts", type=int, default=0, help="shared experts (SwiGLU of width F * n)")
    p.add_argument("--latent-dim", type=int, default=None, help="LatentMoE width of the routed experts")
    p.add_argument("--fused-gate-up", action="store_true", help="fused w_gate_up [E, 2F, Din] on both sides")
    p.add_argument("--fp8", action="store_true",
                   help="routed experts in DeepSeek-V3's blockwise FP8 on both sides (not with --fused-gate-up "
                        "or --time)")
    p.add_argument("--backend", choices=BACKENDS, default="auto", help="moe_jax GEMM backend (default auto)")
    p.add_argument("--ep-size", type=int, default=1, help="expert-parallel devices of our side (default 1)")
    p.add_argument("--ep-strategy", choices=EP_STRATEGIES, default="padded", help="EP exchange (ragged: GPU only)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--time", action="store_true", help="GPU only: time forward+backward of both sides instead")
    p.add_argument("--warmup", type=int, default=3, help="--time: warm-up steps per side (default 3)")
    p.add_argument("--iters", type=int, default=20, help="--time: timed steps per side, median (default 20)")
    p.add_argument("--json", metavar="PATH", default=None, help="also write the report / timing as JSON")
    return p


def _prepare_environment(args) -> None:
    """Settings jax reads once, at import: must run before the first jax import."""
    # torch and jax share the GPU in this process: jax must not grab 75% of it up front.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    if args.ep_size > 1:
        flag = f"--xla_force_host_platform_device_count={args.ep_size}"
        if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
            os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flag).strip()


def _write_json(path: str, payload: dict) -> None:
    target = pathlib.Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {target}")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _prepare_environment(args)

    from parity import harness

    try:
        config = harness.ParityConfig(
            tokens=args.tokens, d_model=args.d_model, d_ff=args.d_ff, num_experts=args.experts,
            top_k=args.top_k, dtype=args.dtype, skew=args.skew, router=args.router,
            shared_experts=args.shared_experts, latent_dim=args.latent_dim,
            fused_gate_up=args.fused_gate_up, fp8=args.fp8, backend=args.backend, ep_size=args.ep_size,
            ep_strategy=args.ep_strategy, seed=args.seed,
        )
    except (TypeError, ValueError) as exc:
        parser.error(str(exc))

    if args.time:
        from parity import timing

        try:
            result = timing.time_layers(config, warmup=args.warmup, iters=args.iters)
        except (RuntimeError, ValueError) as exc:
            parser.error(str(exc))
        print(timing.format_timing(result))
        if args.json:
            _write_json(args.json, result.to_json())
        return 0

    try:
        report = harness.run_parity(config)
    except ValueError as exc:  # e.g. too few devices for --ep-size
        parser.error(str(exc))
    print(harness.format_table(report))
    if args.json:
        _write_json(args.json, report.to_json())
    try:
        harness.check(report)
    except AssertionError as exc:
        print(exc, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env bash
# One device call: run the named phases in order, each under its own time limit, logging under $OUT.
#   benchmarks/gpu_run.sh env tests:180 tune:240 run-quick:120
# Phases: env | tests[:s] (pytest tests/ compiled) | parity[:s] | tune[:s] | run[:s] | run-quick[:s] | example[:s]
set -u
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
for phase in "$@"; do
  name=${phase%%:*}; limit=${phase#*:}; [ "$limit" = "$phase" ] && limit=300
  echo "=== $name (limit ${limit}s) $(date -u +%T)"
  case $name in
    env) nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
         python3 -m pip list 2>/dev/null | grep -iE '^(jax|jaxlib|jax-cuda|flax|optax|torch|triton|numpy|chex|hypothesis|orbax|pytest|pytest-xdist|matplotlib|tqdm|rich|jaxtyping) ' | tee "$OUT/pip.txt" ;;
    tests) timeout "$limit" python3 -m pytest ${TESTS:-tests} -q -x -n 8 -p no:cacheprovider 2>&1 | tee "$OUT/tests.log" | tail -25 ;;
    parity) timeout "$limit" python3 -m pytest parity -q -x -p no:cacheprovider 2>&1 | tee "$OUT/parity.log" | tail -25 ;;
    tune) timeout "$limit" python3 -m benchmarks.gmm tune --json "$OUT/tune.json" 2>&1 | tee "$OUT/tune.log" | grep -v "^    \[skipped\]" | tail -40 ;;
    run) timeout "$limit" python3 -m benchmarks.gmm run --json "$OUT/run.json" $( [ -f "$OUT/tune.json" ] && echo --configs "$OUT/tune.json") 2>&1 | tee "$OUT/run.log" | tail -40 ;;
    run-quick) timeout "$limit" python3 -m benchmarks.gmm run --quick --json "$OUT/run_quick.json" 2>&1 | tee "$OUT/run_quick.log" | tail -30 ;;
    example) timeout "$limit" python3 examples/train_moe.py --steps 200 --out "$OUT/example" 2>&1 | tee "$OUT/example.log" | tail -20 ;;
    *) echo "unknown phase $name" ;;
  esac
  echo "=== $name done rc=${PIPESTATUS[0]} $(date -u +%T)"
done

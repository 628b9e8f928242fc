#!/usr/bin/env bash
# One device call: run the named phases in order, each under its own time limit, logging under $OUT.
#   benchmarks/gpu_run.sh env tests:180 run:240 example:90
# Two lanes on a 2-GPU machine:  CUDA_VISIBLE_DEVICES=0 LANE=a benchmarks/gpu_run.sh ... &
#                                CUDA_VISIBLE_DEVICES=1 LANE=b benchmarks/gpu_run.sh ... ; wait
#   LANE prefixes every file a phase writes under $OUT (a-tests.log, a-gmm.json, ...), and `run`
#   reads its own lane's tune.json. The ep-* phases, parity-ep and example-ep need both GPUs: run
#   them outside the lanes. Timings from two lanes at once share the host and its PCIe/NVLink.
# Phases: env | tests | parity | tune | run | run-quick | layer-time | drop-in | example | ep-check |
#         ep-bench | parity-ep | example-ep | routed | jax-triton | backends | layer |
#         decode | decode-ncu | wgrad-ncu | accept-tests | accept-example | accept-layers |
#         accept-rerun | accept-rest | accept-compiled | accept-ncu | accept-summary | layer-profile | fp8 | combine | pack   (each optionally :SECONDS)
# pack: every file under $OUT so far into one $OUT/<lane->pack-<time>.tgz (a host that returns only a few files
#   from $OUT still returns all of them; `tar xzf` each call's pack into one folder for accept-summary).
# The GPU acceptance run (docs/acceptance.md) is `accept`: every accept-* phase in order, after
# env and jax-triton; `accept-summary` writes $OUT/accept_summary.md (COMMIT names the commit, DEVICE the card).
# The pytest phases (tests, parity, accept-tests, accept-rerun, accept-rest) stop pytest with SIGINT at their limits:
#   it still prints its counts and names the tests that failed so far.
# Env: NPROC (xdist workers; NPROC_RERUN / NPROC_REST those of accept-rerun / accept-rest), TESTS / PARITY (paths), STEPS (example), TUNE_ONLY (all|prefill|decode),
#      ACCEPT_XML (accept-rest: the JUnit report of an accept-tests run in an earlier call, carried into the checkout),
#      ROUTED_SHAPES (routed: indices into benchmarks.routed_gmm's shapes; default all),
#      WHEELS (jax-triton: the folder holding the jax_triton wheel, default .whl; the image has no registry),
#      LAYER_SHAPES / LAYER_VARIANTS / LAYER_MICRO (layer: benchmarks.layer's --shapes / --variants / --micro-batches),
#      PROFILE_SHAPE / PROFILE_VARIANTS / PROFILE_MICRO (layer-profile: one index into benchmarks.layer's SHAPES, its variants, micro-batches per step),
#      DECODE_TOKENS (decode: buckets, default 1,2,4,8), NCU_TOKENS (decode-ncu: buckets profiled, default 1,8;
#        decode-ncu profiles the fastest candidates of decode's JSON under Nsight Compute, or every
#        candidate when no decode phase ran before it in this call),
#      EP_ARGS (e.g. --skip-ragged; --chunks 1,2,4 adds the chunked-exchange rows),
#      EP_RANKS (ep size of ep-bench and example-ep; default 2),
#      ACCEPT_SHAPES / ACCEPT_DTYPES / ACCEPT_BACKENDS (accept-layers: indices into benchmarks.accept's
#        LAYER_SHAPES, some of its DTYPES, some of its LAYER_BACKENDS; default all: a later lane can make
#        exactly the cells an earlier one did not reach),
#      PARITY_EP (the EP test paths; the EP parity test runs each world size on NCCL when it sees that many GPUs).
# ep-check runs tests/test_ep_moe.py (ep 2 and 4, on GPUs where the host has that many, else on host
#   devices), then its ragged cases once more under XLA's ragged_all_to_all decomposer flag.
set -u
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
L=${LANE:+$LANE-}
phases=()
for phase in "$@"; do
  if [ "$phase" = accept ]; then
    phases+=(env jax-triton accept-tests:540 accept-rerun:300 accept-rest:400 accept-example:360 accept-layers:540 accept-compiled:300 accept-ncu:420 accept-summary)
  else
    phases+=("$phase")
  fi
done
for phase in "${phases[@]}"; do
  name=${phase%%:*}; limit=${phase#*:}; [ "$limit" = "$phase" ] && limit=300
  echo "=== $name (limit ${limit}s) $(date -u +%T)"
  case $name in
    env) nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
         python3 -m pip list 2>/dev/null | grep -iE '^(jax|jaxlib|jax-cuda13-plugin|flax|optax|torch|triton|numpy|chex|hypothesis|orbax-checkpoint|pytest|pytest-xdist|matplotlib|tqdm) ' | tee "$OUT/${L}pip.txt" ;;
    tests) timeout -s INT -k 30 "$limit" python3 -m pytest ${TESTS:-tests} -q -n ${NPROC:-8} -p no:cacheprovider 2>&1 | tee "$OUT/${L}tests.log" | tail -25 ;;
    parity) timeout -s INT -k 30 "$limit" python3 -m pytest ${PARITY:-parity} -q -n ${NPROC:-4} -p no:cacheprovider 2>&1 | tee "$OUT/${L}parity.log" | tail -25 ;;
    tune) timeout "$limit" python3 -m benchmarks.gmm tune --only ${TUNE_ONLY:-all} --json "$OUT/${L}tune.json" 2>&1 | tee "$OUT/${L}tune.log" | grep -v "^    \[skipped\]" | tail -40 ;;
    run) timeout "$limit" python3 -m benchmarks.gmm run --json "$OUT/${L}gmm.json" $( [ -f "$OUT/${L}tune.json" ] && echo --configs "$OUT/${L}tune.json") 2>&1 | tee "$OUT/${L}gmm.log" | tail -40 ;;
    run-quick) timeout "$limit" python3 -m benchmarks.gmm run --quick --json "$OUT/${L}gmm_quick.json" 2>&1 | tee "$OUT/${L}gmm_quick.log" | tail -30 ;;
    layer-time) timeout "$limit" python3 -m parity --time --tokens 4096 --d-model 2048 --d-ff 768 --experts 128 --top-k 8 --dtype bfloat16 --json "$OUT/${L}layer_time.json" 2>&1 | tee "$OUT/${L}layer_time.log" | tail -20 ;;
    routed) timeout "$limit" python3 -m benchmarks.routed_gmm sweep ${ROUTED_SHAPES:+--shapes $ROUTED_SHAPES} --traces benchmarks/data/expert_counts.npz --json "$OUT/${L}routed.json" 2>&1 | tee "$OUT/${L}routed.log" | grep -v "^|" | tail -20 ;;
    drop-in) timeout "$limit" python3 -m benchmarks.drop_in --json "$OUT/${L}drop_in.json" 2>&1 | tee "$OUT/${L}drop_in.log" | tail -20 ;;
    example) timeout "$limit" python3 examples/train_moe.py --steps ${STEPS:-300} --out "$OUT/${L}example" 2>&1 | tr '\r' '\n' | grep -v '^ *$' | tee "$OUT/${L}example.log" | tail -25 ;;
    ep-check) timeout "$limit" bash -c 'python3 -m pytest tests/test_ep_moe.py -q -rA -p no:cacheprovider; a=$?
                XLA_FLAGS="${XLA_FLAGS:+$XLA_FLAGS }--xla_gpu_unsupported_enable_ragged_all_to_all_decomposer=true" python3 -m pytest tests/test_ep_moe.py -k ragged -q -rA -p no:cacheprovider; b=$?
                exit $((a ? a : b))' 2>&1 | tee "$OUT/${L}ep_check.log" | tail -30 ;;
    ep-bench) timeout "$limit" python3 -m benchmarks.ep --ranks ${EP_RANKS:-2} ${EP_ARGS:-} --json "$OUT/${L}ep.json" 2>&1 | tee "$OUT/${L}ep.log" | tail -30 ;;
    parity-ep) timeout "$limit" python3 -m pytest ${PARITY_EP:-tests/test_dispatch.py parity/tests/test_parity_ep.py parity/tests/test_reference_ep.py} -q -rA -p no:cacheprovider 2>&1 | tee "$OUT/${L}parity_ep.log" | tail -25 ;;
    example-ep) timeout "$limit" python3 examples/train_moe.py --ep ${EP_RANKS:-2} --steps ${STEPS:-200} --out "$OUT/${L}example_ep" 2>&1 | tr '\r' '\n' | grep -v '^ *$' | tee "$OUT/${L}example_ep.log" | tail -25 ;;
    jax-triton) python3 -m pip install -q --no-deps --no-index "${WHEELS:-.whl}"/jax_triton-*.whl 2>&1 | tail -2
                python3 -c "import jax_triton; print('jax_triton', jax_triton.__version__)" ;;
    backends) timeout "$limit" python3 -m benchmarks.backends --json "$OUT/${L}backends.json" 2>&1 | tee "$OUT/${L}backends.log" | tail -30 ;;
    decode) timeout "$limit" python3 -m benchmarks.decode sweep ${DECODE_TOKENS:+--tokens $DECODE_TOKENS} --json "$OUT/${L}decode.json" 2>&1 | tee "$OUT/${L}decode.log" | tail -60 ;;
    decode-ncu) timeout -k 10 "$limit" ncu --clock-control none --print-units base --csv --log-file "$OUT/${L}decode_ncu.csv" \
                  --metrics gpu__time_duration.sum,dram__bytes_read.sum,launch__grid_size,launch__registers_per_thread,launch__shared_mem_per_block_dynamic \
                  python3 -m benchmarks.decode kernels $( [ -f "$OUT/${L}decode.json" ] && echo --from "$OUT/${L}decode.json") --tokens ${NCU_TOKENS:-1,8} \
                  --labels "$OUT/${L}decode_ncu_labels.json" 2>&1 | tail -15
                python3 -m benchmarks.decode ncu-table "$OUT/${L}decode_ncu.csv" --labels "$OUT/${L}decode_ncu_labels.json" 2>&1 | tail -60 ;;
    wgrad-ncu) timeout "$limit" ncu --clock-control none --print-units base --csv --log-file "$OUT/${L}wgrad_ncu.csv" \
                 --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,lts__throughput.avg.pct_of_peak_sustained_elapsed,l1tex__throughput.avg.pct_of_peak_sustained_elapsed,sm__throughput.avg.pct_of_peak_sustained_elapsed,sm__warps_active.avg.pct_of_peak_sustained_active,launch__grid_size,launch__block_size,launch__registers_per_thread,launch__shared_mem_per_block_dynamic \
                 -k 'regex:tgmm|device_kernel' python3 -m benchmarks.wgrad_profile 2>&1 | tail -5
               python3 -m benchmarks.wgrad_profile table "$OUT/${L}wgrad_ncu.csv" 2>&1 | tail -30 ;;
    # SIGINT at the limit: pytest stops, still prints its summary and names what failed so far
    # (benchmarks.accept.interrupted: such a run is never green).
    accept-tests) timeout -s INT -k 60 "$limit" python3 -m pytest tests parity -q -n ${NPROC:-14} -p no:cacheprovider --durations=40 \
                    --junitxml "$OUT/${L}tests.xml" 2>&1 | tee "$OUT/${L}tests.log" \
                    | grep -v -E '^[0-9.]+s (call|setup|teardown) ' | tail -25 ;;  # the slowest 40 stay in the log
    accept-rerun) python3 -m benchmarks.accept failed-ids "$OUT/${L}tests.log" > "$OUT/${L}tests_rerun_ids.txt"
                  # tests that ran out of device memory beside the other workers (and the example) on a smaller card
                  # (a log cut off before pytest's summary names no test: nothing to rerun, never the whole suite)
                  if grep -q '[^[:space:]]' "$OUT/${L}tests_rerun_ids.txt"; then
                    timeout -s INT -k 30 "$limit" python3 -m pytest @"$OUT/${L}tests_rerun_ids.txt" -q -n ${NPROC_RERUN:-4} -p no:cacheprovider --tb=line 2>&1 \
                      | tee "$OUT/${L}tests_rerun.log" | tail -8
                  else rm -f "$OUT/${L}tests_rerun_ids.txt"; echo "nothing to rerun"; fi ;;
    accept-rest) # the tests accept-tests did not reach in its limit (its JUnit report, ACCEPT_XML when an earlier call made it)
                 python3 -m benchmarks.accept unreached-ids "${ACCEPT_XML:-$OUT/${L}tests.xml}" tests parity > "$OUT/${L}tests_rest_ids.txt"
                 if grep -q '[^[:space:]]' "$OUT/${L}tests_rest_ids.txt"; then
                   timeout -s INT -k 30 "$limit" python3 -m pytest @"$OUT/${L}tests_rest_ids.txt" -q -n ${NPROC_REST:-8} -p no:cacheprovider --tb=short \
                     --durations=20 2>&1 | tee "$OUT/${L}tests_rest.log" | grep -v -E '^[0-9.]+s (call|setup|teardown) ' | tail -12
                 else echo "every test was reached" | tee "$OUT/${L}tests_rest.log"; fi ;;
    accept-example) for run in float32 bfloat16 fp8; do  # the README's command with its defaults (fp32), bf16, bf16 in FP8
                      case $run in float32) args= ;; bfloat16) args="--dtype bfloat16" ;; fp8) args="--dtype bfloat16 --fp8" ;; esac
                      # the run's folder (checkpoints, metrics, plot) stays on the host: its log comes back
                      rm -rf "/tmp/${L}example_$run"
                      timeout $((limit / 3)) python3 examples/train_moe.py $args --out "/tmp/${L}example_$run" 2>&1 \
                        | tr '\r' '\n' | grep -v '^ *$' > "$OUT/${L}example_$run.log"
                      echo "exit ${PIPESTATUS[0]}" >> "$OUT/${L}example_$run.log"; tail -4 "$OUT/${L}example_$run.log"
                    done ;;
    accept-layers) timeout "$limit" python3 -m benchmarks.accept layers ${ACCEPT_SHAPES:+--shapes $ACCEPT_SHAPES} ${ACCEPT_DTYPES:+--dtypes $ACCEPT_DTYPES} ${ACCEPT_BACKENDS:+--backends $ACCEPT_BACKENDS} --json "$OUT/${L}accept_layers.json" 2>&1 | tee "$OUT/${L}accept_layers.log" | tail -14 ;;
    accept-compiled) timeout "$limit" env -u TRITON_INTERPRET python3 -m tests.compiled_resources --jobs ${NPROC:-14} > "$OUT/${L}compiled.jsonl" 2> "$OUT/${L}compiled.err"
                     python3 -c "import json,sys; r=[json.loads(l) for l in open(sys.argv[1])]; print(len(r), 'compiled; model below the compiler on', sum(x['compiled']>x['model'] for x in r), '; exact on', sum(x['compiled']==x['model'] for x in r))" "$OUT/${L}compiled.jsonl" ;;
    accept-ncu) timeout -k 10 "$limit" ncu --clock-control none --print-units base --csv --log-file "$OUT/${L}accept_ncu.csv" \
                  --metrics launch__shared_mem_per_block_dynamic,launch__shared_mem_per_block_static -k 'regex:moe_jax|mosaic|_body' \
                  python3 -m benchmarks.accept launch --labels "$OUT/${L}accept_labels.json" 2>&1 | tail -5
                python3 -m benchmarks.accept ncu-table "$OUT/${L}accept_ncu.csv" --labels "$OUT/${L}accept_labels.json" \
                  --out "$OUT/${L}accept_resources.json" 2>&1 | tee "$OUT/${L}accept_resources.log" | tail -30 ;;
    pack) files=$(cd "$OUT" && ls -A | grep -v -E '(^|-)pack-[0-9]+\.tgz$')
          if [ -n "$files" ]; then (cd "$OUT" && tar czf "${L}pack-$(date -u +%H%M%S).tgz" --remove-files $files) && ls "$OUT"
          else echo "nothing to pack"; fi ;;
    accept-summary) python3 -m benchmarks.accept summary "$OUT" --commit "${COMMIT:-unknown}" --device "${DEVICE:-one H200}" | tail -60 ;;
    fp8) timeout "$limit" python3 -m benchmarks.fp8 --sections ${FP8_SECTIONS:-gemm,fb} ${FP8_SHAPES:+--shapes $FP8_SHAPES} --variants \
           --json "$OUT/${L}fp8.json" 2>&1 | grep -v -E "rematerialization|gpu_hlo_schedule|Warning|warner" | tee "$OUT/${L}fp8.log" | tail -40 ;;
    combine) timeout "$limit" python3 -m benchmarks.combine --json "$OUT/${L}combine.json" 2>&1 | tee "$OUT/${L}combine.log" | tail -8 ;;
    layer) timeout "$limit" python3 -m benchmarks.layer ${LAYER_SHAPES:+--shapes $LAYER_SHAPES} ${LAYER_VARIANTS:+--variants $LAYER_VARIANTS} ${LAYER_MICRO:+--micro-batches $LAYER_MICRO} --json "$OUT/${L}layer.json" 2>&1 | tee "$OUT/${L}layer.log" | tail -20 ;;
    layer-profile) timeout -k 10 "$limit" python3 -m benchmarks.layer_profile --shape ${PROFILE_SHAPE:-0} --variants ${PROFILE_VARIANTS:-auto,fp8} --micro-batches ${PROFILE_MICRO:-1} \
                     --out "$OUT/${L}layer_profile" 2>&1 | grep -v -E "DeprecationWarning|stats = dict" | tail -50 ;;
    *) echo "unknown phase $name" ;;
  esac
  echo "=== $name done rc=${PIPESTATUS[0]} $(date -u +%T)"
done

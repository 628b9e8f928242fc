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
`--rebalance-every N` (with `--ep`) gives every layer spare expert slots holding replicas of hot
experts and re-plans the placement every N steps, moving weights and optimizer state on device
(`placement`, docs/placement.md). `--ep-chunks N` splits each device's exchange into N token
chunks that XLA may overlap with the expert GEMMs (`EPOptions(chunks=N)`).

Legend (shape suffixes): B batch (sequences), S sequence length, D model width, V vocabulary (256),
H attention heads, Dh head width, L MoE layers, E experts.

Modules (the entry script `examples/train_moe.py` calls `cli.main`):

    cli          argument parser and its cross-checks, `check_resumable`, `run` (one whole run), `main`
    data         corpus loading, train/validation split, seeded batches (host numpy)
    model        `ModelConfig`, attention, `Block`, `MoETransformer`, `make_router`
    steps        `StepMetrics`, schedule, AdamW optimizer, the jitted train and eval steps
    runtime      fake CPU devices, `jax.distributed`, the EP mesh, `to_device`
    placement    `Rebalancer`: the layers' expert placements and `--rebalance-every`
    checkpoints  `Checkpoints` (orbax)
    metrics      per-step JSON records, log lines, reloading `metrics.json` on resume
    plots        `plot_metrics` (`train_moe.png`)
    train        the training loop `train`
"""

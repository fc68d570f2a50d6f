"""jaxloop's benchmarks: `python -m benchmarks` (see benchmarks/__main__.py); bench_data.py and
bench_checkpoint.py also run on their own."""

DESCRIPTION = """
## What each row measures

All times are medians after warm-up; contenders sharing the machine run interleaved (A B C A B C ...),
with the same data (the run's first micro-batches in jaxloop's record order, real Tiny Shakespeare
windows or digits), the same initial weights (jaxloop's, loaded into torch_ref), fp32, and the same
threads (XLA:CPU uses every core; torch.set_num_threads(cores), OMP_NUM_THREADS for torch children).
torch_ref runs as it does in its own loop, i.e. with torch.use_deterministic_algorithms(True).

- **peak**: fp32 matmul rate of this CPU, n x n (2048; 1024 under --quick), jitted `jnp.dot` vs
  `torch.mm`, best block; the larger of the two is the peak that the GPT step rows' "% of peak" uses.
- **step.{mlp,gpt64,gpt128}.k{1,4}** (goal: jaxloop <= 0.7x torch eager for the GPT, <= 0.5x for the
  MLP, and no slower than torch.compile): ms per optimizer update of K micro-batches. jaxloop: K calls
  of `train_step.lower(state, batch).compile()` (as the loop calls it), blocking at the end of each
  block; torch eager: `torch_ref.step.train_update` over K micro-batches; torch.compile: the same with
  `state.model = torch.compile(state.model)` (its failure is caught and reported; skipped under
  --quick). GPT rows also give the achieved GFLOP/s of jaxloop's update, counted from the compiled
  HLO's cost analysis (the analytic 6·N·tokens + attention count is recorded beside it), as % of the
  measured peak.
- **eval.gpt128** (goal >= 3x): tokens/s of a full validation pass (`eval_step` over `val_batches`,
  the preset's eval_batch_size (32), dispatch all then fetch, as the loop's evaluate) / tokens/s of the compiled
  training update alone (batch 32).
- Host allocator: the harness process (step, eval and peak rows, both frameworks) keeps freed memory
  for reuse as `jaxloop.run` does (`jaxloop.host_memory`, glibc mallopt); child processes running a
  CLI have their own policy (jaxloop's sets it, `retain_host_memory`; torch_ref's keeps glibc's default).
- **loop.{mlp,gpt64}.k{1,4}** (goal <= 1.10): `jaxloop.train.run` in a child process (log_every 10,
  prefetch 2, async checkpoints every 100, eval only at the end), its own `step_ms` from
  metrics.jsonl (every log interval after the first, weighted by its updates: the loop's wall time
  per update, the time saves block it included, evaluation not), divided by the compiled update alone
  measured in the same process on the same batches, runs and alone-blocks interleaved. In the notes:
  the median interval, and (wall - setup - compile - eval - checkpoint) / updates (no save's time).
- **e2e.shakespeare64** (goal: jaxloop wall <= 0.6x torch_ref's, val_loss within 0.02): `python -m
  jaxloop.train` and `python -m torch_ref.train` with `--preset shakespeare --model.context 64
  --batch_size 12 --data.path ... --steps 2000` (100 under --quick), wall time of the whole process
  (imports, compile, evaluations every 250, checkpoints included); final val_loss of both. jaxloop's
  `--compile_cache` is a new, empty directory: a first run, its compile in the wall.
- **e2e.script64** (goal: jaxloop wall <= 0.9x the script's, val_loss within 0.02): issue 30's race,
  with equal evaluation work (issue 37). `python -m jaxloop.train --preset shakespeare --model.context 64
  --batch_size 12 --steps 2000 --eval_batches 20 --data.eval_batch_size 12` (100 updates under --quick)
  as a user runs it (progress lines, report and TensorBoard; a fresh run_dir and an empty
  `--compile_cache`), against `benchmarks/plain_torch_gpt.py`, a single-file eager PyTorch loop of the
  kind users copy (nanoGPT's CPU "baby GPT" settings, 20-batch validation estimates of 12 windows every
  250 iterations, jaxloop's model, split and schedule so the losses compare), each in its own process
  with the same threads. Evaluation work is equal: 8 evaluations of 20 x 12 windows on each side
  (jaxloop's fixed seeded subset at updates 250..2000, the script's random batches at 0..1750). The
  script's final whole-split evaluation, which jaxloop's run has no counterpart of, is left out of its
  wall (its own timer, `final_eval_s`); the row's val_loss for jaxloop is its final params evaluated
  over the same whole split afterwards, untimed (`python -m benchmarks.driver valloss`). Notes: the
  time per update alone (jaxloop: summary.json's updates_per_s; the script: its loop less its
  estimates), both sides' evaluation seconds, jaxloop's compile and setup seconds.
- **startup.compile** (goal <= 2 s): `train_step.lower(...).compile()` of the 4-block GPT
  (ctx 128, batch 32) in a fresh process with no cache; CPU seconds, init and eval-step compile in the notes.
- **startup.cache** (goal <= 0.5 s): the same in fresh processes with `--compile_cache`'s two caches
  as the loop uses them for a built-in task: `jaxloop.compilation.enable_compilation_cache(dir)` and
  `jaxloop.executables.compile_cached` (compiled calls stored by config and source, loaded without
  tracing). The first run fills them; the second's train_step "compile" is the row (a load). A third run
  with JAX's persistent cache alone (what a user's own task gets) is in the notes, split into tracing +
  lowering (Python, which JAX's cache cannot skip) and the cache load.
- **startup.digits** (goal <= 3 s): `python -m jaxloop.train` (digits, log_every 1) from `Popen` to
  its first train record appearing in metrics.jsonl (polled every 10 ms); torch_ref's CLI beside it.
  jaxloop's figure is a second run of the command: its `--compile_cache` (a directory of the row's own)
  filled by a first run, timed too, in the notes with a run with no cache at all (`--compile_cache ''`).
- **memory.***: peak RSS (the child's VmHWM from /proc, polled every 10 ms; wait4's ru_maxrss would carry the
  harness's own high-water mark over fork + exec) of jaxloop vs torch_ref: the e2e and
  digits CLI runs, and state + compile + updates of one framework per child (mlp, gpt128).
- **data**: benchmarks/bench_data.py (grain TrainLoader vs torch DataLoader, same records and per-record
  transform), the worst grain / best-torch ratio over worker counts.
- **checkpoint**: benchmarks/bench_checkpoint.py, the time an async save blocks the loop / a sync
  save's (goal <= 0.1), worst over state sizes.
- **accel.{fp32,bf16}**: with a GPU, the GPT update (ctx 128, batch 32) of jaxloop against torch_ref eager
  on the same GPU, interleaved (ratio = jaxloop / torch); the notes give jaxloop's model-FLOPs utilisation
  against the GPU's measured 8192^3 matmul peak in that precision (fp32: full float32, no TF32, as
  jaxloop's fp32 policy computes). Without a GPU, "unmeasured: no GPU". Run them where the GPU is and merge
  the JSON: `python -m benchmarks --only accel --out gpu.json` there, then
  `python -m benchmarks --from-json cpu.json gpu.json --markdown BENCHMARKS.md` (the header names the GPU
  machine beside its rows).
- **gpt2.cpu**: benchmarks/bench_gpt2.py, the update of `--preset gpt2-small`'s model (124M: 12 x 768,
  GPT-2's vocabulary padded to 50304, tied) at context 128, batch 2, fp32 on the CPU: tokens/s of jaxloop
  / torch_ref eager (ratio > 1: jaxloop faster), torch.compile's in the notes; one update per block, three
  rounds interleaved, the same initial weights and batches. No goal: the issue sets none for the CPU.
- **gpt2.gpu**: on a GPU, GPT-2 small at context 1024, batch 16, bf16, model.attention=auto: tokens/s of
  jaxloop / torch_ref eager (autocast), torch.compile's and every contender's MFU (6N + 12LTd against the
  GPU's table peak, jaxloop.flops) in the notes; goal: jaxloop's MFU >= 45%. Without a GPU,
  "unmeasured: no GPU lent to this task".
"""

FINDINGS = """
## Where the GPT's compile time goes (scan over blocks)

Measured 2026-11-23 on the 2-core AMD EPYC (loaded by other jobs, so in CPU seconds of the compiling
process, which load disturbs far less than wall time), jax 0.10.2, 4-block GPT ctx 128 batch 32:

| compiled function (jit(...).lower().compile()) | unrolled blocks | `GPT(scan_blocks=True)` |
|---|---|---|
| forward + backward (jax.grad of the loss) | 3.0 s | 5.1 s |
| optimizer update alone (MultiSteps(clip, adamw), 52 leaves) | 6.1-6.6 s | 5.5 s |
| grad + optimizer | 8.3 s | 10.0 s |
| the whole train_step | 10.5-11.7 s | 14.1-15.1 s |
| eval_step | 1.0-1.3 s | 1.6-1.9 s |

- A lax.scan over the blocks (tried as `GPT(scan_blocks=True)`) makes XLA:CPU's compile *slower* here (the while loop's body, its
  dynamic slices of the stacked weights and the stacked residuals of the backward pass cost more than
  compiling four copies of a small block), and the update got slower: in this file's run, row
  scan.gpt128 (since removed) measured the scanned update 1.18x the unrolled one's time and its compile 14.0 vs 9.8 CPU
  seconds; a fresh process's first compile 12.5 vs 9.0 CPU seconds. The scanned formulation was
  therefore removed again (the measurement is kept here).
- Stacking the block parameters as nn.scan does ([n_layers, ...] under one name, 16 leaves instead of
  52) only takes the optimizer's compile from 6.1 to 3.6 s.
- The optimizer dominates: MultiSteps alone doubles it (chain(clip, adamw) without MultiSteps: 3.3 s;
  with it: 6.6 s; both lax.cond branches over every leaf), and the same MultiSteps(clip, adamw) over
  one raveled float32 vector (jax.flatten_util.ravel_pytree, 818k entries) compiles in 0.6 s. That,
  not the blocks, is the way to the <= 2 s goal (optim/step's owners). The persistent compilation
  cache (row startup.cache) removes the XLA part on every run after the first; what remains is
  tracing and lowering train_step (about 1.5-2 CPU seconds, also mostly the per-leaf optimizer), which
  JAX's cache cannot skip (jaxloop.executables now does, for the built-in tasks).
"""

FINDINGS += """
## The optimizer's compile and run time, after the rewrite of the accumulation

Measured 2026-11-23 15:00-15:20Z on the 2-core AMD EPYC (quiet), each part `jax.jit(...).lower()` then
`.compile()` in one script over the 4-block GPT's 52 parameter leaves, runs with the loop's host
memory policy (wall seconds; noisy to about 20%):

| optimizer update (ctx 64 params) | XLA compile | run |
|---|---|---|
| optax.adamw | 0.5 s | 1.0-1.4 ms |
| chain(record_grad_norm, clip, inject_hyperparams(adamw)) | 0.8-1.1 s | 1.2-1.9 ms |
| + optax.MultiSteps(K=1) | 1.7-2.4 s | 2.8 ms |
| + the former skip_nonfinite_windows (checks the whole new state) | 2.6-3.9 s | 4.5-7.8 ms |
| make_optimizer now (K=1: no accumulator traffic; skip decided from the gradient's sum of squares) | 2.2-2.3 s | 1.9 ms |

optax.MultiSteps runs the inner optimizer at every micro-batch and selects each leaf of its result;
the former skip transformation then reduced over the whole new state and chose between two whole
states. In the whole GPT train_step, a select per leaf on the skip predicate compiled in 10.9 s
against 3.6 s for a lax.cond around Adam (the run time within noise), hence the lax.cond. Whole step,
ctx 128 batch 32: trace + lower 2.06 -> 1.13 s, XLA 4.71 -> 2.99 s. The stacked-blocks experiment
above was repeated this session, before the rewrite: nn.scan over the blocks (XLA) compiled in 6.1 s
against 4.7 s unrolled, and its update ran 698 against 469 ms.
"""

FINDINGS += """
## Where the MLP loop's time goes: Orbax's checkpoint saves

Measured 2026-11-23 17:40-17:55Z on the 2-core AMD EPYC (scripts around `jaxloop.train.run`, digits MLP
b64, K = 1, 1000 updates, log_every 10; `time.thread_time` / `process_time` per thread and process):

| loop | median step_ms | process CPU | prefetch thread CPU |
|---|---|---|---|
| no periodic save (`checkpoint.every 0`) | 0.29-0.37 ms (the update alone: 0.40 ms) | 1.0 s | 0.04-0.05 s |
| async saves every 100 updates (the loop rows' setting) | 0.52-0.67 ms | 2.2-2.5 s | 0.04-0.05 s |

- Every save costs Orbax 110-150 ms of CPU (the MLP state: 36 small leaves), in the background but on
  the same two cores as the steps. 100 updates of this MLP compute in 30-40 ms, so a save every 100
  updates costs 2-3x the training it follows: the next save waits for the previous one, and the loop
  is blocked. That blocking is loop time (the issue's loop efficiency counts async checkpoints every
  100); the loop rows measured it only from this run on (`step_ms` used to leave saves out, and the
  rows took the median interval, which leaves out the one interval in ten that holds a save).
- Orbax's CPU per save, `CheckpointManager.save` + `wait_until_finished` in one script (10 saves):
  the state item alone 89-104 ms as jax.Arrays (the jax.Array handler's per-array bookkeeping, thread
  start-ups, the deletion of the step that rotates out), 51-70 ms as NumPy arrays (copied and written
  all the same); the three JSON items
  9 ms. The loop now hands Orbax zero-copy NumPy views on one CPU process (`jaxloop.checkpoint._for_orbax`):
  `python benchmarks/bench_checkpoint.py --cpu --sizes mlp 512x6` (18:18Z, medians of 10 alternating
  sync saves): digits MLP 97.8 -> 55.4 ms of CPU per save (0.57), GPT 19M params 889 -> 588 ms (0.66). To keep saves
  every 100 updates within the <= 1.10 goal, a save would have to cost
  under ~4 ms of CPU; no Orbax configuration tried comes near (use_ocdbt=False 142 ms, zarr3 123 ms).
  Nor can any state: Orbax's floor, the same Checkpointer saving one leaf of 4 floats with the same JSON
  items, costs 21.0 ms of CPU per save (`python benchmarks/bench_checkpoint.py --cpu --sizes mlp`,
  2026-11-25 00:35Z at b5a9374; the MLP state 38.2 ms as NumPy views, 60.5 ms as jax.Arrays), and a bare
  `CheckpointManager` saving one `StandardSave` item of 4 floats 13.5 ms of CPU, 14.0 ms wall (one
  item of the MLP's 36 leaves: 33.2 ms; the same bytes as one leaf: 15.0 ms). Packing the state into
  one leaf would save the blocking but not the floor, and would cost the checkpoint its named arrays
  and its sharded layout, so it was not done.
- Re-measured 2026-11-24 00:45-00:55Z at 3ef9051 (quiet; `jaxloop.train.run`, 2000 updates, medians of
  3 alternating runs): saves every 100 updates, 0.70 ms per update by step_ms; no periodic save, 0.26 ms
  (the compiled update alone: 0.31 ms; a lax.scan of 50 updates, as the loop dispatches, 0.24 ms);
  logging every 10 against every 1000, and TensorBoard on or off, within 0.03 ms. So all of the gap is
  the saves, about 44 ms per save: 23 ms of blocking (the previous hand-over still running) and the rest
  their CPU taken from the steps. Even overlapped perfectly on the two cores, the save's CPU bounds the
  loop near 0.45 ms per update (1.45x). Orbax's `enable_background_delete` and
  `AsyncOptions(create_directories_asynchronously=True)`, alone and together: 0.84-0.90 ms against 0.88
  ms for the default in one interleaved script (noise). A lax.scan's `unroll` of 2, 5 or 10: within
  0.01 ms of 1.
- loop.gpt64.k4 runs 75 updates: it holds no periodic save (only the final one, outside its intervals).
  Its notes' figure "without any save" leaves out the time saves block, not the CPU their background
  writes take from the steps.
- The prefetch thread gathers a whole call's micro-batches in one grain element
  (`TrainLoader.chunks`): 0.113 -> 0.048 s of its CPU per 1000 updates in the loop (thread_time, the
  script above); alone, `python benchmarks/bench_data.py --chunks 50` (19:27Z): 2.507 -> 0.366 ms a call.

## A second run's start-up: the executable cache (startup.cache, startup.digits)

The table above (00:07-00:26Z at 3ef9051) has startup.cache at 0.30 s, against 1.12 s for JAX's cache
alone. The start-up rows of the other runs, all in fresh processes with caches of their own
(`python -m benchmarks --only startup` for the 22:40Z rows, at 5822d7f, which compiles the same
programs; the 23:20Z row, a full run at 3ef9051 on a machine loaded by other jobs, stopped at its
checkpoint row):

| run | startup.cache (executable loaded) | JAX's cache alone: trace + lower + load | startup.digits (second run / first / no cache) | startup.compile |
|---|---|---|---|---|
| 22:40:47Z | 0.35 s | 1.35 s = 0.99 + 0.37 | 2.18 / 4.80 / 4.25 s | 4.94 s |
| 22:41:54Z | 0.38 s | 1.34 s = 1.02 + 0.33 | 2.29 / 4.49 / 4.80 s | 4.65 s |
| 23:20:50Z (loaded) | 0.32 s | 1.65 s = 1.08 + 0.58 | 2.47 / 5.27 / 5.83 s | 3.44 s |
| 00:07:15Z (this file) | 0.30 s | 1.12 s = 0.83 + 0.29 | 1.87 / 4.13 / 5.18 s | 3.68 s |

- What remains of a loaded start-up is `deserialize_and_load` (XLA:CPU links the executable's code:
  ~0.3 s for the GPT's train_step) and reading the key's inputs (jaxloop's sources are hashed once, at
  import).
- An executable that JAX loaded from its persistent cache serializes without its code (jax 0.10.2,
  XLA:CPU: the call loaded back fails with `NOT_FOUND: Function wrapped_tanh not found`), so
  jaxloop.executables stores only compiles it saw happen, and recompiles once without JAX's cache
  where JAX's cache answered (tests/test_executables.py reproduces both).

## Where the GPT's update time goes (profile, 2026-11-23 20:45-21:10Z, quiet machine)

Throwaway scripts around jaxloop.models.GPT (ctx 128, batch 32), the forward and backward of the loss
(480-570 ms), `jax.profiler` traces read with `jax.profiler.ProfileData`. Thunk time summed over the
4 blocks, per iteration (434 ms of thunks, 506 ms wall):

| part | forward | backward |
|---|---|---|
| attention q.k^T, batched over 128 (batch x heads) | 42 ms | 39 ms |
| attention weights.v | 32 ms | 16 ms |
| the reshapes / transposes around them | 20 ms | 10 ms |
| softmax's division, its broadcast materialised | 16 ms | |
| MLP matmuls (fc, proj) | 37 + 26 ms | 37 + 18 ms |

- Alone, XLA:CPU's batched product of 128 matrices 128x128 @ 128x32 takes 2.6-3.9 ms; torch's `bmm`
  takes 1.03 ms. In the full graph the YNNPACK fusions XLA:CPU makes here run these dots at ~13 GFLOP/s.
  The attention core's forward and backward for one block: 37 ms in JAX against 22 ms in torch eager.
  The MLP block's: 33 ms against 42 ms, in JAX's favour.
- Tried, interleaved in one process over 6 rounds: heads-major layout, q scaled before the product, k
  pre-transposed, and `jax.nn.dot_product_attention`. All were within noise of the current formulation
  (504 ms median; the variants 514-559 ms).
- XLA:CPU flags, applied per executable with `.compile(compiler_options=...)` and interleaved at ctx 64,
  were all within 1 ms of the default: the concurrency-optimized scheduler, a vector width of 512,
  XNN graph fusion GREEDY_SLINKY, and fast math. Fast math moved the gradients by 4e-8, so the options
  took effect.
  Tried 2026-11-24 00:35Z at ctx 128 batch 32 (the forward and backward; base 420-428 ms): per executable,
  `xla_cpu_use_onednn`, `xla_cpu_experimental_onednn_custom_call` (both bit-identical to the base: not
  in this jaxlib's CPU build, it seems), `xla_cpu_use_xnnpack=false` and
  `xla_cpu_multi_thread_eigen=false`, 422-438 ms; through XLA_FLAGS in fresh processes,
  `xla_cpu_experimental_ynn_fusion_type` empty or `individual_dot`, `..._xnn_fusion_type=dot,eltwise` and
  `..._onednn_fusion_type=dot`, 432-525 ms. None faster.
- At ctx 64 batch 12 the update is latency-bound: its thunks run one after another (their summed time
  equals the wall time, ~50 ms). The dots take 29 ms of that, and the transposes feeding the weight
  gradients 4.3 ms.

## Reading a run taken on a loaded machine

On a machine that other jobs load (load average 7-10 on 2 cores during a run of an earlier session),
torch_ref's figures inflate far more than jaxloop's: every small torch op is an OpenMP parallel region
whose barrier waits for a thread the scheduler has taken away, and torch_ref's update is hundreds of
small ops (per-parameter isfinite, .item() syncs), so the MLP's eager update went from 12 ms to 290 ms
between two runs minutes apart while jaxloop's went from 0.8 to 1.5 ms. Ratios against torch from a
loaded run are therefore far too flattering to jaxloop; only a quiet machine's run is a record.
"""

FINDINGS += """
## The first compile (startup.compile, goal <= 2 s): what else was tried

Measured 2026-11-24 04:00-04:35Z on the 2-core AMD EPYC (quiet), throwaway scripts around jaxloop's
train_step for the 4-block GPT at ctx 128 batch 32, wall seconds; two runs each unless said (noise
about 0.3 s):

- Where it goes: tracing and lowering the whole train_step 0.78-0.83 s, XLA 2.1-2.5 s. The forward and
  backward alone (jax.grad of the loss) lower in 0.37-0.40 s and compile in 0.89-0.90 s, so the
  optimizer and its glue take about 0.4 s of tracing and 1.3 s of XLA. `perf record` over four
  compiles of the optimizer alone (514 kernels): XLA's compile 72% of the process's samples, of which
  LLVM's code generation for the kernels 29 points, the MLIR fusion emitters 14 and the HLO passes 5.
- None of these brought the whole step's compile under the noise:

| tried | kernels | lower + XLA | update |
|---|---|---|---|
| as now | 862-909 | 0.78-0.83 + 2.07-2.50 s | 399-451 ms |
| the gradient's squared norm computed once and handed to record_grad_norm and the clip through optax's extra_args (it was computed again inside the lax.cond, where XLA cannot share it) | 790 | 0.79-0.83 + 2.33-2.82 s | same, bit-identical |
| the optimizer over one raveled vector inside the step (the state stays a tree: concatenated and split every step) | | 0.58-0.65 + 2.23-2.61 s | 409-426 ms |
| params and optimizer state stacked over the 4 blocks (16 leaves instead of 52; the model unrolled over static slices of the stack) | 528 | 0.68-0.70 + 2.85-2.88 s | 434-438 ms |
| params and optimizer state kept as one raveled vector (a different checkpoint layout, never built) | | 0.33 + 1.71-1.76 s | 425-432 ms |

- Compile options, one process, one compile each after the same lowering: default 2.16 s (update 420
  ms); `xla_cpu_opt_preset` CPU_OPT_PRESET_FAST_COMPILE 2.38 s (428-436 ms; results moved by 6e-8, so
  it took effect), CPU_OPT_PRESET_FAST_RUNTIME 2.24 s; `xla_cpu_parallel_codegen_split_count` 8 or 64:
  2.24 and 2.40 s; `xla_cpu_use_fusion_emitters=false` 4.29 s. In fresh processes:
  `xla_backend_optimization_level` 1 2.06 s and `xla_llvm_disable_expensive_passes` 2.07 s (default
  2.07-2.32 s, update the same); level 0 1.51 s, but the update took 719 ms instead of 399-405.
- So even the flat layout, which the FSDP sharding and the checkpoint layout torch_ref's converter
  reads argue against, would leave the first compile near 2.1 s.

## Orbax options for the MLP's save (loop.mlp)

`CheckpointManager.save` + `wait_until_finished`, the MLP state as the loop hands it (NumPy views) with
the three JSON items, process CPU per save, medians of 10 alternating saves (2026-11-24 04:03Z): as now
51.6 ms; `PyTreeCheckpointHandler(use_compression=False)` 51.7 ms (and 4x the bytes on disk);
`save_root_metadata=False` 51.4 ms; `temporary_path_class=CommitFileTemporaryPath` 49.5 ms. A cProfile
of one sync save: ten `asyncio` event loops started and about 16 threads (Orbax's own), 6 ms to
delete the step that rotates out, 10 ms of finalising.
"""

FINDINGS += """
## The GPT's dots inside the step against alone (ctx 128 batch 32)

`jax.profiler` trace of jaxloop's train_step, 2026-11-24 04:55-05:05Z (quiet), per call:

- The dense dots inside the step take 3.2-7.5 ms each (72-168 GFLOP/s). The MLP's fc forward,
  [4096,128] @ [128,512], takes 5.7-7.5 ms. Alone, jitted and timed without the profiler, the same
  dot takes 3.24-3.42 ms (157-166 GFLOP/s). Alone, storing the weight as [out, in] (torch's layout)
  and contracting its second axis gives the same time within 0.1 ms, so that layout would not help.
  Little of the other thread's work overlaps these dots in the trace: 0-0.7 ms of 7, except 3.5 ms
  for one qkv dot. Pinned to one core (`taskset -c 0`), the fc forward takes 11.6 ms inside the step
  against 6.5 ms alone. So the dot runs about 1.8x slower inside the step on one core as on two: the
  second core being taken is not the cause.
- The batched attention scores, [32,4,128,32] @ [32,4,32,128], take 6.6-9.3 ms inside the step on
  two cores and 6.7 ms on one. This dot does not use the second core. Alone it takes 2.45 ms. Split
  into 2, 4 or 8 independent dots, for the executor to run side by side: 2.8-3.1 ms. Slower.
- The whole step takes 415 ms on two cores and 739 ms on one.
- Why (2026-11-25 06:32Z, `python benchmarks/profile_step.py --modes worker inline hugepages`, the
  slower EPYC): on jax's worker thread the step's temporaries are mmapped afresh each call (next
  finding), so the dots fault in the pages they write. Summed over XLA's threads, ms per update, worker
  thread / inline / huge pages: wall 392.8 / 225.6 / 241.2, all thunks 334.1 / 179.1 / 191.0, the
  YNNPACK fusions that hold the dots 204.0 / 132.4 / 135.8, the rest 130.2 / 46.7 / 55.2. The thunk
  slowest on the worker thread, ynn_fusion.169, takes 7.44 ms there and 1.96 ms inline; a few others
  (ynn_fusion.82, .93, .104: about 5.0 ms in every mode) do not move. Inline, thunks fill 179 of the
  226 ms, and the step runs at about torch eager's speed (bench_dispatch: 240.5 ms; torch_ref eager
  219.1 ms in the step rows of a `python -m benchmarks --only step` run at 05:50Z).
"""

FINDINGS += """
## The gpt128 step rows pay for jax's worker thread: 90,000 page faults per update

`python benchmarks/bench_dispatch.py` (2026-11-25 06:20Z, the slower 2-core EPYC of that day, matmul peak
196 GFLOP/s; glibc 2.36, transparent huge pages `madvise`; fresh processes alternated, 3 rounds, the
loop's host memory policy in all), ms per update and its ratio to jax's worker thread (its default):
CPU calls on the dispatching thread (`jaxloop.host_memory.run_cpu_calls_inline`), on the worker thread
with glibc's huge pages for mmapped blocks (`GLIBC_TUNABLES=glibc.malloc.hugetlb=1`), and on the worker
thread with one malloc arena for every thread (`MALLOC_ARENA_MAX=1`):

| shape | worker thread | inline | huge pages | one arena |
|---|---|---|---|---|
| digits MLP b64, one train_step per call (the step rows) | 0.274 | 0.355 = 1.30 | 0.267 = 0.97 | 0.426 = 1.55 |
| digits MLP b64, the loop's call (10 updates, lax.scan) | 0.210 | 0.234 = 1.11 | 0.205 = 0.97 | 0.266 = 1.26 |
| GPT ctx64 b12, one train_step per call | 34.5 | 36.6 = 1.06 | 35.3 = 1.02 | 38.8 = 1.13 |
| GPT ctx64 b12, the loop's call | 34.1 | 34.6 = 1.01 | 35.2 = 1.03 | 38.2 = 1.12 |
| GPT ctx128 b32, one train_step per call | 316.0 (faults 89,082) | 240.5 = 0.76 (0) | 263.3 = 0.83 (641) | 286.3 = 0.91 (8,206) |
| GPT ctx128 b32, the loop's call | 246.7 (faults 8,927) | 230.1 = 0.93 (0) | 250.9 = 1.02 (54) | 239.7 = 0.97 (0) |

- The 4-block GPT at ctx 128, batch 32 has 335 MB of temporaries per call. On jax's worker thread they
  come from a glibc secondary arena, whose heaps hold at most 64 MiB, so every call mmaps them afresh
  and faults every page in (strace: one 334,880,768-byte mmap and munmap per call). On the dispatching
  thread they come from the main heap, which the policy keeps. The loop's call allocates them once per
  10 updates, so inside the loop the update costs 247 ms, against 316 ms one call per update.
- Run inline, the small calls lose the overlap of Python with the call (the MLP 1.1-1.3x slower; a run
  at 03:26Z had 1.59 and 1.67), so neither the loop nor the step rows run inline.
- Huge pages leave the mmaps but fault 2 MiB at a time (641 faults instead of 89,082), and cost the
  small calls nothing. glibc reads the tunable only at process start, so a run cannot set it for
  itself; a research loop calling train_step one micro-batch at a time on a model of this size can
  start with it, or run inline (docs/your-model.md, "Your own loop", and docs/speed.md).
- One arena for every thread (tried as the loop's policy, mallopt M_ARENA_MAX 1 before jax starts its
  threads) puts jax's workers on the main heap's lock beside Python's thread: the MLP's calls 1.3-1.6x
  slower. Its heap still faults now and then, when a small allocation has split the freed 335 MB and the
  next call's temporaries land above it. `python -m benchmarks --only step --only loop` at HEAD and then
  with (M_ARENA_MAX, 1) added to `jaxloop.host_memory.SETTINGS` (05:50-06:10Z, uncommitted) took
  step.gpt128.k1 from 1.74 to 1.18 but step.mlp.k4 from 0.457 to 0.731, so it was not kept.
- The policy now also takes blocks over 32 MiB from the heap (M_MMAP_MAX 0). Without it, once a small
  long-lived allocation (a NumPy view of the state, in the probe) split the freed chunk, every later
  call of the same update mmapped its 335 MB again, even on the dispatching thread.
"""

FINDINGS += """
## What is left of the GPT update's time: its dots alone against the step goal

`python benchmarks/dot_floor.py` (2026-11-25 07:30Z at baf775e, the slower 2-core EPYC, 1m26s): every
dot of jaxloop's compiled train_step (75: XLA:CPU's optimized HLO, fused or not) timed alone, as the HLO
states it and as the same B x [M, K] @ [K, N] product in the canonical layout (XLA:CPU and torch.matmul,
the same 2 threads), summed, beside the update itself (jaxloop's compiled train_step and torch_ref's
eager update, interleaved, 5 rounds). ms per update, and the ratio to torch eager's update:

| | gpt64 (ctx 64, b12; 3.96 GFLOP) | gpt128 (ctx 128, b32; 22.75 GFLOP) |
|---|---|---|
| update, jaxloop | 35.22 = 0.79 | 323.71 = 1.47 |
| update, torch_ref eager | 44.67 | 220.25 |
| goal, 0.7x torch eager | 31.27 | 154.18 |
| dots alone, as the HLO states them (XLA:CPU) | 31.44 = 0.70 | 209.21 = 0.95 |
| dots alone, best of that and canonical (XLA:CPU) | 24.68 = 0.55 | 139.74 = 0.63 |
| dots alone, canonical (torch.matmul) | 21.93 = 0.49 | 142.29 = 0.65 |
| jaxloop's update outside its dots (vs the best) | 10.54 = 0.24 | 183.98 = 0.84 |
| torch's update outside its dots | 22.74 = 0.51 | 77.97 = 0.35 |

- Even with every dot in its fastest layout, the dots alone take 0.55x (gpt64) and 0.63x (gpt128) of
  torch eager's whole update, so the 0.7x goal leaves 0.15x and 0.07x for everything else: the layer
  norms, softmax, GELU, the loss, the optimizer over 52 leaves and the thunks' own overhead (about 850
  thunks per call at gpt64). Torch spends 0.51x and 0.35x on those; jaxloop 0.24x at gpt64. At gpt128
  jaxloop's remainder includes the worker thread's page faults (the finding above, "The gpt128 step rows pay for jax's
  worker thread").
- The gap between the HLO's layout and the canonical one (31.4 against 24.7 ms at gpt64) is in the
  weight gradients: XLA:CPU contracts the activation's first axis against a transposed copy of the
  output gradient. Tried (07:27Z, one process, interleaved over 7 rounds): a custom_vjp for the GPT's
  Dense layers whose weight gradient materialises the activation's transpose behind
  lax.optimization_barrier, which alone runs that product in 0.72 ms instead of 1.00 (gpt64's
  [768,512]^T @ [768,128]) and 3.74 instead of 5.15 ms (gpt128's). Inside the step: gpt64 35.92 against
  35.19 ms, gpt128 384.7 against 385.7 ms, so XLA:CPU already runs them its own way there; not kept.
- Also tried at 07:15-07:25Z, fresh processes: `XLA_FLAGS=--xla_cpu_experimental_ynn_fusion_type=` with
  `dot,eltwise,reduce` 61.7-64.4 ms, `dot,eltwise` 65.2-65.6 ms, `dot,reduce` 35.0-40.3 ms against
  33.7-34.9 ms for the default; and the ctx-64 loop (300 updates, 2 runs) over two host devices
  (`--xla_force_host_platform_device_count=2`, the batch split between them): 35.3-37.6 ms per update
  against 35.4-36.0 on one device, so XLA:CPU's second device does not run beside the first on 2 cores.
- How much of the remainder each non-dot part holds (07:35Z, gpt64, one process, ablated models
  compiled side by side, interleaved over 7 rounds; throwaway, results wrong on purpose): the update
  34.53 ms; every LayerNorm reduced to x * scale + bias 32.81 ms (1.72 ms saved); softmax replaced by
  an exp 34.01 ms (0.52 ms); GELU replaced by x / 2 36.33 ms (none). So no single part would free the
  4-9 ms that separate the update from the goal (its figure moves with torch eager's, 36.9-44.7 ms in
  this session's runs); a hand-written LayerNorm backward could win at most part of 1.7 ms.
"""

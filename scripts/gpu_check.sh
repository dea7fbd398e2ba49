#!/usr/bin/env bash
# The GPU checks of the CUDA backend in one pass, for a GPU machine with the bundle of
# scripts/bundle.sh unpacked (docs/cuda.md, "On a GPU machine"), each step under its own
# time limit so that one hang or crash does not cost the rest:
#   fresh    the ops first written without a GPU, swept in groups, a process each (so that a
#            crash in one group leaves the others' results), before the whole sweep
#   ops      the conformance sweep (mixtape-ops --backend cuda)
#   tests    the CUDA test suite (mixtape_cuda_tests), in four processes: the tests of what
#            ran on a GPU before, then [attention], [capture] and [float8]
#   sanitize the kernels first written without a GPU (attention, layer_norm, cross-entropy,
#            linear, the optimizers' list updates, clipping, the tape's cast_list) under
#            compute-sanitizer memcheck and racecheck (not in the default steps)
#   mnist    the trainer on mlp and cnn under float32, mixed_float16 and mixed_bfloat16
#   guide    the trainer on the guide workload under the three policies, and
#   torch    the PyTorch reference of it (torch.autocast + GradScaler), alternated with
#            guide in ROUNDS rounds (default 2)
#   base     the guide again with bin/mixtape-mnist-base (an earlier build copied into the
#            bundle, for a before / after on the same card), in the same rounds
#   custom   the trainer's custom GradientTape loop (guide mixed_float16, mlp mixed_bfloat16)
#   profile  per-kernel GPU times of two guide steps through Nsight Compute (ncu)
#   gemm     the cuBLAS rate of the guide's GEMM shapes, through PyTorch
#   gpt      the character-level GPT against its PyTorch twin (the bundle's
#            bench/charlm_reference.py: SDPA, fused AdamW, autocast, GradScaler), alternated
#            in GPT_ROUNDS rounds (default 2), GPT_STEPS steps a run (default 60): the
#            6-layer shape (width 384, 6 heads, context 256, batch 64) under mixed_bfloat16,
#            mixed_float16 and float32, the GPT-2-small body (--preset gpt2-small, batch 8)
#            under mixed_bfloat16 and mixed_float16 (and once more under mixed_bfloat16 with
#            MIXTAPE_CUDA_ATTENTION_WIDE_KEYS=1 at both shapes: the forward kernel walking the
#            keys 128 at a time; the plain kernels' run, MIXTAPE_CUDA_MMA_ATTENTION=0, which
#            took the step past its limit at GPT-2 small's shape, is no longer made);
#            gpt.log has each mixtape run's --kernel-census (the kernels of one step); the
#            captured step (--capture-step, a CUDA graph) at both shapes and at charlm's defaults
#   gptprofile  per-kernel GPU times of one training step of the GPT-2-small body (batch 8,
#            mixed_bfloat16), mixtape's and its PyTorch twin's, through Nsight Compute recording
#            only the step each program marks (cudaProfilerStart/Stop: mixtape-charlm's
#            --kernel-census step, charlm_reference.py's --profile-step), summed by kernel with
#            scripts/ncu_summary.py into gpt_profile.txt
#   f8profile   the same for mixtape's step under mixed_float8 (not in the default steps)
#   attnprofile  why the attention kernels take their time: Nsight Compute's sections (speed
#            of light, occupancy, warp states, pipes, memory, instructions, the stalls'
#            sources) for the last layer's forward, dq and dk/dv tile kernels of the same
#            GPT-2-small step, and for PyTorch's fused attention kernels (cuDNN's) of its step,
#            in attn_profile_*.txt (not in the default steps)
#   float8   mixed_float8 against mixed_bfloat16 (FP8 GEMMs on Hopper): the guide workload and
#            the GPT-2-small body (FLOAT8_STEPS steps, default 300: tokens/s and the validation
#            loss) alternated in ROUNDS rounds, the GPT-2-small body once under
#            mixed_float8_delayed, mixed_float8 with --capture-step, and MNIST mlp and cnn
#            accuracy under both policies
#   gptcompile  PyTorch's torch.compile at both shapes under mixed_bfloat16 (one round; its
#            compilation takes a minute or more a run, so it is not in the default steps)
#            (GPT_DEVICE=cpu runs these two on the CPU: a dry run of the step itself)
#
#   bash scripts/gpu_check.sh BUNDLE_DIR LOG_DIR [reference_pytorch.py] [STEPS]
#
# STEPS: a comma-separated subset of the steps above (default: all but gptcompile), always the
# fourth argument ("" for the third). Logs go to LOG_DIR, a file or two per step; summary.txt
# has a line per run. DEADLINE (seconds from the start; default none): no run starts after it, and
# each run's time limit is cut to what is left, so that one call ends in time whatever hangs.
# Programs run line-buffered and are killed 5 s after their limit, so a killed run's log keeps
# what it printed. Needs nvidia-smi (peak memory), and python3 with PyTorch for torch, gemm,
# gpt and gptcompile, ncu for profile, compute-sanitizer for sanitize.
#
# scripts/gpu_lease.sh runs these steps in parts under one budget, for a lease of one call.
set -uo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
bundle="$(cd "$1" && pwd)"
logs="$2"
ref="${3:-}"
steps=",${4:-fresh,ops,tests,mnist,guide,torch,custom,profile,gemm,gpt},"
mkdir -p "$logs"
summary="$logs/summary.txt"
: >"$summary"
note() { echo "$*" | tee -a "$summary"; }
want() { [[ "$steps" == *",$1,"* ]]; }
deadline="${DEADLINE:-0}"

# limited SECONDS CMD [ARGS...]: CMD under timeout (killed 5 s after SIGTERM), line-buffered;
# the limit cut to what is left before DEADLINE, and nothing run (rc 124) when under 5 s are.
limited() {
  local t=$1
  shift
  if ((deadline > 0)); then
    local left=$((deadline - SECONDS - 5))
    ((left < t)) && t=$left
  fi
  if ((t < 5)); then
    echo "not run: DEADLINE (${deadline} s) reached"
    return 124
  fi
  local buffering=()
  # (not around the profilers, which inject libraries of their own)
  if command -v stdbuf >/dev/null && [[ $1 != compute-sanitizer && $1 != ncu ]]; then
    buffering=(stdbuf -oL -eL)
  fi
  timeout -k 5 "$t" "${buffering[@]}" "$@"
}

# Peak GPU memory in use (MiB, the whole device, as nvidia-smi reports it) while CMD runs.
with_peak_memory() {
  local samples
  samples="$(mktemp)"
  nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 100 >"$samples" 2>/dev/null &
  local smi=$!
  "$@"
  local rc=$?
  kill "$smi" 2>/dev/null
  wait "$smi" 2>/dev/null
  peak_mib="$(sort -n "$samples" | tail -1)"
  rm -f "$samples"
  return $rc
}

note "== $(date -u +%FT%TZ) $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader)"
# What the programs still lack with run.sh's library folders (which this first call finds).
note "libraries: $(limited 60 "$bundle/run.sh" --ldd | tr '\n' ';')"
note "tools: $(for t in compute-sanitizer ncu stdbuf python3; do command -v "$t" >/dev/null && echo -n "$t " || echo -n "(no $t) "; done)"

# The ops first written without a GPU, a process per group, each case's line (-v) in fresh.log.
if want fresh; then
  for group in "attention attention_backward" "linear linear_backward" \
    "layer_norm layer_norm_backward softmax_cross_entropy softmax_cross_entropy_backward dropout" \
    "adam_update sgd_update rmsprop_update sum_squares scale_list cast_list unscale_check loss_scale_update" \
    "scaled_matmul quantize_float8 cast"; do
    ops=()
    for op in $group; do ops+=(--op "$op"); done
    t0=$SECONDS
    echo "--- $group" >>"$logs/fresh.log"
    limited 45 "$bundle/run.sh" mixtape-ops --backend cuda -v "${ops[@]}" >>"$logs/fresh.log" 2>&1
    note "fresh $group: rc=$? $((SECONDS - t0)) s: $(tail -1 "$logs/fresh.log")"
  done
fi

if want ops; then
  t0=$SECONDS
  limited 90 "$bundle/run.sh" mixtape-ops --backend cuda -v >"$logs/ops.log" 2>&1
  note "ops: rc=$? $((SECONDS - t0)) s: $(tail -1 "$logs/ops.log")"
  grep -E "FAIL|failed" "$logs/ops.log" | grep -v " 0 failed" | head -20 | tee -a "$summary"
  # The linear op again with cuBLASLt's epilogues off (its own kernel after the product):
  # where the line above fails on linear, this says whether the epilogues are the cause.
  MIXTAPE_CUDA_LT_EPILOGUES=0 limited 30 "$bundle/run.sh" mixtape-ops --backend cuda --op linear \
    >"$logs/ops_variants.log" 2>&1
  note "ops linear, MIXTAPE_CUDA_LT_EPILOGUES=0: rc=$?: $(tail -1 "$logs/ops_variants.log")"
  # The attention with its tensor-core kernels off (the plain kernels for every case): where
  # the first line fails on attention, this says whether the tiled kernels are the cause.
  MIXTAPE_CUDA_MMA_ATTENTION=0 limited 30 "$bundle/run.sh" mixtape-ops --backend cuda \
    --op attention --op attention_backward >>"$logs/ops_variants.log" 2>&1
  note "ops attention, MIXTAPE_CUDA_MMA_ATTENTION=0: rc=$?: $(tail -1 "$logs/ops_variants.log")"
  # The forward kernel that walks the keys 128 at a time (docs/environment.md).
  MIXTAPE_CUDA_ATTENTION_WIDE_KEYS=1 limited 30 "$bundle/run.sh" mixtape-ops --backend cuda \
    --op attention >>"$logs/ops_variants.log" 2>&1
  note "ops attention, MIXTAPE_CUDA_ATTENTION_WIDE_KEYS=1: rc=$?: $(tail -1 "$logs/ops_variants.log")"
fi

if want tests; then
  # Four processes: a crash in the tests of what is new to the GPU (the fused attention, the
  # captured step, the FP8 path) does not hide the results of the rest.
  for filter in "~[attention]~[capture]~[float8]" "[attention]" "[capture]" "[float8]"; do
    t0=$SECONDS
    echo "--- $filter" >>"$logs/cuda_tests.log"
    limited 100 "$bundle/run.sh" mixtape_cuda_tests --durations yes "$filter" \
      >>"$logs/cuda_tests.log" 2>&1
    note "tests $filter: rc=$? $((SECONDS - t0)) s: $(grep -E '^(test cases|All tests)' "$logs/cuda_tests.log" | tail -1)"
  done
fi

# The kernels first written without a GPU (2026-11-27/28) under compute-sanitizer: memcheck
# (out-of-bounds and misaligned accesses) and racecheck (shared-memory races: the tiled
# attention's). Both runs go to sanitize.log.
if want sanitize && ! command -v compute-sanitizer >/dev/null; then
  note "sanitize: not run: no compute-sanitizer on PATH"
elif want sanitize; then
  fresh_ops=(--op attention --op attention_backward --op layer_norm --op layer_norm_backward
    --op softmax_cross_entropy --op softmax_cross_entropy_backward --op linear
    --op linear_backward --op dropout --op adam_update --op sgd_update --op rmsprop_update
    --op sum_squares --op scale_list --op cast_list --op unscale_check --op loss_scale_update)
  # racecheck looks at shared memory: the kernels that use it (the tiled attention, the
  # reductions), not the cuBLASLt products of linear.
  race_ops=(--op attention --op attention_backward --op sum_squares --dtype bfloat16
    --dtype float16 --dtype float32)
  for tool in memcheck racecheck; do
    t0=$SECONDS
    echo "--- $tool" >>"$logs/sanitize.log"
    if [[ $tool == memcheck ]]; then args=("${fresh_ops[@]}"); else args=("${race_ops[@]}"); fi
    limited 120 compute-sanitizer --tool "$tool" --target-processes all --error-exitcode 3 \
      --launch-timeout 60 "$bundle/run.sh" mixtape-ops --backend cuda "${args[@]}" \
      >>"$logs/sanitize.log" 2>&1
    note "sanitize $tool: rc=$? $((SECONDS - t0)) s: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$logs/sanitize.log" | tail -1); $(tail -1 "$logs/sanitize.log")"
  done
fi

# One trainer run: MODEL POLICY EPOCHS [extra arguments]; its epoch lines go to mnist.log.
# MNIST_BIN names the program (default mixtape-mnist).
mnist() {
  local model=$1 policy=$2 epochs=$3 bin=${MNIST_BIN:-mixtape-mnist}
  shift 3
  local metrics="$logs/metrics_${model}_${policy}.jsonl"
  echo "--- $bin $model $policy $epochs epochs $*" >>"$logs/mnist.log"
  t0=$SECONDS
  with_peak_memory limited "${MNIST_TIMEOUT:-30}" "$bundle/run.sh" "$bin" --device cuda \
    --data-dir "$bundle/data" --model "$model" --policy "$policy" --epochs "$epochs" \
    --verbose 2 --metrics-out "$metrics" "$@" >>"$logs/mnist.log" 2>&1
  local rc=$?
  note "$bin $model $policy: rc=$rc $((SECONDS - t0)) s, peak ${peak_mib} MiB: $(grep -iE 'epoch|test acc' "$logs/mnist.log" | tail -1)"
  cat "$metrics" >>"$logs/mnist.log" 2>/dev/null
  rm -f "$metrics"
}

if want mnist; then
  for policy in float32 mixed_float16 mixed_bfloat16; do
    mnist mlp "$policy" 3
    mnist cnn "$policy" 2
  done
fi
# The guide workload side by side with the PyTorch reference (torch.autocast + GradScaler
# for mixed_float16), alternated in ROUNDS rounds (default 2) so that both see the same card.
torch_guide() {
  local policy=$1
  t0=$SECONDS
  PYTHONUNBUFFERED=1 with_peak_memory limited 45 python3 "$ref" --data "$bundle/data" --model guide \
    --precision "$policy" --device cuda --epochs 5 >>"$logs/torch.log" 2>&1
  note "torch guide $policy: rc=$? $((SECONDS - t0)) s, peak ${peak_mib} MiB: $(tail -1 "$logs/torch.log")"
}
for round in $(seq "${ROUNDS:-2}"); do
  for policy in float32 mixed_float16 mixed_bfloat16; do
    want guide && mnist guide "$policy" 5
    want base && [[ -x "$bundle/bin/mixtape-mnist-base" ]] && MNIST_BIN=mixtape-mnist-base mnist guide "$policy" 5
    want torch && [[ -n "$ref" ]] && torch_guide "$policy"
  done
done
if want custom; then
  mnist guide mixed_float16 5 --custom-loop
  mnist mlp mixed_bfloat16 2 --custom-loop
fi

# Per-kernel GPU times of two guide steps (16384 images, one epoch) through Nsight Compute,
# for mixtape under mixed_float16 and float32 and for the PyTorch reference under
# mixed_float16 (a window of its steady-state kernels): which kernels the step time goes to.
# Needs ncu and a runtime that lets it read the GPU's counters.
if want profile && command -v ncu >/dev/null; then
  ncu_times() {  # NAME [ncu options] PROGRAM [ARGS...]
    local name=$1
    shift
    local csv
    csv="$(mktemp)"
    limited 120 ncu --clock-control none --metrics gpu__time_duration.sum --csv \
      --log-file "$csv" "$@" >/dev/null 2>&1
    note "ncu $name: rc=$? $(grep -c gpu__time_duration "$csv") kernels"
    { echo "# $name"; cat "$csv"; } >>"$logs/ncu.csv"  # one file for all runs
    rm -f "$csv"
  }
  for policy in mixed_float16 float32; do
    ncu_times "mixtape_$policy" "$bundle/run.sh" mixtape-mnist --device cuda \
      --data-dir "$bundle/data" --model guide --policy "$policy" --epochs 1 --limit 16384 --verbose 0
  done
  [[ -n "$ref" ]] && ncu_times torch_mixed_float16 --launch-skip 300 --launch-count 150 \
    python3 "$ref" --data "$bundle/data" --model guide --precision mixed_float16 --device cuda --epochs 1
fi

# The cuBLAS rate of the guide's largest GEMM (8192x4096 @ 4096x4096) and of its first
# layer (8192x784 @ 784x4096), median of 20 after 5 warm-ups, through PyTorch (which calls
# cuBLASLt for these), on random data; TF32 off for float32.
if want gemm; then
  PYTHONUNBUFFERED=1 limited 40 python3 - >>"$logs/gemm.log" 2>&1 <<'PY'
import torch, statistics
torch.backends.cuda.matmul.allow_tf32 = False
for (m, k, n) in [(8192, 4096, 4096), (8192, 784, 4096), (4096, 8192, 4096)]:
    for dt in (torch.float16, torch.bfloat16, torch.float32):
        a = torch.randn(m, k, device="cuda", dtype=dt)
        b = torch.randn(k, n, device="cuda", dtype=dt)
        for _ in range(5):
            a @ b
        ts = []
        for _ in range(20):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record(); a @ b; e.record(); e.synchronize()
            ts.append(s.elapsed_time(e) / 1e3)
        t = statistics.median(ts)
        print(f"gemm {m}x{k}x{n} {str(dt).split('.')[1]}: {2*m*k*n/t/1e12:.1f} TFLOP/s ({t*1e6:.1f} us)")
PY
  note "$(cat "$logs/gemm.log")"
fi
# The charlm at one shape and policy, mixtape or PyTorch: FRAMEWORK POLICY [shape arguments];
# one summary line with tokens/s, the validation loss, the device's peak memory (nvidia-smi) and
# the peak the tensors held (mixtape's memory_stats, PyTorch's max_memory_allocated).
gpt() {
  local framework=$1 policy=$2
  shift 2
  local steps=${GPT_STEPS:-60} out
  out="$(mktemp)"
  t0=$SECONDS
  if [[ $framework == mixtape ]]; then
    with_peak_memory limited 120 "$bundle/run.sh" mixtape-charlm --device "${GPT_DEVICE:-cuda}" \
      --text "$bundle/data/charlm.txt" --policy "$policy" --steps "$steps" --log-every "$steps" \
      --eval-every 0 --sample 0 --kernel-census "$@" >"$out" 2>&1
  else
    PYTHONUNBUFFERED=1 with_peak_memory limited 300 python3 "$bundle/bench/charlm_reference.py" \
      --device "${GPT_DEVICE:-cuda}" \
      --text "$bundle/data/charlm.txt" --precision "$policy" --steps "$steps" \
      --log-every "$steps" "$@" >"$out" 2>&1
  fi
  local rc=$?
  { echo "--- $framework $policy $*"; cat "$out"; } >>"$logs/gpt.log"
  note "gpt $framework $policy $*${GPT_NOTE:-}: rc=$rc $((SECONDS - t0)) s, peak ${peak_mib} MiB:" \
    "$(grep -E 'training throughput|validation loss|peak tensor memory' "$out" | tr '\n' ' ')" \
    "$(grep -oE '"(tokens_per_s|peak_allocated_mib|peak_reserved_mib)": [0-9.]*' "$out" | tr '\n' ' ')"
  rm -f "$out"
}
small_gpt=(--layers 6 --width 384 --heads 6 --context 256 --batch 64)
if want gpt; then
  # Most telling first (a DEADLINE may cut the list): the GPT-2-small body and the 6-layer
  # shape under mixed_bfloat16 against PyTorch, the captured step, then the other policies.
  for round in $(seq "${GPT_ROUNDS:-2}"); do
    gpt mixtape mixed_bfloat16 --preset gpt2-small --batch 8
    gpt pytorch mixed_bfloat16 --preset gpt2-small --batch 8
    gpt mixtape mixed_bfloat16 "${small_gpt[@]}"
    gpt pytorch mixed_bfloat16 "${small_gpt[@]}"
    # The captured step (a CUDA graph a step): both shapes, and charlm's defaults, where the
    # host sets the pace, with and without it.
    gpt mixtape mixed_bfloat16 "${small_gpt[@]}" --capture-step
    gpt mixtape mixed_bfloat16 --preset gpt2-small --batch 8 --capture-step
    gpt mixtape mixed_bfloat16
    gpt mixtape mixed_bfloat16 --capture-step
    gpt mixtape mixed_float16 --preset gpt2-small --batch 8
    gpt pytorch mixed_float16 --preset gpt2-small --batch 8
    for policy in mixed_float16 float32; do
      gpt mixtape "$policy" "${small_gpt[@]}"
      gpt pytorch "$policy" "${small_gpt[@]}"
    done
    gpt mixtape float32 "${small_gpt[@]}" --capture-step
    # The forward kernel walking the keys 128 at a time against the default 64, both shapes
    # (an experiment's switch: docs/environment.md).
    if [[ $round == 1 ]]; then
      GPT_NOTE=", MIXTAPE_CUDA_ATTENTION_WIDE_KEYS=1" MIXTAPE_CUDA_ATTENTION_WIDE_KEYS=1 \
        gpt mixtape mixed_bfloat16 --preset gpt2-small --batch 8
      GPT_NOTE=", MIXTAPE_CUDA_ATTENTION_WIDE_KEYS=1" MIXTAPE_CUDA_ATTENTION_WIDE_KEYS=1 \
        gpt mixtape mixed_bfloat16 "${small_gpt[@]}"
    fi
  done
fi
# gptprofile: NAME PROGRAM [ARGS...] under ncu, recording the range the program marks; the
# CSV and ncu's own output in LOG_DIR, the per-kernel table appended to gpt_profile.txt.
gpt_ncu() {
  local name=$1
  shift
  local csv="$logs/ncu_$name.csv"
  t0=$SECONDS
  limited 150 ncu --profile-from-start off --clock-control none --print-units base \
    --metrics gpu__time_duration.sum --csv --log-file "$csv" "$@" >"$logs/ncu_$name.out" 2>&1
  local rc=$?
  python3 "$here/ncu_summary.py" "$csv" --label "$name" >>"$logs/gpt_profile.txt" 2>&1
  note "gptprofile $name: rc=$rc $((SECONDS - t0)) s: $(grep "^$name:" "$logs/gpt_profile.txt" | tail -1)"
}
if want gptprofile && ! command -v ncu >/dev/null; then
  note "gptprofile: not run: no ncu on PATH"
elif want gptprofile; then
  gpt_ncu mixtape_gpt2_bf16 "$bundle/run.sh" mixtape-charlm --device cuda \
    --text "$bundle/data/charlm.txt" --policy mixed_bfloat16 --preset gpt2-small --batch 8 \
    --steps 3 --log-every 3 --eval-every 0 --sample 0 --kernel-census
  PYTHONUNBUFFERED=1 gpt_ncu pytorch_gpt2_bf16 python3 "$bundle/bench/charlm_reference.py" \
    --device cuda --text "$bundle/data/charlm.txt" --precision mixed_bfloat16 \
    --preset gpt2-small --batch 8 --steps 3 --log-every 3 --profile-step 2
fi
if want f8profile && command -v ncu >/dev/null; then
  gpt_ncu mixtape_gpt2_fp8 "$bundle/run.sh" mixtape-charlm --device cuda \
    --text "$bundle/data/charlm.txt" --policy mixed_float8 --preset gpt2-small --batch 8 \
    --steps 3 --log-every 3 --eval-every 0 --sample 0 --kernel-census
fi
# attnprofile: NAME KERNEL_REGEX SKIP COUNT PROGRAM [ARGS...]: ncu's sections for COUNT launches
# of the kernels KERNEL_REGEX names, after SKIP of them, in the range the program marks.
attn_ncu() {
  local name=$1 kernels=$2 skip=$3 count=$4
  shift 4
  t0=$SECONDS
  limited 150 ncu --profile-from-start off --clock-control none -k "regex:$kernels" \
    --launch-skip "$skip" --launch-count "$count" --section SpeedOfLight --section Occupancy \
    --section LaunchStats --section WarpStateStats --section SchedulerStats \
    --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
    --section InstructionStats --section SourceCounters "$@" >"$logs/attn_profile_$name.txt" 2>&1
  note "attnprofile $name: rc=$? $((SECONDS - t0)) s:" \
    "$(grep -cE '^  [a-zA-Z_].*\(([0-9]+, ){2}[0-9]+\)x' "$logs/attn_profile_$name.txt") kernels profiled"
}
if want attnprofile && command -v ncu >/dev/null; then
  # The step's tile kernels: 12 forwards, then per layer from the last, dq and dk/dv (the row
  # dot products have a kernel of their own, not matched).
  attn_ncu mixtape attention_tile 11 3 "$bundle/run.sh" mixtape-charlm --device cuda \
    --text "$bundle/data/charlm.txt" --policy mixed_bfloat16 --preset gpt2-small --batch 8 \
    --steps 3 --log-every 3 --eval-every 0 --sample 0 --kernel-census
  PYTHONUNBUFFERED=1 attn_ncu pytorch 'sdpa|flash|fmha' 11 4 python3 \
    "$bundle/bench/charlm_reference.py" --device cuda --text "$bundle/data/charlm.txt" \
    --precision mixed_bfloat16 --preset gpt2-small --batch 8 --steps 3 --log-every 3 \
    --profile-step 2
fi
if want float8; then
  # mixed_float8's goals (issue 37): its rate against mixed_bfloat16's on the guide MLP and the
  # GPT-2-small body, alternated; its losses and accuracies against mixed_bfloat16's.
  for round in $(seq "${ROUNDS:-2}"); do
    for policy in mixed_bfloat16 mixed_float8; do
      mnist guide "$policy" 5
      GPT_STEPS=${FLOAT8_STEPS:-300} gpt mixtape "$policy" --preset gpt2-small --batch 8
    done
  done
  GPT_STEPS=${FLOAT8_STEPS:-300} gpt mixtape mixed_float8_delayed --preset gpt2-small --batch 8
  # The FP8 step captured (one launch of host work a step): whether the host sets its pace
  # (each FP8 product adds three quantisations, three launches each, to the step).
  GPT_STEPS=${FLOAT8_STEPS:-300} gpt mixtape mixed_float8 --preset gpt2-small --batch 8 \
    --capture-step
  for policy in mixed_bfloat16 mixed_float8; do
    mnist mlp "$policy" 3
    mnist cnn "$policy" 2
  done
fi
if want gptcompile; then
  gpt pytorch mixed_bfloat16 "${small_gpt[@]}" --compile
  gpt pytorch mixed_bfloat16 --preset gpt2-small --batch 8 --compile
fi
note "== done $(date -u +%FT%TZ)"

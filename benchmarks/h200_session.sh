#!/usr/bin/env bash
# One GPU session's work on the lent H200, batched into one call (device time is short):
# the GPU test suite, compute-sanitizer memcheck over decode / extend / graph tests, and
# the benchmarks. Every phase has a time cap and writes its log under $OUT; a failing
# phase does not stop the next one.
#
#   source .whl/setup.sh >"$OUT/setup.log" 2>&1 && bash benchmarks/h200_session.sh [PHASES]
#
# PHASES: comma-separated subset of tests,sanitize,bench,engine (default: the first three;
# engine: bench_engine, profile_engine, bench_cascade, profile_cascade). ONLY, when
# set, is a comma-separated list of phase names to run (the others are skipped), e.g.
# ONLY=sanitizer_long_lived,sanitizer_items.
# Caps (seconds) and run_gpu.py's parts can be lowered to fit the device time left:
# CAP_TESTS, CAP_SAN_EAGER, CAP_SAN_FAST, CAP_SAN_POS, CAP_SAN_ITEMS, CAP_SAN_GRAPHS,
# CAP_SAN_LONG, CAP_SAN_LONG_GRAPHS (and SAN_LONG_LIVED_BATCHES), CAP_RUN_GPU,
# CAP_FLOOR, CAP_SPEC, CAP_ITEMS, CAP_PROFILE, CAP_PROFILE_CASES, CAP_HOST_CPU, RUN_GPU_PARTS,
# CAP_ENGINE, CAP_PROFILE_ENGINE, CAP_CASCADE.
# The FlashInfer wheels and module cache come from the git-ignored .whl/ folder that
# ../shared/tools/device/prepare.sh fills on the CPU machine (see docs/benchmarks.md).
set -uo pipefail

RESULTS="${OUT:?set OUT to the results folder}"
OUT="$RESULTS/r"  # every log and table here; packed into $RESULTS/results.tgz at the end
mkdir -p "$OUT"
PHASES=",${1:-tests,sanitize,bench},"
export PYTHONUNBUFFERED=1
START=$SECONDS

phase() {  # phase NAME CAP_SECONDS CMD...: run with a cap, log to $OUT/NAME.log
  local name="$1" cap="$2"; shift 2
  local t0=$SECONDS rc=0
  if [[ -n "${ONLY:-}" && ",$ONLY," != *",$name,"* ]]; then return 0; fi
  echo "::: [$name] cap ${cap}s: $*" | tee -a "$OUT/summary.log"
  timeout --kill-after=10 "$cap" "$@" >"$OUT/$name.log" 2>&1 || rc=$?
  echo "::: [$name] rc=$rc in $((SECONDS - t0))s (total $((SECONDS - START))s)" \
    | tee -a "$OUT/summary.log"
  tail -n 3 "$OUT/$name.log" | sed "s/^/    /" | tee -a "$OUT/summary.log"
}

python3 -c 'import torch, flashinfer, triton; print("torch", torch.__version__,
  "flashinfer", flashinfer.__version__, "triton", triton.__version__,
  torch.cuda.get_device_name())' | tee -a "$OUT/summary.log"

if [[ $PHASES == *,tests,* ]]; then
  # includes tests/gpu/test_long_lived.py: one executor over 4 x 500 random batches (~160 s)
  phase gpu_tests "${CAP_TESTS:-420}" python3 -m pytest -q -p no:cacheprovider -rfEs tests/gpu tests/kernels
fi

if [[ $PHASES == *,sanitize,* ]]; then
  # memcheck over decode and extend (ragged, ragged+paged, paged; page 1 and 16; bf16
  # and fp16; soft cap) without torch's caching allocator, so that every tensor is its
  # own allocation and an access past a tensor's end is caught too; then the CUDA-graph
  # tests (graph capture needs the caching allocator).
  SAN=(compute-sanitizer --tool memcheck --target-processes all --print-limit 20
       --error-exitcode 99 python3 -m pytest -q -p no:cacheprovider)
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 phase sanitizer_eager "${CAP_SAN_EAGER:-80}" "${SAN[@]}" \
    tests/gpu/test_flashinfer_executor.py -k "test_matches_reference and 128-16-4-30"
  # eager decode re-planned through fast_decode_plan (wrappers then read staged views)
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 phase sanitizer_fast_plan "${CAP_SAN_FAST:-60}" "${SAN[@]}" \
    tests/gpu/test_fast_plan.py -k eager
  # positions built on the device (fill_runs) from the staged runs, every mode
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 phase sanitizer_positions "${CAP_SAN_POS:-40}" "${SAN[@]}" \
    tests/gpu/test_positions_gpu.py -k "not graph"
  # multi-item token_pos_in_items filled on the device; prefill re-plans on staged views;
  # the fused gather + mask launch (jit and direct launches)
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 phase sanitizer_items "${CAP_SAN_ITEMS:-60}" "${SAN[@]}" \
    tests/gpu/test_multi_item.py tests/gpu/test_fast_prefill.py tests/kernels/test_fused.py \
    -k "random_batches or views or plain_batch or fast_prefill or fused or direct"
  phase sanitizer_graphs "${CAP_SAN_GRAPHS:-60}" "${SAN[@]}" tests/gpu/test_step_loop.py -k "not busy"
  # one long-lived executor over a shorter random sequence (every mode, page size, path,
  # group kind; varied heads), FA2 and auto (FA3 prefill), then graph buckets replaying
  # many batches (memcheck runs ~100x slower: 60 batches take ~100 s)
  FLASHPLAN_LONG_LIVED_BATCHES="${SAN_LONG_LIVED_BATCHES:-60}" PYTORCH_NO_CUDA_MEMORY_CACHING=1 \
    phase sanitizer_long_lived "${CAP_SAN_LONG:-150}" "${SAN[@]}" tests/gpu/test_long_lived.py \
    -k "many_batches and fa2 and varied"
  FLASHPLAN_LONG_LIVED_BATCHES="${SAN_LONG_LIVED_AUTO_BATCHES:-30}" \
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 phase sanitizer_long_lived_auto "${CAP_SAN_LONG:-150}" \
    "${SAN[@]}" tests/gpu/test_long_lived.py -k "many_batches and auto and varied"
  phase sanitizer_long_lived_graphs "${CAP_SAN_LONG_GRAPHS:-120}" "${SAN[@]}" \
    tests/gpu/test_long_lived.py -k "graph_buckets and 16"
fi

if [[ $PHASES == *,bench,* ]]; then
  # the floor of a decode re-plan: module plan entry + one staging copy + one bound launch
  phase floor "${CAP_FLOOR:-60}" python3 benchmarks/floor.py --out "$OUT"
  phase run_gpu "${CAP_RUN_GPU:-110}" python3 benchmarks/run_gpu.py --out "$OUT" \
    --parts "${RUN_GPU_PARTS:-copy,host,graph,deterministic,window}"
  phase bench_speculative "${CAP_SPEC:-40}" python3 benchmarks/bench_speculative.py --out "$OUT"
  phase bench_multi_item "${CAP_ITEMS:-50}" python3 benchmarks/bench_multi_item.py --out "$OUT" --no-full
  phase profile_apply "${CAP_PROFILE:-60}" python3 benchmarks/profile_apply.py --batch 256 --n 100 --no-cprofile
  phase profile_apply_verify "${CAP_PROFILE_CASES:-30}" python3 benchmarks/profile_apply.py \
    --case verify --n 100 --no-cprofile
  phase profile_apply_extend "${CAP_PROFILE_CASES:-30}" python3 benchmarks/profile_apply.py \
    --case extend --n 100 --no-cprofile
  phase profile_apply_multi_item "${CAP_PROFILE_CASES:-30}" python3 benchmarks/profile_apply.py \
    --case multi_item --n 40 --no-cprofile
  phase host_cpu "${CAP_HOST_CPU:-40}" python3 benchmarks/host_cpu.py --reps 500
fi
if [[ $PHASES == *,engine,* ]]; then
  # issues 28 and 29: the engine against HF (graphs, compiled, speculative at batch 1),
  # a decode step's split, the cascade benchmark and its profile
  phase bench_engine "${CAP_ENGINE:-300}" python3 benchmarks/bench_engine.py \
    --parts engine,hf,spec --batches 1,8,64 --compile --hf-compile \
    --md "$OUT/bench_engine.md" --json "$OUT/bench_engine.json"
  phase profile_engine "${CAP_PROFILE_ENGINE:-120}" python3 benchmarks/profile_engine.py \
    --batch 64 --compile --md "$OUT/profile_engine.md"
  phase bench_cascade "${CAP_CASCADE:-90}" python3 benchmarks/bench_cascade.py \
    --md "$OUT/bench_cascade.md" --json "$OUT/bench_cascade.json"
  phase profile_cascade "${CAP_CASCADE:-90}" python3 benchmarks/profile_cascade.py \
    --md "$OUT/profile_cascade.md"
fi
echo "::: done in $((SECONDS - START))s" | tee -a "$OUT/summary.log"
cp "$OUT/summary.log" "$RESULTS/summary.log"
tar czf "$RESULTS/results.tgz" -C "$RESULTS" r && rm -rf "$OUT"

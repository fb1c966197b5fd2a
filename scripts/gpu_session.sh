#!/usr/bin/env bash
# Everything the H200 has to check and time, in one device call (device time is the scarce thing).
#
# Here, before the call:
#   bash ../shared/device/prepare-mlx-cuda.sh            # prints the back-to-back staging runs
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 -d .whl mlx-lm==0.32.2 \
#       pytest-xdist execnet
# Device runs: the staging runs it printed, then the last one with carry [".devwhl/pN", ".whl",
# ".ptxcache"]:
#   bash .devwhl/pN/install.sh && bash scripts/gpu_session.sh
# (.ptxcache/ptxcache.tgz: the JIT cache the previous session's run returned; see below.)
# Logs land in $OUT (or ./gpu-out when run elsewhere). Correctness runs before any timing, and a
# failing check does not stop the timings (the log says which failed).
set -uo pipefail
out=${OUT:-gpu-out}
mkdir -p "$out"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=/root/site:/tmp/site:$PWD PYTHONUNBUFFERED=1 MLX_ENABLE_TF32=0
# MLX's JIT (NVRTC) output is cached on disk; a fresh machine recompiles every kernel variant
# (minutes of device time). A previous session's cache travels back in: copy the
# ptxcache.tgz a run returned to .ptxcache/ (git-ignored) and add ".ptxcache" to carry.
export MLX_PTX_CACHE_DIR=/tmp/mlx-ptx-cache
mkdir -p "$MLX_PTX_CACHE_DIR"
if [ -f .ptxcache/ptxcache.tgz ] && [ -z "$(ls -A "$MLX_PTX_CACHE_DIR")" ]; then
  tar xzf .ptxcache/ptxcache.tgz -C "$MLX_PTX_CACHE_DIR" && echo "restored $(ls "$MLX_PTX_CACHE_DIR" | wc -l) cached kernels"
fi
save_ptx_cache() {  # at most 16 MiB comes back per file
  tar czf "$out/ptxcache.tgz" -C "$MLX_PTX_CACHE_DIR" . 2>/dev/null
  local size=$(stat -c %s "$out/ptxcache.tgz" 2>/dev/null || echo 0)
  if [ "$size" -gt 16000000 ]; then
    echo "ptxcache.tgz is $size bytes: too large to come back, dropped"; rm -f "$out/ptxcache.tgz"
  else
    echo "ptxcache.tgz: $size bytes, $(ls "$MLX_PTX_CACHE_DIR" | wc -l) kernels"
  fi
}
python3 -c 'import mlx.core as mx; print("mlx", mx.__version__, mx.default_device())' | tee "$out/env.txt"
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv >> "$out/env.txt" 2>&1

xdist_args() {  # 12 workers when pytest-xdist imports (the JIT of each kernel specialization is
  python3 -c 'import xdist' 2>/dev/null && echo "-n 12"   # single-threaded)
}
# One BLAS thread a process: 12 test workers each running the float64 oracles with OpenBLAS's
# 16 threads oversubscribed the 16 cores (mla_tests: 64 of 72 passed in 480 s, 2026-12-02).
export OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 MKL_NUM_THREADS=1

reap() {  # test workers a timeout left behind (xdist) would compile and run beside the timings
  pkill -f "^python3 -m pytest" 2>/dev/null   # anchored: not a shell whose command line mentions it
  pkill -f "execnet" 2>/dev/null
  sleep 1
}

step() {  # step NAME LIMIT COMMAND...: run under a time limit, log, record pass/fail
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  printf '%-14s rc=%d %4ds\n' "$name" "$rc" "$((SECONDS - t0))" | tee -a "$out/summary.txt"
}

# Steps to run: the arguments (default: all). One device call may last 600 s, so a session is
# usually three calls: `gpu_session.sh checks`, `gpu_session.sh compiled_tests bench_moe_mla` and
# `gpu_session.sh bench_e2e bench_long_context`.
# `checks` runs check_twins and the GPU tests concurrently (before any timing).
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(checks bench_qgemv bench_moe_mla bench_e2e)
for s in "${steps[@]}"; do
  case $s in
    checks)        # the correctness steps at once: JIT compiles are CPU-bound (16 cores), so the GPU
                   # tests run under pytest-xdist when it is there (carried in .whl), one process otherwise
                   (step check_twins 360 python3 scripts/check_kernels_gpu.py --jobs 6) &
                   # (the model-level tests are compiled_tests': together they outgrow 360 s of JIT; the
                   # kernel tests alone ran out of 280 s on 2026-12-02)
                   (step gpu_tests 360 python3 -m pytest -q $(xdist_args) tests/test_moe_block.py \
                      tests/test_mla_decode.py tests/test_moe_shared_slot.py tests/test_moe_routed.py \
                      $(ls tests/test_router*.py 2>/dev/null)) &
                   wait; reap ;;
    check_twins)   step check_twins 200 python3 scripts/check_kernels_gpu.py --jobs 12 ;;
    compiled_tests) step compiled_tests 300 python3 -m pytest -q $(xdist_args) tests/test_compiled.py \
                     tests/test_attention_glue.py tests/test_model_parity.py \
                     tests/test_moe_block.py::test_greedy_tokens_kernels_equal_reference; reap ;;
    mla_compiled_tests) # compiled_tests and the mla_decode kernel tests in one worker pool
                   step mla_compiled_tests 480 python3 -m pytest -q $(xdist_args) tests/test_compiled.py \
                     tests/test_attention_glue.py tests/test_model_parity.py tests/test_mla_decode.py \
                     tests/test_moe_block.py::test_greedy_tokens_kernels_equal_reference; reap ;;
    pending_tests) step pending_tests 200 python3 -m pytest -q $(xdist_args) \
                     tests/test_moe_block.py::test_bank_of_uint32_words \
                     tests/test_mla_decode.py::test_fixed_capacity_buffer_with_step_params tests/test_compiled.py; reap ;;
    kernel_tests)  step kernel_tests 200 python3 -m pytest -q -x tests/test_moe_block.py tests/test_mla_decode.py; reap ;;
    parity)        step parity 200 python3 -m pytest -q tests/test_model_parity.py \
                     tests/test_moe_block.py::test_greedy_tokens_kernels_equal_reference; reap ;;
    bench_qgemv)   step bench_qgemv 130 python3 scripts/bench_qgemv.py --json "$out/bench_qgemv.json" ;;
    bench_qgemv_early) # the same, with MLX committing (launching) its CUDA graph every 4 launches
                   # instead of 100: the GPU starts while the rest of the evaluation is encoded
                   step bench_qgemv_early 130 env MLX_MAX_OPS_PER_BUFFER=4 python3 scripts/bench_qgemv.py \
                     --json "$out/bench_qgemv_early.json" ;;
    bench_moe_mla) step bench_moe_mla 200 python3 scripts/bench_moe_mla.py --iters 10 --cache 16 4096 32768 ;;
    timeline_moe_mla) # the same chains under PyTorch's profiler: each row's host lead, GPU busy and gaps
                   step timeline_moe_mla 240 python3 scripts/bench_moe_mla.py --iters 10 --cache 4096 32768 --timeline ;;
    bench_mla_parts) step bench_mla_parts 200 python3 scripts/bench_mla_parts.py --iters 10 ;;
    bench_moe_parts) step bench_moe_parts 150 python3 scripts/bench_moe_parts.py ;;
    bench_long_context) # decode at 4096 / 32768 positions: the row written in place vs the scatter
                   step bench_long_context 200 python3 scripts/bench_long_context.py --context 4096 32768 ;;
    bench_e2e)     step bench_e2e 240 python3 scripts/bench_e2e.py --steps 16 ${E2E_ARGS:-} ;;
    profile)       step profile 150 python3 scripts/profile_decode.py --experts 64 --steps 8 ;;
    e2e_graphs)    # MLX's CUDA backend records a step's launches into one CUDA graph (up to 100
                   # nodes on sm_90) and launches it at the end of the evaluation: the GPU idles
                   # while the step is encoded. Direct launches (no graphs) and smaller graphs,
                   # each a process of its own (MLX reads these once), ours and mlx-lm alike.
                   for env in MLX_USE_CUDA_GRAPHS=0 MLX_MAX_OPS_PER_BUFFER=20; do
                     step "e2e_${env//=/_}" 150 env "$env" python3 scripts/bench_e2e.py --steps 16 --quick
                   done ;;
    moe_mla_graphs) # the per-layer chains under MLX's other CUDA graph settings (each a process
                   # of its own; ours and mlx-lm alike): direct launches let the GPU start while
                   # the rest of the chain is encoded, smaller graphs do so a graph at a time
                   for env in MLX_USE_CUDA_GRAPHS=0 MLX_MAX_OPS_PER_BUFFER=10; do
                     step "bench_moe_mla_${env//=/_}" 150 env "$env" python3 scripts/bench_moe_mla.py \
                       --iters 10 --cache 4096 32768
                   done ;;
    mb_graphs)     # MLX also commits its graph once the inputs recorded since the last commit pass
                   # MLX_MAX_MB_PER_BUFFER (1000 MB on sm_90), counting a resident MoE bank in full
                   # each time a launch reads it: the chains and the decode step commit after their
                   # MoE launches. Without that limit (each a process of its own; mlx-lm alike):
                   for b in bench_moe_mla bench_e2e; do
                     args="--iters 10 --cache 4096 32768"; [ $b = bench_e2e ] && args="--steps 16 --quick"
                     step "${b}_mb" 200 env MLX_MAX_MB_PER_BUFFER=1000000 python3 scripts/$b.py $args
                   done ;;
    probe_build)   # where a compiled chain's per-call host time goes (CompiledBlock, the trace alone,
                   # plain ops, backend queries; cProfile)
                   step probe_build 150 python3 scripts/probe_build.py ;;
    profile_step)  step profile_step 200 python3 scripts/profile_step.py --steps 8 --sequence ;;
    kernel_times)  step kernel_times ${PK_LIMIT:-150} python3 scripts/profile_kernels.py --cupti ${PK_ARGS:-} ;;
    wide_tests)    # mla_attn_wide (CUDA, 16-bit caches: 32-position chunks staged by cp.async) on
                   # every edge the mma variant is tested at
                   step wide_tests 240 python3 -m pytest -q $(xdist_args) tests/test_mla_decode.py \
                     -k "wide or deepseek or joint or fixed_capacity"; reap ;;
    wide_times)    # mla_attn_wide (the default: 16 heads a block) against 32 heads and mla_attn_mma:
                   # kernel alone, then the MLA block per layer with each attention
                   step wide_kernel 150 python3 scripts/profile_kernels.py --cupti --only mla_attn \
                     --attn wide:32,mma --cache 4096 32768
                   step bench_mla_wide 200 python3 scripts/bench_moe_mla.py --iters 10 --only mla --cache 4096 32768
                   step bench_mla_mma 200 env COLIBRI_MLA_VARIANT=mma python3 scripts/bench_moe_mla.py \
                     --iters 10 --only mla --cache 4096 32768 ;;
    wide_bf16_times) # mla_attn_wide's bf16 hi / lo products (COLIBRI_MLA_WIDE_BF16=1, opt-in) against its
                   # TF32 default: kernel alone, then the MLA block per layer (each a process of its own)
                   step wide_bf16_kernel 150 env COLIBRI_MLA_WIDE_BF16=1 python3 scripts/profile_kernels.py --cupti \
                     --only mla_attn --cache 4096 32768
                   step wide_tf32_kernel 150 python3 scripts/profile_kernels.py --cupti --only mla_attn --cache 4096 32768
                   step bench_mla_bf16 200 env COLIBRI_MLA_WIDE_BF16=1 python3 scripts/bench_moe_mla.py --iters 10 \
                     --only mla --cache 4096 32768 ;;
    kparts_times)  # mla_attn_wide over 8 k-parts a 16-head tile (COLIBRI_MLA_KPARTS=8: 256 threads, two
                   # blocks an SM) against the default 4: kernel alone, then the MLA block per layer
                   step kp8_kernel 150 env COLIBRI_MLA_KPARTS=8 python3 scripts/profile_kernels.py --cupti \
                     --only mla_attn --cache 4096 32768
                   step kp8_bf16_kernel 150 env COLIBRI_MLA_KPARTS=8 COLIBRI_MLA_WIDE_BF16=1 python3 \
                     scripts/profile_kernels.py --cupti --only mla_attn --cache 4096 32768
                   step kp4_kernel 150 python3 scripts/profile_kernels.py --cupti --only mla_attn --cache 4096 32768
                   step bench_mla_kp8 200 env COLIBRI_MLA_KPARTS=8 python3 scripts/bench_moe_mla.py --iters 10 \
                     --only mla --cache 4096 32768 ;;
    mla_tests)     # every mla_decode GPU test (the TF32 model's budget for the matrix variants, the planted
                   # defects, the opt-in knobs' edges); a call of its own: the float64 model of the 40000-
                   # position cases is CPU work (run 9 of the twentieth session: 58 passed in 270 s, then cut);
                   # -v names each test as it passes, so a cut run still says which did
                   step mla_tests 480 python3 -m pytest -v --durations=20 $(xdist_args) tests/test_mla_decode.py; reap ;;
    tile_times)    # mla_attn_wide's tile at a 4096 cache (default 128 positions: 32 tiles x 8 head blocks,
                   # each block loading its 36 KB of q' and writing 32 KB of partials for 4 chunks) against
                   # 256 and 512: the attention and mla_out alone, then the MLA block per layer
                   for t in 256 512; do
                     step tile${t}_kernel 100 env COLIBRI_MLA_TILE=$t python3 scripts/profile_kernels.py --cupti \
                       --only mla_attn mla_out --cache 4096
                   done
                   step tile_default_kernel 100 python3 scripts/profile_kernels.py --cupti --only mla_attn mla_out \
                     --cache 4096
                   step bench_mla_tile256 150 env COLIBRI_MLA_TILE=256 python3 scripts/bench_moe_mla.py --iters 10 \
                     --only mla --cache 4096
                   step bench_mla_tile_default 150 python3 scripts/bench_moe_mla.py --iters 10 --only mla --cache 4096 ;;
    fold_tests)    # mla_rows_qb_qabs bit for bit against its two launches, the compiled step with it,
                   # and mla_attn_wide's planted defects
                   step fold_tests 240 python3 -m pytest -q $(xdist_args) tests/test_mla_decode.py \
                     tests/test_compiled.py -k "rows_qb_qabs or planted or rows_into or equals_plain or in_place"; reap ;;
    fold_times)    # the decode row folded into the attention's first launch (mla_rows_qb_qabs,
                   # COLIBRI_MLA_ROWS_FOLD=1) against its own launch first (the default): MLA block per
                   # layer, each a process of its own, the default again last (the host's drift)
                   step bench_mla_nofold 200 python3 scripts/bench_moe_mla.py --iters 10 --only mla --cache 4096 32768
                   step bench_mla_fold 200 env COLIBRI_MLA_ROWS_FOLD=1 python3 scripts/bench_moe_mla.py \
                     --iters 10 --only mla --cache 4096 32768
                   step bench_mla_nofold2 200 python3 scripts/bench_moe_mla.py --iters 10 --only mla --cache 4096 32768 ;;
    host_floor)    # every kernel returns at its first line (COLIBRI_EMPTY_KERNELS=1): the per-layer
                   # rows then cost all but the GPU's work; the default in the next process
                   step bench_empty 200 env COLIBRI_EMPTY_KERNELS=1 python3 scripts/bench_moe_mla.py --iters 10 \
                     --only moe mla --cache 4096 32768
                   step bench_full 200 python3 scripts/bench_moe_mla.py --iters 10 --only moe mla --cache 4096 32768 ;;
    host_floor_fold) # the same for the MLA block with the decode row folded into the attention's
                   # first launch (COLIBRI_MLA_ROWS_FOLD=1: 5 launches a layer), then the default again
                   step bench_empty_fold 200 env COLIBRI_EMPTY_KERNELS=1 COLIBRI_MLA_ROWS_FOLD=1 \
                     python3 scripts/bench_moe_mla.py --iters 10 --only mla --cache 4096 32768
                   step bench_full_fold 200 env COLIBRI_MLA_ROWS_FOLD=1 python3 scripts/bench_moe_mla.py --iters 10 \
                     --only mla --cache 4096 32768
                   step bench_empty2 200 env COLIBRI_EMPTY_KERNELS=1 python3 scripts/bench_moe_mla.py --iters 10 \
                     --only mla --cache 4096 32768
                   step bench_full2 200 python3 scripts/bench_moe_mla.py --iters 10 --only mla --cache 4096 32768 ;;
    moe_tests)     step moe_tests 200 python3 -m pytest -q $(xdist_args) tests/test_moe_block.py \
                     tests/test_moe_shared_slot.py tests/test_moe_routed.py tests/test_router.py; reap ;;
    bench_moe)     step bench_moe 150 python3 scripts/bench_moe_mla.py --iters 10 --only moe ;;
    probes)        # what bounds the GEMV-shaped kernels (CUDA-only experiments, each checked
                   # against the production kernel; docs/performance.md, thirteenth session)
                   step probe_qgemv 200 python3 scripts/probe_qgemv_mma.py
                   step probe_moe_down 120 python3 scripts/probe_moe_down_hsmem.py ;;
    ncu)           # Nsight Compute on one launch of each kernel (profile_kernels.py --once); its
                   # details come back as ncu.log. Needs the hardware counters (Firecracker hosts).
                   ncu_bin=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -n 1)
                   step ncu 240 "$ncu_bin" --clock-control none --target-processes all --nvtx \
                     --nvtx-include "profiled/" --set full \
                     python3 scripts/profile_kernels.py --once --only "${NCU_ONLY:-}" --cache 32768 ;;
    *) echo "gpu_session.sh: unknown step $s" >&2; exit 2 ;;
  esac
done
save_ptx_cache
tail -n 25 "$out"/bench_*.log 2>/dev/null
cat "$out/summary.txt"

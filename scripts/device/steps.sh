#!/usr/bin/env bash
# Everything the H200 has to check and time, in one device call (device time is the scarce thing).
#
# Here, before the call:
#   bash ../shared/device/prepare-mlx-cuda.sh            # prints the back-to-back staging runs
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 -d .whl mlx-lm==0.32.2 \
#       pytest-xdist execnet gguf==0.19.0        # gguf (pure Python, imports yaml): the GGUF steps
# Device runs: the staging runs it printed, then the last one with carry [".devwhl/pN", ".whl",
# ".ptxcache"]:
#   bash .devwhl/pN/install.sh && bash scripts/device/steps.sh
# (.ptxcache/ptxcache.tgz: the JIT cache an earlier device call returned; see below.)
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
# (minutes of device time). An earlier call's cache travels back in: copy the
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

# Steps to run: the arguments (default: all). One device call may last 600 s, so a full check is
# usually three calls: `steps.sh checks`, `steps.sh compiled_tests bench_moe_mla` and
# `steps.sh bench_e2e bench_long_context`.
# `checks` runs check_twins and the GPU tests concurrently (before any timing).
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(checks bench_qgemv bench_moe_mla bench_e2e)
for s in "${steps[@]}"; do
  case $s in
    checks)        # the correctness steps at once: JIT compiles are CPU-bound (16 cores), so the GPU
                   # tests run under pytest-xdist when it is there (carried in .whl), one process otherwise
                   (step check_twins 360 python3 scripts/device/check_kernels_gpu.py --jobs 6) &
                   # (the model-level tests are compiled_tests': together they outgrow 360 s of JIT; the
                   # kernel tests alone ran out of 280 s on 2026-12-02)
                   (step gpu_tests 360 python3 -m pytest -q $(xdist_args) tests/test_moe_block.py \
                      tests/test_mla_decode.py tests/test_moe_shared_slot.py \
                      $(ls tests/test_router*.py 2>/dev/null)) &
                   wait; reap ;;
    cuda_twins)    # every CUDA twin launch of the default matrix and the odd shapes (--all), compiled
                   # by NVRTC with ptxas's report; CI compiles the fewest launches holding every template
                   # setting (tests/test_cuda_twins_compile.py)
                   step cuda_twins 300 python3 scripts/kernels/compile_cuda_twins.py --all --ptxas --jobs 16 ;;
    check_twins)   step check_twins 200 python3 scripts/device/check_kernels_gpu.py --jobs 12 ;;
    compiled_tests) step compiled_tests 300 python3 -m pytest -q $(xdist_args) tests/test_compiled.py \
                     tests/test_attention_glue.py tests/test_model_parity.py \
                     tests/test_moe_block.py::test_greedy_tokens_kernels_equal_reference; reap ;;
    mla_compiled_tests) # compiled_tests and the mla_decode kernel tests in one worker pool
                   step mla_compiled_tests 480 python3 -m pytest -q $(xdist_args) tests/test_compiled.py \
                     tests/test_attention_glue.py tests/test_model_parity.py tests/test_mla_decode.py \
                     tests/test_moe_block.py::test_greedy_tokens_kernels_equal_reference; reap ;;
    kernel_tests)  step kernel_tests 200 python3 -m pytest -q -x tests/test_moe_block.py tests/test_mla_decode.py; reap ;;
    parity)        step parity 200 python3 -m pytest -q tests/test_model_parity.py \
                     tests/test_moe_block.py::test_greedy_tokens_kernels_equal_reference; reap ;;
    mlx_quant)     # the MLX-format decode variants (fmt 7-10): qgemv and moe_block kernels against
                   # float64, then GEMV against mx.quantized_matmul on the same arrays
                   step mlx_quant_tests 300 python3 -m pytest -q -m device $(xdist_args) tests/test_mlx_quant.py; reap
                   step bench_mlx_quant 200 python3 scripts/bench/bench_mlx_quant.py --all --json "$out/bench_mlx_quant.json" ;;
    spec)          # speculative decoding: the verify/1-row cost and the demo's decode tok/s per draft
                   # kind, then the compiled k+1-row verify step and greedy identity with the kernels on
                   # (the timing first: the tests' JIT of every variant may use up the call)
                   step bench_spec 300 python3 scripts/bench/bench_speculative.py --out "$out/bench_spec.json"
                   step spec_tests ${SPEC_TESTS_LIMIT:-240} python3 -m pytest -q $(xdist_args) tests/test_compiled_rows.py \
                     tests/test_speculative.py tests/test_mla_decode.py -m "not msl and not slow"; reap ;;
    mlx_e2e)       # mlx-lm checkpoints of bench_e2e's model (affine 4-bit g64, 3-bit g64, mxfp4, written by
                   # mlx-lm): ours vs mlx-lm ms/token on the same files, 64 greedy tokens kernels vs reference,
                   # then ours on the same model as a fmt 4 g64 container (the margin on containers, same run)
                   step mlx_e2e ${MLX_E2E_LIMIT:-240} python3 scripts/bench/bench_mlx_lm_checkpoint.py --steps 16 --greedy 64 \
                       --out "$out/mlx_lm_e2e.json" ${MLX_E2E_ARGS:-} ;;
    bench_qgemv)   step bench_qgemv 130 python3 scripts/bench/bench_qgemv.py --json "$out/bench_qgemv.json" ;;
    bench_gguf_gemv) # GGUF GEMVs (Q4_K, IQ4_XS, Q6_K, IQ2_XXS, Q8_0) vs mx.quantized_matmul 4-bit; every type checked
                   step bench_gguf_gemv 200 python3 scripts/bench/bench_gguf_gemv.py --json "$out/bench_gguf_gemv.json" ;;
    bench_moe_mla) step bench_moe_mla 200 python3 scripts/bench/bench_moe_mla.py --iters 10 --cache 16 4096 32768 ;;
    bench_mla_parts) step bench_mla_parts 200 python3 scripts/bench/bench_mla_parts.py --iters 10 ;;
    bench_moe_parts) step bench_moe_parts 150 python3 scripts/bench/bench_moe_parts.py ;;
    bench_long_context) # decode at 4096 / 32768 positions: the row written in place vs the scatter
                   step bench_long_context 200 python3 scripts/bench/bench_long_context.py --context 4096 32768 ;;
    batch_tests)   # continuous batching with the kernels on: every request of a batch equal to it alone
                   step batch_tests 240 python3 -m pytest -q tests/test_batch_engine.py; reap ;;
    bench_serve)   # decode tok/s and time to first token at 1-32 streams: BatchEngine against mlx-lm's
                   # BatchGenerator on bench_e2e's model
                   step bench_serve 300 python3 scripts/bench/bench_serve.py --out "$out/bench_serve.json" ;;
    bench_serve_drafts) # speculative decoding inside the batch: the demo model's decode tok/s at 1-8
                   # streams with --draft none, mtp and ngram (drafts fill the 8 decode rows a step has)
                   # and the MTP drafting of several requests, pooled against one by one
                   step bench_serve_drafts 300 python3 scripts/bench/bench_serve.py --demo --drafts none,mtp,ngram \
                       --streams 1,2,4,8 --out "$out/bench_serve_drafts.json"
                   step bench_mtp_rows 120 python3 scripts/bench/bench_mtp_rows.py --requests 2 4 2 --drafts 3 1 1 ;;
    bench_serve_http) # the same rounds direct and through colibri serve's HTTP server with the openai client
                   # (openai==3.51.0 and its dependencies installed; without it the HTTP rows report the error)
                   step bench_serve_http 300 python3 scripts/bench/bench_serve.py --http --no-mlx-lm \
                       --out "$out/bench_serve_http.json" ;;
    prefill_tests) # prefill's GPU routes: mx.quantized_matmul on the stored bytes against float64, and the
                   # 64 greedy tokens of mlx-lm checkpoints, kernels against the reference
                   step prefill_tests 300 python3 -m pytest -q -m device $(xdist_args) tests/test_mlx_qmm.py \
                     tests/test_mlx_lm_device.py -k "prefill_route or greedy_64"; reap ;;
    bench_prefill) # prefill at 16-512 tokens by each route (mx.quantized_matmul / gather_qmm, dequantize), and
                   # mlx-lm's prefill of the same prompt (the server's time to first token)
                   step bench_prefill 300 python3 scripts/bench/bench_prefill.py --json "$out/bench_prefill.json" ;;
    bench_e2e)     step bench_e2e 240 python3 scripts/bench/bench_e2e.py --steps 16 ${E2E_ARGS:-} ;;
    gguf_e2e)      # bench_e2e's model as Q4_K_M and IQ2_XXS-experts GGUF files against fmt 4, paired A/B
                   step gguf_e2e 300 python3 scripts/bench/bench_gguf_e2e.py --json "$out/gguf_e2e.json" ;;
    profile)       step profile 150 python3 scripts/bench/profile_decode.py --experts 64 --steps 8 ;;
    profile_step)  step profile_step 200 python3 scripts/bench/profile_step.py --steps 8 --sequence ${PS_ARGS:-} ;;
    kernel_times)  step kernel_times ${PK_LIMIT:-150} python3 scripts/bench/profile_kernels.py --cupti ${PK_ARGS:-} ;;
    mla_tests)     # every mla_decode GPU test (the TF32 model's budget for the matrix variants, the planted
                   # defects, the opt-in knobs' edges); a call of its own: the float64 model of the 40000-
                   # position cases is CPU work (58 tests passed in 270 s of a 480 s limit, then it was cut);
                   # -v names each test as it passes, so a cut run still says which did
                   step mla_tests 480 python3 -m pytest -v --durations=20 $(xdist_args) tests/test_mla_decode.py; reap ;;
    host_floor)    # every kernel returns at its first line (COLIBRI_EMPTY_KERNELS=1): the per-layer
                   # rows then cost all but the GPU's work; the default in the next process
                   step bench_empty 200 env COLIBRI_EMPTY_KERNELS=1 python3 scripts/bench/bench_moe_mla.py --iters 10 \
                     --only moe mla --cache 4096 32768
                   step bench_full 200 python3 scripts/bench/bench_moe_mla.py --iters 10 --only moe mla --cache 4096 32768 ;;
    moe_tests)     step moe_tests 200 python3 -m pytest -q $(xdist_args) tests/test_moe_block.py \
                     tests/test_moe_shared_slot.py tests/test_router.py; reap ;;
    bench_moe)     step bench_moe 150 python3 scripts/bench/bench_moe_mla.py --iters 10 --only moe ;;
    ncu)           # Nsight Compute on one launch of each kernel (profile_kernels.py --once); its
                   # details come back as ncu.log. Needs the hardware counters (Firecracker hosts).
                   ncu_bin=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -n 1)
                   step ncu 240 "$ncu_bin" --clock-control none --target-processes all --nvtx \
                     --nvtx-include "profiled/" --set full \
                     python3 scripts/bench/profile_kernels.py --once --only "${NCU_ONLY:-}" --cache 32768 ;;
    *) echo "steps.sh: unknown step $s" >&2; exit 2 ;;
  esac
done
save_ptx_cache
tail -n 25 "$out"/bench_*.log 2>/dev/null
cat "$out/summary.txt"

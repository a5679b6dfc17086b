#!/usr/bin/env bash
# The GPU checks, for a lent GPU machine (the device tool runs this over a copy of the
# working tree). GPUs are lent rarely and for 15 minutes: run what is open, in one call.
#
#   run(command="bash tools/gpu_session.sh build tests", carry=[".whl"])
#   run(command="bash tools/gpu_session.sh bench --quick", carry=[".whl", ".official"])
#   run(command="bash tools/gpu_session.sh var", carry=[".whl", ".official"])
#   run(command="bash tools/gpu_session.sh profile", carry=[".whl"])
#
# Measured on the first GPU session (2026-11-27, H100, 16 cores): build 46 s; tests 129 s
# for the four MAR files the list then held (on the 2-core development machine the full
# list below takes 144 s with its CUDA cases skipped); bench --quick --configs base 120 s.
# On the second (2026-11-29, H200): build ~50 s; tests 166 s for the nine files below;
# var --models d16 d30 --batches 16 64 ~110 s (the d30 weights written first); profile
# ~15 s. A fresh machine took about a minute to start.
#
# Steps (any order, default build tests bench): build (MARCACHE_CUDA=1, in place; kept
# between calls on a warm machine, and run by the other steps first when no CUDA-enabled
# build imports), tests (MARCACHE_REQUIRE_CUDA=1: every CUDA test, which fail instead of
# skipping), bench [ARGS] (benchmarks/bench_gpu.py ARGS, default --quick: MAR against the
# official code), var [ARGS] (benchmarks/bench_var_gpu.py ARGS, default d16 and d30 at
# batch 16 and 64 against the official VAR code; then bench_var.py's FastVAR d30 batch-64
# bf16 point), profile [ARGS] (benchmarks/profile_var_gpu.py ARGS, default VAR-d16 at
# batch 16 in bf16: the GPU time of every kernel, the scale loop and the decode apart).
# bench, var and profile take the rest of the line as their arguments. Logs and JSON
# go to $OUT (the device tool brings them back) or ./gpu_out.
#
# Carried folders (ignored by git; see the device README): .whl holds the wheels the
# machine lacks, here scipy-openblas32 for Python 3.12:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#       --implementation cp --platform manylinux_2_28_x86_64 -d .whl scipy-openblas32==0.3.34.481.3
# .official/mar and .official/var are the official LTH14/mar and FoundationVision/VAR
# trees for the side-by-side benchmarks (bench_gpu.py's and bench_var_gpu.py's docstrings
# say how to export them).
set -u -o pipefail

steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(build tests bench)
for step in "${steps[@]}"; do
    case "$step" in
    build | tests) ;;
    bench | var | profile) break ;; # the rest are the benchmark's arguments
    *)
        echo "unknown step '$step' (build, tests, bench [ARGS], var [ARGS], profile [ARGS])" >&2
        exit 2
        ;;
    esac
done

OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1

if ls .whl/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}

status=0

run_build() {
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv \
        | tee "$OUT/gpu.txt"
    if ! MARCACHE_CUDA=1 "$PY" setup.py build_ext --inplace -f > "$OUT/build.log" 2>&1; then
        tail -40 "$OUT/build.log"
        return 1
    fi
    # cuBLAS is loaded with the first CUDA backend; load it here so the file shows which.
    "$PY" -c "import json, marcache; marcache._C._cublas_load(); print(json.dumps(marcache.build_info()))" \
        | tee "$OUT/build_info.json"
}

# A separate call (run(command="bash tools/gpu_session.sh tests")) may start on a bare machine
# without the built extension, or find the CPU-only one of a build without nvcc: every step
# but build first builds unless a CUDA-enabled marcache._C imports.
have_cuda_build() {
    "$PY" -c "import sys, marcache; sys.exit(0 if marcache.build_info()['cuda'] else 1)" \
        > /dev/null 2>&1
}

ensure_built() {
    if have_cuda_build; then
        return 0
    fi
    echo "gpu_session: no CUDA-enabled marcache._C here; building first"
    run_build
}

# Every test file with a test that skips without a GPU (a CUDA parametrisation of the
# backend fixture, or a cuda_only test). CI keeps this list whole: .ci/check_skips.py
# fails when a test skipped for want of CUDA lives in a file not named here.
GPU_TEST_FILES="test_cuda_build.py test_ops.py test_cuda_ops_extra.py test_devices.py test_phase_telemetry.py test_var.py test_var_devices.py test_fastvar.py test_vqvae.py"

run_tests() {
    ensure_built || return 1
    # shellcheck disable=SC2086 # the list is words
    (cd tests && MARCACHE_REQUIRE_CUDA=1 "$PY" -m pytest -q -rfEs --durations=15 \
        $GPU_TEST_FILES 2>&1) | tee "$OUT/tests.log" | tail -60
}

run_bench() {
    ensure_built || return 1
    local args=("$@")
    [ ${#args[@]} -eq 0 ] && args=(--quick)
    "$PY" benchmarks/bench_gpu.py "${args[@]}" --time-budget "${BENCH_SECONDS:-480}" \
        --out "$OUT/bench_gpu.json" 2>&1 | tee "$OUT/bench.log" | tail -40
}

run_var() {
    ensure_built || return 1
    local status=0
    "$PY" benchmarks/bench_var_gpu.py "$@" --out "$OUT/bench_var_gpu.json" 2>&1 | tee "$OUT/var.log" | tail -20 \
        || status=1
    # Without arguments, also the FastVAR point (the same d30 weights under benchmarks/.cache).
    if [ $# -eq 0 ]; then
        "$PY" benchmarks/bench_var.py --fastvar --models d30 --batches 64 --settings none default \
            --device cuda --dtype bf16 --json "$OUT/fastvar_gpu.json" 2>&1 | tee "$OUT/fastvar.log" | tail -8 \
            || status=1
    fi
    return $status
}

run_profile() {
    ensure_built || return 1
    local args=("$@")
    [ ${#args[@]} -eq 0 ] && args=(--model d16 --batch 16)
    "$PY" benchmarks/profile_var_gpu.py "${args[@]}" --json "$OUT/profile_var_gpu.json" 2>&1 \
        | tee "$OUT/profile.log" | head -80
}

i=0
while [ $i -lt ${#steps[@]} ]; do
    case "${steps[$i]}" in
    build) run_build || { status=1; break; } ;;
    tests) run_tests || status=1 ;;
    bench)
        # everything after "bench" is the benchmark's arguments
        run_bench "${steps[@]:$((i + 1))}" || status=1
        break
        ;;
    var)
        run_var "${steps[@]:$((i + 1))}" || status=1
        break
        ;;
    profile)
        run_profile "${steps[@]:$((i + 1))}" || status=1
        break
        ;;
    esac
    i=$((i + 1))
done
exit $status

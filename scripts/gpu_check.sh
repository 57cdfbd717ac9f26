#!/usr/bin/env bash
# GPU check for fxopt: install the checkout, run the CUDA tests, the diagnostics asked for, the benchmark.
#
#   scripts/gpu_check.sh [fxopt.bench args...]
#   e.g. scripts/gpu_check.sh --models resnet18,resnet50 --batch 1,32 --dtype float16 --time-budget 420
#   GPU_CHECK_DIAGNOSE="seedcnn:float32:1 resnet50:float16:1" GPU_CHECK_SKIP_TESTS=1 scripts/gpu_check.sh --models seedcnn
#
# For the GPU machine (python3 3.12, torch/torchvision/triton/onnx preinstalled, no
# network). If /tmp/ortsite exists it is put first on PYTHONPATH (an unpacked
# onnxruntime-gpu). The bench writes straight into $OUT when it is set (so partial
# results survive a kill), else into bench_out/ (or the --out you pass).
# Keeps going when a step fails; exits non-zero at the end if any step failed.
# Env: PYTHON (default python3), GPU_CHECK_TEST_TIMEOUT (seconds for pytest, 0 = none),
#      GPU_CHECK_SKIP_TESTS=1 (skip pytest), FXOPT_TARGET (--target dir fallback),
#      GPU_CHECK_MEMCHECK=1 (also run the CUDA kernel tests under compute-sanitizer memcheck;
#      GPU_CHECK_MEMCHECK_FX_ONLY=1: instrument fxopt's own kernels only),
#      GPU_CHECK_DIAGNOSE="MODEL:DTYPE:BATCH ..." (run `fxopt diagnose host` and, with empty fxopt
#      caches, `fxopt diagnose compile` for each, into diagnose.log).
set -uo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO" || exit 2
PY="${PYTHON:-python3}"
FAILED=()
LOGDIR="${OUT:-$REPO/bench_out}"
mkdir -p "$LOGDIR"

step() { printf '\n=== %s ===\n' "$*" >&2; }

step "environment"
nvidia-smi -L >&2 2>&1 || echo "nvidia-smi not available" >&2
"$PY" - >&2 <<'EOF' || FAILED+=("environment")
import sys, torch
print("python", sys.version.split()[0], "torch", torch.__version__, "CUDA", torch.version.cuda,
      "cuda available", torch.cuda.is_available())
if torch.cuda.is_available():
    print("device", torch.cuda.get_device_name(), torch.cuda.get_device_capability())
EOF

if [ -d /tmp/ortsite ]; then
    export PYTHONPATH="/tmp/ortsite${PYTHONPATH:+:$PYTHONPATH}"
    echo "using onnxruntime from /tmp/ortsite" >&2
fi
"$PY" -c 'import onnxruntime as o; print("onnxruntime", o.__version__, o.get_available_providers())' >&2 \
    || echo "onnxruntime not importable (its bench rows will say so)" >&2

step "install fxopt"
INSTALL_LOG="$(mktemp /tmp/fxopt_install.XXXXXX.log)"
if "$PY" -m pip install --no-deps --no-build-isolation -e . >"$INSTALL_LOG" 2>&1; then
    echo "installed editable" >&2
else
    echo "editable install failed (read-only site?); installing with --target" >&2
    TARGET="${FXOPT_TARGET:-/tmp/fxopt_site}"
    rm -rf "$TARGET"
    if "$PY" -m pip install --no-deps --no-build-isolation --target "$TARGET" . >>"$INSTALL_LOG" 2>&1; then
        export PYTHONPATH="$TARGET${PYTHONPATH:+:$PYTHONPATH}"
        export PYTHONSAFEPATH=1   # keep ./fxopt (no fxopt.passes mapping) from shadowing the install
        # an older pyproject may not list fxopt.bench / fxopt.testing as packages
        for sub in bench testing diagnose; do
            [ -d "$TARGET/fxopt/$sub" ] || cp -r "fxopt/$sub" "$TARGET/fxopt/$sub"
        done
        echo "installed into $TARGET" >&2
    else
        tail -20 "$INSTALL_LOG" >&2
        cp "$INSTALL_LOG" "$LOGDIR/install.log"
        FAILED+=("install")
    fi
fi
"$PY" -c 'import fxopt, fxopt.bench; print("fxopt importable from", fxopt.__file__)' >&2 \
    || FAILED+=("import fxopt")

step "CUDA tests (pytest -m gpu)"
if [ "${GPU_CHECK_SKIP_TESTS:-0}" = "1" ]; then
    echo "skipped (GPU_CHECK_SKIP_TESTS=1)" >&2
    rc=0
else
    timeout "${GPU_CHECK_TEST_TIMEOUT:-0}" "$PY" -m pytest -q -m gpu tests/ 2>&1 | tee "$LOGDIR/pytest_gpu.log" | tail -25 >&2
    rc=${PIPESTATUS[0]}
fi
if [ "$rc" -eq 124 ]; then
    FAILED+=("pytest -m gpu (timed out after ${GPU_CHECK_TEST_TIMEOUT:-0} s)")
elif [ "$rc" -eq 5 ]; then
    echo "no gpu tests collected" >&2
elif [ "$rc" -ne 0 ]; then
    FAILED+=("pytest -m gpu (rc=$rc)")
fi

if [ "${GPU_CHECK_MEMCHECK:-0}" = "1" ]; then
    step "CUDA kernel tests under compute-sanitizer memcheck"
    if command -v compute-sanitizer >/dev/null 2>&1; then
        # one sanitizer process per test file: each gets its own summary, and a slow file (the
        # whole-model tests take minutes under memcheck) cannot hide the others' results
        : > "$LOGDIR/memcheck.log"
        # GPU_CHECK_MEMCHECK_FX_ONLY=1: instrument only fxopt's kernels (all named fx_...), several
        # times faster on the whole-model tests; but then only fxopt's kernels are slowed, so a test
        # that asserts a measured choice (a generated kernel beating PyTorch's) may fail
        FILTER=()
        [ "${GPU_CHECK_MEMCHECK_FX_ONLY:-0}" = "1" ] && FILTER=(--kernel-name kns=fx_)
        for f in tests/test_cuda_codegen.py tests/test_cuda_regions.py tests/test_cuda_linear.py \
                 tests/test_cuda_linear_chain.py tests/test_cuda_direct_conv.py tests/test_gpu_fusion.py tests/test_gpu.py \
                 tests/test_onnx.py; do
            echo "--- $f" >>"$LOGDIR/memcheck.log"
            timeout "${GPU_CHECK_TEST_TIMEOUT:-0}" compute-sanitizer --tool memcheck --report-api-errors no \
                "${FILTER[@]}" --error-exitcode 3 "$PY" -m pytest -q -m gpu "$f" -p no:cacheprovider \
                >>"$LOGDIR/memcheck.log" 2>&1
            rc=$?
            printf '%s: %s\n' "$f" "$(grep -E 'passed|failed|skipped' "$LOGDIR/memcheck.log" | tail -1)" >&2
            [ "$rc" -ne 0 ] && FAILED+=("memcheck $f (rc=$rc)")
        done
        grep "ERROR SUMMARY" "$LOGDIR/memcheck.log" >&2
    else
        echo "compute-sanitizer not on PATH" >&2
        FAILED+=("memcheck (no compute-sanitizer)")
    fi
fi

if [ -n "${GPU_CHECK_DIAGNOSE:-}" ]; then
    step "diagnostics (fxopt diagnose host, compile)"
    : > "$LOGDIR/diagnose.log"
    for cfg in $GPU_CHECK_DIAGNOSE; do
        IFS=: read -r model dtype batch <<<"$cfg"
        for diagnostic in host compile; do
            cmd=("$PY" -m fxopt.cli diagnose "$diagnostic" "$model" --dtype "${dtype:-float16}" --batch "${batch:-1}"
                 --device cuda)
            echo "--- fxopt ${cmd[*]:3}" >>"$LOGDIR/diagnose.log"
            cache="$(mktemp -d /tmp/fxopt_cache.XXXXXX)"   # compile: a cold compile, as a user's first
            FXOPT_CACHE_DIR="$cache" "${cmd[@]}" >>"$LOGDIR/diagnose.log" 2>&1 || FAILED+=("diagnose $diagnostic $cfg")
            rm -rf "$cache"
        done
    done
    grep -E "µs per call|first call" "$LOGDIR/diagnose.log" >&2
fi

step "benchmark"
BENCH_OUT="$LOGDIR"
prev=""
for arg in "$@"; do   # honour an --out given by the caller
    case "$arg" in --out=*) BENCH_OUT="${arg#--out=}" ;; esac
    [ "$prev" = "--out" ] && BENCH_OUT="$arg"
    prev="$arg"
done
"$PY" -m fxopt.bench --device cuda --out "$LOGDIR" "$@" >/dev/null 2>"$LOGDIR/bench_stderr.log"
rc=$?
tail -5 "$LOGDIR/bench_stderr.log" | tr '\r' '\n' | tail -5 >&2
[ "$rc" -ne 0 ] && FAILED+=("bench (rc=$rc)")
if [ -n "${OUT:-}" ] && [ "$BENCH_OUT" != "$OUT" ]; then
    for f in results.json results.md summary.md speedup.png errors.log; do
        [ -f "$BENCH_OUT/$f" ] && cp "$BENCH_OUT/$f" "$OUT/"
    done
fi

step "result"
if [ ${#FAILED[@]} -eq 0 ]; then
    echo "gpu_check: all steps passed" >&2
else
    printf 'gpu_check: FAILED: %s\n' "${FAILED[@]}" >&2
fi
if [ -f "$BENCH_OUT/summary.md" ]; then
    cat "$BENCH_OUT/summary.md"
else
    echo "(no benchmark summary was written)"
fi
[ ${#FAILED[@]} -eq 0 ]

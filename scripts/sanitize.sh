#!/usr/bin/env bash
# Fuzzed graphs covering every kernel family under compute-sanitizer (on the GPU machine).
#
#   scripts/sanitize.sh [OUTDIR]          (default: $OUT or sanitize_out/)
#   scripts/sanitize.sh --streams [OUTDIR]  only the multi-stream graphs (below)
#
# 1. select: draws fuzz programs and plans them with the cuda executor on CPU tensors until every
#    kernel family has SANITIZE_PER_FAMILY programs (python -m fxopt.fuzz.sample select; no GPU
#    needed); a family without a program fails the run (the others still go on);
# 2. memcheck: all selected programs, run on the GPU (CUDA graphs off, every candidate measured
#    afresh with one warm-up and two timed runs, so every candidate kernel launches under the tool);
# 3. racecheck and synccheck: the programs whose kernels use shared memory or warp shuffles (racecheck:
#    the inference ones, see below). A program
#    that leaves its process unable to run CUDA work does not take the later ones with it: they run
#    in a new process, which the tool follows (fxopt.fuzz.sample run --start).
# The tools instrument fxopt's kernels (named fx_...); SANITIZE_ALL_KERNELS=1 has memcheck instrument
# every kernel (cuDNN's and cuBLAS's too: several times slower).
# Each tool gets a time limit; its programs start only while its budget (the limit less
# SANITIZE_MARGIN seconds) lasts, and a program left out fails the run, naming its families. The
# defaults (about 40 s to select, 250 + 140 + 110 s for the tools) keep the whole run within ~550 s
# on an H100; SANITIZE_PER_FAMILY=2 with longer limits for a longer run.
# Each tool's log is OUTDIR/<tool>.log; exits non-zero if a step failed or a tool reported errors.
# Env: PYTHON (default python3), SANITIZE_PER_FAMILY (1), SANITIZE_MAX_DRAWS (300), SANITIZE_SEED (0),
#      SANITIZE_MEMCHECK_TIMEOUT (250), SANITIZE_RACECHECK_TIMEOUT (140), SANITIZE_SYNCCHECK_TIMEOUT (110),
#      SANITIZE_MARGIN (60), SANITIZE_ALL_KERNELS=1, SANITIZE_SELECT_ONLY=1 (stop after step 1),
#      SANITIZE_INITCHECK=1 (a 4th tool, initcheck over every kernel; SANITIZE_INITCHECK_TIMEOUT, 200).
#
# --streams: racecheck, synccheck and memcheck (SANITIZE_STREAMS_TOOLS: which ones) over a multi-stream
# capture: tests/test_stream_capture.py::test_float32_inception_blocks_on_streams (two Inception blocks,
# the plan on up to 4 streams captured and measured; float32 with TF32 off and fxopt's direct
# convolutions: racecheck fails inside cuDNN's tensor-core kernels, fp16 or TF32, before fxopt's run),
# fxopt's kernels instrumented, each tool within SANITIZE_STREAMS_TIMEOUT (200) s. The tools check each
# kernel's own shared-memory and barrier use and its accesses; the order across streams is what the
# tests check (eager's values, every cross-stream read marked, every side stream joined).
set -uo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO" || exit 2
PY="${PYTHON:-python3}"
STREAMS_ONLY=0
if [ "${1:-}" = "--streams" ]; then STREAMS_ONLY=1; shift; fi
DIR="${1:-${OUT:-$REPO/sanitize_out}}"
mkdir -p "$DIR"
FAILED=()
START=$SECONDS

if [ "$STREAMS_ONLY" = "1" ]; then
    command -v compute-sanitizer >/dev/null 2>&1 || { echo "compute-sanitizer not on PATH" >&2; exit 2; }
    for tool in ${SANITIZE_STREAMS_TOOLS:-racecheck synccheck memcheck}; do
        extra=()
        [ "$tool" = "racecheck" ] && extra=(--racecheck-report all)
        [ "$tool" = "memcheck" ] && extra=(--report-api-errors no)  # the driver's cuGetProcAddress probing
        t0=$SECONDS
        timeout "${SANITIZE_STREAMS_TIMEOUT:-200}" compute-sanitizer --tool "$tool" --error-exitcode 3 \
            --kernel-name kns=fx_ "${extra[@]}" "$PY" -m pytest -q -m gpu -p no:cacheprovider \
            tests/test_stream_capture.py::test_float32_inception_blocks_on_streams >"$DIR/streams_$tool.log" 2>&1
        rc=$?
        grep -E "ERROR SUMMARY|RACECHECK SUMMARY| passed| failed" "$DIR/streams_$tool.log" | tail -3 >&2
        echo "streams $tool: rc=$rc in $((SECONDS - t0)) s" >&2
        [ "$rc" -ne 0 ] && FAILED+=("streams $tool (rc=$rc)")
    done
    [ "${#FAILED[@]}" -ne 0 ] && { echo "FAILED: ${FAILED[*]}" >&2; exit 1; }
    echo "sanitizers clean on the multi-stream graphs: $DIR" >&2
    exit 0
fi

"$PY" -m fxopt.fuzz.sample select --out "$DIR/sample.json" --per-family "${SANITIZE_PER_FAMILY:-1}" \
    --max-draws "${SANITIZE_MAX_DRAWS:-300}" --seed "${SANITIZE_SEED:-0}" >"$DIR/select.log" 2>&1
rc=$?
grep -E "programs from|never reached" "$DIR/select.log" | tail -2 >&2
case "$rc" in
    0) ;;
    3) FAILED+=("select (a family without a program: $DIR/select.log)") ;;
    *) echo "selection failed (see $DIR/select.log)" >&2; exit 1 ;;
esac
echo "selected in $((SECONDS - START)) s: $DIR/sample.json" >&2
if [ "${SANITIZE_SELECT_ONLY:-0}" = "1" ]; then
    [ "${#FAILED[@]}" -ne 0 ] && { echo "FAILED: ${FAILED[*]}" >&2; exit 1; }
    exit 0
fi

if ! command -v compute-sanitizer >/dev/null 2>&1; then
    echo "compute-sanitizer not on PATH" >&2
    exit 2
fi

run_tool() {  # tool, time limit (s), "sample run" args (quoted as one word), sanitizer args...
    local tool="$1" limit="$2" which="$3"; shift 3
    local budget=$((limit - ${SANITIZE_MARGIN:-60}))
    [ "$budget" -lt 30 ] && budget=30
    echo "=== $tool (limit ${limit} s) ===" >&2
    local t0=$SECONDS
    # shellcheck disable=SC2086
    timeout "$limit" compute-sanitizer --tool "$tool" --error-exitcode 3 "$@" \
        "$PY" -m fxopt.fuzz.sample run "$DIR/sample.json" --time-budget "$budget" $which >"$DIR/$tool.log" 2>&1
    local rc=$?
    grep -E "ERROR SUMMARY|RACECHECK SUMMARY|FAIL|^ran " "$DIR/$tool.log" | tail -5 >&2
    echo "$tool: rc=$rc in $((SECONDS - t0)) s" >&2
    [ "$rc" -ne 0 ] && FAILED+=("$tool (rc=$rc$([ "$rc" -eq 124 ] && echo ', out of time'))")
}

FX=(--kernel-name kns=fx_)
# memcheck sees an access only where it leaves every allocation: with the caching allocator a kernel
# writing past its output lands in a neighbouring tensor of the same segment, unseen; so each tensor
# is its own cudaMalloc, and only fxopt's kernels are instrumented (cuDNN's read past a small weight,
# 1 byte after a 96-byte allocation, is reported there). SANITIZE_ALL_KERNELS=1: every kernel,
# with the caching allocator.
if [ "${SANITIZE_ALL_KERNELS:-0}" = "1" ]; then
    run_tool memcheck "${SANITIZE_MEMCHECK_TIMEOUT:-250}" "" --report-api-errors no
else
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 run_tool memcheck "${SANITIZE_MEMCHECK_TIMEOUT:-250}" "" --report-api-errors no "${FX[@]}"
fi
# racecheck runs the inference programs (select gives every family one): on an H200 (torch 2.11, CUDA 13)
# the tool fails on cuBLAS's float16 product of a training backward with no fxopt code involved (a
# plain torch `g.t() @ a` of [1, 8] by [8, 120]: "Internal Sanitizer Error: The Sanitizer failed to
# handle a hardware exception", then CUBLAS_STATUS_EXECUTION_FAILED), and the training program with it
run_tool racecheck "${SANITIZE_RACECHECK_TIMEOUT:-140}" "--shared-only --inference-only" "${FX[@]}" --racecheck-report all
run_tool synccheck "${SANITIZE_SYNCCHECK_TIMEOUT:-110}" --shared-only "${FX[@]}"
if [ "${SANITIZE_INITCHECK:-0}" = "1" ]; then
    # reads of device memory nothing wrote (a kernel leaving part of its output unwritten, read by the
    # next one, fxopt's or a library's): every allocation its own cudaMalloc, so that memory the
    # caching allocator recycles does not count as written
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 run_tool initcheck "${SANITIZE_INITCHECK_TIMEOUT:-200}" ""
fi

echo "total $((SECONDS - START)) s" >&2
if [ "${#FAILED[@]}" -ne 0 ]; then
    echo "FAILED: ${FAILED[*]}" >&2
    exit 1
fi
echo "sanitizers clean: $DIR" >&2

#!/usr/bin/env bash
# Fuzzed graphs covering every kernel family under compute-sanitizer (on the GPU machine).
#
#   scripts/sanitize.sh [OUTDIR]          (default: $OUT or sanitize_out/)
#
# 1. select: draws fuzz programs and plans them with the cuda executor on CPU tensors until every
#    kernel family has SANITIZE_PER_FAMILY programs (python -m fxopt.fuzz.sample select; no GPU needed);
# 2. memcheck: all selected programs, run on the GPU (CUDA graphs off);
# 3. racecheck and synccheck: the programs whose kernels use shared memory or warp shuffles;
#    only fxopt's kernels (named fx_...) are instrumented by these two.
# Each tool's log is OUTDIR/<tool>.log; exits non-zero if a step failed or a tool reported errors.
# Env: PYTHON (default python3), SANITIZE_PER_FAMILY (2), SANITIZE_MAX_DRAWS (300), SANITIZE_SEED (0),
#      SANITIZE_TIMEOUT (seconds per tool, default 480), SANITIZE_SELECT_ONLY=1 (stop after step 1).
set -uo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO" || exit 2
PY="${PYTHON:-python3}"
DIR="${1:-${OUT:-$REPO/sanitize_out}}"
mkdir -p "$DIR"
FAILED=()

"$PY" -m fxopt.fuzz.sample select --out "$DIR/sample.json" --per-family "${SANITIZE_PER_FAMILY:-2}" \
    --max-draws "${SANITIZE_MAX_DRAWS:-300}" --seed "${SANITIZE_SEED:-0}" 2>&1 | tee "$DIR/select.log" | tail -3
[ "${PIPESTATUS[0]}" -ne 0 ] && { echo "selection failed (see $DIR/select.log)" >&2; exit 1; }
[ "${SANITIZE_SELECT_ONLY:-0}" = "1" ] && exit 0

if ! command -v compute-sanitizer >/dev/null 2>&1; then
    echo "compute-sanitizer not on PATH" >&2
    exit 2
fi

run_tool() {  # tool, "sample run" args (quoted as one word), sanitizer args...
    local tool="$1" which="$2"; shift 2
    echo "=== $tool ===" >&2
    # shellcheck disable=SC2086
    timeout "${SANITIZE_TIMEOUT:-480}" compute-sanitizer --tool "$tool" --error-exitcode 3 "$@" \
        "$PY" -m fxopt.fuzz.sample run "$DIR/sample.json" $which >"$DIR/$tool.log" 2>&1
    local rc=$?
    grep -E "ERROR SUMMARY|RACECHECK SUMMARY|FAIL" "$DIR/$tool.log" | tail -5 >&2
    [ "$rc" -ne 0 ] && FAILED+=("$tool (rc=$rc)")
}

run_tool memcheck "" --report-api-errors no
run_tool racecheck --shared-only --kernel-name kns=fx_ --racecheck-report all
run_tool synccheck --shared-only --kernel-name kns=fx_

if [ "${#FAILED[@]}" -ne 0 ]; then
    echo "FAILED: ${FAILED[*]}" >&2
    exit 1
fi
echo "sanitizers clean: $DIR" >&2

#!/usr/bin/env bash
# The whole GPU check of the decode paths in one device call (benchmarks/gpu_decode_check.py).
#
#   bash scripts/gpu-check.sh fetch          # here, just before the device call: the wheels the
#                                            #   GPU machine lacks, cute_gemv's cubins and the
#                                            #   commit, -> .whl/
#   bash scripts/gpu-check.sh run [ARGS...]  # there, in one call that carries .whl:
#                                            #   results.json, summary.md, log.txt and the
#                                            #   traces and run directories packed in parts
#                                            #   (evidence.tar.gz.part*) -> $OUT; give the
#                                            #   call timeout_s 360 (the budget, 330 s, + 30)
#
# The GPU machine has Python 3.12 with torch, triton, numpy, pyarrow, click and rich, and no
# network: msgspec, plotly (with the narwhals it needs; packaging is there) and nvtx travel
# as wheels. kimi-perf itself runs from the checkout
# (PYTHONPATH), with kernels/ importable under its installed name, kimi_perf_kernels.
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=${WHEELS:-.whl}
PYTHON=${PYTHON:-python3}

case "${1:-}" in
fetch)
  grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
  # a fetch made before a pin changed must not travel too: two versions of a wheel fail the
  # install there, in the first seconds of the device's time
  rm -rf "$WHEELS"
  mkdir -p "$WHEELS"
  # The copy of the working tree the GPU machine gets has no .git: the results name this
  # commit, marked where what travels differs from it (untracked files travel too).
  commit=$(git rev-parse HEAD)
  [ -z "$(git --no-optional-locks status --porcelain)" ] || commit="$commit+uncommitted"
  echo "$commit" > "$WHEELS/COMMIT"
  "$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version "${PY_VERSION:-3.12}" \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$WHEELS" msgspec==0.23.0 plotly==7.1.0 narwhals==2.29.0 nvtx==0.2.11
  # cute_gemv's cubins for sm_90a (CuTe DSL compiles here without a GPU; its runtime is too
  # large to travel, the cubins launch there through CuPy). A build that spills still
  # travels: the check measures it, and says so.
  "${BUILD_PYTHON:-.venv/bin/python}" -m kimi_perf_kernels.cute_gemv --out "$WHEELS/cute" \
    || echo "warning: cute_gemv's build spilled or failed (see above); the check goes on" >&2
  ls "$WHEELS"
  ;;
run)
  shift
  # the device call's clock starts here: the check's budget counts what comes before it
  GPU_CHECK_STARTED=$(date +%s.%N)
  export GPU_CHECK_STARTED
  site=$(mktemp -d)
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" \
    "$WHEELS"/*.whl
  ln -s "$PWD/kernels" "$site/kimi_perf_kernels"
  # TEARDOWN_CUPTI=0: the check opens a dozen profiler sessions in one process that replays
  # CUDA graphs; tearing CUPTI down between them is what PyTorch itself avoids with graphs
  export PYTHONPATH="$PWD:$site" PYTHONUNBUFFERED=1 TEARDOWN_CUPTI=0
  [ -f "$WHEELS/COMMIT" ] && export KIMI_PERF_GIT_COMMIT=$(cat "$WHEELS/COMMIT")
  out=${OUT:-gpu-check-out}
  mkdir -p "$out"
  cubins=()
  [ -f "$WHEELS/cute/manifest.json" ] && cubins=(--cubins "$WHEELS/cute")
  "$PYTHON" benchmarks/gpu_decode_check.py --out "$out" ${cubins[@]+"${cubins[@]}"} "$@" 2>&1 \
    | tee "$out/log.txt"
  ;;
*)
  echo "usage: bash scripts/gpu-check.sh fetch | run [ARGS...]" >&2
  exit 2
  ;;
esac

#!/usr/bin/env bash
# The one prepared script for a GPU machine: the CUDA tests of OrtBackend, then the GPU benchmark (bench.gpu) with
# CUDA graphs off and on, everything written under docs/ with the date and the device's name.
#
# The GPU machine lacks onnxruntime-gpu (its onnxruntime is the CPU build), the onnxruntime-genai builder and a
# few pure-Python packages, and reaches no network; a device call carries at most 64 MiB. So the work is split:
#
#   1. Here, on a CPU machine with pip and the convert extra:   scripts/gpu_check.sh --prepare [DIR]
#      (DIR defaults to .device_carry, git-ignored; 10 minutes on 2 busy cores, most of it xz) writes
#        DIR/base.tar.xz            tiny test folders (tiny-fp16-cuda, tiny-fp32), pylib/ (pytest & co, appended to
#                                   PYTHONPATH only for what the machine lacks), pyfirst/ (onnx-ir, ahead of the
#                                   machine's), builder/ (onnxruntime-genai's models/: the model builder, pure
#                                   Python), genai/ (the onnxruntime-genai-cuda wheel, for its own greedy)
#        DIR/parts/ort-gpu.tar.xz.NN  onnxruntime-gpu 1.31.1 for CUDA 13 / Python 3.12 (the wheel unpacked, tar, xz:
#                                   195 MiB), in parts of at most 61 MiB, the first smaller by base.tar.xz (18 MB)
#      and prints the carry plan: one device call per part, back to back (a machine stays warm 30 s after a call).
#   2. On the GPU machine, each call but the last:               scripts/gpu_check.sh --receive
#      unpacks base.tar.xz once and starts building the benchmark's model folders in the background (setsid, so the
#      builds run on between calls: random weights of SmolLM2-135M's and Qwen2.5-0.5B's shapes, fp16 and int4, by
#      the carried builder), then lists the parts that have arrived. A few seconds.
#   3. The last call (the last part carried):                     scripts/gpu_check.sh [--modes eager,graphs]
#      joins and unpacks onnxruntime-gpu, installs ORT GenAI for CUDA, prints the providers and versions, runs the
#      `cuda` tests of tests/test_onnx_backend.py and tests/test_fast_path.py, waits for the builds (rebuilding any
#      that failed, e.g. int4 before onnxruntime-gpu's quantizer arrived), runs `python -m bench.gpu --provider cuda`
#      and writes docs/gpu/gpu-bench-cuda-<device>-<date>.{json,md} and docs/gpu_check-<device>-<date>.log, copied
#      to $OUT too when it is set (what a device call brings back).
#
# Device time, estimated (not measured: this script has not run on a GPU yet): the machine's start (1-2 min) and
# one call per part (transfer + a few seconds each); the builds (about 1-2 min on 16 cores, 4 at a time) overlap
# the transfers; the last call about 4-5 min (unpack ~15 s, cuda tests ~45 s: the old script's 8 tests took 32 s
# there; bench.gpu ~3 min: 4 folders x 2 modes x (session open, CUDA graph capture of 17 widths, 4 greedy runs of
# 256 tokens, 187 cost-curve passes, identity runs, replay pricing ~5 s) + ORT GenAI 4 folders x 2; ~1 min spare).
# So about 8 minutes of device time with 4 parts, within the 10-minute per-command limit for the last call.
# GPU_CHECK_BUDGET (seconds, default 540) caps the last call: each step gets at most what is left (the builds are
# waited for while more than 200 s are left). GPU_CHECK_BENCH_ARGS adds bench.gpu arguments to the builds and the
# bench (e.g. "--shape qwen2.5-0.5b --precision int4" for a shorter run). GPU_CHECK_PROVIDER=cpu runs the same flow
# without a GPU (the cuda tests skip, the bench runs on the CPU provider): a dry run of this script, e.g. with
# GPU_CHECK_BENCH_ARGS="--shape tiny --precision fp32".
#
# Exit status: 0 when the CUDA tests passed and the bench wrote its results, 2 when they could not run (no CUDA EP,
# no CuPy/torch, parts missing), 1 on failure.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-$(command -v python3 || command -v python)}"
CARRY=".device_carry"
MODE="run"
MODES="eager,graphs"
ORT_PATH=""
ORT_GPU_VERSION="1.31.1"
GENAI_VERSION="0.18.0"
ONNX_IR_VERSION="1.1.0"
CALL_MIB=61  # carried bytes per device call: 64 MiB less the working tree (~2 MB) and a margin
ORT_WHEEL=""

while [ $# -gt 0 ]; do
  case "$1" in
    --prepare) MODE=prepare; if [ $# -gt 1 ] && [ "${2#--}" = "$2" ]; then CARRY="$2"; shift; fi ;;
    --receive) MODE=receive ;;
    --carry) CARRY="$2"; shift ;;
    --modes) MODES="$2"; shift ;;
    --ort-path) ORT_PATH="$2"; shift ;;
    --ort-wheel) ORT_WHEEL="$2"; shift ;;
    -h|--help) sed -n '2,40p' "$0"; exit 0 ;;
    *) echo "unknown argument: $1" >&2; exit 64 ;;
  esac
  shift
done

# ------------------------------------------------------------------------------------------------------------------
if [ "$MODE" = prepare ]; then
  set -e
  rm -rf "$CARRY/stage" "$CARRY/parts" "$CARRY/base.tar.xz"
  STAGE="$CARRY/stage"
  mkdir -p "$STAGE/base" "$STAGE/ort" "$CARRY/parts"
  TINY='import sys; from tests.support.models import make_tiny_model as m; m(sys.argv[1], precision=sys.argv[2], execution_provider=sys.argv[3])'
  "$PY" -c "$TINY" "$STAGE/base/tiny-fp16-cuda" fp16 cuda
  "$PY" -c "$TINY" "$STAGE/base/tiny-fp32" fp32 cpu
  PIPDL=("$PY" -m pip download --no-deps --disable-pip-version-check -q --only-binary=:all:)
  # pure-Python packages: pylib is appended to PYTHONPATH for what the machine lacks; pyfirst goes ahead of it
  "${PIPDL[@]}" -d "$STAGE/wheels" --platform any --python-version 3.12 --implementation py \
      attrs platformdirs pytest pluggy iniconfig packaging pygments typing_extensions
  "${PIPDL[@]}" -d "$STAGE/wheels-first" --platform any --python-version 3.12 --implementation py "onnx-ir==$ONNX_IR_VERSION"
  for w in "$STAGE"/wheels/*.whl; do "$PY" -m zipfile -e "$w" "$STAGE/base/pylib"; done
  for w in "$STAGE"/wheels-first/*.whl; do "$PY" -m zipfile -e "$w" "$STAGE/base/pyfirst"; done
  # ORT GenAI for CUDA (its own greedy beside ours) and its builder (models/, pure Python) as a plain folder
  GENAI_PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
                   --python-version 3.12 --implementation cp)
  mkdir -p "$STAGE/base/genai"
  "${PIPDL[@]}" -d "$STAGE/base/genai" "${GENAI_PLATFORMS[@]}" "onnxruntime-genai-cuda==$GENAI_VERSION"
  "$PY" - "$STAGE/base/genai"/*.whl "$STAGE/base/builder" <<'EOF'
import sys, zipfile
from pathlib import Path
wheel, dest = sys.argv[1], Path(sys.argv[2])
with zipfile.ZipFile(wheel) as zf:
    for name in zf.namelist():
        if name.startswith("onnxruntime_genai/models/") and "__pycache__" not in name and not name.endswith("/"):
            target = dest / name[len("onnxruntime_genai/models/"):]
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(zf.read(name))
print(f"builder: {sum(1 for _ in dest.rglob('*.py'))} files from {Path(wheel).name}")
EOF
  tar -C "$STAGE/base" -cf - . | xz -T0 -6 > "$CARRY/base.tar.xz"
  # onnxruntime-gpu: the wheel unpacked, tarred, xz-compressed, split
  if [ -z "$ORT_WHEEL" ]; then
    "${PIPDL[@]}" -d "$STAGE/ortwheel" "${GENAI_PLATFORMS[@]}" "onnxruntime-gpu==$ORT_GPU_VERSION"
    ORT_WHEEL="$(ls "$STAGE"/ortwheel/onnxruntime_gpu-*.whl)"
  fi
  "$PY" -m zipfile -e "$ORT_WHEEL" "$STAGE/ort"
  tar -C "$STAGE/ort" -cf - . | xz -T0 -6 > "$STAGE/ort-gpu.tar.xz"
  # parts of at most CALL_MIB each, the first smaller by base.tar.xz (they travel together in the first call)
  "$PY" - "$STAGE/ort-gpu.tar.xz" "$CARRY/base.tar.xz" "$CARRY/parts" "$CALL_MIB" <<'EOF'
import os, sys
src, base, out, call_mib = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
limit = call_mib << 20
first = limit - os.path.getsize(base)
if first < 1 << 20:
    sys.exit(f"base.tar.xz ({os.path.getsize(base)} bytes) leaves no room for a part in a {call_mib} MiB call")
with open(src, "rb") as f:
    index, size = 0, first
    while chunk := f.read(size):
        with open(os.path.join(out, f"ort-gpu.tar.xz.{index:02d}"), "wb") as part:
            part.write(chunk)
        index, size = index + 1, limit
EOF
  rm -rf "$STAGE"
  ls -l "$CARRY/base.tar.xz" "$CARRY"/parts/
  n=$(ls "$CARRY"/parts/ | wc -l)
  echo
  echo "carry plan ($n parts; make the calls back to back: a machine goes back 30 s after a call):"
  i=0
  for part in "$CARRY"/parts/*; do
    if [ $i -eq 0 ]; then extra="\"$CARRY/base.tar.xz\", "; else extra=""; fi
    if [ $i -eq $((n - 1)) ]; then cmd="scripts/gpu_check.sh"; t="timeout_s=590"; else cmd="scripts/gpu_check.sh --receive"; t="timeout_s=60"; fi
    echo "  call $((i + 1)): carry [${extra}\"$part\"]  command: $cmd  ($t)"
    i=$((i + 1))
  done
  if [ "$n" -eq 1 ]; then echo "  (one part: base.tar.xz and it go in the one call)"; fi
  echo "each call carries at most ${CALL_MIB} MiB; with the working tree (~2 MB) under the 64 MiB a call may take."
  exit 0
fi

# ------------------------------------------------------------------------------------------------------------------
# on the GPU machine
case "$CARRY" in /*) ;; *) CARRY="$ROOT/$CARRY" ;; esac
T0=$(date +%s)
BUDGET="${GPU_CHECK_BUDGET:-540}"
PROVIDER="${GPU_CHECK_PROVIDER:-cuda}"  # cpu: a dry run of this script's flow on a machine without a GPU
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
cap() { local want="$1" l; l=$(left); if [ "$l" -lt "$want" ]; then echo "$l"; else echo "$want"; fi; }

mkdir -p "$CARRY"
if [ -f "$CARRY/base.tar.xz" ] && [ ! -f "$CARRY/base/.unpacked" ]; then
  rm -rf "$CARRY/base" && mkdir -p "$CARRY/base"
  xz -dc "$CARRY/base.tar.xz" | tar -x -C "$CARRY/base" && touch "$CARRY/base/.unpacked"
fi
BASE="$CARRY/base"
MODELS="$CARRY/models"

# The package shim: ortspec -> ortspec/*, ortspec.core -> core/, ortspec.backends -> backends/,
# ortspec.adapters -> adapters/; then the repository root (for bench), then carried packages.
SHIM="$CARRY/shim"
rm -rf "$SHIM" && mkdir -p "$SHIM/ortspec"
for f in "$ROOT"/ortspec/*; do ln -s "$f" "$SHIM/ortspec/$(basename "$f")"; done
for d in core backends adapters; do ln -s "$ROOT/$d" "$SHIM/ortspec/$d"; done
export PYTHONPATH="$SHIM:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
[ -d "$BASE/pyfirst" ] && export PYTHONPATH="$BASE/pyfirst:$PYTHONPATH"
export PYTHONUNBUFFERED=1
export PYTHONSAFEPATH=1  # keep the working directory (whose ortspec/ lacks core, backends, adapters) off sys.path
export ORTSPEC_GENAI_BUILDER="$BASE/builder"
export TQDM_DISABLE=1

add_pylib() {  # carried pure-Python packages, after the machine's own, for the ones it lacks
  local missing
  missing=$("$PY" -c "
import importlib.util
print(' '.join(m for m in ('attrs', 'platformdirs', 'pytest') if importlib.util.find_spec(m) is None))")
  if [ -n "$missing" ] && [ -d "$BASE/pylib" ]; then
    echo "using carried pylib for: $missing"
    export PYTHONPATH="$PYTHONPATH:$BASE/pylib"
  fi
}

start_builds() {  # the benchmark's folders, in the background, once
  if [ -f "$CARRY/build.started" ] || [ ! -d "$BASE/builder" ]; then return; fi
  touch "$CARRY/build.started"
  rm -f "$CARRY/build.done"
  # setsid: the builds run on after this call returns; build.done holds their exit status when they end
  setsid nohup sh -c '"$0" -m bench.gpu --provider "$4" --build-only --build-jobs 4 --models-dir "$1" $3; echo $? > "$2"' \
      "$PY" "$MODELS" "$CARRY/build.done" "${GPU_CHECK_BENCH_ARGS:-}" "$PROVIDER" > "$CARRY/build.log" 2>&1 < /dev/null &
  echo $! > "$CARRY/build.pid"
  echo "builds started (pid $(cat "$CARRY/build.pid")), log $CARRY/build.log"
}

if [ "$MODE" = receive ]; then
  add_pylib
  start_builds
  echo "parts here: $(ls "$CARRY"/parts/ 2>/dev/null | tr '\n' ' ')"
  [ -f "$CARRY/build.log" ] && tail -n 5 "$CARRY/build.log"
  echo "receive done in $(( $(date +%s) - T0 ))s"
  exit 0
fi

# ------------------------------------------------------------------------------------------------------------------
# the last call: onnxruntime-gpu, tests, bench
DATE=$(date -u +%Y-%m-%d)
DEVICE="unknown"
mkdir -p docs/gpu
LOG="docs/gpu_check-pending-$DATE.log"
exec > >(tee "$LOG") 2>&1
finish() {  # on every exit: the log under its final name, and everything worth keeping copied to $OUT
  local status=$? final="docs/gpu_check-${DEVICE}-${DATE}.log"
  echo "== done in $(( $(date +%s) - T0 ))s, exit $status; log $final"
  sleep 1  # let tee write the last lines
  mv "$LOG" "$final"
  if [ -n "${OUT:-}" ] && [ -d "${OUT:-}" ]; then
    cp "$final" "$OUT"/ 2>/dev/null
    cp docs/gpu/gpu-bench-"$PROVIDER"-*-"$DATE".json docs/gpu/gpu-bench-"$PROVIDER"-*-"$DATE".md "$OUT"/ 2>/dev/null
    [ -f "$CARRY/build.log" ] && cp "$CARRY/build.log" "$OUT/gpu_check-build-${DATE}.log"
  fi
  return $status
}
trap finish EXIT
echo "== gpu_check $(date -u +%Y-%m-%dT%H:%M:%SZ), budget ${BUDGET}s"

if [ -n "$ORT_PATH" ]; then
  export PYTHONPATH="$ORT_PATH:$PYTHONPATH"
elif ls "$CARRY"/parts/ort-gpu.tar.xz.* >/dev/null 2>&1; then
  if [ ! -f "$CARRY/site-ort/.unpacked" ]; then
    rm -rf "$CARRY/site-ort" && mkdir -p "$CARRY/site-ort"
    cat "$CARRY"/parts/ort-gpu.tar.xz.* | xz -dc | tar -x -C "$CARRY/site-ort" && touch "$CARRY/site-ort/.unpacked" \
      || { echo "onnxruntime-gpu parts do not unpack (one missing?): $(ls "$CARRY"/parts/)"; exit 2; }
  fi
  export PYTHONPATH="$CARRY/site-ort:$PYTHONPATH"
fi
if [ -d "$BASE/genai" ] && [ ! -f "$CARRY/site-genai/.installed" ]; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$CARRY/site-genai" \
      "$BASE"/genai/*.whl && touch "$CARRY/site-genai/.installed" || echo "ORT GenAI for CUDA did not install"
fi
[ -f "$CARRY/site-genai/.installed" ] && export PYTHONPATH="$PYTHONPATH:$CARRY/site-genai"
add_pylib
start_builds  # in case no --receive call came first

echo "== onnxruntime providers"
"$PY" -c "import onnxruntime as ort; print('onnxruntime', ort.__version__, ort.__file__, ort.get_available_providers())" || {
  echo "onnxruntime is not importable"; exit 2; }
if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  DEVICE=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1 | tr 'A-Z' 'a-z' | tr -cs 'a-z0-9' '-' | sed 's/-$//')
fi
"$PY" - <<'EOF'
import importlib.util, sys
print("python", sys.version.split()[0])
for m in ("numpy", "cupy", "torch", "attrs", "platformdirs", "pytest", "onnx", "onnx_ir", "transformers",
          "tokenizers", "onnxruntime_genai"):
    spec = importlib.util.find_spec(m)
    ver = ""
    if spec is not None:
        try:
            ver = getattr(__import__(m), "__version__", "")
        except Exception as exc:  # noqa: BLE001
            ver = f"(import failed: {type(exc).__name__}: {str(exc)[:200]})"
    print(f"  {m:18s} {'yes ' + str(ver) if spec else 'no'}")
try:
    import torch
    print("  torch.cuda.is_available():", torch.cuda.is_available())
except Exception:
    pass
EOF

why=$("$PY" -c "
import importlib.util, onnxruntime as ort
if 'CUDAExecutionProvider' not in ort.get_available_providers():
    print('onnxruntime has no CUDAExecutionProvider (needs onnxruntime-gpu)')
elif importlib.util.find_spec('cupy') is None and importlib.util.find_spec('torch') is None:
    print('neither CuPy nor torch is installed')
" 2>&1)
if [ -n "$why" ] && [ "$PROVIDER" = cuda ]; then echo "CUDA checks cannot run: $why"; exit 2; fi

echo "== pytest -m cuda ($(left)s left)"
ORTSPEC_CUDA_TINY_MODEL="$BASE/tiny-fp16-cuda" timeout "$(cap 200)" "$PY" -m pytest \
    tests/test_onnx_backend.py tests/test_fast_path.py -m cuda -q -s -p no:cacheprovider --noconftest -o addopts="" -rA
if [ $? -ne 0 ]; then rc=1; else rc=0; fi

echo "== builds ($(left)s left)"
if [ -f "$CARRY/build.pid" ]; then
  pid=$(cat "$CARRY/build.pid")
  waited=0
  while [ ! -f "$CARRY/build.done" ] && [ "$(left)" -gt 200 ]; do sleep 2; waited=$((waited + 2)); done
  if [ -f "$CARRY/build.done" ]; then
    echo "builds ended with exit $(cat "$CARRY/build.done") (waited ${waited}s here)"
  else
    echo "builds still running after ${waited}s of waiting; stopping them (bench.gpu builds what is missing)"
    kill -- -"$pid" 2>/dev/null
  fi
  cat "$CARRY/build.log"
fi

echo "== bench.gpu --modes $MODES ($(left)s left)"
# shellcheck disable=SC2086  # GPU_CHECK_BENCH_ARGS: extra bench.gpu arguments, split on spaces (e.g. --shape tiny)
[ "$PROVIDER" = cpu ] && MODES="${MODES//,graphs/}"
timeout "$(cap 420)" "$PY" -m bench.gpu --provider "$PROVIDER" --modes "$MODES" --build-jobs 4 \
    --models-dir "$MODELS" --out docs/gpu ${GPU_CHECK_BENCH_ARGS:-}
brc=$?
[ $brc -ne 0 ] && { echo "bench.gpu failed or timed out (exit $brc)"; rc=1; }

exit $rc

#!/usr/bin/env bash
# All CUDA checks of OrtBackend in one go, for a machine with an NVIDIA GPU (runs in well under 5 minutes).
#
# Two steps, because the GPU machine may lack the model builder (transformers + onnxruntime-genai):
#
#   1. On a machine with the convert extra (pip install 'ortspec[convert]'), no GPU needed:
#        scripts/gpu_check.sh --prepare [DIR]        # default DIR: .device_carry (git-ignored)
#      builds DIR/tiny-fp16-cuda (the test model), DIR/tiny-fp32 (fp32 on CUDA, informational) and
#      DIR/small-fp16-cuda (the speed comparison model: 4 layers, SmolLM2's 49152-wide vocabulary), and unpacks the pure-Python packages the tests need
#      (attrs, platformdirs, pytest and its deps) into DIR/pylib. About 40 MB in all.
#   2. On the GPU machine, from the repository root, with DIR copied along:
#        scripts/gpu_check.sh [--model DIR/tiny-fp16-cuda] [--bench-model DIR/small-fp16-cuda] [--pylib DIR/pylib]
#      (the defaults are those paths under .device_carry; --ort-path DIR puts an unpacked onnxruntime-gpu first
#      on PYTHONPATH when the installed onnxruntime lacks the CUDA execution provider). It prints onnxruntime.get_available_providers()
#      first, then runs the `cuda` tests of tests/test_onnx_backend.py and a CPU-vs-CUDA speed comparison.
#      It needs numpy, onnxruntime-gpu, and CuPy or torch with CUDA. It does not need the package installed:
#      it points PYTHONPATH at a shim of links that maps ortspec.{core,backends,adapters} onto the repo.
#
# Last run (NVIDIA H200, python 3.12, onnxruntime-gpu 1.31.1 for CUDA 13 unpacked under --ort-path because the
# machine's preinstalled onnxruntime 1.30 was the CPU build, CuPy 14.2, torch 2.11+cu130): 7 cuda tests passed
# (CuPy and torch device arrays), 32 s in all.
#
# Exit status: 0 when the CUDA tests passed, 2 when they could not run (no CUDA EP, no CuPy/torch), 1 on failure.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-$(command -v python3 || command -v python)}"
CARRY=".device_carry"
MODEL=""
BENCH_MODEL=""
PYLIB=""
PREPARE=""
ORT_PATH=""

while [ $# -gt 0 ]; do
  case "$1" in
    --prepare) PREPARE=1; if [ $# -gt 1 ] && [ "${2#--}" = "$2" ]; then CARRY="$2"; shift; fi ;;
    --model) MODEL="$2"; shift ;;
    --bench-model) BENCH_MODEL="$2"; shift ;;
    --pylib) PYLIB="$2"; shift ;;
    --ort-path) ORT_PATH="$2"; shift ;;
    -h|--help) sed -n '2,24p' "$0"; exit 0 ;;
    *) echo "unknown argument: $1" >&2; exit 64 ;;
  esac
  shift
done

if [ -n "$PREPARE" ]; then
  set -e
  mkdir -p "$CARRY"
  "$PY" -m ortspec.adapters.convert --tiny "$CARRY/tiny-fp16-cuda" --precision fp16 --execution-provider cuda
  "$PY" -m ortspec.adapters.convert --tiny "$CARRY/tiny-fp32" --precision fp32
  "$PY" - "$CARRY/small-fp16-cuda" <<'EOF'
import sys
from ortspec.adapters.convert import make_tiny_model
print(make_tiny_model(sys.argv[1], layers=4, hidden=128, heads=4, kv_heads=2, vocab=49152, context=1024,
                      precision="fp16", execution_provider="cuda"))
EOF
  rm -rf "$CARRY/pylib" "$CARRY/wheels"
  "$PY" -m pip download --no-deps --disable-pip-version-check -q -d "$CARRY/wheels" \
      --only-binary=:all: --platform any --python-version 3.10 --implementation py \
      attrs platformdirs pytest pluggy iniconfig packaging pygments tomli exceptiongroup typing_extensions
  mkdir -p "$CARRY/pylib"
  for w in "$CARRY"/wheels/*.whl; do "$PY" -m zipfile -e "$w" "$CARRY/pylib"; done
  rm -rf "$CARRY/wheels"
  du -sh "$CARRY"
  echo "prepared $CARRY; on the GPU machine run: scripts/gpu_check.sh"
  exit 0
fi

MODEL="${MODEL:-$CARRY/tiny-fp16-cuda}"
BENCH_MODEL="${BENCH_MODEL:-$CARRY/small-fp16-cuda}"
PYLIB="${PYLIB:-$CARRY/pylib}"
T0=$(date +%s)
# --ort-path DIR: a folder holding an unpacked onnxruntime-gpu package (DIR/onnxruntime), used instead of the
# installed onnxruntime (for a GPU machine whose preinstalled onnxruntime is the CPU-only build).
if [ -n "$ORT_PATH" ]; then export PYTHONPATH="$ORT_PATH${PYTHONPATH:+:$PYTHONPATH}"; fi

echo "== onnxruntime providers"
"$PY" -c "import onnxruntime as ort; print('onnxruntime', ort.__version__, ort.get_available_providers())" || {
  echo "onnxruntime is not importable"; exit 2; }
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
"$PY" - <<'EOF'
import importlib.util, sys
print("python", sys.version.split()[0])
for m in ("numpy", "cupy", "torch", "attrs", "platformdirs", "pytest", "onnxruntime_genai", "transformers"):
    spec = importlib.util.find_spec(m)
    ver = ""
    if spec is not None:
        try:
            ver = getattr(__import__(m), "__version__", "")
        except Exception as exc:  # noqa: BLE001
            ver = f"(import failed: {exc})"
    print(f"  {m:18s} {'yes ' + str(ver) if spec else 'no'}")
try:
    import torch
    print("  torch.cuda.is_available():", torch.cuda.is_available())
except Exception:
    pass
EOF

# The package shim: ortspec -> ortspec/*, ortspec.core -> core/, ortspec.backends -> backends/, ortspec.adapters -> adapters/
SHIM="$(mktemp -d)"
mkdir -p "$SHIM/ortspec"
for f in "$ROOT"/ortspec/*; do ln -s "$f" "$SHIM/ortspec/$(basename "$f")"; done
for d in core backends adapters; do ln -s "$ROOT/$d" "$SHIM/ortspec/$d"; done
export PYTHONPATH="$SHIM${PYTHONPATH:+:$PYTHONPATH}"
missing=$("$PY" -c "
import importlib.util
print(' '.join(m for m in ('attrs', 'platformdirs', 'pytest') if importlib.util.find_spec(m) is None))")
if [ -n "$missing" ]; then
  if [ -d "$PYLIB" ]; then
    echo "using carried $PYLIB for: $missing"
    case "$PYLIB" in /*) export PYTHONPATH="$PYTHONPATH:$PYLIB" ;; *) export PYTHONPATH="$PYTHONPATH:$ROOT/$PYLIB" ;; esac
  else
    echo "missing $missing and no $PYLIB (run scripts/gpu_check.sh --prepare on a machine with pip)"; exit 2
  fi
fi
export PYTHONUNBUFFERED=1
export PYTHONSAFEPATH=1  # keep the repo root (whose ortspec/ lacks core, backends, adapters) off sys.path

if [ ! -f "$MODEL/genai_config.json" ]; then
  echo "== no $MODEL: trying to build it here"
  "$PY" -m ortspec.adapters.convert --tiny "$MODEL" --precision fp16 --execution-provider cuda || {
    echo "cannot build the tiny model here; run scripts/gpu_check.sh --prepare elsewhere and copy $CARRY"; exit 2; }
fi

why=$("$PY" -c "
import importlib.util, onnxruntime as ort
if 'CUDAExecutionProvider' not in ort.get_available_providers():
    print('onnxruntime has no CUDAExecutionProvider (needs onnxruntime-gpu)')
elif importlib.util.find_spec('cupy') is None and importlib.util.find_spec('torch') is None:
    print('neither CuPy nor torch is installed')
" 2>&1)
if [ -n "$why" ]; then echo "CUDA checks cannot run: $why"; exit 2; fi

echo "== CUDA session probe"
"$PY" - "$MODEL" "$CARRY/tiny-fp32" <<'EOF'
import sys
import numpy as np
import onnxruntime as ort
from ortspec.backends.onnx import OrtBackend
for folder in sys.argv[1:]:
    try:
        b = OrtBackend.from_folder(folder, provider="cuda")
        row = b.decode([5, 6, 7], 0)
        print(f"  {folder}: {b!r} providers={b.session.get_providers()} argmax={int(np.argmax(row))} "
              f"arrays={b._arrays.name}")
    except Exception as exc:  # noqa: BLE001
        print(f"  {folder}: {type(exc).__name__}: {str(exc)[:600]}")
EOF

echo "== pytest -m cuda"
ORTSPEC_CUDA_TINY_MODEL="$MODEL" timeout 200 "$PY" -m pytest tests/test_onnx_backend.py -m cuda -q -s \
    -p no:cacheprovider --noconftest -o addopts="" -rA
if [ $? -ne 0 ]; then rc=1; else rc=0; fi

echo "== speed: CPU vs CUDA on $BENCH_MODEL"
if [ -f "$BENCH_MODEL/genai_config.json" ]; then
  for prov in cpu cuda; do
    timeout 100 "$PY" scripts/bench_backend.py --model "$BENCH_MODEL" --provider "$prov" --runs 30 --warmup 5 \
        --prompt-len 128 --ks 1,2,4,8,16 || echo "bench on $prov failed"
  done
else
  echo "no $BENCH_MODEL; skipped"
fi
echo "== done in $(( $(date +%s) - T0 ))s, exit $rc"
exit $rc

#!/usr/bin/env bash
# The GPU checks and benchmark on the device machine (docs/gpu.md), in two halves:
#
#   here:        bash bench/gpu_device_run.sh prepare
#                  cp312 wheels the device lacks (xgrammar + apache-tvm-ffi, pydantic and its parts) and the
#                  SmolLM2 tokenizer files (not the weights) into .cache/gpu-carry (git-ignored, ~11 MB).
#   the device:  run tool, carry [".cache/gpu-carry"], command:
#                  bash bench/gpu_device_run.sh device all      (checks, then the benchmark; ~7 min)
#                  bash bench/gpu_device_run.sh device checks   (bench/gpu_checks.py alone; ~1-2 min)
#                  bash bench/gpu_device_run.sh device bench    (bench/gpu.py alone; < 6 min)
#                Logs and gpu.json land in $OUT. Extra arguments after the stage go to bench/gpu.py.
set -euo pipefail
cd "$(dirname "$0")/.."
CARRY=.cache/gpu-carry
stage=${1:-}
shift || true

case "$stage" in
prepare)
  PY=${PY:-.venv/bin/python}
  mkdir -p "$CARRY/wheels" "$CARRY/tokenizer"
  # the versions that worked on the device (cp312 wheels: its Python is 3.12; docs/gpu.md)
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
    -d "$CARRY/wheels" xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2 pydantic==2.14.4 pydantic-core==2.50.5 \
    annotated-types typing-inspection 'typing-extensions>=4.16'
  src=${SIE_MODEL_CACHE:-.cache/models}/SmolLM2-135M-Instruct
  for f in tokenizer.json tokenizer_config.json chat_template.jinja config.json generation_config.json; do
    [ -f "$src/$f" ] && cp "$src/$f" "$CARRY/tokenizer/"
  done
  size=$(du -sm "$CARRY" | cut -f1)
  echo "carry: $CARRY ${size} MiB (the device accepts 64 MiB in all)"
  [ "$size" -lt 60 ] || { echo "carry too large" >&2; exit 1; }
  ;;
device)
  what=${1:-all}
  shift || true
  OUT=${OUT:-/tmp/gpu-out}
  mkdir -p "$OUT"
  PY=${PY:-/opt/torch/.venv/bin/python}
  [ -x "$PY" ] || PY=python3
  site=/tmp/gpu-carry-site
  # SKIP_INSTALL=1: a local dry run of the plumbing (the carried wheels are for the device's Python 3.12)
  [ "${SKIP_INSTALL:-0}" = 1 ] || "$PY" -m pip install -q --no-index --no-deps --target "$site" \
    "$CARRY"/wheels/*.whl 2>&1 | tail -3
  export PYTHONPATH="$site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
  export TOKENIZERS_PARALLELISM=false
  nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader || true
  "$PY" -c "import importlib.metadata as m, torch, xgrammar; print({p: m.version(p) for p in ('torch', \
'transformers', 'xgrammar', 'pydantic')}, 'cuda', torch.cuda.is_available())"
  rc=0
  if [ "$what" = all ] || [ "$what" = checks ]; then
    timeout 180 "$PY" -m bench.gpu_checks --tokenizer "$CARRY/tokenizer" ${GPU_CHECKS_ARGS:-} 2>&1 \
      | tee "$OUT/gpu_checks.log" || rc=$?
  fi
  if [ "$what" = all ] || [ "$what" = bench ]; then
    timeout 400 "$PY" -m bench.gpu --tokenizer "$CARRY/tokenizer" --out "$OUT/gpu.json" "$@" 2>&1 \
      | tee "$OUT/gpu.log" || rc=$?
  fi
  exit $rc
  ;;
*)
  echo "usage: $0 prepare | device [all|checks|bench] [bench.gpu args]" >&2
  exit 2
  ;;
esac

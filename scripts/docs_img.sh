#!/usr/bin/env bash
# Regenerates the plot screenshots of docs/img/ (docs/img/README.md lists them). Each takes
# seconds on a CPU; every image stays under 150 KB.
set -euo pipefail
cd "$(dirname "$0")/.."
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# latency CDFs with the SLO bounds: paged vs contiguous, llama-3.1-8b on one H200 (virtual time)
python3 -m kvpool simulate --requests 100 --layout paged,contiguous --json --plot "$tmp" >/dev/null
cp "$tmp/latency_cdf.png" docs/img/sim_latency_cdf.png
cp "$tmp/comparison.png" docs/img/sim_comparison.png
# KV bytes of one request against context length, for the planner's default presets
python3 -m kvpool plan --plot docs/img/kv_vs_context.png >/dev/null

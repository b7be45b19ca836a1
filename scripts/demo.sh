#!/usr/bin/env bash
# Set up from nothing and run the demo: a tiny random-weight transformers Llama compiled
# with fusion on CPU, logits checked against eager, fusion report printed.
# Extra arguments go to `npu-fx-fusion demo` (e.g. --dtype bfloat16 --model qwen3).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/venv.sh
pip_install '.[demo]'
# Graphviz's `dot` lays out the graph drawings of --dump-dir (skipped without it).
apt_install dot:graphviz || echo "note: --dump-dir writes no drawings" >&2
exec "$VENV/bin/npu-fx-fusion" demo "$@"

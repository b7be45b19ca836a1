#!/usr/bin/env bash
# Set up from nothing and run the demo: a tiny random-weight transformers Llama compiled
# with fusion on CPU, logits checked against eager, fusion report printed.
# Extra arguments go to `npu-fx-fusion demo` (e.g. --dtype bfloat16 --model qwen3).
# Setup prints one line per step; a second run finds everything in place in seconds.
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS=4
source scripts/venv.sh
step "installing npu-fx-fusion[demo] (transformers, pydot)" pip_install '.[demo]'
# Graphviz's `dot` lays out the graph drawings of --dump-dir (skipped without it).
system_packages "the --dump-dir drawings" dot:graphviz || true
echo "running: .venv/bin/npu-fx-fusion demo${*:+ $*}   (yourself: source .venv/bin/activate, then npu-fx-fusion ...)" >&2
echo >&2
exec "$VENV/bin/npu-fx-fusion" demo "$@"

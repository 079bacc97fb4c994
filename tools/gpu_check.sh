#!/usr/bin/env bash
# The prepared check for one NVIDIA GPU (an H100 or an H200), < 8 min: see tools/gpu_check.py for the steps.
#
#   tools/gpu_check.sh [--out DIR] [--profiles DIR] [--skip STEP,...] [--dry-run]
#
# Needs torch with CUDA, megatron-core 0.19.2 and transformer-engine 2.17.x (`pip install --no-build-isolation
# .[gpu]`). Writes DIR/gpu_check.json (default gpu_check_out/) and profiles/<preset>_{bf16,fp8}.json + <preset>.json
# (<preset>: the device's cluster preset, e.g. h100-sxm or h200).
# Exit 0: every step passed; 1: a step failed (the report says which); 2: bad arguments or no GPU.
set -uo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x "$ROOT/.venv/bin/python" ]]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON=python3; fi
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONWARNINGS=ignore
exec "$PYTHON" "$ROOT/tools/gpu_check.py" --python "$PYTHON" "$@"

#!/usr/bin/env bash
# Issue 18's distillation data and heads on the lent NVIDIA machine (distill_on_gpu.py says what and
# why), inside one call: BUDGET seconds in all, the unpacking and the model's conversion included.
#
#   CODE=<commit> BUDGET=480 bash benchmarks/device/cuda_distill.sh   # there, after the parts are in $X
#   QUICK=1 BUDGET=600 X=/tmp/xq PY=.venv/bin/python OUT=/tmp/dq bash benchmarks/device/cuda_distill.sh
set -u
start=$SECONDS
source "$(dirname "$0")/env.sh"
BUDGET=${BUDGET:-480}
timeout 150 $PY -c "from mlx_specdec.model.default import ensure_default_model as e; print(e('f16'))" 2>&1 | tail -2
$PY benchmarks/device/distill_on_gpu.py --budget $((BUDGET - (SECONDS - start))) --out "$OUT" \
    --work /tmp/distill ${QUICK:+--quick}

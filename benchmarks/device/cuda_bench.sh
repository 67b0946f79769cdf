#!/usr/bin/env bash
# ReDrafter in the GPU regime (../shared/gpu.md): ar against redrafter through MLX's CUDA backend
# on the lent NVIDIA machine, where a few extra query tokens cost almost nothing, as on a Mac GPU.
#
#   bash benchmarks/device/cuda_bench.sh          # there, after the parts are in $X (below)
#
# The wheels (mlx, mlx-cuda-13, mlx-lm, platformdirs, unpacked into site/) and the 6-bit default
# model (model/) travel as one xz'd tar split into parts ($X/part.*; benchmarks/device/pack.sh
# makes them), carried over back-to-back calls because one call carries at most 64 MiB. Every
# step writes its report under $OUT as it finishes, so a run stopped at its limit still returns
# what it measured; the steps run in the order they matter.
set -u
X=${X:-/tmp/x}
OUT=${OUT:-/tmp/out}
PY=${PY:-python3}
QUICK=${QUICK:-}  # set: one prompt, 8 tokens (a check of this script on a CPU)
cd "$(dirname "$0")/../.."
mkdir -p "$OUT"
if [ ! -d "$X/site" ] && ls "$X"/part.* >/dev/null 2>&1; then
    cat "$X"/part.* | xz -dc -T0 | tar xf - -C "$X" || { echo "unpack failed"; exit 1; }
fi
export PYTHONPATH="$X/site:$PWD" PYTHONUNBUFFERED=1 MLX_SPECDEC_NO_OPENBLAS=1
M=$X/model
D=models/drafter-smollm2-135m
LIMIT="--limit 8"; LIMIT16="--limit 16"; TOKENS=64
[ -n "$QUICK" ] && { LIMIT="--limit 1"; LIMIT16="--limit 1"; TOKENS=8; }

{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1
  $PY -c "import mlx.core as mx; print('mlx', mx.__version__, mx.default_device(), mx.device_info())" 2>&1
} | tee "$OUT/environment.txt"

step() {  # step NAME SECONDS COMMAND...: run under a limit, keep its log
    local name=$1 limit=$2; shift 2
    echo "== $name"
    local t0=$SECONDS
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    echo "   rc $? in $((SECONDS - t0)) s"; tail -3 "$OUT/$name.log"
}
bench() {  # bench NAME SECONDS ARGS...: ar against redrafter, the report as markdown
    local name=$1 limit=$2; shift 2
    step "$name" "$limit" $PY -m mlx_specdec.cli bench --model "$M" --drafter "$D" --max-tokens "$TOKENS" \
        --format md --output "$OUT/$name.md" "$@"
}

# What a T-token forward costs against one token: the number that decides whether verifying pays.
step forward_cost 45 $PY benchmarks/forward_cost.py --model "$M" --context 150 --tokens 1,2,3,4,6,8,16 --repeats 20
# The issue's figure: the chat prompts the head never saw, the shipped defaults (W1 L3 cutoff 0.2).
bench unseen_native 90 --methods ar,redrafter --prompts benchmarks/chat_unseen.jsonl $LIMIT
# Where a verify is nearly free, longer and wider drafts may pay: the sweep the CPU chose W1 L3 by.
bench unseen_sweep 120 --methods ar,redrafter --prompts benchmarks/chat_unseen.jsonl $LIMIT \
    --beam-width 1,2,4 --beam-length 3,5 --draft-cutoff 0
# The project's prompts, and the same weights in float32 (the CPU's numerics: acceptance comparable).
bench prompts16_native 90 --methods ar,redrafter $LIMIT16
bench unseen_float32 75 --methods ar,redrafter --prompts benchmarks/chat_unseen.jsonl $LIMIT --dtype float32 --dequantize on
bench unseen_profile 60 --methods redrafter --prompts benchmarks/chat_unseen.jsonl $LIMIT --profile
echo "== done"

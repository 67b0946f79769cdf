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
LIMIT="--limit 8"; TOKENS=64
[ -n "$QUICK" ] && { LIMIT="--limit 1"; TOKENS=8; REPEATS=1; }

{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1
  $PY -c "import mlx.core as mx; print('mlx', mx.__version__, mx.default_device(), mx.device_info())" 2>&1
} | tee "$OUT/environment.txt"

LOGS=$(mktemp -d)  # logs stay there: at most 8 files come back from $OUT
step() {  # step NAME SECONDS COMMAND...: run under a limit, keep its log
    local name=$1 limit=$2; shift 2
    echo "== $name"
    local t0=$SECONDS
    timeout "$limit" "$@" > "$LOGS/$name.log" 2>&1
    echo "   rc $? in $((SECONDS - t0)) s"; tr '\r' '\n' < "$LOGS/$name.log" | grep -v "^bench:" | tail -4
}
bench() {  # bench NAME SECONDS ARGS...: ar against redrafter, the report as markdown
    local name=$1 limit=$2; shift 2
    step "$name" "$limit" $PY -m mlx_specdec.cli bench --model "$M" --drafter "$D" --max-tokens "$TOKENS" \
        --format md --output "$OUT/$name.md" "$@"
}

# The issue's figure: the chat prompts the head never saw, the shipped defaults (W1 L3 cutoff 0.2,
# prompt lookup of 4 drafts) against the head alone (--lookup 0). Three repeats in one process: the
# first pays MLX-CUDA's kernel compiles (a cold process's first repeat took ~80 s on an H200 in
# 2026-11); benchmarks/device/per_repeat.py shows each apart. (The forward-cost table, float32 and
# the W/L sweep of the first H200 run are in benchmarks/results/issue18_h200_cuda/.)
bench unseen_native 220 --methods ar,redrafter --prompts benchmarks/chat_unseen.jsonl $LIMIT --repeats ${REPEATS:-3} \
    --lookup 0,4
# Longer answers repeat themselves more: where prompt lookup pays most (CPU: 1.51x at 256 tokens).
bench unseen_native_256 200 --methods ar,redrafter --prompts benchmarks/chat_unseen.jsonl $LIMIT --repeats 2 \
    --lookup 0,4 --max-tokens $((TOKENS * 4))
$PY benchmarks/device/per_repeat.py "$OUT"/*.md | tee "$OUT/per_repeat.txt"
echo "== done"

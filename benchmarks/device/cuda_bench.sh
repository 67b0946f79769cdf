#!/usr/bin/env bash
# ReDrafter in the GPU regime (../shared/gpu.md): ar against redrafter through MLX's CUDA backend
# on the lent NVIDIA machine, where a few extra query tokens cost almost nothing, as on a Mac GPU.
#
#   CODE=<commit> bash benchmarks/device/cuda_bench.sh   # there, after the parts are in $X (below)
#   QUICK=1 X=/tmp/xq PY=.venv/bin/python OUT=/tmp/oq bash benchmarks/device/cuda_bench.sh   # a check here
#
# The wheels (mlx, mlx-cuda-13, mlx-lm, platformdirs, unpacked into site/) and the default model's
# GGUF (home/downloads/, converted there into the float16 and 4-bit default models) travel as one
# xz'd tar split into parts ($X/part.*; benchmarks/device/pack.sh makes them), carried over
# back-to-back calls because one call carries at most 64 MiB. Every step writes its report under
# $OUT as it finishes, so a run stopped at its limit still returns what it measured; the steps run
# in the order they matter.
set -u
QUICK=${QUICK:-}  # set: one prompt, 8 tokens, one repeat (a check of this script on a CPU)
source "$(dirname "$0")/env.sh"
D=models/drafter-smollm2-135m
LIMIT=8; TOKENS=64; REPEATS=2; AB_REPEATS=12
[ -n "$QUICK" ] && { LIMIT=1; TOKENS=8; REPEATS=1; AB_REPEATS=2; }

LOGS=$(mktemp -d)  # logs stay there: at most 8 files come back from $OUT
step() {  # step NAME SECONDS COMMAND...: run under a limit, keep its log
    local name=$1 limit=$2; shift 2
    echo "== $name"
    local t0=$SECONDS
    timeout "$limit" "$@" > "$LOGS/$name.log" 2>&1
    echo "   rc $? in $((SECONDS - t0)) s"; tr '\r' '\n' < "$LOGS/$name.log" | grep -v "^bench:" | tail -4
}
bench() {  # bench NAME SECONDS ARGS...: the report as markdown
    local name=$1 limit=$2; shift 2
    step "$name" "$limit" $PY -m mlx_specdec.cli bench --drafter "$D" --limit "$LIMIT" --format md \
        --output "$OUT/$name.md" "$@"
}

# The real default models, converted from the GGUF as a user's first run does (float16 and 4-bit).
step convert 150 $PY -c "from mlx_specdec.model.default import ensure_default_model as e; print(e('f16'), e('4bit'))"
# 1. A verify forward, T = 1..8 tokens against one: its key bucket read from the cache buffer and
#    its mask built once per forward (this build), against padded in every layer (the build before).
step verify_ab_f16 60 sh -c "$PY benchmarks/device/verify_ab.py --model default --context 150,1000 \
    --tokens 1,2,3,4,6,8 --repeats $AB_REPEATS > $OUT/verify_ab_f16.md"
# 2. The issue's figure on the model a GPU runs by default (float16): the 8 unseen chat prompts,
#    64 tokens, shipped defaults, repeats in one process (the first pays MLX-CUDA's kernel
#    compiles; per_repeat.py shows each apart); then 256 tokens, where prompt lookup pays most.
bench unseen_f16 100 --model default --methods ar,redrafter --prompts benchmarks/chat_unseen.jsonl \
    --max-tokens "$TOKENS" --repeats "$REPEATS"
bench unseen_f16_256 90 --model default --methods ar,redrafter --prompts benchmarks/chat_unseen.jsonl \
    --max-tokens $((TOKENS * 4)) --repeats 1
# 3. The issue's 4-bit target (`bench --model default-4bit`), its project prompts, 48 tokens (apar
#    left out: cold on CUDA it outlasted a 180 s limit over 8 prompts), and the 4-bit verify forward.
bench q4 60 --model default-4bit --methods ar,redrafter --max-tokens $((TOKENS * 3 / 4)) --repeats 2
step verify_ab_q4 40 sh -c "$PY benchmarks/device/verify_ab.py --model default-4bit --context 150 \
    --tokens 1,2,3,4,6,8 --repeats $AB_REPEATS > $OUT/verify_ab_q4.md"
$PY benchmarks/device/per_repeat.py "$OUT"/unseen_f16*.md "$OUT"/q4.md > "$OUT/per_repeat.txt" 2>&1
cat "$OUT/per_repeat.txt"
echo "== done"

#!/usr/bin/env bash
# ReDrafter's device step against the host-read step and ar, on a lent GPU (../shared/gpu.md):
# the per-phase profile of one answer, then ar against redrafter (--step host,device) on the 8
# held-out chats, 96 tokens, 3 repeats, greedy and T = 0.7, then ar against mlx-lm.
#
#   CODE=<commit> bash benchmarks/device/gpu_step.sh     # there, after the parts are in $X (pack.sh)
#   QUICK=1 X=/tmp/xq PY=.venv/bin/python OUT=/tmp/oq bash benchmarks/device/gpu_step.sh   # a check here
#
# Each figure is written under $OUT as it finishes, most important first, so a run stopped at its
# limit returns what it measured. The first repeat of a process pays its compiles:
# per_repeat.py reports it apart.
set -u
QUICK=${QUICK:-}
source "$(dirname "$0")/env.sh"
D=models/drafter-smollm2-135m
P=benchmarks/chat_heldout.jsonl
LIMIT=8; TOKENS=96; REPEATS=3
[ -n "$QUICK" ] && { LIMIT=1; TOKENS=8; REPEATS=1; }
LOGS=$(mktemp -d)
step() {  # step NAME SECONDS COMMAND...
    local name=$1 limit=$2; shift 2
    echo "== $name"
    local t0=$SECONDS
    timeout "$limit" "$@" > "$LOGS/$name.log" 2>&1
    echo "   rc $? in $((SECONDS - t0)) s"; tr '\r' '\n' < "$LOGS/$name.log" | grep -v "^bench:" | tail -4
}
bench() {  # bench NAME SECONDS ARGS...: the report as markdown (with the per-step counts)
    local name=$1 limit=$2; shift 2
    step "$name" "$limit" $PY -m mlx_specdec.cli bench --model default --drafter "$D" --prompts "$P" \
        --limit "$LIMIT" --max-tokens "$TOKENS" --format md --output "$OUT/$name.md" "$@"
}
step convert 150 $PY -c "from mlx_specdec.model.default import ensure_default_model as e; print(e('f16'))"
# 1. Where one answer's step time goes, each step kind (a deliberate sync per phase: slower).
for kind in host device; do
    step "profile_$kind" 60 sh -c "$PY -m mlx_specdec.cli generate --model default --drafter $D --method redrafter \
        --step $kind --profile on --temp 0 --max-tokens $TOKENS -p 'Explain how a refrigerator keeps food cold.' \
        2> $OUT/profile_$kind.txt > /dev/null"
done
# 2. The issue's figures: greedy, then T = 0.7 (top-p 0.9).
bench greedy 200 --methods ar,redrafter --step host,device --repeats "$REPEATS" --temp 0
bench t07 200 --methods ar,redrafter --step host,device --repeats "$REPEATS" --temp 0.7 --top-p 0.9 --seed 2
# 3. ar against mlx-lm on the same GPU.
bench ar_mlxlm 120 --methods ar,mlx-lm --repeats "$REPEATS" --temp 0
$PY benchmarks/device/per_repeat.py "$OUT"/greedy.md "$OUT"/t07.md > "$OUT/per_repeat.txt" 2>&1
cat "$OUT/per_repeat.txt"
echo "== done"

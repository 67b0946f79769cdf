# Sourced by the device scripts (cuda_bench.sh, cuda_distill.sh): unpack the carried parts once
# ($X/part.*: the wheels' site/ and an MLX_SPECDEC_HOME with the default model's GGUF, made by
# pack.sh) and point Python at them and at this checkout. Writes the environment to $OUT.
X=${X:-/tmp/x}
OUT=${OUT:-/tmp/out}
PY=${PY:-python3}
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
mkdir -p "$OUT"
if [ ! -d "$X/home" ] && ls "$X"/part.* >/dev/null 2>&1; then
    cat "$X"/part.* | xz -dc -T0 | tar xf - -C "$X" || { echo "unpack failed"; exit 1; }
fi
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1 MLX_SPECDEC_NO_OPENBLAS=${MLX_SPECDEC_NO_OPENBLAS-1} MLX_SPECDEC_HOME="$X/home"
[ -d "$X/site" ] && export PYTHONPATH="$X/site:$PWD"
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1
  $PY -c "import mlx.core as mx; print('mlx', mx.__version__, mx.default_device(), mx.device_info())" 2>&1
  # the device copy's .git can name an older commit than the tree that travelled: the caller says
  # which (CODE=$(git rev-parse --short HEAD) in the run's command, made here)
  if [ -n "${CODE:-}" ]; then echo "code at $CODE (as the caller said)"; else git log -1 --format='code at %h %s (the copy'"'"'s .git)' 2>&1; fi
} | tee "$OUT/environment.txt"

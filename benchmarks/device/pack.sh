#!/usr/bin/env bash
# Here, before the device calls: the wheels cuda_bench.sh needs, unpacked into site/, and the
# default model quantized to 6 bits (group 64: 109 MB, near float16's answers; float16 itself is
# 269 MB) into model/, as one xz'd tar split into 46 MB parts, one per folder .xfer1, .xfer2, ...
# (ignored by git), so that each call carries one part beside the 19 MB tree under its 64 MiB.
#
#   bash benchmarks/device/pack.sh     # then, per call: carry .xferN, cp .xferN/* /tmp/x/
set -eu
cd "$(dirname "$0")/../.."
grep -qx '/.xfer\*/' .git/info/exclude 2>/dev/null || echo '/.xfer*/' >> .git/info/exclude
grep -qx '/.whl/' .git/info/exclude || echo '/.whl/' >> .git/info/exclude
work=$(mktemp -d)
mkdir -p .whl "$work/site"
for pkg in mlx==0.32.4 mlx-cuda-13==0.32.4 mlx-lm==0.32.2 platformdirs; do
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_35_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        -d .whl "$pkg"
done
for w in .whl/*.whl; do unzip -q -o "$w" -d "$work/site"; done  # what pip install --target makes
.venv/bin/python -m mlx_lm convert --hf-path "$HOME/.cache/mlx-specdec/models/SmolLM2-135M-Instruct-f16" \
    --mlx-path "$work/model" -q --q-bits 6 --q-group-size 64
rm -rf .xfer*
(cd "$work" && tar cf - site model | xz -6 -T0) | split -b 46000000 -d -a 1 - "$work/part."
i=1
for part in "$work"/part.*; do mkdir -p ".xfer$i"; mv "$part" ".xfer$i/"; i=$((i + 1)); done
rm -rf "$work"
du -b .xfer*/*

#!/usr/bin/env bash
# Here, before the device calls: what cuda_bench.sh needs, as one xz'd tar split into parts, one per
# folder .xfer1, .xfer2, ... (ignored by git), each sized to travel beside the repository's tree
# under a call's 64 MiB:
#   site/   the wheels mlx, mlx-cuda-13, mlx-lm, platformdirs for Python 3.12, unpacked
#   home/   an MLX_SPECDEC_HOME holding the default model's GGUF (downloads/), from which the
#           engine converts the real default models there (float16 and 4-bit, as on a Mac): the
#           float16 directory itself (269 MB) is too big to carry.
#
#   bash benchmarks/device/pack.sh     # then, per call: carry .xferN, cp .xferN/* /tmp/x/
set -eu
cd "$(dirname "$0")/../.."
grep -qx '/.xfer\*/' .git/info/exclude 2>/dev/null || echo '/.xfer*/' >> .git/info/exclude
grep -qx '/.whl/' .git/info/exclude || echo '/.whl/' >> .git/info/exclude
work=$(mktemp -d)
mkdir -p .whl "$work/site" "$work/home/downloads"
for pkg in mlx==0.32.4 mlx-cuda-13==0.32.4 mlx-lm==0.32.2 platformdirs; do
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_35_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        -d .whl "$pkg"
done
for w in .whl/*.whl; do unzip -q -o "$w" -d "$work/site"; done  # what pip install --target makes
gguf=$(.venv/bin/python -c "from mlx_specdec.model.default import fetch_gguf; print(fetch_gguf(quiet=True))")
cp "$gguf" "$work/home/downloads/"
rm -rf .xfer*
# A call carries the tree (tracked and untracked files git does not ignore) and one part: 64 MiB.
tree=$(git ls-files -co --exclude-standard -z | du -cb --files0-from=- | tail -1 | cut -f1)
part=$((64 * 1024 * 1024 - tree - 1000000))
(cd "$work" && tar cf - site home | xz -6 -T0) | split -b "$part" -d -a 1 - "$work/part."
i=1
for p in "$work"/part.*; do mkdir -p ".xfer$i"; mv "$p" ".xfer$i/"; i=$((i + 1)); done
rm -rf "$work"
du -b .xfer*/*

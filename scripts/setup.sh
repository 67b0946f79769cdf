#!/usr/bin/env bash
# One-time setup behind `make chat` / `make test`: a .venv with the project installed.
# On Linux (MLX on the CPU) it also installs the system OpenBLAS, which the engine preloads
# before MLX: 13x faster float32 matmuls here than MLX's bundled fallback (design.md).
set -euo pipefail
VENV="${VENV:-.venv}"
PYTHON="${PYTHON:-python3}"

if [ "$(uname -s)" = "Linux" ] && ! ldconfig -p 2>/dev/null | grep -q 'libopenblas\.so\.0'; then
  if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null; then
    echo "setup: installing libopenblas0-pthread (system OpenBLAS for MLX on the CPU)"
    (apt-get install -y -q libopenblas0-pthread >/dev/null 2>&1 ||
      { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q libopenblas0-pthread >/dev/null; }) ||
      echo "setup: could not install libopenblas0-pthread; MLX will run without it (slower)"
  elif command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
    sudo apt-get install -y -q libopenblas0-pthread >/dev/null || true
  else
    echo "setup: tip: 'sudo apt-get install libopenblas0-pthread' makes MLX on the CPU much faster"
  fi
fi

# tmux: the chat app's real-terminal test drives it with send-keys/capture-pane (skipped without it)
if [ "$(uname -s)" = "Linux" ] && ! command -v tmux >/dev/null && [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null; then
  apt-get install -y -q tmux >/dev/null 2>&1 || true
fi

if [ ! -x "$VENV/bin/python" ]; then
  echo "setup: creating $VENV"
  "$PYTHON" -m venv "$VENV"
fi
EXTRAS="dev"
[ "$(uname -s)" = "Linux" ] && EXTRAS="cpu,dev"  # MLX's Linux CPU wheels; macOS wheels carry Metal
echo "setup: installing mlx-specdec[$EXTRAS] into $VENV"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check -e ".[$EXTRAS]"

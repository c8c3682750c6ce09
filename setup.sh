#!/usr/bin/env bash
# Create .venv and install commlab into it. Safe to run again: it only
# reinstalls when pyproject.toml or this script changed.
#
# torch (scripts/install_torch.sh): an existing torch in the venv is kept (CPU or CUDA). A CUDA torch in
# the base python is reused through --system-site-packages. On a machine with an NVIDIA driver,
# torch==2.13.0 comes from the package index (a CUDA build). Without one, the CPU build
# (torch==2.13.0+cpu) from the configured indexes or PyTorch's CPU wheel index; if neither has it, the
# default build (several GB), said before it starts.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
VENV=.venv
TORCH_VERSION=2.13.0

if [ ! -x "$VENV/bin/python" ]; then
    if "$PY" -c 'import torch, sys; sys.exit(0 if torch.version.cuda else 1)' 2>/dev/null; then
        echo "setup: reusing the CUDA torch of $PY" >&2
        "$PY" -m venv --system-site-packages "$VENV"
    else
        "$PY" -m venv "$VENV"
    fi
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)

TORCH_VERSION=$TORCH_VERSION bash scripts/install_torch.sh "$VENV/bin/python" torch

STAMP="$VENV/.commlab-installed"
WANT=$(cat pyproject.toml setup.sh | sha256sum | cut -d' ' -f1)
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$WANT" ]; then
    echo "setup: installing commlab and its dependencies into $VENV; this takes a few minutes (about 4 on a" \
         "fresh machine) with nothing printed meanwhile" >&2
    "${PIP[@]}" install -e ".[app,dev,notebooks,models,ft]" 2>&1 | grep -v "is ignored: it is neither a file nor a directory" || true
    "$VENV/bin/python" -c 'import torch, commlab.engine, commlab.lab' || { echo "setup: install failed" >&2; exit 1; }
    echo "$WANT" > "$STAMP"
fi

# torchvision (torchvision:<arch> models, optional), matched to the torch above; never swaps torch
TORCH_VERSION=$TORCH_VERSION bash scripts/install_torch.sh "$VENV/bin/python" torchvision

# torchft (fault_tolerance:, optional), --no-deps so torch is never swapped (its wheel asks for a bare torch); the
# extra `ft` above brought what it imports. Kept when it is there already.
TORCHFT_VERSION=0.2.0
if ! "$VENV/bin/python" -c "import importlib.metadata as m, sys; sys.exit(0 if m.version('torchft') == '$TORCHFT_VERSION' else 1)" 2>/dev/null; then
    if "${PIP[@]}" install --no-deps "torchft==$TORCHFT_VERSION" >/dev/null 2>&1 && "$VENV/bin/python" -c 'import torchft' 2>/dev/null; then
        echo "setup: installed torchft==$TORCHFT_VERSION" >&2
    else
        echo "setup: torchft==$TORCHFT_VERSION is not available here; fault_tolerance: is off" >&2
    fi
fi

# The lab's bytecode, written here once: where Python does not write it itself (PYTHONDONTWRITEBYTECODE set, a
# checkout it cannot write to) every process would compile what it imports of the lab again, about 0.6 s of CPU
# for the lab's side and 0.25 s for a rank on a 2-core machine. Only what changed is compiled again.
"$VENV/bin/python" -m compileall -q -j 0 commlab >/dev/null || echo "setup: could not write the lab's bytecode (it is compiled on import instead)" >&2

#!/usr/bin/env bash
# Create .venv and install commlab into it. Safe to run again: it only
# reinstalls when pyproject.toml or this script changed.
#
# torch: an existing torch in the venv is kept (CPU or CUDA). A CUDA torch in
# the base python is reused through --system-site-packages. On a machine with
# an NVIDIA driver, torch==2.13.0 comes from the package index (a CUDA build).
# Without one, only the CPU build (torch==2.13.0+cpu) is accepted, so a
# multi-GB CUDA build never lands on a CPU machine.
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

if ! "$VENV/bin/python" -c 'import torch' 2>/dev/null; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        echo "setup: NVIDIA GPU found, installing torch==$TORCH_VERSION (CUDA build)" >&2
        "${PIP[@]}" install "torch==$TORCH_VERSION"
    else
        echo "setup: no GPU, installing torch==$TORCH_VERSION+cpu" >&2
        if ! "${PIP[@]}" install "torch==$TORCH_VERSION+cpu"; then
            echo "setup: the CPU build torch==$TORCH_VERSION+cpu was not found." >&2
            echo "setup: point pip at PyTorch's CPU wheel index (PIP_EXTRA_INDEX_URL) or a folder holding the wheel (PIP_FIND_LINKS), then run again." >&2
            exit 1
        fi
    fi
fi

STAMP="$VENV/.commlab-installed"
WANT=$(cat pyproject.toml setup.sh | sha256sum | cut -d' ' -f1)
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$WANT" ]; then
    echo "setup: installing commlab and its dependencies into $VENV" >&2
    "${PIP[@]}" install -e ".[app,dev,notebooks,models]" 2>&1 | grep -v "is ignored: it is neither a file nor a directory" || true
    "$VENV/bin/python" -c 'import torch, engine, lab' || { echo "setup: install failed" >&2; exit 1; }
    echo "$WANT" > "$STAMP"
fi

# torchvision (torchvision:<arch> models, optional) for the torch above, --no-deps (never swap torch):
# the CUDA torchvision==$TV_VERSION beside a CUDA torch; beside the CPU build torchvision==$TV_VERSION+cpu
# when pip can find it (PyTorch's CPU wheel index), else the plain torchvision==$TV_VERSION (a CUDA build).
# A CUDA torchvision's C++ extension cannot load into a CPU torch; engine.external.import_torchvision
# then defines its operator names without kernels so that its models import and train (its detection
# operators, nms, roi_align, ..., stay unavailable).
TV_VERSION=0.28.0
TV_CHECK='from engine.external import import_torchvision; import_torchvision()'
if ! "$VENV/bin/python" -c 'import importlib.util, sys; sys.exit(0 if importlib.util.find_spec("torchvision") else 1)'; then
    if "$VENV/bin/python" -c 'import torch, sys; sys.exit(0 if torch.version.cuda else 1)'; then
        CANDIDATES=("torchvision==$TV_VERSION")
    else
        CANDIDATES=("torchvision==$TV_VERSION+cpu" "torchvision==$TV_VERSION")
    fi
    TV=""
    for cand in "${CANDIDATES[@]}"; do
        if "${PIP[@]}" install --no-deps "$cand" 2>/dev/null; then TV=$cand; break; fi
    done
    if [ -z "$TV" ]; then
        echo "setup: torchvision==$TV_VERSION is not available here; torchvision:<arch> models are off" >&2
    elif "$VENV/bin/python" -c "$TV_CHECK" 2>/dev/null; then
        case "$TV" in
            *+cpu) echo "setup: installed $TV" >&2 ;;
            *) "$VENV/bin/python" -c 'import torch, sys; sys.exit(0 if torch.version.cuda else 1)' \
                   && echo "setup: installed $TV" >&2 \
                   || echo "setup: installed $TV (a CUDA build: its C++ operators do not load into the CPU torch; models work, detection ops do not)" >&2 ;;
        esac
    else
        "${PIP[@]}" uninstall -y torchvision >/dev/null 2>&1 || true
        echo "setup: $TV does not import beside torch here; removed it; torchvision:<arch> models are off" >&2
    fi
fi

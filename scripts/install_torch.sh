#!/usr/bin/env bash
# Install torch (and, with --vision, torchvision) into the Python given as $1, the way setup.sh needs it:
#
# - a torch that imports already (CPU or CUDA) is kept: nothing is replaced;
# - with an NVIDIA driver: torch==$TORCH_VERSION from the configured indexes (a CUDA build);
# - without one: the CPU build, torch==$TORCH_VERSION+cpu, from the configured indexes, else from PyTorch's CPU
#   wheel index ($COMMLAB_TORCH_CPU_INDEX; the plain package index has no +cpu builds); if neither has it,
#   the default build torch==$TORCH_VERSION (a CUDA build of several GB, which also runs on the CPU), said
#   before it starts.
#
# Exit status 0 when torch imports at the end, 1 otherwise. Every decision is said on stderr, "setup: ...".
set -euo pipefail
PY=$1
WHAT=${2:-torch}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
TV_VERSION=${TV_VERSION:-0.28.0}
CPU_INDEX=${COMMLAB_TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}
PIP=("$PY" -m pip --disable-pip-version-check -q)

say() { echo "setup: $*" >&2; }
has_gpu() { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }
torch_is_cuda() { "$PY" -c 'import torch, sys; sys.exit(0 if torch.version.cuda else 1)' 2>/dev/null; }
quiet_pip() {  # pip install, without the noise of a folder in the pip configuration that does not exist here
    "${PIP[@]}" install "$@" 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" >&2 || true; }
    return "${PIPESTATUS[0]}"
}

install_torch() {
    if "$PY" -c 'import torch' 2>/dev/null; then
        return 0  # kept as it is, CUDA or CPU: never swapped for another build
    fi
    if has_gpu; then
        say "NVIDIA GPU found, installing torch==$TORCH_VERSION (CUDA build)"
        quiet_pip "torch==$TORCH_VERSION"
        return
    fi
    say "no GPU, installing torch==$TORCH_VERSION+cpu"
    if quiet_pip "torch==$TORCH_VERSION+cpu"; then
        return 0
    fi
    say "torch==$TORCH_VERSION+cpu is not on the configured indexes; trying PyTorch's CPU wheel index ($CPU_INDEX)"
    if quiet_pip --extra-index-url "$CPU_INDEX" "torch==$TORCH_VERSION+cpu"; then
        say "installed torch==$TORCH_VERSION+cpu from $CPU_INDEX"
        return 0
    fi
    say "the CPU build was not found there either (no network, or the index lacks it); installing the default"
    say "build torch==$TORCH_VERSION instead: a CUDA build of several GB (about 5 GB in .venv) that runs on the CPU too."
    say "To get the small CPU build later: rm -rf .venv, point COMMLAB_TORCH_CPU_INDEX (or pip) at an index or"
    say "folder that holds torch==$TORCH_VERSION+cpu, and run ./setup.sh again"
    quiet_pip "torch==$TORCH_VERSION"
}

install_torchvision() {
    # Optional (torchvision:<arch> models), --no-deps so torch is never swapped. It must match torch's build:
    # the CUDA one beside a CUDA torch; beside the CPU build the +cpu one, else the plain (CUDA) one, whose
    # C++ operators then stay undefined (commlab.engine.external.import_torchvision; models work, detection ops do not).
    if "$PY" -c 'import importlib.util, sys; sys.exit(0 if importlib.util.find_spec("torchvision") else 1)'; then
        return 0
    fi
    local tries
    if torch_is_cuda; then
        tries=("torchvision==$TV_VERSION")
    else
        tries=("torchvision==$TV_VERSION+cpu" "--extra-index-url $CPU_INDEX torchvision==$TV_VERSION+cpu"
               "torchvision==$TV_VERSION")
    fi
    local t got=""
    for t in "${tries[@]}"; do
        # shellcheck disable=SC2086  # "--extra-index-url URL pkg" splits into its words on purpose
        if "${PIP[@]}" install --no-deps $t >/dev/null 2>&1; then got=${t##* }; break; fi
    done
    if [ -z "$got" ]; then
        say "torchvision==$TV_VERSION is not available here; torchvision:<arch> models are off"
    elif "$PY" -c 'from commlab.engine.external import import_torchvision; import_torchvision()' 2>/dev/null; then
        case "$got" in
            *+cpu) say "installed $got" ;;
            *) if torch_is_cuda; then say "installed $got"; else
                   say "installed $got (a CUDA build: its C++ operators do not load into the CPU torch; models work, detection ops do not)"
               fi ;;
        esac
    else
        "${PIP[@]}" uninstall -y torchvision >/dev/null 2>&1 || true
        say "$got does not import beside torch here; removed it; torchvision:<arch> models are off"
    fi
}

case "$WHAT" in
    torch) install_torch
           "$PY" -c 'import torch' 2>/dev/null || { say "torch did not install; see pip's message above"; exit 1; } ;;
    torchvision) install_torchvision ;;
    *) say "install_torch.sh: second argument must be torch or torchvision, got '$WHAT'"; exit 2 ;;
esac

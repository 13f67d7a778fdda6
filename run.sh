#!/usr/bin/env bash
# Runs a command inside triton-ep's environment, setting that environment up first if needed.
#   ./run.sh python examples/moe_layer.py     # the main job
#   ./run.sh pytest                           # the test suite
# Where torch and triton already import (a GPU machine with its own stack) they are used as they are
# and nothing is installed. Elsewhere a virtual environment .venv/ is made with the CPU build of torch
# (no CUDA libraries), triton, numpy, pytest, hypothesis and tqdm, and this checkout installed editable.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cd "$here"
py=${PYTHON:-python3}

if [ ! -d .venv ] && "$py" -c 'import torch, triton, numpy' >/dev/null 2>&1; then
    export PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}"
    bin="$(dirname "$(command -v "$py")")"
else
    if [ ! -x .venv/bin/python ]; then
        echo "[run.sh] creating .venv" >&2
        "$py" -m venv .venv
    fi
    vpy=.venv/bin/python
    if ! "$vpy" -c 'import torch, triton, numpy, pytest, hypothesis, tqdm, triton_ep' >/dev/null 2>&1; then
        echo "[run.sh] installing dependencies into .venv (first run only)" >&2
        pip_q=(-q --disable-pip-version-check)
        if ! "$vpy" -c 'import torch' >/dev/null 2>&1; then
            # The CPU build of torch, never the multi-GB CUDA build on a machine with no GPU: the local
            # CPU wheel where pip's find-links has one (our CPU image: torch from disk, its dependencies
            # from the index), else PyTorch's CPU index.
            if "$vpy" -m pip install -q --dry-run --no-deps --no-index torch==2.13.0 >/dev/null 2>&1; then
                "$vpy" -m pip install "${pip_q[@]}" torch==2.13.0
            else
                "$vpy" -m pip install "${pip_q[@]}" torch --index-url https://download.pytorch.org/whl/cpu
            fi
        fi
        "$vpy" -m pip install "${pip_q[@]}" triton numpy pytest hypothesis tqdm
        "$vpy" -m pip install "${pip_q[@]}" --no-deps -e .
    fi
    if [ -x scripts/install_pyverbs.sh ]; then
        scripts/install_pyverbs.sh "$vpy" || echo "[run.sh] pyverbs not installed (RDMA tests will skip)" >&2
    fi
    bin="$here/.venv/bin"
fi
export PATH="$bin:$PATH"
if [ "$#" -eq 0 ]; then set -- python -c 'import triton_ep; print(triton_ep.__version__)'; fi
exec "$@"

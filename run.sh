#!/usr/bin/env bash
# Runs a command inside triton-ep's environment, setting that environment up first if needed.
#   ./run.sh python examples/moe_layer.py     # the main job
#   ./run.sh pytest                           # the test suite
# Where torch and triton already import and there is no .venv/ (a GPU machine with its own stack) they are
# used as they are and nothing is installed. Elsewhere a virtual environment .venv/ is made with the CPU build
# of torch (no CUDA libraries), triton, numpy, pytest, hypothesis, tqdm and prometheus-client (the metrics
# exporter's tests), and this checkout installed editable; scripts/install_pyverbs.sh then tries to bring
# Debian's pyverbs into it (optional).
#
# Setup is checked once, not on every call: after a successful setup run.sh writes the stamp .venv/.run.sh-ok
# (the checksums of run.sh and pyproject.toml). A later call whose stamp matches, and whose .venv
# site-packages has not changed since (no pip install or uninstall), runs the command at once and silently.
# Otherwise (first run, an interrupted setup, run.sh or pyproject.toml changed, packages changed) the setup
# runs again: each step says what it does and how long it took, and skips what already imports.
#
# The command runs in the caller's current folder (path/to/run.sh python myscript.py works from anywhere);
# the setup and its checks run in the checkout's folder, so .venv is always the checkout's.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
py=${PYTHON:-python3}
stamp=.venv/.run.sh-ok

# Why .venv needs a setup run; nothing (and status 1) when the stamp says it is complete.
stale() {
    [ -x .venv/bin/python ] || { echo "no .venv yet"; return; }
    [ -f "$stamp" ] || { echo "first run, or an earlier setup did not finish"; return; }
    [ "$(cksum run.sh pyproject.toml)" = "$(<"$stamp")" ] || { echo "run.sh or pyproject.toml changed"; return; }
    local site
    for site in .venv/lib/python*/site-packages; do
        if [ "$site" -nt "$stamp" ]; then echo "packages in .venv changed"; return; fi
    done
    return 1
}

steps=5
# step N TITLE [CHECK_IMPORTS]: announce step N; with CHECK_IMPORTS (a Python import list) return 1 when
# those already import in .venv (nothing to do), saying so.
step() {
    if [ -n "${3:-}" ] && "$vpy" -c "import $3" >/dev/null 2>&1; then
        echo "[run.sh] $1/$steps $2: already there" >&2
        return 1
    fi
    echo "[run.sh] $1/$steps $2 ..." >&2
    t0=$SECONDS
}
took() { echo "[run.sh] $1/$steps done in $((SECONDS - t0)) s" >&2; }

setup_venv() {
    local why=$1 pip_q=(-q --disable-pip-version-check) start=$SECONDS
    echo "[run.sh] setting up .venv ($why)" >&2
    rm -f "$stamp"
    if [ -x .venv/bin/python ]; then
        echo "[run.sh] 1/$steps .venv: already there" >&2
    else
        step 1 "creating .venv with $py"
        "$py" -m venv .venv
        took 1
    fi
    vpy=.venv/bin/python
    if step 2 "torch (CPU build)" torch; then
        # The CPU build of torch, never the multi-GB CUDA build on a machine with no GPU: the local
        # CPU wheel where pip's find-links has one (our CPU image: torch from disk, its dependencies
        # from the index), else PyTorch's CPU index.
        if "$vpy" -m pip install -q --dry-run --no-deps --no-index torch==2.13.0 >/dev/null 2>&1; then
            "$vpy" -m pip install "${pip_q[@]}" torch==2.13.0
        else
            "$vpy" -m pip install "${pip_q[@]}" torch --index-url https://download.pytorch.org/whl/cpu
        fi
        took 2
    fi
    if step 3 "triton numpy pytest hypothesis tqdm prometheus-client" \
            "triton, numpy, pytest, hypothesis, tqdm, prometheus_client"; then
        "$vpy" -m pip install "${pip_q[@]}" triton numpy pytest hypothesis tqdm prometheus-client
        took 3
    fi
    # Always, on this path: pyproject.toml may have changed (console scripts, metadata).
    step 4 "triton-ep (editable install of this checkout)"
    "$vpy" -m pip install "${pip_q[@]}" --no-deps -e .
    took 4
    if [ -x scripts/install_pyverbs.sh ]; then
        step 5 "pyverbs (optional; silent when it already imports)"
        scripts/install_pyverbs.sh "$vpy" || echo "[run.sh] pyverbs not installed (RDMA tests will skip)" >&2
        took 5
    fi
    cksum run.sh pyproject.toml > "$stamp"
    echo "[run.sh] .venv ready in $((SECONDS - start)) s" >&2
}

# Setup and checks in the checkout's folder (subshells), the command in the caller's.
if [ ! -d "$here/.venv" ] && (cd "$here" && "$py" -c 'import torch, triton, numpy') >/dev/null 2>&1; then
    export PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}"
    bin="$(cd "$here" && cd "$(dirname "$(command -v "$py")")" && pwd)"
else
    if why="$(cd "$here" && stale)"; then (cd "$here"; setup_venv "$why"); fi
    bin="$here/.venv/bin"
fi
export PATH="$bin:$PATH"
if [ "$#" -eq 0 ]; then set -- python -c 'import triton_ep; print(triton_ep.__version__)'; fi
exec "$@"

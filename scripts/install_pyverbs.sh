#!/usr/bin/env bash
# Brings a working pyverbs (rdma-core's Python bindings) into a Python environment on Debian.
#   scripts/install_pyverbs.sh [PYTHON]        # PYTHON defaults to .venv/bin/python, else python3
#
# Why not pip: PyPI's `pyverbs` is a source build that must match the rdma-core (libibverbs) of the host
# exactly at run time. Debian ships a matching pair instead: `python3-pyverbs` (rdma-core 44 on bookworm)
# built for the system's CPython 3.11. This script
#   1. returns at once, printing nothing, if PYTHON already imports pyverbs;
#   2. installs python3-pyverbs with apt-get when it is missing (as root, or through passwordless sudo);
#   3. checks that PYTHON's ABI tag matches the Debian extension modules (cpython-311);
#   4. exposes ONLY the pyverbs package to PYTHON: a folder holding one symlink to
#      /usr/lib/python3/dist-packages/pyverbs, listed in a .pth file in PYTHON's site-packages (the rest of
#      dist-packages stays invisible);
#   5. imports it to prove it works.
# Idempotent; every external step has a timeout; exits non-zero (with the reason) when pyverbs cannot be had.
set -uo pipefail

py="${1:-}"
if [ -z "$py" ]; then
    if [ -x .venv/bin/python ]; then py=.venv/bin/python; else py=python3; fi
fi
say() { echo "[install_pyverbs] $*" >&2; }
probe='import pyverbs.device, pyverbs.qp, pyverbs.wr, pyverbs.addr, pyverbs.mr, pyverbs.cq, pyverbs.pd'

if timeout 30 "$py" -c "$probe" >/dev/null 2>&1; then
    exit 0   # silently: run.sh calls this on every setup
fi

src=/usr/lib/python3/dist-packages/pyverbs
if [ ! -d "$src" ]; then
    if ! command -v apt-get >/dev/null 2>&1; then
        say "no apt-get: not a Debian-family host; install rdma-core's pyverbs by other means"; exit 1
    fi
    if [ "$(id -u)" -eq 0 ]; then sudo_=(); elif sudo -n true 2>/dev/null; then sudo_=(sudo -n); else
        say "python3-pyverbs is missing and this user is neither root nor a passwordless sudoer"; exit 1
    fi
    apt_opts=(-y -q --no-install-recommends -o DPkg::Lock::Timeout=60)
    export DEBIAN_FRONTEND=noninteractive
    if ! timeout 300 "${sudo_[@]}" apt-get install "${apt_opts[@]}" python3-pyverbs >/dev/null 2>&1; then
        say "apt-get install failed; refreshing the package lists once"
        timeout 180 "${sudo_[@]}" apt-get update -q >/dev/null 2>&1 || true
        if ! timeout 300 "${sudo_[@]}" apt-get install "${apt_opts[@]}" python3-pyverbs >/dev/null 2>&1; then
            say "apt-get install python3-pyverbs failed"; exit 1
        fi
    fi
fi
[ -d "$src" ] || { say "python3-pyverbs installed but $src is missing"; exit 1; }

tag="$(timeout 30 "$py" -c 'import sys; print(sys.implementation.cache_tag)' 2>/dev/null)"
so_tag="$(ls "$src"/device.*.so 2>/dev/null | head -n1 | sed -E 's/.*device\.([a-z]+-[0-9]+).*/\1/')"
if [ -n "$so_tag" ] && [ "$tag" != "$so_tag" ]; then
    say "Debian's pyverbs is built for $so_tag but $py is $tag; pyverbs stays unavailable there"; exit 1
fi

site="$(timeout 30 "$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" || {
    say "cannot find the site-packages of $py"; exit 1; }
dir="$site/_triton_ep_system_pyverbs"
mkdir -p "$dir"
ln -sfn "$src" "$dir/pyverbs"
echo "$dir" > "$site/triton_ep_system_pyverbs.pth"

if timeout 30 "$py" -c "$probe" >/dev/null 2>&1; then
    say "pyverbs from python3-pyverbs ($(dpkg-query -W -f='${Version}' python3-pyverbs 2>/dev/null)) now imports in $py"
    exit 0
fi
err="$(timeout 30 "$py" -c "$probe" 2>&1 | tail -n1)"
say "pyverbs linked into $site but does not import: $err"
rm -f "$site/triton_ep_system_pyverbs.pth"
exit 1

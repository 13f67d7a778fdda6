#!/usr/bin/env bash
# The optional engine tier (docs/engines.md): a separate virtual environment with the pinned engines' own packages
# (vllm==0.33.0, sglang==0.5.23, installed --no-deps: their full dependency sets are tens of GiB), which reuses the
# development venv's torch through a .pth path entry and this checkout's triton_ep, then imports the engines'
# DeepEP classes with TRITON_EP_AS_DEEP_EP=1 and reports, per class, "OK" or the exact import error.
#
#   scripts/engines_tier.sh            # builds $ENGINES_VENV (default /tmp/triton_ep_engines_venv) and probes
#   ENGINES_VENV=/path scripts/engines_tier.sh
#
# tests/engines/test_engine_classes.py runs the probe with that venv's python where it exists (extended tier).
# Result on the development machine (PyPI reachable; torch 2.13 CPU): vLLM's deepep_ht / deepep_ll prepare-finalize
# classes and all2all managers import against triton-ep; SGLang's token_dispatcher/deepep.py stops at
# "No module named 'torchvision'" (sglang/srt/multimodal/internvl_utils.py:5), which needs SGLang's torch 2.14.1.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VENV="${ENGINES_VENV:-/tmp/triton_ep_engines_venv}"
BASE_PY="${BASE_PYTHON:-$ROOT/.venv/bin/python}"
if [ ! -x "$VENV/bin/python" ]; then
    "$BASE_PY" -m venv --without-pip "$VENV" 2>/dev/null || python3 -m venv "$VENV"
fi
SITE="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
BASE_SITE="$("$BASE_PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
# this checkout first (triton_ep and its deep_ep hook), then the development venv's packages (torch, triton)
printf '%s\n' "$ROOT" > "$SITE/00_triton_ep_checkout.pth"
printf '%s\n' "$BASE_SITE" > "$SITE/zz_base_venv.pth"
cp "$ROOT/triton_ep_deep_ep.pth" "$SITE/triton_ep_deep_ep.pth"     # the switch, as pip installs it
if ! "$VENV/bin/python" -c 'import vllm, sglang' 2>/dev/null; then
    "$BASE_PY" -m pip --python "$VENV/bin/python" install --no-deps "vllm==0.33.0" "sglang==0.5.23" 2>&1 | tail -3
fi
# the engines' light, pure-Python import-time dependencies (their GPU stacks stay out: the probe names what is missing)
"$BASE_PY" -m pip --python "$VENV/bin/python" install -q ${ENGINES_EXTRA_DEPS:-psutil pydantic orjson msgspec \
    cloudpickle pyzmq requests tqdm blake3 cachetools regex sentencepiece protobuf prometheus_client \
    py-cpuinfo einops cbor2 pybase64 partial_json_parser setproctitle uvloop transformers pillow aiohttp starlette fastapi uvicorn openai pyyaml jinja2 watchfiles gguf lark xgrammar outlines_core openai-harmony mistral_common compressed-tensors depyf diskcache numba llguidance interegular ipython} 2>&1 | tail -3 || true
TRITON_EP_AS_DEEP_EP=1 "$VENV/bin/python" "$ROOT/tests/engines/engine_classes_probe.py"

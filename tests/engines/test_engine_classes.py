"""Optional engine tier: the pinned engines' own DeepEP classes imported against triton-ep in the separate virtual
environment that scripts/engines_tier.sh builds (``ENGINES_VENV``, default /tmp/triton_ep_engines_venv); skipped
where it does not exist. Last result on the 2-core development machine (torch 2.13 CPU): vLLM's
DeepEPHTPrepareAndFinalize, DeepEPLLPrepareAndFinalize, DeepEPV2PrepareAndFinalize and the all2all managers (V2's
included) import (vllm._C absent: a warning), and vLLM's deepep_v2 gate says "DeepEP v2 requires NCCL >= 2.30.4 but
found unknown" (no libnccl on a CPU machine); SGLang's deepep.py and deepep_v2.py stop at
``ModuleNotFoundError: No module named 'torchvision'``
(sglang/srt/multimodal/internvl_utils.py:5; SGLang pins torch 2.14.1, torchvision would need its own torch)."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

VENV = Path(os.environ.get("ENGINES_VENV", "/tmp/triton_ep_engines_venv"))
PROBE = Path(__file__).with_name("engine_classes_probe.py")


@pytest.mark.extended
@pytest.mark.skipif(not (VENV / "bin" / "python").exists(), reason="no engines venv: run scripts/engines_tier.sh")
def test_vllm_deepep_classes_import_on_triton_ep():
    env = dict(os.environ, TRITON_EP_AS_DEEP_EP="1")
    env.pop("PYTHONPATH", None)
    r = subprocess.run([str(VENV / "bin" / "python"), str(PROBE)], env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr
    assert "triton_ep/_deep_ep/__init__.py" in r.stdout.splitlines()[0], r.stdout
    for mod in ("prepare_finalize.deepep_ht: OK", "prepare_finalize.deepep_ll: OK", "prepare_finalize.deepep_v2: OK",
                "all2all: OK"):
        assert mod in r.stdout, r.stdout

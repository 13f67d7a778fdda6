"""Shared pytest set-up: hypothesis profiles and the GPU marker.

Profiles: ``ci`` (default; derandomized, few examples, no deadline) and ``deep`` (many examples), chosen
by ``TRITON_EP_HYPOTHESIS=deep``.
"""
import os
import sys

import pytest
import torch
from hypothesis import HealthCheck, settings

sys.path.insert(0, os.path.dirname(__file__))

settings.register_profile("ci", max_examples=12, deadline=None, derandomize=True, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("deep", max_examples=300, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile(os.environ.get("TRITON_EP_HYPOTHESIS", "ci"))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none on this machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)

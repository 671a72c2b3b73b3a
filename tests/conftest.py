"""Test-wide environment: set before any project module (or triton) is imported."""

import os

import pytest

# Triton reads TRITON_INTERPRET when @triton.jit decorates a kernel, i.e. at import time.
try:
    import torch

    _HAS_CUDA = torch.cuda.is_available()
except ImportError:  # pragma: no cover
    _HAS_CUDA = False
if not _HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_collection_modifyitems(config, items):
    if _HAS_CUDA:
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (tests/gpu/run_all.sh runs these where one is lent)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)

"""Where the engines of tests/sglang_engine run: CPU in fp32 by default (CI). On a GPU machine:

    SGLANG_TEST_DEVICE=cuda SGLANG_TEST_DTYPE=bf16 .venv-sglang/bin/python -m pytest tests/sglang_engine

and SGLANG_TEST_ATTENTION_BACKEND=torch_sdpa where sglang-kernel's FlashAttention library is
absent (tests/gpu/sglang_cuda.sh). The tolerances of the tests are CPU fp32 figures."""

from __future__ import annotations

import os

import torch

DEVICE = os.environ.get("SGLANG_TEST_DEVICE", "cpu")
DTYPE = {"fp32": torch.float32, "bf16": torch.bfloat16}[os.environ.get("SGLANG_TEST_DTYPE", "fp32")]
ATTENTION_BACKEND = os.environ.get("SGLANG_TEST_ATTENTION_BACKEND") or None


def native_kwargs(**extra) -> dict:
    """NativeEngine keyword arguments for DEVICE / DTYPE."""
    return {"device": DEVICE, "dtype": DTYPE, **extra}


def sglang_kwargs(**extra) -> dict:
    """SGLangEngine keyword arguments for DEVICE / DTYPE / ATTENTION_BACKEND."""
    return {"device": DEVICE, "dtype": DTYPE, "attention_backend": ATTENTION_BACKEND, **extra}

"""Dtype names as the flags spell them ("bf16", "fp16", "fp32"), resolved in one place."""

from __future__ import annotations

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
#: the names an engine also accepts (the torch spellings too)
_ENGINE_DTYPES = {**DTYPES, "bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def resolve_dtype(name: str | torch.dtype | None) -> torch.dtype | None:
    """'bf16' | 'fp16' | 'fp32' | torch.dtype | None -> torch.dtype | None."""
    if name is None or isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {tuple(DTYPES)}, got {name!r}")
    return DTYPES[name]


def engine_dtype(dtype, device: torch.device) -> torch.dtype:
    """A torch dtype from a dtype, a name ("bf16", "fp32", ...) or None (fp32 on CPU, where bf16
    is ~2x slower; bf16 on CUDA)."""
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return _ENGINE_DTYPES[str(dtype).lower()]
    except KeyError:
        raise ValueError(f"unknown engine dtype {dtype!r}; use one of {sorted(_ENGINE_DTYPES)}") from None

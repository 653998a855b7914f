"""Where the engines of tests/sglang_engine run, and how close their outputs must then be.

CPU in fp32 by default (CI). On a GPU machine:

    SGLANG_TEST_DEVICE=cuda SGLANG_TEST_DTYPE=bf16 python -m pytest tests/sglang_engine

(SGLANG_TEST_DTYPE takes fp32 / float32 / bf16 / bfloat16), and SGLANG_TEST_ATTENTION_BACKEND=
torch_sdpa where sglang-kernel's FlashAttention library is absent (tests/gpu/sglang_cuda.sh).

Tolerances. The two engines run the same math through different DiT implementations (SGLang
fuses the text q/k/v projection and has its own norm / modulation / RoPE kernels), so their
outputs agree to the rounding of the dtype they run in, not bit for bit:

- fp32: measured <= 1e-6 on CPU (latents, images, embeddings, log-probs); the tests allow 1e-5.
  On CUDA, cuDNN's TF32 (torch.backends.cudnn.allow_tf32, True by default) rounds the VAE's
  convolution inputs to 10 mantissa bits and turns 1e-6 latent differences into ~5e-4 image
  differences; fp32 runs here turn TF32 off (matmul and cuDNN) so that the assertions measure the
  engines, not TF32.
- bf16: one rounding of a value of magnitude ~2 is 2^-7 = 0.008, and the two DiTs round at
  different places; over a 6-step chain the latents and images of the two engines differed by
  0.016-0.07 on an H200, the per-candidate mean log-probs by 1.7e-4-8.3e-4, and the trainer's
  replay of each engine's recorded log-probs by <= 6e-5. The bf16 bounds below are those figures
  with a margin of 2-8x. They still catch a wrong step (a missing noise term or a wrong sigma
  moves latents by O(0.1-1) and log-probs by O(1) per element).
"""

from __future__ import annotations

import os

import torch

_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}

DEVICE = os.environ.get("SGLANG_TEST_DEVICE", "cpu")
_dtype_name = os.environ.get("SGLANG_TEST_DTYPE", "fp32")
if _dtype_name not in _DTYPES:
    raise ValueError(f"SGLANG_TEST_DTYPE={_dtype_name!r}: use one of {', '.join(_DTYPES)}")
DTYPE = _DTYPES[_dtype_name]
ATTENTION_BACKEND = os.environ.get("SGLANG_TEST_ATTENTION_BACKEND") or None

#: max abs difference allowed between the two engines' outputs (or one engine's batched vs
#: unbatched outputs), per trajectory key; and between a recorded log-prob and its replay
if DTYPE == torch.float32:
    TOL = {"latents": 1e-5, "next_latents": 1e-5, "images": 1e-5, "prompt_embeds": 1e-5,
           "prompt_embeds_mask": 0.0, "log_probs": 1e-5}
    REPLAY_TOL = 1e-5
else:
    TOL = {"latents": 0.25, "next_latents": 0.25, "images": 0.06, "prompt_embeds": 0.06,
           "prompt_embeds_mask": 0.0, "log_probs": 4e-3}
    REPLAY_TOL = 4e-3


def tol(key: str) -> float:
    """The tolerance of one output key (conditions.* and the bookkeeping tensors included)."""
    key = key.split(".", 1)[-1]
    return TOL.get(key, 0.0 if key in ("sigmas", "sigmas_next", "timesteps", "slots", "group_indices",
                                       "policy_versions") else max(TOL.values()))


def exact_numerics() -> None:
    """fp32 on CUDA: no TF32 anywhere, so that fp32 comparisons see fp32 rounding only."""
    if DEVICE.startswith("cuda") and DTYPE == torch.float32:
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False


def native_kwargs(**extra) -> dict:
    """NativeEngine keyword arguments for DEVICE / DTYPE."""
    return {"device": DEVICE, "dtype": DTYPE, **extra}


def sglang_kwargs(**extra) -> dict:
    """SGLangEngine keyword arguments for DEVICE / DTYPE / ATTENTION_BACKEND."""
    return {"device": DEVICE, "dtype": DTYPE, "attention_backend": ATTENTION_BACKEND, **extra}

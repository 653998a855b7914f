"""A one-frame causal 3-D convolution run as the 2-D convolution it equals.

Qwen-Image's VAE (diffusers' AutoencoderKLQwenImage, a video VAE run on one frame) is built of
causal 3-D convolutions: a 3 x 3 x 3 kernel sees the frame and the two before it, and for the
first frame those two are zero padding. An image's decode (and an edit source's encode) is all
first frames, so two thirds of every such convolution's multiply-adds are against zeros. The
output is the 2-D convolution of the frame with the kernel's last temporal tap, which is what
`single_frame_forward` runs; a call with cached frames (a video's later chunks) or any other
temporal geometry takes the layer's own forward. The two agree up to the convolution
algorithms' summation order (tests/test_causal_conv.py).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F


def _one_frame_applies(conv: torch.nn.Conv3d, x: torch.Tensor, cache_x: torch.Tensor | None) -> bool:
    """One input frame, no cached frames, and the causal padding puts that frame under the
    kernel's last temporal tap alone (front padding of kernel - 1 zeros, stride and dilation 1)."""
    padding = conv._padding  # diffusers' causal padding: (w, w, h, h, 2 * t, 0)
    return (x.dim() == 5 and x.shape[2] == 1 and cache_x is None and padding[5] == 0
            and padding[4] == conv.kernel_size[0] - 1 and conv.stride[0] == 1 and conv.dilation[0] == 1
            and padding[0] == padding[1] and padding[2] == padding[3])


def single_frame_forward(conv: torch.nn.Conv3d, x: torch.Tensor, cache_x: torch.Tensor | None = None) -> torch.Tensor:
    """`conv`'s forward (a diffusers QwenImageCausalConv3d), as a 2-D convolution when
    _one_frame_applies, else the layer's own."""
    if not _one_frame_applies(conv, x, cache_x):
        return type(conv).forward(conv, x, cache_x)
    padding = conv._padding
    y = F.conv2d(x[:, :, 0], conv.weight[:, :, -1], conv.bias, stride=conv.stride[1:],
                 padding=(padding[2], padding[0]), dilation=conv.dilation[1:], groups=conv.groups)
    return y.unsqueeze(2)


def install_single_frame_convs(vae: torch.nn.Module) -> int:
    """Give every causal 3-D convolution of `vae` single_frame_forward (an instance attribute:
    the class, the parameters and the state dict stay diffusers'). Idempotent; returns how many
    layers have it."""
    from diffusers.models.autoencoders.autoencoder_kl_qwenimage import QwenImageCausalConv3d

    n = 0
    for module in vae.modules():
        if isinstance(module, QwenImageCausalConv3d):
            if "forward" not in module.__dict__:
                module.forward = functools.partial(single_frame_forward, module)
            n += 1
    return n

"""The VAE's one-frame causal convolutions as 2-D ones (trainer.models.causal_conv): the same
images and latents as diffusers' own forward up to summation order, a third of the
multiply-adds on an image, and video chunks with cached frames left to the 3-D path."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from trainer.models.causal_conv import install_single_frame_convs
from tools.make_tiny_model import TINY_VAE_CONFIG


@pytest.fixture(scope="module")
def vaes():
    from diffusers import AutoencoderKLQwenImage

    torch.manual_seed(0)
    # a 3 x 3 x 3 causal kernel in every residual block: the real VAE's layout at the tiny width
    plain = AutoencoderKLQwenImage(**TINY_VAE_CONFIG).eval()
    fast = copy.deepcopy(plain)
    n = install_single_frame_convs(fast)
    assert n > 0 and install_single_frame_convs(fast) == n  # idempotent
    return plain, fast


def _flops(fn) -> int:
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


def test_image_decode_and_encode_match_the_3d_convolutions(vaes):
    plain, fast = vaes
    z = torch.randn(3, TINY_VAE_CONFIG["z_dim"], 1, 12, 10)
    with torch.no_grad():
        a, b = plain.decode(z).sample, fast.decode(z).sample
    assert a.shape == b.shape and torch.allclose(a, b, atol=1e-5, rtol=0), (a - b).abs().max()
    x = torch.rand(2, 3, 1, 48, 40) * 2 - 1
    with torch.no_grad():
        ea, eb = plain.encode(x).latent_dist.mode(), fast.encode(x).latent_dist.mode()
    assert torch.allclose(ea, eb, atol=1e-5, rtol=0), (ea - eb).abs().max()
    # the zero frames are no longer multiplied: well under half of the decode's FLOPs remain
    assert _flops(lambda: fast.decode(z)) < 0.5 * _flops(lambda: plain.decode(z))


def test_video_chunks_with_cached_frames_keep_the_3d_path(vaes):
    plain, fast = vaes
    z = torch.randn(1, TINY_VAE_CONFIG["z_dim"], 3, 8, 8)  # 3 latent frames: later chunks see the cache
    with torch.no_grad():
        a, b = plain.decode(z).sample, fast.decode(z).sample
    assert a.shape == b.shape and a.shape[2] > 1
    assert torch.allclose(a, b, atol=1e-5, rtol=0), (a - b).abs().max()


def test_the_adapters_decode_installs_it(tiny_model_dir):
    from diffusers.models.autoencoders.autoencoder_kl_qwenimage import QwenImageCausalConv3d

    from trainer.engine.native import NativeEngine
    from trainer.models.qwen_image import QwenImageAdapter
    from trainer.trajectory import Geometry

    engine = NativeEngine(str(tiny_model_dir), device="cpu", dtype=torch.float32)
    geom = Geometry(32, 32, engine.vae_scale_factor)
    rows = (32 // engine.vae_scale_factor // 2) ** 2
    before = copy.deepcopy(engine.vae)
    images = QwenImageAdapter().decode(engine.vae, torch.randn(2, rows, 4 * engine.latent_channels), geom)
    convs = [m for m in engine.vae.modules() if isinstance(m, QwenImageCausalConv3d)]
    assert convs and all("forward" in m.__dict__ for m in convs)
    with torch.no_grad():
        z = torch.randn(2, engine.latent_channels, 1, 4, 4)
        assert torch.allclose(before.decode(z).sample, engine.vae.decode(z).sample, atol=1e-5, rtol=0)
    assert images.shape == (2, 3, 32, 32)

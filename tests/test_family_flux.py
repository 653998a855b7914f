"""The FLUX.1 family on its tiny offline model: the directory loads as diffusers' FluxPipeline,
the adapter's math is FluxPipeline's (packing, RoPE ids, schedule, the DiT call, decode), and the
contracts the Qwen-Image path holds hold here too (replay == sampler, ratio 1 on the first
update, every trainable parameter trained, sync parity, export round trip)."""

from __future__ import annotations

import json

import pytest
import torch

from tools.tiny_flux import FLUX_DEV_SCHEDULER_CONFIG, TINY_FLUX_TRANSFORMER_CONFIG, build_tiny_flux_pipeline
from trainer.models import flux as fx


@pytest.fixture(scope="module")
def pipe(tiny_flux_dir):
    from diffusers import FluxPipeline

    p = FluxPipeline.from_pretrained(str(tiny_flux_dir), local_files_only=True, dtype=torch.float32)
    p.set_progress_bar_config(disable=True)
    return p


# ------------------------------------------------------------------------- the tiny model


def test_tiny_directory_has_flux_dev_layout(tiny_flux_dir):
    index = json.loads((tiny_flux_dir / "model_index.json").read_text())
    assert index["_class_name"] == "FluxPipeline"
    assert index["transformer"] == ["diffusers", "FluxTransformer2DModel"]
    assert index["text_encoder"] == ["transformers", "CLIPTextModel"]
    assert index["text_encoder_2"] == ["transformers", "T5EncoderModel"]
    cfg = json.loads((tiny_flux_dir / "transformer" / "config.json").read_text())
    assert cfg["guidance_embeds"] is True and cfg["in_channels"] == 16
    sched = json.loads((tiny_flux_dir / "scheduler" / "scheduler_config.json").read_text())
    for key, value in FLUX_DEV_SCHEDULER_CONFIG.items():
        assert sched[key] == value, key
    vae = json.loads((tiny_flux_dir / "vae" / "config.json").read_text())
    assert (vae["scaling_factor"], vae["shift_factor"], vae["latent_channels"]) == (0.3611, 0.1159, 4)
    size = sum(p.stat().st_size for p in tiny_flux_dir.rglob("*") if p.is_file())
    assert size < 8 * 1024 * 1024, f"tiny FLUX is {size / 1e6:.1f} MB"


def test_tiny_loads_with_flux_pipeline_offline_and_generates(pipe, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert pipe.vae_scale_factor == 4 and pipe.transformer.config.guidance_embeds
    # the tokenizers are real: one token per byte / character of a word, plus the specials
    clip = pipe.tokenizer("a red ball").input_ids
    t5 = pipe.tokenizer_2("a red ball").input_ids
    # CLIP: <bos> + one per byte + <eos>; T5: the word marker fuses with a word's first character, then </s>
    assert len(clip) == 2 + len("aredball") and len(t5) == len("aredball") + 1
    out = pipe("a red ball", height=32, width=32, num_inference_steps=2, max_sequence_length=16,
               output_type="pt", generator=torch.Generator().manual_seed(0)).images
    assert out.shape == (1, 3, 32, 32) and torch.isfinite(out).all()


def test_same_seed_same_weights_and_cli(tmp_path, tiny_flux_dir):
    from safetensors.torch import load_file

    from tools.make_tiny_model import main

    assert main(["--family", "flux", "--output-dir", str(tmp_path / "again"), "--seed", "0"]) == 0
    build_tiny_flux_pipeline(tmp_path / "seed1", seed=1)
    name = "transformer/diffusion_pytorch_model.safetensors"
    a, b, c = (load_file(d / name) for d in (tiny_flux_dir, tmp_path / "again", tmp_path / "seed1"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a)
    assert json.loads((tmp_path / "again" / "TINY_RANDOM_MODEL.json").read_text())["family"] == "flux"


# ------------------------------------------------------------------------- FluxPipeline's math


@pytest.mark.parametrize("h, w", [(8, 8), (8, 12), (16, 4)])
def test_packing_and_ids_are_flux_pipelines(pipe, h, w):
    from diffusers import FluxPipeline

    x = torch.randn(3, 4, h, w)
    packed = fx.pack_latents(x)
    assert torch.equal(packed, FluxPipeline._pack_latents(x, 3, 4, h, w))
    vsf = pipe.vae_scale_factor
    assert torch.equal(fx.unpack_latents(packed, h // 2, w // 2),
                       FluxPipeline._unpack_latents(packed, h * vsf, w * vsf, vsf))
    assert fx.packed_grid(h * vsf, w * vsf, vsf) == (h // 2, w // 2)
    assert torch.equal(fx.latent_image_ids(h // 2, w // 2),
                       FluxPipeline._prepare_latent_image_ids(3, h // 2, w // 2, "cpu", torch.float32))
    with pytest.raises(ValueError, match="expected 2 x 2"):
        fx.unpack_latents(packed, 2, 2)


@pytest.mark.parametrize("height, width, steps", [(32, 32, 4), (512, 512, 6), (1024, 1024, 28), (768, 1360, 10)])
def test_sigma_schedule_is_flux_pipelines(height, width, steps):
    """The driver's schedule for FLUX.1-dev's scheduler config is the scheduler's own, set as
    FluxPipeline sets it: sigmas = linspace(1, 1/N, N), mu = calculate_shift(image tokens)."""
    import numpy as np
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift

    from trainer.sampling import image_seq_len, sigma_schedule

    sched = FlowMatchEulerDiscreteScheduler(**FLUX_DEV_SCHEDULER_CONFIG)
    seq = image_seq_len(height, width, 8)
    assert seq == (height // 16) * (width // 16)
    c = sched.config
    mu = calculate_shift(seq, c.base_image_seq_len, c.max_image_seq_len, c.base_shift, c.max_shift)
    sched.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps), mu=mu)
    ours = sigma_schedule(FLUX_DEV_SCHEDULER_CONFIG, steps, seq)
    assert ours == [float(s) for s in sched.sigmas]
    assert ours[0] == 1.0 and ours[-1] == 0.0


def test_dit_call_is_flux_pipelines(pipe):
    """flux_velocity gives, bit for bit, the transformer output FluxPipeline's own denoising loop
    gets (guidance 3.5 through the guidance embedding, 2-D ids, timestep / 1000)."""
    seen = {}

    def hook(module, args, kwargs, out):
        if "kw" not in seen:
            seen["kw"] = {k: v.clone() if torch.is_tensor(v) else v for k, v in kwargs.items()}
            seen["out"] = out[0].clone()

    handle = pipe.transformer.register_forward_hook(hook, with_kwargs=True)
    try:
        pipe("a blue cup", height=32, width=48, num_inference_steps=2, max_sequence_length=12, guidance_scale=3.5,
             output_type="latent", generator=torch.Generator().manual_seed(1))
    finally:
        handle.remove()
    kw = seen["kw"]
    assert kw["txt_ids"].dim() == 2 and kw["img_ids"].dim() == 2
    assert torch.equal(kw["guidance"], fx.guidance_tensor(3.5, 1))
    rows, cols = fx.packed_grid(32, 48, 4)
    v = fx.flux_velocity(pipe.transformer, kw["hidden_states"], kw["timestep"] * 1000, kw["encoder_hidden_states"],
                         kw["pooled_projections"], fx.guidance_tensor(3.5, 1), rows, cols)
    assert torch.equal(v, seen["out"])
    # the guidance input matters: the distilled model's output depends on it
    other = fx.flux_velocity(pipe.transformer, kw["hidden_states"], kw["timestep"] * 1000,
                             kw["encoder_hidden_states"], kw["pooled_projections"], fx.guidance_tensor(1.0, 1),
                             rows, cols)
    assert (other - v).abs().max() > 1e-4


def test_decode_is_flux_pipelines(pipe):
    """decode_latents = FluxPipeline's decode of the same packed latents (output_type 'pt')."""
    from diffusers import FluxPipeline

    torch.manual_seed(0)
    packed = torch.randn(2, 4 * 6, 16)
    ours = fx.decode_latents(pipe.vae, packed, 32, 48, 4)
    z = FluxPipeline._unpack_latents(packed, 32, 48, 4) / pipe.vae.config.scaling_factor + pipe.vae.config.shift_factor
    with torch.no_grad():
        want = pipe.image_processor.postprocess(pipe.vae.decode(z, return_dict=False)[0], output_type="pt")
    torch.testing.assert_close(ours, want, rtol=0, atol=1e-6)
    assert fx.vae_scale_factor_from_config(pipe.vae.config) == 4
    assert TINY_FLUX_TRANSFORMER_CONFIG["in_channels"] == 4 * pipe.vae.config.latent_channels

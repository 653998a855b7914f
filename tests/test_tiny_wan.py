"""The tiny Wan2.1 text-to-video model: built offline, loaded by diffusers' WanPipeline through
the real loading code, generating a few frames on CPU; and the real Wan2.1 configurations the
benchmark builds, checked against the published parameter counts."""

from __future__ import annotations

import json

import pytest
import torch

from tools.tiny_wan import (
    TINY_WAN_TRANSFORMER_CONFIG,
    WAN21_FLOW_SHIFT,
    WAN21_T2V_1_3B_TRANSFORMER_CONFIG,
    WAN21_T2V_14B_TRANSFORMER_CONFIG,
    WAN21_UMT5_XXL_CONFIG,
    WAN21_VAE_CONFIG,
    WAN21_VAE_LATENTS_MEAN,
    build_tiny_wan_pipeline,
    main,
)


@pytest.fixture(scope="module")
def tiny_wan_dir(tmp_path_factory):
    return build_tiny_wan_pipeline(tmp_path_factory.mktemp("tiny_wan") / "model", seed=0)


@pytest.fixture(scope="module")
def pipe(tiny_wan_dir):
    from diffusers import WanPipeline

    p = WanPipeline.from_pretrained(str(tiny_wan_dir), local_files_only=True, dtype=torch.float32)
    p.set_progress_bar_config(disable=True)
    return p


def test_tiny_directory_has_the_wan_t2v_layout(tiny_wan_dir):
    index = json.loads((tiny_wan_dir / "model_index.json").read_text())
    assert index["_class_name"] == "WanPipeline"
    assert index["transformer"] == ["diffusers", "WanTransformer3DModel"]
    assert index["vae"] == ["diffusers", "AutoencoderKLWan"]
    assert index["text_encoder"] == ["transformers", "UMT5EncoderModel"]
    assert index["scheduler"] == ["diffusers", "FlowMatchEulerDiscreteScheduler"]
    assert index.get("transformer_2") in (None, [None, None])  # Wan2.1: one expert
    sched = json.loads((tiny_wan_dir / "scheduler" / "scheduler_config.json").read_text())
    assert sched["shift"] == WAN21_FLOW_SHIFT and not sched.get("use_dynamic_shifting")
    vae = json.loads((tiny_wan_dir / "vae" / "config.json").read_text())
    assert tuple(vae["latents_mean"]) == WAN21_VAE_LATENTS_MEAN and vae["z_dim"] == 16
    assert (vae["scale_factor_temporal"], vae["scale_factor_spatial"]) == (4, 8)
    size = sum(p.stat().st_size for p in tiny_wan_dir.rglob("*") if p.is_file())
    assert size < 2 * 1024 * 1024, f"tiny Wan is {size / 1e6:.1f} MB"


def test_tiny_loads_with_wan_pipeline_offline_and_generates_frames(pipe, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # the real factors, so the tiny model has the real latent geometry
    assert (pipe.vae_scale_factor_temporal, pipe.vae_scale_factor_spatial) == (4, 8)
    # a real tokenizer: the word marker fuses with each word's first character, then </s>
    assert len(pipe.tokenizer("a red ball").input_ids) == len("aredball") + 1
    video = pipe("a red ball", height=32, width=32, num_frames=5, num_inference_steps=2, max_sequence_length=16,
                 output_type="pt", generator=torch.Generator().manual_seed(0)).frames
    assert video.shape == (1, 5, 3, 32, 32)
    assert torch.isfinite(video).all() and 0.0 <= float(video.min()) and float(video.max()) <= 1.0
    latents = pipe("a red ball", height=32, width=32, num_frames=5, num_inference_steps=2, max_sequence_length=16,
                   output_type="latent", generator=torch.Generator().manual_seed(0)).frames
    # 5 frames -> (5 - 1) // 4 + 1 = 2 latent frames; 32 px / 8 = 4 latent rows and columns
    assert latents.shape == (1, 16, 2, 4, 4)


def test_same_seed_same_weights_other_seed_other_weights(tiny_wan_dir, tmp_path):
    from safetensors.torch import load_file

    def weights(d):
        return load_file(str(d / "transformer" / "diffusion_pytorch_model.safetensors"))

    again = weights(build_tiny_wan_pipeline(tmp_path / "again", seed=0))
    other = weights(build_tiny_wan_pipeline(tmp_path / "other", seed=1))
    first = weights(tiny_wan_dir)
    assert all(torch.equal(first[k], again[k]) for k in first)
    assert any(not torch.equal(first[k], other[k]) for k in first)
    assert json.loads((tmp_path / "other" / "TINY_RANDOM_MODEL.json").read_text())["seed"] == 1


def test_cli_writes_the_directory(tmp_path, capsys):
    assert main(["--output-dir", str(tmp_path / "cli"), "--seed", "3"]) == 0
    assert (tmp_path / "cli" / "model_index.json").is_file()
    assert "tiny Wan2.1" in capsys.readouterr().out


def _count(module) -> int:
    return sum(p.numel() for p in module.parameters())


def test_real_configs_have_the_published_sizes():
    """Built on the meta device (no memory): Wan2.1-T2V-1.3B's DiT has 1.42 B parameters, the 14B's
    14.29 B, the VAE 127 M, umt5-xxl's encoder 5.68 B; a wrong constant moves these."""
    from diffusers import AutoencoderKLWan, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    with torch.device("meta"):
        small = WanTransformer3DModel(**WAN21_T2V_1_3B_TRANSFORMER_CONFIG)
        large = WanTransformer3DModel(**WAN21_T2V_14B_TRANSFORMER_CONFIG)
        vae = AutoencoderKLWan(**WAN21_VAE_CONFIG)
        text = UMT5EncoderModel(UMT5Config(**WAN21_UMT5_XXL_CONFIG, is_encoder_decoder=False))
    assert 1.40e9 < _count(small) < 1.44e9
    assert 14.2e9 < _count(large) < 14.4e9
    assert 126e6 < _count(vae) < 128e6
    assert 5.6e9 < _count(text) < 5.8e9
    # the DiT reads the text encoder's width; the tiny model keeps that coupling
    assert WAN21_T2V_14B_TRANSFORMER_CONFIG["text_dim"] == WAN21_UMT5_XXL_CONFIG["d_model"]
    assert TINY_WAN_TRANSFORMER_CONFIG["in_channels"] == WAN21_VAE_CONFIG["z_dim"]


def test_the_wan_bench_runs_on_the_tiny_configuration(tmp_path):
    """tools/bench_wan.py end to end on the CPU (--tiny): every figure it promises: WanPipeline's
    rollout, the native engine's on the same modules (with and without decode, the ratio per DiT
    row, the replay vs sampler gap: 0 in fp32), LoRA replay with and without activation
    checkpointing, and the adapter's own replay."""
    from tools.bench_wan import main as bench

    out = tmp_path / "wan.jsonl"
    assert bench(["--tiny", "--iters", "1", "--out", str(out)]) == 0
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["figure"] for r in recs] == ["rollout_videos_per_s", "vae_decode", "engine_rollout_videos_per_s",
                                           "engine_rollout_videos_per_s", "ratio_per_dit_row",
                                           "replay_vs_sampler_max_abs", "replay_vs_sampler_max_abs",
                                           "replay_transition", "replay_transition", "replay_transition_ours"]
    assert recs[1]["frames_out"] == 5 and recs[0]["value"] > 0
    assert [r["decode"] for r in recs[2:4]] == [True, False] and recs[4]["value"] > 0
    assert [r["value"] for r in recs[5:7]] == [0.0, 0.0]  # fp32: the replay is the sampler
    assert [r["activation_checkpointing"] for r in recs[7:9]] == [True, False]
    assert all(r["status"] == "ok" and r["rows"] == 2 and r["lora_params"] > 0 for r in recs[7:])

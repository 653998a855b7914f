"""The tiny offline Qwen-Image builds fast, is small, and loads through the real loaders."""

from __future__ import annotations

import json

import pytest
import torch

from tools.make_tiny_model import QWEN_IMAGE_SCHEDULER_CONFIG, build_tiny_pipeline


def test_layout_and_size(tiny_model_dir):
    for sub in ("transformer", "vae", "text_encoder", "tokenizer", "scheduler"):
        assert (tiny_model_dir / sub).is_dir(), sub
    index = json.loads((tiny_model_dir / "model_index.json").read_text())
    assert index["_class_name"] == "QwenImagePipeline"
    assert index["transformer"] == ["diffusers", "QwenImageTransformer2DModel"]
    size = sum(p.stat().st_size for p in tiny_model_dir.rglob("*") if p.is_file())
    assert size < 40 * 1024 * 1024, f"tiny model is {size / 1e6:.1f} MB"
    sched = json.loads((tiny_model_dir / "scheduler" / "scheduler_config.json").read_text())
    for key, value in QWEN_IMAGE_SCHEDULER_CONFIG.items():
        assert sched[key] == value, key


def test_loads_with_diffusers_pipeline_offline(tiny_model_dir, monkeypatch):
    """The stock QwenImagePipeline loads the directory with local_files_only and generates."""
    from diffusers import QwenImagePipeline

    from trainer.models.qwen_image import prompt_template_start_idx

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    pipe = QwenImagePipeline.from_pretrained(str(tiny_model_dir), local_files_only=True, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    pipe.prompt_template_encode_start_idx = prompt_template_start_idx(pipe.tokenizer, pipe.prompt_template_encode)
    # byte-level, no merges: the template prefix is one token per byte except the special tokens
    prefix = pipe.prompt_template_encode.split("{}")[0]
    n_special = prefix.count("<|im_start|>") + prefix.count("<|im_end|>")
    expected = len(prefix.encode()) - sum(len(t) for t in ("<|im_start|>",) * 2 + ("<|im_end|>",)) + n_special
    assert pipe.prompt_template_encode_start_idx == expected
    out = pipe("a red panda", height=64, width=64, num_inference_steps=3, output_type="pt",
               generator=torch.Generator().manual_seed(0)).images
    assert out.shape == (1, 3, 64, 64) and torch.isfinite(out).all()


def test_same_seed_same_weights(tmp_path, tiny_model_dir):
    from safetensors.torch import load_file

    other = build_tiny_pipeline(tmp_path / "again", seed=0)
    different = build_tiny_pipeline(tmp_path / "seed1", seed=1)
    a = load_file(tiny_model_dir / "transformer" / "diffusion_pytorch_model.safetensors")
    b = load_file(other / "transformer" / "diffusion_pytorch_model.safetensors")
    c = load_file(different / "transformer" / "diffusion_pytorch_model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a)


def test_cli(tmp_path):
    from tools.make_tiny_model import main

    assert main(["--output", str(tmp_path / "cli"), "--seed", "3"]) == 0
    assert json.loads((tmp_path / "cli" / "TINY_RANDOM_MODEL.json").read_text())["seed"] == 3


def test_adapter_loads_only_the_transformer(tiny_model_dir):
    from diffusers import QwenImageTransformer2DModel

    from trainer.models.qwen_image import QwenImageAdapter

    adapter = QwenImageAdapter()
    model = adapter.load_train_model(str(tiny_model_dir), dtype=torch.float32)
    assert isinstance(model, QwenImageTransformer2DModel)
    assert adapter.vae_scale_factor == 4
    with pytest.raises(FileNotFoundError, match="--model-path"):
        adapter.load_train_model(str(tiny_model_dir / "nope"))


def test_vae_output_gain_scales_only_the_decoder_output(tiny_model_dir, tmp_path):
    """The demo's model: the same random weights, the decoder's last conv scaled (bias zeroed)."""
    from safetensors.torch import load_file

    gained = build_tiny_pipeline(tmp_path / "gain", seed=0, vae_output_gain=8.0)
    base = load_file(str(tiny_model_dir / "vae" / "diffusion_pytorch_model.safetensors"))
    new = load_file(str(gained / "vae" / "diffusion_pytorch_model.safetensors"))
    assert torch.equal(new["decoder.conv_out.weight"], base["decoder.conv_out.weight"] * 8)
    assert torch.count_nonzero(new["decoder.conv_out.bias"]) == 0
    assert all(torch.equal(new[k], base[k]) for k in base if not k.startswith("decoder.conv_out."))
    t_base = load_file(str(tiny_model_dir / "transformer" / "diffusion_pytorch_model.safetensors"))
    t_new = load_file(str(gained / "transformer" / "diffusion_pytorch_model.safetensors"))
    assert all(torch.equal(t_new[k], t_base[k]) for k in t_base)

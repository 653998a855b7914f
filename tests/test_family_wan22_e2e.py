"""Wan2.2 A14B's two experts end to end: the real training loop under torchrun (2 gloo processes)
on the tiny two-expert model (configs/wan22_t2v_tiny.toml: trained steps on both sides of the
boundary, CFG 4.5 for the high-noise expert and 3.0 for the low-noise one). The launches of
tests/family_e2e.py's train_and_resume: a LoRA run of 2 rollouts and a run resumed from its first
checkpoint for rollout 1; the last checkpoint exported merged (both transformers) and as adapters."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.family_e2e import assert_lora_resume_is_exact, train_and_resume

pytestmark = pytest.mark.filterwarnings("ignore:FSDP2-wrapped module.*returned a view tensor")

ADAPTER_PATH = "trainer.models.wan.WanAdapter"
ROLLOUTS = 2
CANDIDATES = 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tools.tiny_wan import TINY_WAN22_BOUNDARY_RATIO, build_tiny_wan_pipeline

    return build_tiny_wan_pipeline(tmp_path_factory.mktemp("wan22_gain") / "model", seed=0, vae_output_gain=8.0,
                                   boundary_ratio=TINY_WAN22_BOUNDARY_RATIO)


@pytest.fixture(scope="module")
def runs(model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("wan22_e2e")
    train = tmp / "train.jsonl"
    train.write_text(json.dumps({"prompt": "a red ball", "metadata": {"task": "t2v", "sample_id": "t0"}}) + "\n")
    text = (Path(__file__).resolve().parents[1] / "configs" / "wan22_t2v_tiny.toml").read_text()
    text = text.replace('"${TINY_WAN22}"', f'"{model_dir}"').replace('"${PROMPTS}"', f'"{train}"')
    (tmp / "wan22_tiny.toml").write_text(text)
    return train_and_resume(tmp / "wan22_tiny.toml", tmp, ROLLOUTS)


def test_lora_on_both_experts_resumes_exactly(runs):
    """Iteration 1 of the uninterrupted and the resumed run are the same (tensors, policy version,
    lr step, videos byte for byte); both experts hold LoRA tensors and both were trained by
    rollout 1; the sidecars record the boundary and the second guidance scale."""
    from tests.test_e2e import _model_tensors
    from trainer import artifacts

    ta = assert_lora_resume_is_exact(*runs, ADAPTER_PATH, CANDIDATES, task="t2v", media="*.webp")
    t0 = _model_tensors(runs[0] / "ckpt", 0, task="t2v")
    for expert in ("transformer", "transformer_2"):
        mine = [n for n in ta if n.startswith(expert + ".blocks.") and "lora_" in n]
        assert mine and any(not torch.equal(ta[n], t0[n]) for n in mine), expert
    d = runs[1] / "artifacts" / "t2v" / "rollout_0000001"
    _, meta = artifacts.read_sidecar(next(iter(artifacts.iter_sidecars(d))))
    assert json.loads(meta["expert_boundary"]) == 700.0 and json.loads(meta["guidance_scale_2"]) == 3.0


def test_export_writes_both_transformers_and_an_adapter_per_expert(runs, model_dir, tmp_path):
    """The last checkpoint exported merged (verified) loads through DiffusionPipeline.from_pretrained
    as a WanPipeline with both transformers and the boundary, and samples a video with both scales;
    exported as adapters (one directory per expert), WanPipeline.load_lora_weights (with
    load_into_transformer_2 for the second) and the engine's --lora give each expert exactly the
    merged weights' function, and each expert moved away from the base."""
    from diffusers import DiffusionPipeline, WanPipeline

    from tools.export_checkpoint import export_checkpoint
    from trainer.engine.native import NativeEngine
    from trainer.models.wan import WanAdapter

    g = torch.Generator().manual_seed(123)
    fixed = dict(hidden_states=torch.randn(2, 16, 2, 4, 4, generator=g),
                 encoder_hidden_states=torch.randn(2, 8, 32, generator=g), timestep=torch.tensor([900.0, 400.0]))

    @torch.no_grad()
    def forward(model):
        return model.eval()(**fixed, return_dict=False)[0]

    merged = export_checkpoint(runs[0] / "ckpt", "t2v", ROLLOUTS - 1, tmp_path / "merged", form="merged",
                               base_model_path=model_dir, verify=True)
    assert merged["experts"] == ["transformer", "transformer_2"]
    assert merged["verify"]["lora_modules_checked"] > 0 and merged["verify_2"]["lora_modules_checked"] > 0
    adapter = export_checkpoint(runs[0] / "ckpt", "t2v", ROLLOUTS - 1, tmp_path / "adapter", form="adapter",
                                verify=True)
    assert adapter["verify"]["peft_injection_checked"] and adapter["verify_2"]["peft_injection_checked"]

    pipe = DiffusionPipeline.from_pretrained(str(tmp_path / "merged"), local_files_only=True)
    assert isinstance(pipe, WanPipeline) and pipe.config.boundary_ratio == 0.7
    want = {c: forward(getattr(pipe, c)) for c in ("transformer", "transformer_2")}
    base = WanPipeline.from_pretrained(str(model_dir), local_files_only=True)
    for c in want:
        assert (want[c] - forward(getattr(base, c))).abs().max() > 1e-4, c  # training moved both experts
    base.load_lora_weights(str(tmp_path / "adapter" / "transformer"))
    base.load_lora_weights(str(tmp_path / "adapter" / "transformer_2"), load_into_transformer_2=True)
    engine = NativeEngine(str(model_dir), device="cpu", dtype=torch.float32, adapter=WanAdapter())
    assert engine.load_lora_dir(tmp_path / "adapter")["rank"] == 4
    for c in want:
        torch.testing.assert_close(forward(getattr(base, c)), want[c], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(forward(getattr(engine.transformer, c)), want[c], rtol=1e-5, atol=1e-5)
    pipe.set_progress_bar_config(disable=True)
    video = pipe("a red ball", negative_prompt="", guidance_scale=4.5, guidance_scale_2=3.0, height=32, width=32,
                 num_frames=5, num_inference_steps=2, max_sequence_length=16, output_type="pt",
                 generator=torch.Generator().manual_seed(0)).frames
    assert video.shape == (1, 5, 3, 32, 32) and torch.isfinite(video).all()


def test_the_sample_tool_samples_with_a_two_expert_checkpoint_and_its_adapter_export(runs, model_dir, tmp_path):
    from tests.test_e2e import _write_prompts
    from tools.export_checkpoint import export_checkpoint
    from tools.sample import main

    prompts = _write_prompts(tmp_path / "p.jsonl", ["a red ball"], "s")
    prompts.write_text(prompts.read_text().replace('"t2i"', '"t2v"'))
    export_checkpoint(runs[0] / "ckpt", "t2v", ROLLOUTS - 1, tmp_path / "adapter", form="adapter")
    sampling = json.dumps({"height": 32, "width": 32, "num_frames": 5, "num_inference_steps": 4,
                           "guidance_scale": 4.5, "guidance_scale_2": 3.0, "negative_prompt": "",
                           "cfg_renorm": False})
    videos = []
    for i, lora in enumerate((runs[0] / "ckpt", tmp_path / "adapter")):
        assert main(["--model-path", str(model_dir), "--prompt-data", str(prompts), "--output-dir",
                     str(tmp_path / f"out{i}"), "--n-samples-per-prompt", "1", "--device", "cpu", "--lora", str(lora),
                     "--sampling-config", sampling]) == 0
        (video,) = (tmp_path / f"out{i}" / "t2v" / "rollout_0000000").glob("*.webp")
        videos.append(video.read_bytes())
    assert videos[0] == videos[1]  # the checkpoint's LoRA and its export are the same weights

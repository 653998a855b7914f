"""Wan2.1 text-to-video end to end: the real training loop under torchrun (2 gloo processes) on the
tiny Wan model, task t2v: 5-frame 32 x 32 videos, true CFG 4.5 with the empty negative prompt,
FlowGRPO's Wan SDE on every step but the last, the colour reward on 2 frames of each video through
the framewise wrapper. Two launches shared by every test here: a LoRA run of 2 rollouts and a run
resumed from its first checkpoint for rollout 1 (weights, policy version, lr step and the videos
sampled after the resume identical); the last checkpoint exported both ways and loaded back
through diffusers' WanPipeline and into the engine; tools/sample.py writing videos with it."""

from __future__ import annotations

import json

import pytest
import torch

from tests.family_e2e import assert_export_round_trip, assert_lora_resume_is_exact, train_and_resume
from tests.test_e2e import _write_prompts

pytestmark = pytest.mark.filterwarnings("ignore:FSDP2-wrapped module.*returned a view tensor")

ADAPTER_PATH = "trainer.models.wan.WanAdapter"
ROLLOUTS = 2
CANDIDATES = 4
GUIDANCE = 4.5


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The tiny Wan model with its decoder's output scaled up, so the latents move the colours."""
    from tools.tiny_wan import build_tiny_wan_pipeline

    return build_tiny_wan_pipeline(tmp_path_factory.mktemp("wan_gain") / "model", seed=0, vae_output_gain=8.0)


def recipe(tmp, model_dir):
    """configs/wan21_t2v_tiny.toml on this model and prompt file, at 2 ranks."""
    from pathlib import Path

    train = tmp / "train.jsonl"
    train.write_text(json.dumps({"prompt": "a red ball", "metadata": {"task": "t2v", "sample_id": "t0"}}) + "\n")
    text = (Path(__file__).resolve().parents[1] / "configs" / "wan21_t2v_tiny.toml").read_text()
    text = text.replace('model-path = "${TINY_WAN}"', f'model-path = "{model_dir}"')
    text = text.replace('prompt-data = "${PROMPTS}"', f'prompt-data = "{train}"')
    path = tmp / "wan_tiny.toml"
    path.write_text(text)
    return path


@pytest.fixture(scope="module")
def runs(model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("wan_e2e")
    return train_and_resume(recipe(tmp, model_dir), tmp, ROLLOUTS)


def test_lora_resume_is_exact_and_videos_are_written(runs):
    """Iteration 1 of the uninterrupted run and of the one resumed from iteration 0: the same
    adapter (on the four attention projections of both attentions), policy version and lr step,
    and the rollout after the resume sampled the same videos, byte for byte. The sidecars hold
    [B, S, C, F', H', W'] latents, the frames and the negative prompt's conditions."""
    from trainer import artifacts

    ta = assert_lora_resume_is_exact(*runs, ADAPTER_PATH, CANDIDATES, task="t2v", media="*.webp")
    lora = {n.split(".lora_")[0].split(".", 2)[2] for n in ta if "lora_" in n}
    assert lora == {f"{a}.{p}" for a in ("attn1", "attn2") for p in ("to_q", "to_k", "to_v", "to_out.0")}
    d = runs[1] / "artifacts" / "t2v" / "rollout_0000001"
    assert not list(d.glob("*.png"))
    tensors, meta = artifacts.read_sidecar(next(iter(artifacts.iter_sidecars(d))))
    assert meta["frames"] == "5" and meta["sde_type"] == "wan" and float(meta["guidance_scale"]) == GUIDANCE
    assert tensors["tracks.latents"].shape == (CANDIDATES, 3, 16, 2, 4, 4)
    assert "conditions.negative_prompt_embeds" in tensors
    from PIL import Image

    with Image.open(next(iter(d.glob("*.webp")))) as im:
        assert im.is_animated and im.size == (32, 32)


def test_videos_reach_tensorboard_at_a_readable_height_and_the_index_names_them(runs):
    """The rollout grid shows each clip as frames 128 px high (the 32 px frames enlarged, not a
    32 px strip shrunk further); the rollout's index.jsonl names its WebP files with the prompt."""
    from tests.test_run_visuals import tb_images

    grid = tb_images(runs[0] / "tb")["rollout/candidates"]
    # rank 0's two clips of the group: two strips of 4 frames, 128 + 2 px per frame
    assert grid.shape[1] == 2 * (4 * 128 + 3 * 2) + 4
    d = runs[0] / "artifacts" / "t2v" / "rollout_0000001"
    (entry,) = [json.loads(line) for line in (d / "index.jsonl").read_text().splitlines()]
    assert entry["prompt"] == "a red ball" and entry["sources"] == []
    assert [c["file"] for c in entry["candidates"]] == sorted(p.name for p in d.glob("*.webp"))
    assert all(set(c) == {"slot", "file", "scores", "advantage"} for c in entry["candidates"])


def _fixed_input():
    g = torch.Generator().manual_seed(123)
    return dict(hidden_states=torch.randn(2, 16, 2, 4, 4, generator=g),
                encoder_hidden_states=torch.randn(2, 8, 32, generator=g), timestep=torch.tensor([900.0, 400.0]))


def test_export_round_trip_and_the_sample_tool(runs, model_dir, tmp_path):
    """The trained adapter of the last iteration three ways, all the same function: merged into a
    pipeline DiffusionPipeline.from_pretrained loads as a WanPipeline (which samples a video with
    CFG), the PEFT adapter through WanPipeline.load_lora_weights, and the adapter in the native
    engine. Then tools/sample.py samples with the checkpoint's LoRA and writes one video each."""
    from diffusers import WanPipeline

    from tools.sample import main
    from trainer.models.wan import WanAdapter

    def sample(pipe):
        pipe.set_progress_bar_config(disable=True)
        video = pipe("a red ball", negative_prompt="", guidance_scale=GUIDANCE, height=32, width=32, num_frames=5,
                     num_inference_steps=2, max_sequence_length=16, output_type="pt",
                     generator=torch.Generator().manual_seed(0)).frames
        assert video.shape == (1, 5, 3, 32, 32)
        return video

    assert_export_round_trip(runs[0], model_dir, tmp_path, ROLLOUTS - 1, WanPipeline, WanAdapter(), _fixed_input,
                             sample, task="t2v")
    prompts = _write_prompts(tmp_path / "p.jsonl", ["a red ball"], "s")
    prompts.write_text(prompts.read_text().replace('"t2i"', '"t2v"'))
    assert main(["--model-path", str(model_dir), "--prompt-data", str(prompts), "--output-dir",
                 str(tmp_path / "out"), "--n-samples-per-prompt", "2", "--device", "cpu", "--lora",
                 str(runs[0] / "ckpt"), "--sampling-config",
                 json.dumps({"height": 32, "width": 32, "num_frames": 5, "num_inference_steps": 4})]) == 0
    out = tmp_path / "out" / "t2v" / "rollout_0000000"
    assert len(list(out.glob("*.webp"))) == 2 and not list(out.glob("*.png"))

"""Qwen-Image-Edit end to end, task i2i: the real training loop under torchrun (2 gloo
processes) on the tiny 2511 edit model, two launches shared by every test here. A LoRA run of 2
rollouts on a record with a source image, trained on the colour-edit reward (which reads the
source the loop hands it), against a run resumed from its first checkpoint; the last checkpoint
exported both ways and loaded back through diffusers' QwenImageEditPlusPipeline and into the
engine; tools/sample.py edits the record's source with the trained checkpoint."""

from __future__ import annotations

import json

import pytest
import torch
from PIL import Image

from tests.family_e2e import (assert_export_round_trip, assert_lora_resume_is_exact, edit_recipe, train_and_resume,
                               write_edit_records)

pytestmark = pytest.mark.filterwarnings("ignore:FSDP2-wrapped module.*returned a view tensor")

ADAPTER_PATH = "trainer.models.qwen_image_edit.QwenImageEditAdapter"
ROLLOUTS = 2
LAST = ROLLOUTS - 1
CANDIDATES = 8

@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tools.tiny_qwen_image_edit import build_tiny_qwen_image_edit_pipeline

    return build_tiny_qwen_image_edit_pipeline(tmp_path_factory.mktemp("edit_gain") / "model", seed=0,
                                               vae_output_gain=8.0, variant="2511")


@pytest.fixture(scope="module")
def runs(model_dir, tmp_path_factory):
    """configs/tiny_cpu_edit.toml on this model and one record: ROLLOUTS rollouts, and a run
    resumed from the first checkpoint."""
    tmp = tmp_path_factory.mktemp("edit_e2e")
    return train_and_resume(edit_recipe(tmp, model_dir, write_edit_records(tmp / "data")), tmp, ROLLOUTS)


def test_lora_resume_is_exact_and_the_sidecar_records_the_source(runs):
    """Iteration 1 of the uninterrupted run and of the resumed one agree (adapter, policy
    version, lr step, the images after the resume); a sidecar replays the conditioned forward
    from what it records (source latents, source reference, media in the geometry)."""
    from trainer import artifacts
    from trainer.models.edit_source import SOURCE_PATHS_KEY
    from trainer.models.qwen_image_edit import QwenImageEditAdapter

    assert_lora_resume_is_exact(*runs, ADAPTER_PATH, CANDIDATES, task="i2i")
    side = artifacts.iter_sidecars(runs[0] / "artifacts" / "i2i" / f"rollout_{LAST:07d}")[0]
    traj = artifacts.sidecar_to_trajectory(*artifacts.read_sidecar(side))
    QwenImageEditAdapter().validate_trajectory(traj)
    assert traj.geometry.media == ("image",) and traj.guided
    assert traj.metadata[0][SOURCE_PATHS_KEY][0].endswith("media/src0.png")


def test_the_colour_edit_reward_saw_the_source(runs, capsys):
    """The loop put the source pixels into the scorer's metadata: color_edit is scored (not a
    failure) for every rollout, and tools/score.py re-scores the last rollout's PNGs from the
    sources its sidecars name to the training run's figure."""
    from tools.score import main as score_main
    from trainer.metrics import read_scalars

    means = [v for _, v in read_scalars(runs[0] / "tb")["reward/color_edit_mean"]]
    assert len(means) == ROLLOUTS and all(0.0 <= v <= 1.0 for v in means)
    assert score_main(["--reward-scorer-path", "color_edit", "--reward-runtime", "cpu", "--media-root",
                       str(runs[0].parent / "data"), "--images", str(runs[0] / "artifacts" / "i2i" / f"rollout_{LAST:07d}")]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert len(lines) == CANDIDATES
    rescored = sum(line["scores"]["color_edit"] for line in lines) / len(lines)
    assert rescored == pytest.approx(means[LAST], abs=1e-3)


def test_a_person_sees_each_edit_beside_its_source_and_an_index_of_the_rollout(runs):
    """TensorBoard's rollout grid starts the record's row with its source (the pixels the model
    was conditioned on, captioned with the file's name); the rollout directory's index.jsonl
    names each PNG beside the prompt, the source and the scores the run logged, index.html shows
    them with the prompt escaped."""
    from tests.test_run_visuals import has_pixels, tb_images, tb_texts
    from trainer.metrics import read_scalars
    from trainer.models.edit_source import source_pixels

    assert "source: src0.png" in tb_texts(runs[0] / "tb")["rollout/candidates/captions"]
    src = source_pixels(runs[0].parent / "data" / "media" / "src0.png", 16, 16)
    assert has_pixels(tb_images(runs[0] / "tb")["rollout/candidates"], src.repeat(10, axis=0).repeat(10, axis=1))
    d = runs[0] / "artifacts" / "i2i" / f"rollout_{LAST:07d}"
    (entry,) = [json.loads(line) for line in (d / "index.jsonl").read_text().splitlines()]
    assert entry["prompt"] == "<image> make the square red" and entry["sources"] == ["src0.png"]
    assert [c["file"] for c in entry["candidates"]] == sorted(p.name for p in d.glob("*.png"))
    scores = [c["scores"]["color_edit"] for c in entry["candidates"]]
    assert sum(scores) / len(scores) == pytest.approx(read_scalars(runs[0] / "tb")["reward/color_edit_mean"][LAST][1])
    assert "&lt;image&gt; make the square red" in (d / "index.html").read_text()


def _fixed_input():
    g = torch.Generator().manual_seed(123)
    # 2 x 2 target tokens followed by 2 x 2 source tokens, as the edit pipeline's sequence
    return dict(hidden_states=torch.randn(2, 8, 16, generator=g), encoder_hidden_states=torch.randn(2, 6, 16, generator=g),
                encoder_hidden_states_mask=None, timestep=torch.tensor([0.9, 0.4]),
                img_shapes=[[(1, 2, 2), (1, 2, 2)]] * 2)


def test_export_round_trip_and_sample_with_source_images(runs, model_dir, tmp_path, monkeypatch, capsys):
    """The trained adapter three ways, all the same function (merged into a pipeline that
    QwenImageEditPlusPipeline loads and that edits a source; the PEFT adapter through its
    load_lora_weights; the adapter in the native engine), then tools/sample.py edits the
    record's source with the checkpoint."""
    import diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus as edit_plus
    from diffusers import QwenImageEditPlusPipeline

    from tools.sample import main as sample_main
    from tools.tiny_qwen_image_edit import edit_prompt_template_start_idx
    from trainer.models.qwen_image_edit import QwenImageEditAdapter
    from trainer.models.qwen_vl_processor import ImagePromptProcessor

    monkeypatch.setattr(edit_plus, "VAE_IMAGE_SIZE", 32 * 32)  # the stock 1 megapixel: ~50 s on CPU

    def sample(pipe):
        pipe.prompt_template_encode_start_idx = edit_prompt_template_start_idx(pipe)
        image = pipe(image=[Image.new("RGB", (32, 32), (30, 40, 220))], prompt="make the square red", height=16,
                     width=16, num_inference_steps=2, true_cfg_scale=4.0, negative_prompt=" ", output_type="pt",
                     generator=torch.Generator().manual_seed(0)).images
        assert image.shape == (1, 3, 16, 16)
        return image

    assert_export_round_trip(runs[0], model_dir, tmp_path, LAST, QwenImageEditPlusPipeline, QwenImageEditAdapter(),
                             _fixed_input, sample, task="i2i",
                             load_kwargs=lambda d: {"processor": ImagePromptProcessor.from_pretrained(d / "processor")})

    data = write_edit_records(tmp_path / "sample_data", n=2)
    out = tmp_path / "sampled"
    assert sample_main(["--model-path", str(model_dir), "--prompt-data", str(data), "--output-dir", str(out),
                        "--lora", str(runs[0] / "ckpt"), "--n-samples-per-prompt", "2", "--sampling-config",
                        json.dumps({"height": 16, "width": 16, "num_inference_steps": 2, "sde_indices": [1],
                                    "guidance_scale": 4.0})]) == 0
    pngs = sorted((out / "i2i" / "rollout_0000000").glob("*.png"))
    assert len(pngs) == 4
    assert "wrote 4 PNGs and 2 sidecars" in capsys.readouterr().out

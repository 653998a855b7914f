"""FLUX.1-Kontext end to end, task i2i: configs/tiny_cpu_edit.toml pointed at the tiny Kontext
model (its adapter, Kontext's embedded guidance 2.5 instead of true CFG) under torchrun (2 gloo
processes), two launches shared by the tests here: 2 rollouts against a run resumed from the
first checkpoint; the last checkpoint exported both ways and loaded back through
FluxKontextPipeline and into the engine; tools/sample.py edits a record's source with it."""

from __future__ import annotations

import json

import pytest
import torch
from PIL import Image

from tests.family_e2e import (assert_export_round_trip, assert_lora_resume_is_exact, edit_recipe, train_and_resume,
                               write_edit_records)

pytestmark = pytest.mark.filterwarnings("ignore:FSDP2-wrapped module.*returned a view tensor")

ADAPTER_PATH = "trainer.models.flux_kontext.FluxKontextAdapter"
ROLLOUTS = 2
LAST = ROLLOUTS - 1
CANDIDATES = 8


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tools.tiny_flux_kontext import build_tiny_flux_kontext_pipeline

    return build_tiny_flux_kontext_pipeline(tmp_path_factory.mktemp("kontext_gain") / "model", seed=0,
                                            vae_output_gain=8.0)


@pytest.fixture(scope="module")
def runs(model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("kontext_e2e")
    recipe = edit_recipe(tmp, model_dir, write_edit_records(tmp / "data"), model_adapter_path=json.dumps(ADAPTER_PATH),
                         guidance_scale="2.5", negative_prompt=None)
    return train_and_resume(recipe, tmp, ROLLOUTS)


def test_lora_resume_is_exact_and_the_sidecar_replays(runs):
    from trainer import artifacts
    from trainer.models.flux_kontext import FluxKontextAdapter

    ta = assert_lora_resume_is_exact(*runs, ADAPTER_PATH, CANDIDATES, task="i2i")
    assert any(n.startswith("single_transformer_blocks.") for n in ta)
    side = artifacts.iter_sidecars(runs[0] / "artifacts" / "i2i" / f"rollout_{LAST:07d}")[0]
    traj = artifacts.sidecar_to_trajectory(*artifacts.read_sidecar(side))
    FluxKontextAdapter().validate_trajectory(traj)
    assert traj.conditions["guidance"].tolist() == [2.5] * len(traj) and not traj.guided


def _fixed_input():
    from trainer.models.flux import guidance_tensor, text_ids
    from trainer.models.flux_kontext import kontext_img_ids

    g = torch.Generator().manual_seed(123)
    return dict(hidden_states=torch.randn(2, 8, 16, generator=g), encoder_hidden_states=torch.randn(2, 8, 32, generator=g),
                pooled_projections=torch.randn(2, 32, generator=g), timestep=torch.tensor([0.9, 0.4]),
                guidance=guidance_tensor(2.5, 2), txt_ids=text_ids(8), img_ids=kontext_img_ids(2, 2))


def test_export_round_trip_and_sample_with_source_images(runs, model_dir, tmp_path, capsys):
    from diffusers import FluxKontextPipeline

    from tools.sample import main as sample_main
    from trainer.models.flux_kontext import FluxKontextAdapter

    def sample(pipe):
        image = pipe(image=Image.new("RGB", (32, 32), (30, 40, 220)), prompt="make the square red", height=32,
                     width=32, max_area=32 * 32, _auto_resize=False, num_inference_steps=2, max_sequence_length=8,
                     guidance_scale=2.5, output_type="pt", generator=torch.Generator().manual_seed(0)).images
        assert image.shape == (1, 3, 32, 32)
        return image

    assert_export_round_trip(runs[0], model_dir, tmp_path, LAST, FluxKontextPipeline, FluxKontextAdapter(),
                             _fixed_input, sample, task="i2i")
    data = write_edit_records(tmp_path / "sample_data", n=2)
    out = tmp_path / "sampled"
    assert sample_main(["--model-path", str(model_dir), "--prompt-data", str(data), "--output-dir", str(out),
                        "--lora", str(runs[0] / "ckpt"), "--n-samples-per-prompt", "2", "--sampling-config",
                        json.dumps({"height": 16, "width": 16, "num_inference_steps": 2, "sde_indices": [1]})]) == 0
    assert len(list((out / "i2i" / "rollout_0000000").glob("*.png"))) == 4
    assert "wrote 4 PNGs and 2 sidecars" in capsys.readouterr().out

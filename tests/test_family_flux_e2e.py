"""FLUX.1 end to end: the real training loop under torchrun (2 gloo processes) on the tiny FLUX
model, two launches shared by every test here. A LoRA run of ROLLOUTS rollouts against a run
resumed from its first checkpoint for 1 more rollout (weights, policy version, lr step and the
images sampled after the resume identical); the long run's colour reward rises (a high learning
rate, a wide clip, every step trained, a decoder gain the tiny model can move fast); its last
checkpoint exported both ways and loaded back through diffusers (a merged FluxPipeline via
DiffusionPipeline.from_pretrained; the PEFT adapter via the pipeline's load_lora_weights) and
into the engine."""

from __future__ import annotations


import pytest
import torch

from tests.family_e2e import (assert_export_round_trip, assert_lora_resume_is_exact, color_rewards, lora_recipe,
                               train_and_resume)

pytestmark = pytest.mark.filterwarnings("ignore:FSDP2-wrapped module.*returned a view tensor")

ADAPTER_PATH = "trainer.models.flux.FluxAdapter"
#: the long run; the resumed one runs rollout 1 only
ROLLOUTS = 5
LAST = ROLLOUTS - 1
#: 16, not 8: the tiny model's colour reward moves by ~0.01-0.03 in 5 rollouts, and 8 candidates
#: a rollout left that within the noise of one seed (it fell at one, rose at others)
CANDIDATES = 16

#: 16x16 (a 2 x 2 token grid), 4 steps, every one trained (dance), FLUX.1-dev's embedded guidance
FLUX_SAMPLING = """
[sampling-config]
height = 16
width = 16
num_inference_steps = 4
guidance_scale = 3.5
eta = 1.0
sde_type = "dance"
sde_indices = [0, 1, 2, 3]
"""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The tiny FLUX model with its decoder's output scaled up: a small change of the latents moves
    the image's colour a lot, so a few rollouts raise the reward."""
    from tools.tiny_flux import build_tiny_flux_pipeline

    return build_tiny_flux_pipeline(tmp_path_factory.mktemp("flux_gain") / "model", seed=0, vae_output_gain=8.0)


@pytest.fixture(scope="module")
def runs(model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("flux_e2e")
    recipe = lora_recipe(tmp, model_dir, ADAPTER_PATH, candidates=CANDIDATES, rollouts=ROLLOUTS, lr=0.2,
                         sampling=FLUX_SAMPLING, name="flux_lora")
    return train_and_resume(recipe, tmp, ROLLOUTS)


def test_lora_resume_is_exact(runs):
    """Iteration 1 of the uninterrupted run and of the one resumed from iteration 0: the same
    adapter, policy version and lr step, and the rollout after the resume sampled the same images."""
    ta = assert_lora_resume_is_exact(*runs, ADAPTER_PATH, CANDIDATES)
    assert all("lora_" in n for n in ta)
    assert any(n.startswith("single_transformer_blocks.") for n in ta)


def test_tiny_flux_learns_the_colour_reward(runs):
    """The uninterrupted run's colour reward rises."""
    rewards = color_rewards(runs[0], ROLLOUTS)
    # rollout 0 samples the base model; rollouts 2.. the adapter after 2 or more updates. With
    # --generation-seed 1 and 2 as well the rise was +0.0095 and +0.0245 (+0.0115 here), so the
    # margin asked is half the smallest of the three
    assert sum(rewards[2:]) / len(rewards[2:]) > rewards[0] + 0.005, rewards


def _fixed_input():
    from trainer.models.flux import guidance_tensor, latent_image_ids, text_ids

    g = torch.Generator().manual_seed(123)
    return dict(hidden_states=torch.randn(2, 16, 16, generator=g), encoder_hidden_states=torch.randn(2, 8, 32, generator=g),
                pooled_projections=torch.randn(2, 32, generator=g), timestep=torch.tensor([0.9, 0.4]),
                guidance=guidance_tensor(3.5, 2), txt_ids=text_ids(8), img_ids=latent_image_ids(4, 4))


def test_export_round_trip_through_diffusers_and_the_engine(runs, model_dir, tmp_path):
    """The trained adapter of the last iteration three ways, all the same function: merged into a pipeline
    that DiffusionPipeline.from_pretrained loads (and that samples), the PEFT adapter through
    FluxPipeline.load_lora_weights, and the adapter synced into the native engine (sync parity:
    the engine then holds exactly the checkpoint's LoRA tensors)."""
    from diffusers import FluxPipeline

    from trainer.models.flux import FluxAdapter

    def sample(pipe):
        image = pipe("a red ball", height=32, width=32, num_inference_steps=2, max_sequence_length=8,
                     output_type="pt", generator=torch.Generator().manual_seed(0)).images
        assert image.shape == (1, 3, 32, 32)
        return image

    assert_export_round_trip(runs[0], model_dir, tmp_path, LAST, FluxPipeline, FluxAdapter(), _fixed_input, sample)

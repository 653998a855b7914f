"""Stable Diffusion 3.5 end to end: the real training loop under torchrun (2 gloo processes) on the
tiny SD3.5 model, sampling with true CFG (guidance 1.5, an empty negative prompt), two launches
shared by every test here. A LoRA run of ROLLOUTS rollouts against a run resumed from its first
checkpoint for 1 more rollout (weights, policy version, lr step and the images sampled after the
resume identical); the long run's colour reward rises (a high learning rate, a wide clip, every
step trained, a decoder the tiny model can move the colour of); its last checkpoint exported both
ways and loaded back through diffusers (a merged StableDiffusion3Pipeline via
DiffusionPipeline.from_pretrained; the PEFT adapter via the pipeline's load_lora_weights) and into
the engine."""

from __future__ import annotations


import pytest
import torch

from tests.family_e2e import (assert_export_round_trip, assert_lora_resume_is_exact, color_rewards, lora_recipe,
                               train_and_resume)

pytestmark = pytest.mark.filterwarnings("ignore:FSDP2-wrapped module.*returned a view tensor")

ADAPTER_PATH = "trainer.models.sd3.SD3Adapter"
#: the long run; the resumed one runs rollout 1 only
ROLLOUTS = 5
LAST = ROLLOUTS - 1
CANDIDATES = 16
GUIDANCE = 1.5

#: 8x8 (a 4 x 4 latent grid, 16 image tokens), 4 steps, every one trained (dance: "sde" is
#: singular at step 0), true CFG as StableDiffusion3Pipeline does it (no rescale)
SD3_SAMPLING = f"""
[sampling-config]
height = 8
width = 8
num_inference_steps = 4
guidance_scale = {GUIDANCE}
negative_prompt = ""
cfg_renorm = false
eta = 1.0
sde_type = "dance"
sde_indices = [0, 1, 2, 3]
"""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The tiny SD3.5 model with its decoder's output scaled up and one GroupNorm group: a small
    change of the latents moves the image's colour a lot, so a few rollouts raise the reward."""
    from tools.tiny_sd3 import build_tiny_sd3_pipeline

    return build_tiny_sd3_pipeline(tmp_path_factory.mktemp("sd3_gain") / "model", seed=0, vae_output_gain=8.0,
                                   vae_norm_groups=1)


@pytest.fixture(scope="module")
def runs(model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sd3_e2e")
    recipe = lora_recipe(tmp, model_dir, ADAPTER_PATH, candidates=CANDIDATES, rollouts=ROLLOUTS, lr=0.1,
                         sampling=SD3_SAMPLING, name="sd3_lora")
    return train_and_resume(recipe, tmp, ROLLOUTS)


def test_lora_resume_is_exact(runs):
    """Iteration 1 of the uninterrupted run and of the one resumed from iteration 0: the same
    adapter, policy version and lr step, and the rollout after the resume sampled the same images,
    under CFG (the sidecars carry the guidance and the negative prompt's conditions)."""
    from trainer import artifacts

    ta = assert_lora_resume_is_exact(*runs, ADAPTER_PATH, CANDIDATES)
    # the adapter, plus the DiT's one persistent buffer (the fixed sin-cos position table)
    assert {n for n in ta if "lora_" not in n} == {"pos_embed.pos_embed"}
    lora = [n for n in ta if "lora_" in n]
    assert {n.split(".")[1] for n in lora} == {"0", "1"} and not any(".attn2." in n for n in lora)
    db = runs[1] / "artifacts" / "t2i" / "rollout_0000001"
    tensors, meta = artifacts.read_sidecar(next(iter(artifacts.iter_sidecars(db))))
    assert float(meta["guidance_scale"]) == GUIDANCE
    assert {"conditions.negative_prompt_embeds", "conditions.negative_pooled_prompt_embeds"} <= set(tensors)


def test_tiny_sd3_learns_the_colour_reward(runs):
    """The uninterrupted run's colour reward rises."""
    rewards = color_rewards(runs[0], ROLLOUTS)
    # rollout 0 samples the base model; rollouts 2.. the adapter after 2 or more updates
    assert sum(rewards[2:]) / len(rewards[2:]) > rewards[0] + 0.03, rewards


def _fixed_input():
    g = torch.Generator().manual_seed(123)
    return dict(hidden_states=torch.randn(2, 4, 4, 4, generator=g), encoder_hidden_states=torch.randn(2, 8, 32, generator=g),
                pooled_projections=torch.randn(2, 32, generator=g), timestep=torch.tensor([900.0, 400.0]))


def test_export_round_trip_through_diffusers_and_the_engine(runs, model_dir, tmp_path):
    """The trained adapter of the last iteration three ways, all the same function: merged into a
    pipeline that DiffusionPipeline.from_pretrained loads (and that samples with CFG), the PEFT
    adapter through StableDiffusion3Pipeline.load_lora_weights, and the adapter loaded into the
    native engine (which then holds exactly the checkpoint's LoRA tensors)."""
    from diffusers import StableDiffusion3Pipeline

    from trainer.models.sd3 import SD3Adapter

    def sample(pipe):
        pipe.set_progress_bar_config(disable=True)
        image = pipe("a red ball", negative_prompt="", guidance_scale=GUIDANCE, height=16, width=16,
                     num_inference_steps=2, max_sequence_length=8, output_type="pt",
                     generator=torch.Generator().manual_seed(0)).images
        assert image.shape == (1, 3, 16, 16)
        return image

    assert_export_round_trip(runs[0], model_dir, tmp_path, LAST, StableDiffusion3Pipeline, SD3Adapter(), _fixed_input,
                             sample)

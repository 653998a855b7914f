"""FLUX.1-Kontext on its tiny offline model: the source latents are concatenated to the image
tokens with Kontext's position ids as FluxKontextPipeline does, the embedded guidance is
recorded and replayed, replay == sampler in fp32, the first update's ratio is 1 and every
parameter trains."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from PIL import Image

from trainer.models import flux_kontext as fk

pytestmark = pytest.mark.filterwarnings("ignore:FSDP2-wrapped module.*returned a view tensor")

SAMPLING = {"height": 32, "width": 32, "num_inference_steps": 4, "guidance_scale": 2.5, "eta": 1.0,
            "sde_type": "sde", "sde_indices": [1, 2]}


@pytest.fixture(scope="module")
def kontext_dir(tmp_path_factory):
    from tools.tiny_flux_kontext import build_tiny_flux_kontext_pipeline

    return build_tiny_flux_kontext_pipeline(tmp_path_factory.mktemp("tiny_kontext") / "model", seed=0)


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    d = tmp_path_factory.mktemp("ksources")
    paths = []
    for name, colour in (("red", (220, 30, 30)), ("blue", (30, 30, 220))):
        im = Image.new("RGB", (48, 40), (240, 240, 240))
        im.paste(Image.new("RGB", (20, 20), colour), (10, 10))
        im.save(d / f"{name}.png")
        paths.append(str(d / f"{name}.png"))
    return paths


@pytest.fixture(scope="module")
def adapter():
    return fk.FluxKontextAdapter()


@pytest.fixture(scope="module")
def engine(kontext_dir, adapter):
    from trainer.engine.native import NativeEngine

    return NativeEngine(str(kontext_dir), device="cpu", dtype=torch.float32, adapter=adapter, max_sequence_length=32)


def make_requests(adapter, engine, media, group_size=2):
    from trainer.sampling import parse_sampling_config

    sampling = parse_sampling_config(SAMPLING)
    sigmas = engine.sigma_schedule(sampling.height, sampling.width, sampling.num_inference_steps)
    return [dataclasses.replace(adapter.build_rollout_request(
        "<image> make the square green", group_index=g, slot=s, sample_id=f"p{g}:s{s}", sampling=sampling,
        sde_indices=list(sampling.sde_indices), sigmas=sigmas, generation_seed=3), media=list(src))
        for g, src in enumerate(media) for s in range(group_size)]


@pytest.fixture(scope="module")
def batch(engine, adapter, sources):
    return engine.generate(make_requests(adapter, engine, [[sources[0]], [sources[1]]]))


def test_picked_from_model_index_and_paired_with_i2i(kontext_dir):
    from trainer.config import EDIT_ADAPTERS, adapter_for_model_dir

    path = adapter_for_model_dir(kontext_dir)
    assert path == "trainer.models.flux_kontext.FluxKontextAdapter" and path in EDIT_ADAPTERS


def test_conditioning_and_velocity_are_the_kontext_pipelines(engine, adapter, sources):
    """FluxKontextPipeline's own DiT call (source at the output size) sees our text conditions,
    source latents and ids, and our velocity is its output over the target tokens."""
    from trainer.models.edit_source import open_source_image, resized_source
    from trainer.trajectory import Geometry, SamplerSettings

    pipe = engine.prompt_encoder.pipe
    pipe.set_progress_bar_config(disable=True)
    seen = []

    def hook(module, args, kwargs, out):
        seen.append(({k: v.clone() if torch.is_tensor(v) else v for k, v in kwargs.items()}, out[0].clone()))

    image = resized_source(open_source_image(sources[0]), 32, 32)
    handle = engine.transformer.register_forward_hook(hook, with_kwargs=True)
    try:
        with torch.no_grad():
            pipe(image=image, prompt="make the square green", height=32, width=32, max_area=32 * 32,
                 _auto_resize=False, guidance_scale=2.5, num_inference_steps=2, max_sequence_length=32,
                 output_type="latent", generator=torch.Generator().manual_seed(0))
    finally:
        handle.remove()
    kw, out = seen[0]
    ours = engine.encode_condition("<image> make the square green", [sources[0]], (32, 32))
    n = 4 * 4
    assert torch.equal(ours["prompt_embeds"], kw["encoder_hidden_states"][0])
    assert torch.equal(ours["pooled_prompt_embeds"], kw["pooled_projections"][0])
    assert torch.equal(ours["image_latents"], kw["hidden_states"][0, n:])
    assert torch.equal(fk.kontext_img_ids(4, 4), kw["img_ids"])
    conds = {k: v[None] for k, v in ours.items()}
    conds["guidance"] = torch.full((1,), 2.5)
    with torch.no_grad():
        v = adapter.velocity(engine.transformer, kw["hidden_states"][:, :n], kw["timestep"] * 1000, conds,
                             Geometry(32, 32, 4, media=("image",)), SamplerSettings(4, 1.0))
    torch.testing.assert_close(v, out[:, :n], rtol=0, atol=1e-6)


def test_rollout_records_the_source_and_the_guidance(adapter, batch):
    adapter.validate_trajectory(batch)
    c = batch.conditions
    assert set(c) == {"prompt_embeds", "pooled_prompt_embeds", "guidance", "image_latents"}
    assert c["image_latents"].shape == batch.latents.shape[:1] + batch.latents.shape[2:]
    assert torch.equal(c["image_latents"][0], c["image_latents"][1])
    assert not torch.equal(c["image_latents"][0], c["image_latents"][2])
    assert c["guidance"].tolist() == [2.5] * 4 and not batch.guided and batch.geometry.media == ("image",)


def test_replay_reproduces_the_sampler_and_the_first_update_trains_everything(kontext_dir, adapter, batch, sources):
    from tests.dist.tiny import full_params, make_cfg, one_rank_mesh
    from trainer.actor import Actor
    from trainer.core.names import model_name
    from trainer.engine.native import NativeEngine
    from trainer.loop import make_replay_fn
    from trainer.weight_sync import WeightSyncer

    actor_model = adapter.load_train_model(str(kontext_dir), dtype=torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(adapter.replay_transitions(actor_model, batch), batch.log_probs, atol=1e-5, rtol=0)
        other = dict(batch.conditions, image_latents=batch.conditions["image_latents"].flip(0))
        moved = adapter.replay_transitions(actor_model, dataclasses.replace(batch, conditions=other))
        assert (moved - batch.log_probs).abs().max() > 1e-4
    gen = one_rank_mesh()
    mesh = next(gen)
    try:
        actor = Actor.from_adapter(adapter, str(kontext_dir), mesh, make_cfg("full", optim__lr=1e-3),
                                   device=torch.device("cpu"))
        before = full_params(actor.model)
        actor.train_step(batch.without_images(), torch.tensor([1.0, -1.0, 0.5, -0.5]), make_replay_fn(adapter))
        after = full_params(actor.model)
        first = actor.last_update_stats[0]
        assert first["ratio_max"].item() == 1.0 == first["ratio_min"].item()
        trainable = {model_name(n) for n, p in actor.model.named_parameters() if p.requires_grad}
        assert trainable == set(before) and [n for n in trainable if torch.equal(before[n], after[n])] == []
        # sync parity: a fresh engine given the new weights holds them and samples what the actor replays
        fresh = NativeEngine(str(kontext_dir), device="cpu", dtype=torch.float32, adapter=adapter,
                             max_sequence_length=32)
        WeightSyncer("full", wire_dtype="fp32", name_map=adapter.weight_name_map).sync(actor.model, fresh)
        held = {n: p.detach() for n, p in fresh.transformer.named_parameters()}
        assert all(torch.equal(held[n], t) for n, t in after.items())
        nxt = fresh.generate(make_requests(adapter, fresh, [[sources[1]]]))
        with torch.no_grad():
            torch.testing.assert_close(make_replay_fn(adapter)(actor.model, nxt), nxt.log_probs, atol=1e-5, rtol=0)
    finally:
        next(gen, None)


def test_one_source_per_record(engine, adapter, sources):
    with pytest.raises(ValueError, match="edits one source image, a record gave 2"):
        engine.generate(make_requests(adapter, engine, [sources], group_size=1))


def test_the_kontext_recipe_passes_preflight_at_8_ranks(kontext_dir, sources, tmp_path, monkeypatch):
    import json
    from pathlib import Path

    from trainer.config import load_config
    from trainer.preflight import validate

    for var in ("MODEL_DIR", "DATA_DIR", "EXP_DIR"):
        monkeypatch.setenv(var, str(tmp_path / var.lower()))
    data = tmp_path / "edit.jsonl"
    data.write_text(json.dumps({"prompt": "<image> make the square red", "images": [sources[0]],
                                "metadata": {"task": "i2i", "sample_id": "e0"}}) + "\n")
    recipe = Path(__file__).resolve().parents[1] / "configs" / "flux1kontext_i2i_lora_8gpu.toml"
    validate(load_config(["--config", str(recipe), "--model-path", str(kontext_dir), "--prompt-data", str(data),
                          "--eval-prompt-data", "none", "--artifact-root", str(tmp_path / "a"),
                          "--save", str(tmp_path / "c"), "--tensorboard-dir", str(tmp_path / "tb"),
                          "--media-root", str(Path(sources[0]).parent)]), 8)

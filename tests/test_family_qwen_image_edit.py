"""Qwen-Image-Edit (2511 "plus" layout) on its tiny offline model: the adapter conditions as
QwenImageEditPlusPipeline does (the VL encoder sees the source, the source latents join the DiT
sequence, true CFG's negative branch sees the source too), the engine encodes a source once per
record and keys its cache by prompt AND media, and the contracts of the other families hold
(replay == sampler in fp32 with and without CFG, ratio 1 on the first update, every trainable
parameter trained, sidecar round trip)."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
from PIL import Image

from trainer.models import qwen_image_edit as qe

pytestmark = pytest.mark.filterwarnings("ignore:FSDP2-wrapped module.*returned a view tensor")

SAMPLING = {"height": 32, "width": 32, "num_inference_steps": 4, "eta": 1.0, "sde_type": "sde",
            "sde_indices": [1, 2]}


@pytest.fixture(scope="module")
def edit_dir(tmp_path_factory):
    from tools.tiny_qwen_image_edit import build_tiny_qwen_image_edit_pipeline

    return build_tiny_qwen_image_edit_pipeline(tmp_path_factory.mktemp("tiny_edit") / "model", seed=0, variant="2511")


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """Two source files differing only in colour, and a byte-identical copy of the first."""
    d = tmp_path_factory.mktemp("sources")
    paths = []
    for name, colour in (("red", (220, 30, 30)), ("blue", (30, 30, 220))):
        im = Image.new("RGB", (40, 40), (240, 240, 240))
        im.paste(Image.new("RGB", (20, 20), colour), (10, 10))
        im.save(d / f"{name}.png")
        paths.append(str(d / f"{name}.png"))
    (d / "copy.png").write_bytes((d / "red.png").read_bytes())
    return paths + [str(d / "copy.png")]


@pytest.fixture(scope="module")
def adapter():
    return qe.QwenImageEditAdapter()


@pytest.fixture(scope="module")
def engine(edit_dir, adapter):
    from trainer.engine.native import NativeEngine

    return NativeEngine(str(edit_dir), device="cpu", dtype=torch.float32, adapter=adapter)


def make_requests(adapter, engine, sampling_over, media, group_size=2, prompt="<image> make the square green"):
    from trainer.sampling import parse_sampling_config

    sampling = parse_sampling_config({**SAMPLING, **sampling_over})
    sigmas = engine.sigma_schedule(sampling.height, sampling.width, sampling.num_inference_steps)
    reqs = []
    for g, src in enumerate(media):
        for s in range(group_size):
            r = adapter.build_rollout_request(prompt, group_index=g, slot=s, sample_id=f"p{g}:s{s}", sampling=sampling,
                                              sde_indices=list(sampling.sde_indices), sigmas=sigmas, generation_seed=5)
            reqs.append(dataclasses.replace(r, media=[src]))
    return reqs


@pytest.fixture(scope="module")
def batches(engine, adapter, sources):
    """{guided: Trajectory}: two records (red, blue source) x 2 candidates, without and with CFG."""
    out = {}
    for guided, over in ((False, {}), (True, {"guidance_scale": 4.0, "negative_prompt": " "})):
        out[guided] = engine.generate(make_requests(adapter, engine, over, sources[:2]))
        out[guided, "stats"] = dict(engine.last_stats)
    return out


def test_picked_from_model_index(edit_dir):
    from trainer.config import adapter_for_model_dir

    assert adapter_for_model_dir(edit_dir) == "trainer.models.qwen_image_edit.QwenImageEditAdapter"


def test_instruction_drops_placeholders():
    assert qe.instruction_text("<image> make the circle red") == "make the circle red"
    assert qe.instruction_text("<image><image>swap  them") == "swap them"


def test_conditioning_and_velocity_are_the_edit_plus_pipelines(edit_dir, engine, adapter, sources, monkeypatch):
    """With the pipeline's VAE size set to the output size, QwenImageEditPlusPipeline's own DiT
    call sees exactly our text conditioning and source latents, and our velocity (conditional
    and true-CFG) is its output over the target tokens."""
    import diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus as edit_plus

    from trainer.models.causal_conv import install_single_frame_convs
    from trainer.models.edit_source import open_source_image
    from trainer.trajectory import Geometry, SamplerSettings

    monkeypatch.setattr(edit_plus, "VAE_IMAGE_SIZE", 32 * 32)
    pipe = engine.prompt_encoder.pipe
    # the engine's VAE runs a frame's causal 3-D convolutions as 2-D ones (tests/test_causal_conv.py
    # checks them against diffusers'); the pipeline shares that VAE, so the bytes compare here
    install_single_frame_convs(pipe.vae)
    pipe.set_progress_bar_config(disable=True)
    calls = []

    def hook(module, args, kwargs, out):
        calls.append(({k: v.clone() if torch.is_tensor(v) else v for k, v in kwargs.items()}, out[0].clone()))

    image = open_source_image(sources[0])
    handle = engine.transformer.register_forward_hook(hook, with_kwargs=True)
    try:
        with torch.no_grad():
            pipe(image=[image], prompt="make the square green", negative_prompt=" ", true_cfg_scale=4.0,
                 height=32, width=32, num_inference_steps=2, output_type="latent",
                 generator=torch.Generator().manual_seed(0))
    finally:
        handle.remove()
    (cond_kw, cond_out), (neg_kw, neg_out) = calls[0], calls[1]
    ours = engine.encode_condition("<image> make the square green", [sources[0]], (32, 32))
    neg = engine.encode_condition(" ", [sources[0]], (32, 32))
    n = 4 * 4  # 32 px / VAE 4 / 2 x 2 packing
    assert torch.equal(ours["prompt_embeds"], cond_kw["encoder_hidden_states"][0])
    assert torch.equal(neg["prompt_embeds"], neg_kw["encoder_hidden_states"][0])
    assert torch.equal(ours["image_latents"], cond_kw["hidden_states"][0, n:])
    assert [tuple(s) for s in cond_kw["img_shapes"][0]] == [(1, 4, 4), (1, 4, 4)]
    geom = Geometry(32, 32, 4, media=("image",))
    x, t = cond_kw["hidden_states"][:, :n], cond_kw["timestep"] * 1000
    conds = {k: v[None] for k, v in ours.items()}
    with torch.no_grad():
        v = adapter.velocity(engine.transformer, x, t, conds, geom, SamplerSettings(4, 1.0))
        torch.testing.assert_close(v, cond_out[:, :n], rtol=0, atol=1e-6)
        guided = dict(conds, negative_prompt_embeds=neg["prompt_embeds"][None],
                      negative_prompt_embeds_mask=neg["prompt_embeds_mask"][None])
        vg = adapter.velocity(engine.transformer, x, t, guided, geom,
                              SamplerSettings(4, 1.0, guidance_scale=4.0, negative_prompt=" ", cfg_renorm=True))
    c, u = cond_out[:, :n], neg_out[:, :n]
    comb = u + 4.0 * (c - u)
    torch.testing.assert_close(vg, comb * (c.norm(dim=-1, keepdim=True) / comb.norm(dim=-1, keepdim=True)),
                               rtol=1e-5, atol=1e-5)


def test_condition_cache_is_keyed_by_prompt_and_media(engine, adapter, batches, sources):
    """Two sources under one instruction are two conditions; a group shares one; CFG encodes its
    negative once per source; a byte-identical copy under another name is the same condition."""
    assert batches[False, "stats"]["prompts_encoded"] == 2.0
    assert batches[True, "stats"]["prompts_encoded"] == 4.0
    b = batches[False]
    c = b.conditions
    assert c["image_latents"].shape == (4, 16, 16) and b.geometry.media == ("image",)
    assert torch.equal(c["image_latents"][0], c["image_latents"][1])
    assert not torch.equal(c["image_latents"][0], c["image_latents"][2])
    assert not torch.equal(c["prompt_embeds"][0], c["prompt_embeds"][2])  # the VL encoder saw the source
    g = batches[True].conditions
    assert "negative_image_latents" not in g and "negative_prompt_embeds" in g
    assert not torch.equal(g["negative_prompt_embeds"][0], g["negative_prompt_embeds"][2])
    engine.generate(make_requests(adapter, engine, {}, [sources[0], sources[2]]))
    assert engine.last_stats["prompts_encoded"] == 1.0
    adapter.validate_trajectory(b)


def test_cfg_vae_encodes_each_source_once_and_samples_as_the_whole_condition_path(engine, adapter, sources,
                                                                                  monkeypatch):
    """Under true CFG the VAE encodes each distinct source once per rollout (the instruction's and
    the negative's conditions share its latents; only the VL encoder runs per prompt), and the
    rollout is bit for bit the one sampled from conditions encoded whole, one per prompt and
    source (each with its own VAE encode of the source, the instruction's latents recorded)."""
    from trainer.core.media_key import condition_key
    from trainer.models.edit_source import load_source

    vae = engine.prompt_encoder.pipe.vae
    encoded = []
    real_encode = vae.encode

    def counting_encode(x, *args, **kwargs):
        encoded.append(tuple(x.shape))
        return real_encode(x, *args, **kwargs)

    monkeypatch.setattr(vae, "encode", counting_encode)
    reqs = make_requests(adapter, engine, {"guidance_scale": 4.0, "negative_prompt": " "}, sources[:2])
    traj = engine.generate(reqs)  # 2 records x 2 candidates, both CFG branches
    assert len(encoded) == 2 and engine.last_stats["sources_encoded"] == 2.0
    assert engine.last_stats["prompts_encoded"] == 4.0

    conds, keys, neg_keys = {}, [], []
    for r in reqs:
        for prompt, out in ((r.prompt, keys), (r.negative_prompt, neg_keys)):
            key = condition_key(prompt, [load_source(p).key for p in r.media], (r.height, r.width))
            if key not in conds:
                conds[key] = engine.encode_condition(prompt, r.media, (r.height, r.width))
            out.append(key)
    assert len(encoded) == 2 + 4  # whole conditions: a VAE encode per prompt and source
    for k, n in zip(keys, neg_keys):  # the negative's own latents are the instruction's, bit for bit
        assert torch.equal(conds[k]["image_latents"], conds[n]["image_latents"])
    with torch.no_grad():
        whole = engine._generate_chunk(reqs, conds, keys, neg_keys)
    for name in ("latents", "next_latents", "log_probs", "images"):
        assert torch.equal(getattr(traj, name), getattr(whole, name)), name
    assert traj.conditions.keys() == whole.conditions.keys()
    assert all(torch.equal(traj.conditions[k], whole.conditions[k]) for k in traj.conditions)


def test_replay_reproduces_the_sampler_fp32_with_and_without_cfg(edit_dir, adapter, batches):
    actor = adapter.load_train_model(str(edit_dir), dtype=torch.float32)
    with torch.no_grad():
        for guided in (False, True):
            b = batches[guided]
            assert b.guided == guided
            torch.testing.assert_close(adapter.replay_transitions(actor, b), b.log_probs, atol=1e-5, rtol=0)
            parts = [adapter.replay_transition(actor, b[idx], 1) for idx in ([0], [1, 2], slice(3, 4))]
            torch.testing.assert_close(torch.cat(parts), b.log_probs[:, 1], atol=1e-5, rtol=0)
        # the recorded source latents are what the replay conditions on
        b = batches[False]
        other = dict(b.conditions, image_latents=b.conditions["image_latents"].flip(0))
        moved = adapter.replay_transitions(actor, dataclasses.replace(b, conditions=other))
        assert (moved - b.log_probs).abs().max() > 1e-4


def test_sidecar_round_trip_replays_the_same(batches, adapter, edit_dir, tmp_path):
    from trainer import artifacts
    from trainer.sampling import parse_sampling_config

    b = batches[True]
    rows = b.rows_of_group(1)
    path = artifacts.write_group_sidecar(tmp_path / "g.safetensors", b[rows], task="i2i", rollout_id=0,
                                         sampling=parse_sampling_config({**SAMPLING, "guidance_scale": 4.0}))
    back = artifacts.sidecar_to_trajectory(*artifacts.read_sidecar(path))
    assert back.geometry.media == ("image",) and back.guided
    adapter.validate_trajectory(back)
    actor = adapter.load_train_model(str(edit_dir), dtype=torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(adapter.replay_transitions(actor, back), b.log_probs[rows], atol=1e-5, rtol=0)


def test_first_update_is_ratio_one_and_trains_every_parameter(edit_dir, adapter, batches, sources):
    """The first update's ratio is exactly 1 and every trainable parameter changes (full with CFG,
    LoRA without); then sync parity: the new weights synced (full / adapter) into a fresh engine
    are the actor's, and what that engine samples next the actor replays exactly."""
    from tests.dist.tiny import full_params, make_cfg, one_rank_mesh
    from trainer.actor import Actor
    from trainer.core.names import model_name, strip_wrapper_segments
    from trainer.engine.native import NativeEngine
    from trainer.loop import make_replay_fn
    from trainer.weight_sync import WeightSyncer

    gen = one_rank_mesh()
    mesh = next(gen)
    try:
        for mode, guided in (("full", True), ("lora", False)):
            over = {"optim__lr": 1e-2, "fsdp__fsdp_master_dtype": "fp32"} if mode == "lora" else {"optim__lr": 1e-3}
            actor = Actor.from_adapter(adapter, str(edit_dir), mesh, make_cfg(mode, **over), device=torch.device("cpu"))
            before = full_params(actor.model)
            actor.train_step(batches[guided].without_images(), torch.tensor([1.0, -1.0, 0.5, -0.5]),
                             make_replay_fn(adapter))
            after = full_params(actor.model)
            first = actor.last_update_stats[0]
            assert first["ratio_max"].item() == 1.0 == first["ratio_min"].item()
            trainable = {model_name(n) for n, p in actor.model.named_parameters() if p.requires_grad}
            unchanged = sorted(n for n in trainable if torch.equal(before[n], after[n]))
            assert trainable and unchanged == [], unchanged
            if mode == "full":
                assert trainable == set(before) - set(actor.never_trained)
            else:
                assert all(".lora_" in n for n in trainable)
            fresh = NativeEngine(str(edit_dir), device="cpu", dtype=torch.float32, adapter=adapter)
            syncer = WeightSyncer("full" if mode == "full" else "adapter", wire_dtype="fp32",
                                  name_map=adapter.weight_name_map, lora_config=actor.lora_config)
            syncer.sync(actor.model, fresh)
            held = {strip_wrapper_segments(n): p.detach() for n, p in fresh.transformer.named_parameters()}
            synced = {strip_wrapper_segments(n): t for n, t in after.items() if n in trainable}
            assert synced and all(torch.equal(held[n], t) for n, t in synced.items())
            over = {"guidance_scale": 4.0, "negative_prompt": " "} if guided else {}
            nxt = fresh.generate(make_requests(adapter, fresh, over, sources[:1]))
            with torch.no_grad():
                torch.testing.assert_close(make_replay_fn(adapter)(actor.model, nxt), nxt.log_probs, atol=1e-5, rtol=0)
    finally:
        next(gen, None)


def test_text_family_refuses_source_images_and_edit_needs_them(tiny_model_dir, engine, adapter, sources):
    from trainer.engine.native import NativeEngine
    from trainer.models.qwen_image import QwenImageAdapter

    t2i = NativeEngine(str(tiny_model_dir), device="cpu", dtype=torch.float32, adapter=QwenImageAdapter())
    with pytest.raises(ValueError, match="takes no source images"):
        t2i.generate(make_requests(QwenImageAdapter(), t2i, {}, sources[:1], group_size=1))
    with pytest.raises(ValueError, match="source images"):
        engine.generate(make_requests(adapter, engine, {}, [], group_size=1) or
                        [dataclasses.replace(make_requests(adapter, engine, {}, sources[:1], group_size=1)[0], media=[])])
    with pytest.raises(FileNotFoundError, match="does not exist"):
        engine.generate(make_requests(adapter, engine, {}, [sources[0] + ".gone"], group_size=1))


# ------------------------------------------------------------------------- the task in preflight and recipes


def _edit_argv(model_dir, prompts, tmp_path, task="i2i", adapter=None):
    import json

    return ["--model-path", str(model_dir), "--prompt-data", str(prompts), "--actor-num-gpus-per-node", "1",
            "--rollout-batch-size", "1", "--n-samples-per-prompt", "2", "--global-batch-size", "2",
            "--micro-batch-size", "1", "--sampling-config", json.dumps(SAMPLING), "--generation-task", task,
            "--num-rollout", "1", "--reward-scorer-path", "color_edit", "--reward-runtime", "cpu",
            "--artifact-root", str(tmp_path / "a"), *(["--model-adapter-path", adapter] if adapter else [])]


def test_preflight_pairs_i2i_with_an_edit_family_and_records_with_images(edit_dir, tiny_model_dir, sources, tmp_path):
    import json

    from trainer.config import load_config
    from trainer.preflight import PreflightError, validate

    good = tmp_path / "edit.jsonl"
    good.write_text(json.dumps({"prompt": "<image> make the square red", "images": [sources[1]],
                                "metadata": {"task": "i2i", "sample_id": "e0"}}) + "\n")
    # the shared sources lie outside the prompt file's directory: named as its media root
    cfg = load_config(_edit_argv(edit_dir, good, tmp_path) + ["--media-root", os.path.dirname(sources[1])])
    assert cfg.model.model_adapter_path == "trainer.models.qwen_image_edit.QwenImageEditAdapter"  # model_index.json
    validate(cfg, 1)  # raises on any problem

    def problems(argv):
        with pytest.raises(PreflightError) as e:
            validate(load_config(argv), 1)
        return str(e.value)

    t2i = tmp_path / "t2i.jsonl"
    t2i.write_text(json.dumps({"prompt": "a red ball", "metadata": {"task": "t2i", "sample_id": "p0"}}) + "\n")
    assert "--model-adapter-path trainer.models.qwen_image_edit.QwenImageEditAdapter is an image-editing family" \
        in problems(_edit_argv(edit_dir, t2i, tmp_path, task="t2i"))
    # an edit scorer on a text-to-image run: nothing to compare the image against
    msg = problems(_edit_argv(tiny_model_dir, t2i, tmp_path, task="t2i"))
    assert "scores an edit against its source images, but --generation-task t2i has no source" in msg
    msg = problems(_edit_argv(tiny_model_dir, good, tmp_path))
    assert "--generation-task i2i needs an image-editing family, but --model-adapter-path " \
           "trainer.models.qwen_image.QwenImageAdapter is a text-to-image one" in msg
    bare = tmp_path / "bare.jsonl"
    bare.write_text(json.dumps({"prompt": "make it red", "metadata": {"task": "i2i", "sample_id": "e1"}}) + "\n")
    msg = problems(_edit_argv(edit_dir, bare, tmp_path))
    assert f"--prompt-data: 1 record(s) have no source image (e.g. {bare}:1)" in msg and "--source edit" in msg
    gone = tmp_path / "gone.jsonl"
    gone.write_text(json.dumps({"prompt": "<image> make it red", "images": ["nowhere.png"],
                                "metadata": {"task": "i2i", "sample_id": "e2"}}) + "\n")
    msg = problems(_edit_argv(edit_dir, gone, tmp_path))
    assert "--prompt-data: 1 source image(s) no rollout can use" in msg and "nowhere.png does not exist" in msg


def test_shipped_edit_recipes_load_and_name_the_edit_family(edit_dir, sources, tmp_path, monkeypatch):
    """configs/qwen_image_edit_i2i_lora_8gpu.toml parses into an i2i run of the edit family with
    the edit judge and true CFG and passes preflight at 8 ranks; configs/tiny_cpu_edit.toml passes
    it on the tiny model (the end-to-end tests run it); configs/flux1kontext_i2i_lora_8gpu.toml
    names Kontext with its embedded guidance (tests/test_family_flux_kontext.py checks it)."""
    import json
    from pathlib import Path

    from trainer.config import load_config, resolve_scorer_path
    from trainer.preflight import validate

    root = Path(__file__).resolve().parents[1] / "configs"
    for var in ("MODEL_DIR", "DATA_DIR", "EXP_DIR"):
        monkeypatch.setenv(var, str(tmp_path / var.lower()))
    cfg = load_config(["--config", str(root / "qwen_image_edit_i2i_lora_8gpu.toml")])
    assert cfg.model.generation_task == "i2i"
    assert cfg.model.model_adapter_path == "trainer.models.qwen_image_edit.QwenImageEditAdapter"
    assert resolve_scorer_path(cfg.reward.reward_scorer_path) == "trainer.rewards.edit.EditJudgeScorer"
    assert cfg.rollout.sampling_config["guidance_scale"] == 4.0 and cfg.lora.lora_rank == 64
    data = tmp_path / "edit.jsonl"
    data.write_text(json.dumps({"prompt": "<image> make the square red", "images": [sources[1]],
                                "metadata": {"task": "i2i", "sample_id": "e0"}}) + "\n")
    outputs = ["--prompt-data", str(data), "--artifact-root", str(tmp_path / "a"), "--save", str(tmp_path / "c"),
               "--tensorboard-dir", str(tmp_path / "tb"), "--media-root", str(Path(sources[1]).parent)]
    validate(load_config(["--config", str(root / "tiny_cpu_edit.toml"), "--model-path", str(edit_dir), *outputs]), 2)
    # the 8-device recipe's geometry and flags pass preflight at its world size (the tiny model standing in)
    validate(load_config(["--config", str(root / "qwen_image_edit_i2i_lora_8gpu.toml"), "--model-path", str(edit_dir),
                          "--eval-prompt-data", "none", *outputs]), 8)
    kontext = load_config(["--config", str(root / "flux1kontext_i2i_lora_8gpu.toml")])
    assert kontext.model.generation_task == "i2i"
    assert kontext.model.model_adapter_path == "trainer.models.flux_kontext.FluxKontextAdapter"
    assert kontext.rollout.sampling_config["guidance_scale"] == 2.5


def test_rollout_hands_each_record_its_sources_and_the_scorers_their_pixels(engine, adapter, sources, tmp_path):
    """generate_rollout gives an editing family each record's images (the sidecar keeps their
    paths), and the loop's scorer inputs carry the pixels the engine encoded, decoded once per
    record and shared by its candidates; the colour-edit scorer scores from them."""
    import numpy as np

    from trainer import artifacts
    from trainer.loop import _scorer_inputs
    from trainer.models.edit_source import SOURCE_PATHS_KEY, source_pixels
    from trainer.rewards.base import SOURCE_IMAGES_KEY
    from trainer.rewards.edit import ColorEditScorer
    from trainer.rollout import generate_rollout
    from trainer.sampling import parse_sampling_config

    records = [{"prompt": "<image> make the square red", "images": [src],
                "metadata": {"task": "i2i", "sample_id": f"e{i}"}} for i, src in enumerate(sources[:2])]
    out = generate_rollout(engine, adapter, records, rollout_id=0, sampling=parse_sampling_config(SAMPLING),
                           group_size=2, generation_seed=3, artifact_root=tmp_path / "art", task="i2i")
    traj = out.trajectory
    assert traj.geometry.media == ("image",) and [m[SOURCE_PATHS_KEY] for m in traj.metadata] == \
        [[sources[0]]] * 2 + [[sources[1]]] * 2
    images, prompts, metadata = _scorer_inputs(traj)
    pix = [m[SOURCE_IMAGES_KEY][0] for m in metadata]
    assert pix[0] is pix[1] and pix[2] is pix[3] and pix[0].shape == (32, 32, 3) and pix[0].dtype == np.uint8
    assert np.array_equal(pix[0], source_pixels(sources[0], 32, 32)) and not np.array_equal(pix[0], pix[2])
    assert SOURCE_IMAGES_KEY not in traj.metadata[0]  # the trajectory (and its sidecar) keeps paths, not pixels
    assert all(SOURCE_PATHS_KEY not in m for m in metadata)  # a (remote) scorer gets pixels, never file names
    from trainer.rewards.base import ImageBatch

    scores = ColorEditScorer().score(ImageBatch.from_any(images), prompts, metadata)["color_edit"]
    assert scores.shape == (4,) and bool(((scores >= 0) & (scores <= 1)).all())
    side = artifacts.iter_sidecars(out.artifact_dir)[0]
    back = artifacts.sidecar_to_trajectory(*artifacts.read_sidecar(side))
    assert back.metadata[0][SOURCE_PATHS_KEY] == [sources[0]] and torch.equal(
        back.conditions["image_latents"], traj.conditions["image_latents"][:2])


def test_two_sources_per_record_condition_as_the_pipeline_and_replay(edit_dir, engine, adapter, sources, monkeypatch):
    """A record with two sources: the VL encoder sees "Picture 1 ... Picture 2" and both images,
    the DiT both latent grids after the target (img_shapes target, source 1, source 2), as
    QwenImageEditPlusPipeline feeds it; the replay equals the sampler."""
    import diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus as edit_plus

    from trainer.models.causal_conv import install_single_frame_convs
    from trainer.models.edit_source import open_source_image

    monkeypatch.setattr(edit_plus, "VAE_IMAGE_SIZE", 32 * 32)
    pipe = engine.prompt_encoder.pipe
    # the engine's VAE runs a frame's causal 3-D convolutions as 2-D ones (tests/test_causal_conv.py
    # checks them against diffusers'); the pipeline shares that VAE, so the bytes compare here
    install_single_frame_convs(pipe.vae)
    pipe.set_progress_bar_config(disable=True)
    seen = []
    handle = engine.transformer.register_forward_hook(
        lambda m, a, kw, out: seen.append({k: v.clone() if torch.is_tensor(v) else v for k, v in kw.items()}),
        with_kwargs=True)
    try:
        with torch.no_grad():
            pipe(image=[open_source_image(p) for p in sources[:2]], prompt="swap their colours", height=32, width=32,
                 num_inference_steps=2, true_cfg_scale=1.0, output_type="latent",
                 generator=torch.Generator().manual_seed(0))
    finally:
        handle.remove()
    ours = engine.encode_condition("<image><image> swap their colours", sources[:2], (32, 32))
    assert torch.equal(ours["prompt_embeds"], seen[0]["encoder_hidden_states"][0])
    assert torch.equal(ours["image_latents"], seen[0]["hidden_states"][0, 16:])
    assert [tuple(s) for s in seen[0]["img_shapes"][0]] == [(1, 4, 4)] * 3
    reqs = make_requests(adapter, engine, {}, [sources[0]], prompt="<image><image> swap their colours")
    reqs = [dataclasses.replace(r, media=sources[:2]) for r in reqs]
    traj = engine.generate(reqs)
    assert traj.geometry.media == ("image", "image") and traj.conditions["image_latents"].shape == (2, 32, 16)
    adapter.validate_trajectory(traj)
    actor = adapter.load_train_model(str(edit_dir), dtype=torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(adapter.replay_transitions(actor, traj), traj.log_probs, atol=1e-5, rtol=0)


# ------------------------------------------------------------------------- the source file, read once


def test_scorers_get_the_engines_read_of_a_source_not_the_file_as_it_is_now(engine, adapter, sources, tmp_path):
    """The loop hands the scorers the pixels of the engine's own read (take_sources): the file is
    not read again, so a source replaced after the rollout still scores as the image the model
    was shown; take_sources hands the reads over once."""
    import shutil

    import numpy as np
    from PIL import Image

    from trainer.loop import _scorer_inputs, take_sources
    from trainer.models.edit_source import source_pixels
    from trainer.rewards.base import SOURCE_IMAGES_KEY
    from trainer.rollout import generate_rollout
    from trainer.sampling import parse_sampling_config

    src = str(tmp_path / "source.png")
    shutil.copy(sources[0], src)
    shown = source_pixels(src, 32, 32)
    records = [{"prompt": "<image> make the square red", "images": [src], "metadata": {"task": "i2i", "sample_id": "e0"}}]
    out = generate_rollout(engine, adapter, records, rollout_id=0, sampling=parse_sampling_config(SAMPLING),
                           group_size=2, generation_seed=3)
    Image.fromarray(np.full((40, 40, 3), 7, np.uint8)).save(src)  # the file changes after the rollout
    reads = take_sources(engine)
    assert list(reads) == [src] and engine.last_sources == {} and take_sources(engine) == {}
    _, _, metadata = _scorer_inputs(out.trajectory, reads)
    assert all(np.array_equal(m[SOURCE_IMAGES_KEY][0], shown) for m in metadata)
    _, _, reread = _scorer_inputs(out.trajectory)  # without the engine's reads: the file as it is now
    assert np.array_equal(reread[0][SOURCE_IMAGES_KEY][0], np.full((32, 32, 3), 7, np.uint8))


def test_a_rollout_opens_each_source_file_once(engine, adapter, sources, monkeypatch):
    """With CFG (the instruction's and the negative's conditions both show the source) and two
    candidates per record, each record's file is opened once per rollout: its condition key and
    its pixels come from that one read."""
    import builtins
    import os

    watched = {os.path.abspath(p) for p in sources}
    opened = []
    real_open = builtins.open

    def counting_open(file, *args, **kwargs):
        if isinstance(file, (str, os.PathLike)) and os.path.abspath(os.fspath(file)) in watched:
            opened.append(os.path.abspath(os.fspath(file)))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", counting_open)
    reqs = make_requests(adapter, engine, {"guidance_scale": 4.0, "negative_prompt": " "}, sources[:2])
    engine.generate(reqs)
    assert sorted(opened) == sorted(os.path.abspath(p) for p in sources[:2])
    assert engine.last_stats["prompts_encoded"] == 4.0


def test_source_read_once_keys_and_decodes_the_same_bytes(sources):
    from trainer.data import MediaDigests
    from trainer.models.edit_source import load_source, open_source_image

    src = load_source(sources[0])
    # the data tools' key of the file, and a renamed copy's: one key
    assert src.key == MediaDigests().key(str(sources[0])) == load_source(sources[2]).key
    assert src.key != load_source(sources[1]).key
    assert src.image.mode == "RGB" and src.image.tobytes() == open_source_image(sources[0]).tobytes()


def test_corrupt_oversized_and_missing_sources_keep_their_errors(engine, adapter, sources, tmp_path, monkeypatch):
    """A source that does not decode, has too many pixels (from its header) or too many bytes is
    a ValueError naming the file and the fix, from the file functions and from the engine alike;
    a missing one a FileNotFoundError naming the request and the file."""
    from trainer.models import edit_source

    corrupt = tmp_path / "corrupt.png"
    corrupt.write_bytes(b"\x89PNG\r\n\x1a\n" + b"not an image" * 8)
    for load in (edit_source.open_source_image, edit_source.load_source):
        with pytest.raises(ValueError, match=f"source image {corrupt} does not decode .*inspect_data.py --decode-media"):
            load(corrupt)
    with pytest.raises(ValueError, match=f"source image {corrupt} does not decode"):
        engine.generate(make_requests(adapter, engine, {}, [str(corrupt)], group_size=1))

    monkeypatch.setattr(edit_source, "MAX_SOURCE_PIXELS", 40 * 40 - 1)  # the sources are 40 x 40
    for load in (edit_source.open_source_image, edit_source.load_source):
        with pytest.raises(ValueError, match=f"source image {sources[0]} is 40x40, more than 1599 pixels; downscale it"):
            load(sources[0])
    with pytest.raises(ValueError, match="is 40x40, more than 1599 pixels"):
        engine.generate(make_requests(adapter, engine, {}, sources[:1], group_size=1))
    monkeypatch.undo()

    size = os.path.getsize(sources[0])
    monkeypatch.setattr(edit_source, "MAX_SOURCE_BYTES", size - 1)
    for load in (edit_source.open_source_image, edit_source.load_source):
        with pytest.raises(ValueError, match=f"source image {sources[0]} is {size} bytes, more than {size - 1}; "
                                             "downscale or recompress it"):
            load(sources[0])
    monkeypatch.undo()

    with pytest.raises(FileNotFoundError, match=f"request p0:s0: source image {sources[0]}.gone does not exist"):
        engine.generate(make_requests(adapter, engine, {}, [sources[0] + ".gone"], group_size=1))

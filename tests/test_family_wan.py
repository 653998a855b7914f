"""The Wan2.1 text-to-video family on its tiny model (CPU, fp32): the contracts the image families
hold, with frames in them, through trainer.models.wan.WanAdapter.

The tiny directory (tools/tiny_wan.py) has the real latent geometry: 16 channels, the VAE's
spatial factor 8 and temporal factor 4, so 5 frames of 32 x 32 are a [16, 2, 4, 4] latent.
"""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from trainer.engine.native import NativeEngine
from trainer.models.wan import WanAdapter
from trainer.sampling import initial_noise, parse_sampling_config
from trainer.trajectory import Geometry

pytestmark = pytest.mark.filterwarnings("ignore:FSDP2-wrapped module.*returned a view tensor")

SAMPLING = {"height": 32, "width": 32, "num_frames": 5, "num_inference_steps": 4, "eta": 0.7, "sde_type": "sde",
            "sde_indices": [1, 2], "cfg_renorm": False, "negative_prompt": ""}
CFG = {**SAMPLING, "guidance_scale": 4.5}
#: FlowGRPO's Wan SDE: every step but the last trainable, step 0 included
WAN_SDE = {**CFG, "sde_type": "wan", "eta": 1.0, "sde_indices": [0, 1, 2]}
PROMPTS = ["a cat", "a considerably longer prompt about a red panda drinking tea"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tools.tiny_wan import build_tiny_wan_pipeline

    return build_tiny_wan_pipeline(tmp_path_factory.mktemp("wan") / "model", seed=0)


@pytest.fixture(scope="module")
def adapter():
    return WanAdapter()


@pytest.fixture(scope="module")
def engine(model_dir, adapter):
    return NativeEngine(str(model_dir), device="cpu", dtype=torch.float32, adapter=adapter)


def requests(engine, adapter, sampling: dict, prompts=PROMPTS, group_size=2, seed=7):
    cfg = parse_sampling_config(sampling)
    sigmas = engine.sigma_schedule(cfg.height, cfg.width, cfg.num_inference_steps)
    return [adapter.build_rollout_request(p, group_index=g, slot=s, sample_id=f"p{g}:s{s}", sampling=cfg,
                                          sde_indices=list(cfg.sde_indices), sigmas=sigmas, generation_seed=seed)
            for g, p in enumerate(prompts) for s in range(group_size)], cfg


def rollout(engine, adapter, sampling: dict, **kw):
    reqs, cfg = requests(engine, adapter, sampling, **kw)
    return engine.generate(reqs), cfg


# ---------------------------------------------------------------- the family


def test_make_tiny_model_family_flag_and_the_adapter_is_picked_from_model_index(tmp_path):
    from tools.make_tiny_model import main
    from trainer.config import adapter_for_model_dir

    assert main(["--family", "wan", "--output", str(tmp_path / "m"), "--seed", "1"]) == 0
    assert json.loads((tmp_path / "m" / "model_index.json").read_text())["_class_name"] == "WanPipeline"
    assert adapter_for_model_dir(tmp_path / "m") == "trainer.models.wan.WanAdapter"


def test_the_wan_adapter_implements_the_whole_protocol(adapter, model_dir):
    from trainer.models.base import GenerativeModelAdapter, geometry_problems

    members = [m for m in vars(GenerativeModelAdapter) if not m.startswith("_")]
    members += list(GenerativeModelAdapter.__annotations__)
    assert [m for m in members if not hasattr(adapter, m)] == []
    assert isinstance(adapter, GenerativeModelAdapter)
    assert adapter.lora_target_modules == ("to_q", "to_k", "to_v", "to_out.0")
    assert geometry_problems(adapter, model_dir, 240, 416, 512) == []
    (problem,) = geometry_problems(adapter, model_dir, 240, 420)
    assert "width 420 is not a multiple of 16" in problem and "use e.g. 416" in problem


def test_conditions_and_schedule_are_the_pipelines(engine, adapter):
    """The engine's conditioning is WanPipeline.encode_prompt's at 512 tokens (the empty negative
    prompt's as well); its sigmas are the directory's scheduler's, and the published checkpoints'
    UniPC flow schedule is UniPCMultistepScheduler's own, bit for bit."""
    from diffusers import UniPCMultistepScheduler

    pipe = engine.prompt_encoder.pipeline
    pe, ne = pipe.encode_prompt(prompt=[PROMPTS[1]], negative_prompt="", do_classifier_free_guidance=True,
                                max_sequence_length=512, device="cpu")
    ours, neg = engine.encode_prompt(PROMPTS[1]), engine.encode_prompt("")
    assert set(ours) == {"prompt_embeds"} and ours["prompt_embeds"].shape == (512, 32)
    assert torch.equal(ours["prompt_embeds"], pe[0]) and torch.equal(neg["prompt_embeds"], ne[0])
    for n in (4, 20, 50):
        pipe.scheduler = type(pipe.scheduler).from_config(engine.scheduler_config)
        pipe.scheduler.set_timesteps(n)
        assert engine.sigma_schedule(240, 416, n) == pipe.scheduler.sigmas.tolist()
        unipc = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0)
        unipc.set_timesteps(n)
        assert adapter.sigma_schedule(dict(unipc.config, _class_name="UniPCMultistepScheduler"), n,
                                      Geometry(240, 416, 8, frames=33)) == unipc.sigmas.tolist()


def test_rollout_holds_frames_everywhere(engine, adapter):
    """Latents [B, S, C, F', H', W'], videos [B, F, 3, H, W] decoded as WanPipeline decodes, the
    sidecar records the frames and round-trips the 6-D latents."""
    from trainer.artifacts import group_sidecar_payload, sidecar_to_trajectory

    traj, cfg = rollout(engine, adapter, SAMPLING)
    adapter.validate_trajectory(traj)
    assert traj.latents.shape == (4, 2, 16, 2, 4, 4) and traj.geometry == Geometry(32, 32, 8, frames=5)
    assert traj.images.shape == (4, 5, 3, 32, 32) and 0 <= traj.images.min() and traj.images.max() <= 1
    assert not torch.equal(traj.images[0], traj.images[1])
    tensors, meta = group_sidecar_payload(traj[0:2], task="t2v", rollout_id=0, sampling=cfg)
    assert meta["frames"] == "5" and tensors["tracks.latents"].shape == (2, 2, 16, 2, 4, 4)
    back = sidecar_to_trajectory(tensors, meta)
    assert back.geometry == traj.geometry and torch.equal(back.latents, traj.latents[0:2])
    # decode is the pipeline's: z * std + mean per channel through the VAE, [-1, 1] -> [0, 1], frames second
    vae = engine.vae
    z = torch.randn(1, 16, 2, 4, 4, generator=torch.Generator().manual_seed(1))
    mean = torch.tensor(vae.config.latents_mean).view(1, 16, 1, 1, 1)
    std = 1.0 / torch.tensor(vae.config.latents_std).view(1, 16, 1, 1, 1)
    want = engine.prompt_encoder.pipeline.video_processor.postprocess_video(
        vae.decode(z / std + mean, return_dict=False)[0], output_type="pt")
    assert torch.equal(adapter.decode(vae, z, Geometry(32, 32, 8, frames=5)), want)
    with pytest.raises(ValueError, match=r"must be \[B, S, C, 2, 4, 4\]"):
        adapter.validate_trajectory(dataclasses.replace(traj, latents=traj.latents[:, :, :, :1],
                                                        next_latents=traj.next_latents[:, :, :, :1]))


def test_noise_is_a_pure_function_of_seed_sample_and_step(engine, adapter):
    """A candidate's x_T is sampling.initial_noise of its [C, F', H', W'] shape and seed, and it
    samples the same video alone as inside a batch of four (the noise does not depend on the batch)."""
    reqs, _ = requests(engine, adapter, {**WAN_SDE, "guidance_scale": 1.0})
    traj = engine.generate(reqs)
    for i, r in enumerate(reqs):
        assert torch.equal(traj.latents[i, 0], initial_noise([16, 2, 4, 4], r.generation_seed, r.sample_id))
    alone = engine.generate(reqs[2:3])
    torch.testing.assert_close(alone.next_latents[0], traj.next_latents[2], rtol=0, atol=1e-5)
    torch.testing.assert_close(alone.images[0], traj.images[2], rtol=0, atol=1e-5)


def test_bad_video_requests_are_refused_with_the_fix(engine, adapter):
    sigmas = engine.sigma_schedule(32, 32, 4)

    def build(**over):
        return adapter.build_rollout_request("a", group_index=0, slot=0, sample_id="s",
                                             sampling=parse_sampling_config({**CFG, **over}), sde_indices=[1],
                                             sigmas=sigmas, generation_seed=1)

    with pytest.raises(ValueError, match="num_frames 8 is not of the form 4k\\+1.*use 5 or 9"):
        build(num_frames=8)
    with pytest.raises(ValueError, match="height 40 is not a multiple of 16"):
        build(height=40)
    with pytest.raises(ValueError, match="cfg_renorm false"):
        build(cfg_renorm=True)
    assert build().num_frames == 5


# ---------------------------------------------------------------- FlowGRPO's Wan SDE


def test_wan_sde_type_is_flowgrpos_formula(engine, adapter):
    """sde_type "wan": std_dev_t = sigma_min + (sigma_max - sigma_min) * sigma with sigma_max the
    schedule's sigmas[1] and sigma_min its terminal 0; the transition is
    mean = x (1 + g^2 dt / (2 sigma)) + v (1 + g^2 (1 - sigma) / (2 sigma)) dt, std = g sqrt(-dt),
    log-prob the mean Gaussian log-density: written out here from FlowGRPO's Wan step."""
    from trainer.flow_grpo import sde_step

    reqs, _ = requests(engine, adapter, WAN_SDE)
    sigmas = reqs[0].sigmas
    assert reqs[0].sigma_max == sigmas[1] and reqs[0].sde_type == "wan"
    g = torch.Generator().manual_seed(0)
    x, v, noise = (torch.randn(3, 16, 2, 4, 4, generator=g) for _ in range(3))
    for i in (0, 1, 2):
        s, s_next = sigmas[i], sigmas[i + 1]
        nxt, logp = sde_step(x, v, torch.full((3,), s), torch.full((3,), s_next), 0.5, noise, "wan", sigmas[1])
        std_dev_t = 0.5 * (sigmas[-1] + (sigmas[1] - sigmas[-1]) * s)
        dt = s_next - s
        mean = x * (1 + std_dev_t ** 2 / (2 * s) * dt) + v * (1 + std_dev_t ** 2 * (1 - s) / (2 * s)) * dt
        std = std_dev_t * math.sqrt(-dt)
        torch.testing.assert_close(nxt, mean + std * noise, rtol=1e-6, atol=1e-6)
        want = (-((nxt - mean) ** 2) / (2 * std ** 2) - math.log(std) - 0.5 * math.log(2 * math.pi)).mean((1, 2, 3, 4))
        torch.testing.assert_close(logp, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="needs num_inference_steps >= 2"):
        adapter.build_rollout_request("a", group_index=0, slot=0, sample_id="s",
                                      sampling=parse_sampling_config({**WAN_SDE, "num_inference_steps": 1,
                                                                      "sde_indices": [0]}),
                                      sde_indices=[0], sigmas=[1.0, 0.0], generation_seed=1)


# ---------------------------------------------------------------- replay == sampler


@pytest.mark.parametrize("sampling", [SAMPLING, CFG, WAN_SDE], ids=["no-cfg", "cfg-4.5", "wan-sde"])
def test_replay_reproduces_the_sampler_logprob(engine, adapter, model_dir, sampling):
    """A separately loaded actor transformer at the same weights: each column's replay is the
    sampler's log-prob exactly (fp32), all columns in one forward agree to rounding, and a sidecar
    round trip replays as the rollout itself."""
    from trainer.artifacts import group_sidecar_payload, sidecar_to_trajectory

    traj, cfg = rollout(engine, adapter, sampling)
    assert traj.guided == (sampling is not SAMPLING)
    actor = adapter.load_train_model(str(model_dir), dtype=torch.float32)
    with torch.no_grad():
        cols = torch.stack([adapter.replay_transition(actor, traj, c) for c in range(traj.num_steps)], 1)
        together = adapter.replay_transitions(actor, traj)
        group = traj[0:2]
        back = sidecar_to_trajectory(*group_sidecar_payload(group, task="t2v", rollout_id=0, sampling=cfg))
        from_sidecar = adapter.replay_transitions(actor, back)
    assert torch.equal(cols, traj.log_probs) and torch.isfinite(traj.log_probs).all()
    torch.testing.assert_close(together, traj.log_probs, rtol=0, atol=1e-6)
    assert torch.equal(from_sidecar, adapter.replay_transitions(actor, group))


def test_first_update_ratio_is_one_and_every_trainable_parameter_changes(engine, adapter, model_dir):
    """Full fine-tune and LoRA on a CFG rollout through the loop's replay_fn: ratio exactly 1 on the
    first update, every trainable parameter moves, nothing frozen does; LoRA sits on to_q / to_k /
    to_v / to_out.0 of both attentions of every block."""
    from tests.dist.tiny import full_params, make_cfg, one_rank_mesh
    from trainer.actor import Actor
    from trainer.core.names import model_name
    from trainer.loop import make_replay_fn

    batch, _ = rollout(engine, adapter, {**CFG, "eta": 1.0})
    batch = batch.without_images()
    gen = one_rank_mesh()
    mesh = next(gen)
    try:
        for mode in ("full", "lora"):
            # a wide clip: LoRA's A matrices get a gradient only in the second update (B starts at 0),
            # which the default 1e-4 clip would cut off once the first update moved the log-probs
            run_cfg = make_cfg(mode, optim__lr=1e-2, fsdp__fsdp_master_dtype="fp32", grpo__eps_clip=0.5)
            actor = Actor.from_adapter(adapter, str(model_dir), mesh, run_cfg, device=torch.device("cpu"))
            before = full_params(actor.model)
            m = actor.train_step(batch, torch.tensor([1.0, -1.0, 0.5, -0.5]), make_replay_fn(adapter))
            after = full_params(actor.model)
            first = actor.last_update_stats[0]
            assert first["ratio_max"].item() == 1.0 == first["ratio_min"].item(), mode
            assert math.isfinite(m["train/loss"])
            trainable = {model_name(n) for n, p in actor.model.named_parameters() if p.requires_grad}
            unchanged = sorted(n for n in trainable if torch.equal(before[n], after[n]))
            assert trainable and unchanged == [], (mode, unchanged)
            assert all(torch.equal(before[n], after[n]) for n in before if n not in trainable)
            assert not actor.never_trained
            if mode == "lora":
                modules = {n.split(".lora_")[0] for n in trainable}
                assert all(".lora_" in n for n in trainable)
                assert modules == {f"blocks.{b}.{a}.{p}" for b in (0, 1) for a in ("attn1", "attn2")
                                   for p in ("to_q", "to_k", "to_v", "to_out.0")}
    finally:
        next(gen, None)


# ---------------------------------------------------------------- preflight


def test_preflight_rules_of_the_video_task(model_dir, tmp_path, monkeypatch):
    """configs/wan21_t2v_tiny.toml passes; each video rule is one named violation with its fix."""
    from pathlib import Path

    from trainer.config import load_config
    from trainer.preflight import PreflightError, validate

    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "a red ball", "metadata": {"task": "t2v", "sample_id": "t0"}}) + "\n")
    monkeypatch.setenv("TINY_WAN", str(model_dir))
    monkeypatch.setenv("PROMPTS", str(prompts))
    recipe = str(Path(__file__).resolve().parents[1] / "configs" / "wan21_t2v_tiny.toml")

    def problems(*argv: str) -> list[str]:
        try:
            validate(load_config(["--config", recipe, "--save", str(tmp_path / "ckpt"), "--num-rollout", "2",
                                  "--artifact-root", str(tmp_path / "art"), *argv]), 2)
        except PreflightError as e:
            return e.problems
        return []

    assert problems() == []
    (p,) = problems("--sampling-config.num_frames", "8")
    assert "num_frames 8 is not of the form 4k+1" in p and "use 5 or 9" in p
    (p,) = problems("--sampling-config.num_frames", "1")
    assert "t2v samples videos; set num_frames to 4k + 1 >= 5" in p
    assert any("width 40 is not a multiple of 16" in p for p in problems("--sampling-config.width", "40"))
    (p,) = problems("--reward-scorer-path", "color")
    assert "scores images, but --generation-task t2v samples videos" in p
    assert "--reward-scorer-path framewise --reward-frame-scorer trainer.rewards.color.ColorScorer" in p
    (p,) = problems("--reward-frame-scorer", "temporal_consistency")
    assert "is a video scorer; framewise applies an IMAGE scorer" in p
    (p,) = problems("--reward-frame-every", "4")
    assert "two frame rules" in p
    assert any("a video family: set --generation-task t2v" in p for p in problems("--generation-task", "t2i"))
    assert problems("--reward-scorer-path", "temporal_consistency") == []
    (p,) = problems("--reward-scorer-path", "color_edit")
    assert "scores an edit against its source images, but --generation-task t2v has no source" in p
    (p,) = problems("--reward-frame-scorer", "color_edit")
    assert "scores an edit against its source images, which a video's frames do not have" in p
    # the editing task on the video family: the family, the frames and the scorer each named
    p = problems("--generation-task", "i2i")
    assert any("i2i needs an image-editing family" in x and "is a text-to-video one" in x for x in p)
    assert any("num_frames 5 asks for a video, but --generation-task i2i samples images" in x for x in p)
    assert any("scores videos, but --generation-task i2i samples images: use an edit scorer" in x for x in p)


def test_videos_reach_tensorboard_as_frame_strips(engine, adapter):
    """The loop's image statistics see a video candidate as its frame strip (8 evenly spaced
    frames; here all 5, 2 white pixels apart); the eval probes' thumbnails are strips too (their
    size: tests/test_run_visuals.py)."""
    from trainer.loop import _eval_thumbnails, _viewable
    from trainer.video_artifacts import frame_strip

    traj, _ = rollout(engine, adapter, SAMPLING)
    strip = _viewable(traj.images[0])
    assert strip.shape == (3, 32, 5 * 32 + 4 * 2) and torch.equal(strip, frame_strip(traj.images[0]))
    assert torch.equal(_viewable(traj.images[0, 0]), traj.images[0, 0])  # an image stays as it is
    thumbs = _eval_thumbnails(traj, max_group=1)
    assert [(t.group, t.slot) for t in thumbs] == [(0, 0), (0, 1)]
    assert all(t.image.dtype == torch.uint8 and t.image.shape[0] == 3 and t.image.shape[2] > t.image.shape[1]
               for t in thumbs)


def test_the_score_tool_scores_a_rollouts_videos(engine, adapter, tmp_path, capsys):
    """tools/score.py on a t2v rollout directory: each animated WebP's frames go to a video
    scorer, its prompt from the group's sidecar."""
    from tools.score import main
    from trainer.rollout import generate_rollout

    out = generate_rollout(engine, adapter, ["a red ball"], rollout_id=0, sampling=parse_sampling_config(SAMPLING),
                           group_size=2, generation_seed=3, artifact_root=tmp_path, task="t2v", retention=0)
    assert len(list(out.artifact_dir.glob("*.webp"))) == 2
    assert main(["--reward-scorer-path", "temporal_consistency", "--images", str(out.artifact_dir)]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [(r["image"], r["prompt"]) for r in lines] == [("group_00000000_sample_0000.webp", "a red ball"),
                                                          ("group_00000000_sample_0001.webp", "a red ball")]
    assert all(0 <= r["scores"]["temporal_consistency"] <= 1 for r in lines)


def test_the_engine_samples_what_wanpipeline_samples(engine, adapter):
    """With every step deterministic (the one recorded step is the last under "cps", whose std is 0
    and whose mean is the Euler step) the engine's video is WanPipeline's from the same x_T, prompt,
    empty negative prompt and CFG 4.5, up to the rounding of one two-row forward against two."""
    import dataclasses as dc

    from trainer.sampling import SamplingConfig

    cfg = dc.replace(SamplingConfig(), **{**{k: v for k, v in CFG.items() if k != "sde_indices"},
                                          "sde_type": "cps", "eta": 0.5})
    sigmas = engine.sigma_schedule(32, 32, 4)
    req = adapter.build_rollout_request(PROMPTS[1], group_index=0, slot=0, sample_id="p", sampling=cfg,
                                        sde_indices=[3], sigmas=sigmas, generation_seed=5)
    ours = engine.generate([req]).images
    pipe = engine.prompt_encoder.pipeline
    pipe.scheduler = type(pipe.scheduler).from_config(engine.scheduler_config)
    pipe.set_progress_bar_config(disable=True)
    x_t = initial_noise([16, 2, 4, 4], 5, "p")[None]
    theirs = pipe(PROMPTS[1], negative_prompt="", height=32, width=32, num_frames=5, num_inference_steps=4,
                  guidance_scale=4.5, latents=x_t, output_type="pt").frames
    assert ours.shape == theirs.shape == (1, 5, 3, 32, 32)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)
    assert (ours - theirs).abs().max() < 1e-5 < (ours - ours.mean()).abs().max()  # not two constant videos


def test_bf16_dit_is_uniform_and_replays_the_bf16_sampler(model_dir, adapter):
    """Loaded in bf16 (actor and engine alike) every DiT parameter is bf16, as FSDP2 computes them
    (diffusers alone keeps the time embedder, norms and modulation tables in fp32), the RoPE tables
    stay fp32; and the bf16 engine's log-probs are replayed exactly by a bf16 actor."""
    bf16 = NativeEngine(str(model_dir), device="cpu", dtype=torch.bfloat16, adapter=adapter)
    assert {p.dtype for p in bf16.transformer.parameters()} == {torch.bfloat16}
    assert {b.dtype for b in bf16.transformer.buffers()} == {torch.float32}
    traj, _ = rollout(bf16, adapter, CFG)
    actor = adapter.load_train_model(str(model_dir), dtype=torch.bfloat16)
    with torch.no_grad():
        cols = torch.stack([adapter.replay_transition(actor, traj, c) for c in range(traj.num_steps)], 1)
    assert torch.equal(cols, traj.log_probs)


def test_the_sample_tool_refuses_a_frame_count_before_loading(model_dir, tmp_path, capsys):
    from tools.sample import main

    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "a", "metadata": {"task": "t2v", "sample_id": "a"}}) + "\n")
    assert main(["--model-path", str(model_dir), "--prompt-data", str(prompts), "--output-dir", str(tmp_path / "o"),
                 "--device", "cpu", "--sampling-config", json.dumps({"num_frames": 8})]) == 2
    assert "num_frames 8 is not of the form 4k+1" in capsys.readouterr().err and not (tmp_path / "o").exists()

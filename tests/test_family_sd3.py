"""The Stable Diffusion 3.5 family on its tiny model (CPU, fp32): the contracts the Qwen-Image
path holds, through trainer.models.sd3.SD3Adapter.

The tiny directory is SD3.5-Medium's structure at toy size (tools/tiny_sd3.py): a dual-attention
MMDiT-X block, CLIP-L + CLIP-G + T5, SD3's VAE factors, the static-shift scheduler.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.test_actor_dist import EXPECTED as ACTOR_DIST_CHECKS
from tests.workers.launch import torchrun
from trainer.engine.native import NativeEngine
from trainer.models.sd3 import SD3Adapter
from trainer.sampling import parse_sampling_config
from trainer.trajectory import Geometry

pytestmark = pytest.mark.filterwarnings("ignore:FSDP2-wrapped module.*returned a view tensor")

ADAPTER_PATH = "trainer.models.sd3.SD3Adapter"
SAMPLING = {"height": 32, "width": 32, "num_inference_steps": 6, "eta": 0.7, "sde_type": "sde",
            "sde_indices": [1, 2, 4], "cfg_renorm": False, "negative_prompt": ""}
CFG = {**SAMPLING, "guidance_scale": 4.5}
PROMPTS = ["a cat", "a considerably longer prompt about a red panda drinking tea"]


@pytest.fixture(scope="module")
def adapter():
    return SD3Adapter()


@pytest.fixture(scope="module")
def engine(tiny_sd3_model_dir, adapter):
    return NativeEngine(str(tiny_sd3_model_dir), device="cpu", dtype=torch.float32, adapter=adapter)


def rollout(engine, adapter, sampling: dict, prompts=PROMPTS, group_size=2, seed=7):
    cfg = parse_sampling_config(sampling)
    sigmas = engine.sigma_schedule(cfg.height, cfg.width, cfg.num_inference_steps)
    reqs = [adapter.build_rollout_request(p, group_index=g, slot=s, sample_id=f"p{g}:s{s}", sampling=cfg,
                                          sde_indices=list(cfg.sde_indices), sigmas=sigmas, generation_seed=seed)
            for g, p in enumerate(prompts) for s in range(group_size)]
    return engine.generate(reqs), cfg


# ---------------------------------------------------------------- the tiny model


def test_tiny_model_is_an_sd35_pipeline_directory(tiny_sd3_model_dir, monkeypatch):
    """StableDiffusion3Pipeline loads it offline and generates; it holds a dual-attention block,
    SD3's VAE factors and the static-shift scheduler."""
    from diffusers import StableDiffusion3Pipeline

    from tools.tiny_sd3 import SD3_SCHEDULER_CONFIG, SD3_VAE_SCALING_FACTOR, SD3_VAE_SHIFT_FACTOR

    index = json.loads((tiny_sd3_model_dir / "model_index.json").read_text())
    assert index["_class_name"] == "StableDiffusion3Pipeline"
    assert index["transformer"] == ["diffusers", "SD3Transformer2DModel"]
    size = sum(p.stat().st_size for p in tiny_sd3_model_dir.rglob("*") if p.is_file())
    assert size < 5 * 1024 * 1024, f"tiny model is {size / 1e6:.1f} MB"
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    pipe = StableDiffusion3Pipeline.from_pretrained(str(tiny_sd3_model_dir), local_files_only=True,
                                                    dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    assert pipe.transformer.transformer_blocks[0].attn2 is not None  # MMDiT-X dual attention
    assert pipe.transformer.transformer_blocks[-1].context_pre_only
    assert (pipe.vae.config.scaling_factor, pipe.vae.config.shift_factor) == (SD3_VAE_SCALING_FACTOR,
                                                                              SD3_VAE_SHIFT_FACTOR)
    assert pipe.scheduler.config.shift == SD3_SCHEDULER_CONFIG["shift"] and not pipe.scheduler.config.use_dynamic_shifting
    out = pipe("a red panda", height=32, width=32, num_inference_steps=2, output_type="pt", max_sequence_length=16,
               generator=torch.Generator().manual_seed(0)).images
    assert out.shape == (1, 3, 32, 32) and torch.isfinite(out).all()


def test_make_tiny_model_family_flag(tmp_path):
    from tools.make_tiny_model import main

    assert main(["--family", "sd3", "--output", str(tmp_path / "m"), "--seed", "2"]) == 0
    assert json.loads((tmp_path / "m" / "model_index.json").read_text())["_class_name"] == "StableDiffusion3Pipeline"
    assert json.loads((tmp_path / "m" / "TINY_RANDOM_MODEL.json").read_text())["family"] == "sd3"


def test_one_vae_norm_group_lets_the_latents_move_the_colour(tiny_sd3_model_dir, tmp_path):
    """vae_norm_groups=1 changes the VAE's config only (the same tensors), and at gain 8 a shift of
    one latent channel moves an 8x8 picture's red, green and blue colour rewards over twice as far
    as under the default 4 groups."""
    from diffusers import AutoencoderKL
    from safetensors.torch import load_file

    from tools.tiny_sd3 import build_tiny_sd3_pipeline
    from trainer.rewards.color import color_palette, color_reward

    one = build_tiny_sd3_pipeline(tmp_path / "one", seed=0, vae_output_gain=8.0, vae_norm_groups=1)
    assert json.loads((one / "TINY_RANDOM_MODEL.json").read_text())["vae_norm_groups"] == 1
    four_cfg, one_cfg = (json.loads((d / "vae" / "config.json").read_text()) for d in (tiny_sd3_model_dir, one))
    assert (four_cfg.pop("norm_num_groups"), one_cfg.pop("norm_num_groups")) == (4, 1) and four_cfg == one_cfg
    name = "diffusion_pytorch_model.safetensors"
    four_t, one_t = (load_file(str(d / "vae" / name)) for d in (tiny_sd3_model_dir, one))
    assert four_t.keys() == one_t.keys() and all(torch.equal(four_t[k], one_t[k]) for k in four_t)

    z = torch.randn(32, 4, 4, 4, generator=torch.Generator().manual_seed(0))
    shifts = [0.5 * s * torch.eye(4)[k].view(1, 4, 1, 1) for k in range(4) for s in (-1, 1)]

    def best_gain(model_dir, rgb) -> float:
        vae = AutoencoderKL.from_pretrained(str(model_dir), subfolder="vae", local_files_only=True)

        @torch.no_grad()
        def reward(latents):
            images = SD3Adapter().decode(vae, latents, Geometry(8, 8, 2))
            return sum(color_reward(i, rgb) for i in images) / len(images)

        return max(reward(z + d) for d in shifts) - reward(z)

    for colour in ("red", "green", "blue"):
        rgb = color_palette()[colour]
        four, wide = best_gain(tiny_sd3_model_dir, rgb), best_gain(one, rgb)
        assert wide > 2 * four > 0, (colour, four, wide)


def test_the_sd3_adapter_implements_the_whole_protocol(adapter):
    from trainer.models.base import GenerativeModelAdapter

    members = [m for m in vars(GenerativeModelAdapter) if not m.startswith("_")]
    members += list(GenerativeModelAdapter.__annotations__)
    assert [m for m in members if not hasattr(adapter, m)] == []
    assert isinstance(adapter, GenerativeModelAdapter)


# ---------------------------------------------------------------- the engine is the SD3 pipeline


def test_conditions_and_schedule_are_the_pipelines(engine, adapter):
    """The engine's per-prompt conditioning is StableDiffusion3Pipeline.encode_prompt's (the
    negative prompt's as well), its sigmas are the pipeline's scheduler's, bit for bit."""
    from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import retrieve_timesteps

    pipe = engine.prompt_encoder.pipeline
    pe, ne, pp, npp = pipe.encode_prompt(prompt=[PROMPTS[1]], prompt_2=None, prompt_3=None, device="cpu",
                                         do_classifier_free_guidance=True, negative_prompt="",
                                         max_sequence_length=adapter.max_sequence_length)
    ours, neg = engine.encode_prompt(PROMPTS[1]), engine.encode_prompt("")
    assert set(ours) == {"prompt_embeds", "pooled_prompt_embeds"}
    assert ours["prompt_embeds"].shape == (77 + adapter.max_sequence_length, 32)
    assert torch.equal(ours["prompt_embeds"], pe[0]) and torch.equal(ours["pooled_prompt_embeds"], pp[0])
    assert torch.equal(neg["prompt_embeds"], ne[0]) and torch.equal(neg["pooled_prompt_embeds"], npp[0])
    # a rollout encodes its prompts in one call: every row keeps the fixed window of a prompt alone
    together = engine.encode_prompts([PROMPTS[1], ""])
    for got, alone in ((together[PROMPTS[1]], ours), (together[""], neg)):
        assert {k: v.shape for k, v in got.items()} == {k: v.shape for k, v in alone.items()}
        for k in alone:
            torch.testing.assert_close(got[k], alone[k])
    for n in (6, 10, 40):
        timesteps, _ = retrieve_timesteps(pipe.scheduler, n, "cpu")
        assert engine.sigma_schedule(512, 512, n) == pipe.scheduler.sigmas.tolist()
    traj, _ = rollout(engine, adapter, SAMPLING)
    assert traj.timesteps[0].tolist() == [timesteps_i for timesteps_i in
                                          retrieve_timesteps(pipe.scheduler, 6, "cpu")[0][[1, 2, 4]].tolist()]


def test_rollout_contents_and_decode(engine, adapter):
    traj, _ = rollout(engine, adapter, SAMPLING)
    adapter.validate_trajectory(traj)
    assert traj.latents.shape == (4, 3, 4, 16, 16)  # unpacked [B, S, C, h, w]: 32 px / VAE factor 2
    assert set(traj.conditions) == {"prompt_embeds", "pooled_prompt_embeds"}
    assert torch.equal(traj.conditions["pooled_prompt_embeds"][0], traj.conditions["pooled_prompt_embeds"][1])
    assert not torch.equal(traj.conditions["pooled_prompt_embeds"][0], traj.conditions["pooled_prompt_embeds"][2])
    assert traj.images.shape == (4, 3, 32, 32) and 0 <= traj.images.min() and traj.images.max() <= 1
    assert not torch.equal(traj.images[0], traj.images[1])
    # decode is the pipeline's: z / scaling + shift through the VAE, then [-1, 1] -> [0, 1]
    vae = engine.vae
    z = torch.randn(1, 4, 16, 16, generator=torch.Generator().manual_seed(1))
    want = (vae.decode(z / vae.config.scaling_factor + vae.config.shift_factor).sample / 2 + 0.5).clamp(0, 1)
    assert torch.equal(adapter.decode(vae, z, Geometry(32, 32, 2)), want)
    with pytest.raises(ValueError, match="conditions lack"):
        bad = traj[0:2]
        bad.conditions = {"prompt_embeds": bad.conditions["prompt_embeds"]}
        adapter.validate_trajectory(bad)


def test_cfg_renorm_is_refused_for_this_family(engine, adapter):
    cfg = parse_sampling_config({**CFG, "cfg_renorm": True})
    with pytest.raises(ValueError, match="cfg_renorm false"):
        adapter.build_rollout_request("a", group_index=0, slot=0, sample_id="s", sampling=cfg, sde_indices=[1],
                                      sigmas=engine.sigma_schedule(32, 32, 6), generation_seed=1)


# ---------------------------------------------------------------- replay == sampler


@pytest.mark.parametrize("sampling", [SAMPLING, CFG], ids=["no-cfg", "cfg-4.5"])
def test_replay_reproduces_the_sampler_logprob(engine, adapter, tiny_sd3_model_dir, sampling):
    """A separately loaded actor transformer at the same weights: each column's replay is the
    sampler's log-prob exactly (fp32); all columns in one forward agree to rounding; the
    one-forward replay of a sidecar round trip equals that of the rollout itself."""
    from trainer.artifacts import group_sidecar_payload, sidecar_to_trajectory

    traj, cfg = rollout(engine, adapter, sampling)
    assert traj.guided == (sampling is CFG)
    actor = adapter.load_train_model(str(tiny_sd3_model_dir), dtype=torch.float32)
    with torch.no_grad():
        cols = torch.stack([adapter.replay_transition(actor, traj, c) for c in range(traj.num_steps)], 1)
        together = adapter.replay_transitions(actor, traj)
        group = traj[0:2]
        back = sidecar_to_trajectory(*group_sidecar_payload(group, task="t2i", rollout_id=0, sampling=cfg))
        assert set(back.conditions) == set(group.conditions)
        from_sidecar = adapter.replay_transitions(actor, back)
    assert torch.equal(cols, traj.log_probs)
    torch.testing.assert_close(together, traj.log_probs, rtol=0, atol=1e-6)
    assert torch.equal(from_sidecar, adapter.replay_transitions(actor, group))
    assert torch.isfinite(traj.log_probs).all()


def test_first_update_ratio_is_one_and_every_trainable_parameter_changes(engine, adapter, tiny_sd3_model_dir):
    """Full fine-tune on a CFG rollout through the loop's replay_fn: ratio exactly 1 on the first
    update, every trainable parameter moves, the frozen ones (the last block's text queries,
    which that context_pre_only block discards) do not, and they are exactly what the adapter
    names. LoRA: every adapter tensor moves except those on the never-trained modules."""
    from tests.dist.tiny import full_params, make_cfg, one_rank_mesh
    from trainer.actor import Actor
    from trainer.core.names import model_name
    from trainer.loop import make_replay_fn

    batch, cfg = rollout(engine, adapter, {**CFG, "eta": 1.0})
    batch = batch.without_images()
    gen = one_rank_mesh()
    mesh = next(gen)
    try:
        for mode in ("full", "lora"):
            run_cfg = make_cfg(mode, optim__lr=1e-2, fsdp__fsdp_master_dtype="fp32")
            actor = Actor.from_adapter(adapter, str(tiny_sd3_model_dir), mesh, run_cfg, device=torch.device("cpu"))
            before = full_params(actor.model)
            m = actor.train_step(batch, torch.tensor([1.0, -1.0, 0.5, -0.5]), make_replay_fn(adapter))
            after = full_params(actor.model)
            first = actor.last_update_stats[0]
            assert first["ratio_max"].item() == 1.0 == first["ratio_min"].item(), mode
            assert torch.isfinite(torch.tensor(m["train/loss"]))
            trainable = {model_name(n) for n, p in actor.model.named_parameters() if p.requires_grad}
            unchanged = sorted(n for n in trainable if torch.equal(before[n], after[n]))
            assert trainable and unchanged == [], (mode, unchanged)
            assert all(torch.equal(before[n], after[n]) for n in before if n not in trainable)
            never = set(actor.never_trained)
            if mode == "full":
                assert never == {"transformer_blocks.1.attn.add_q_proj.weight",
                                 "transformer_blocks.1.attn.add_q_proj.bias",
                                 "transformer_blocks.1.attn.norm_added_q.weight"}
            else:
                lora_never = sorted(n for n in never if ".lora_" in n)
                assert lora_never == ["transformer_blocks.1.attn.add_q_proj.lora_A.default.weight",
                                      "transformer_blocks.1.attn.add_q_proj.lora_B.default.weight"]
                assert all(".lora_" in n for n in trainable)
    finally:
        next(gen, None)


# ---------------------------------------------------------------- two processes


def test_two_ranks_replay_update_and_sync_parity(tiny_sd3_model_dir, tmp_path):
    """2 gloo ranks, each rolling out its own candidates: replay == sampler, ratio 1 on the first
    update, every trainable parameter changes, and after a full, an adapter and a merged sync the
    engine's DiT equals the gathered (or merged) actor weights and samples the new version."""
    torchrun("tests/dist/actor_worker.py", nproc=2, timeout=300,
             args=[str(tmp_path), str(tiny_sd3_model_dir), ADAPTER_PATH, json.dumps(SAMPLING)])
    for rank in (0, 1):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert "error" not in result, result["error"]
        checks = result["checks"]
        assert set(checks) == {k for k in ACTOR_DIST_CHECKS if k.startswith("real_")}
        assert [k for k, ok in checks.items() if ok is not True] == [], rank
        assert result["figures"]["real_replay_vs_sampler_max_abs"] == 0.0


# ---------------------------------------------------------------- the real loop: resume and export


def test_loop_resume_is_exact_and_exports_round_trip(tmp_path, tiny_sd3_model_dir):
    """The real training loop (2 gloo ranks, LoRA, adapter sync) on the tiny SD3.5 model: a run of
    4 rollouts and a run of 2 resumed for 2 more end with the same weights, policy version and lr
    step and sample the same images after the resume point. The checkpoint then exports: the
    merged pipeline loads with DiffusionPipeline.from_pretrained, the PEFT adapter with the
    pipeline's load_lora_weights, and both transformers replay the next rollout's recorded
    log-probs (sampled by the engine with exactly those weights)."""
    from tests.test_e2e import _model_tensors, _recipe, _state, _train

    recipe = _recipe(tmp_path, tiny_sd3_model_dir, "lora", extra=f'model-adapter-path = "{ADAPTER_PATH}"')
    a, b = tmp_path / "a", tmp_path / "b"
    lr = ("--lr", "1e-2")  # the LoRA moves the log-probs well beyond the export check's tolerance
    _train(recipe, a, "--num-rollout", "4", *lr)
    _train(recipe, b, "--num-rollout", "2", *lr)
    log = _train(recipe, b, "--num-rollout", "4", "--load", str(b / "ckpt"), *lr)
    assert "continuing at rollout 2" in log
    ta, tb = _model_tensors(a / "ckpt", 3), _model_tensors(b / "ckpt", 3)
    # the adapter, plus the DiT's one persistent buffer (the fixed sin-cos position table) that
    # every model state dict carries
    assert ta.keys() == tb.keys() and {n for n in ta if "lora_" not in n} == {"pos_embed.pos_embed"}
    assert all(torch.equal(ta[n], tb[n]) for n in ta)
    sa, sb = _state(a / "ckpt", 3), _state(b / "ckpt", 3)
    assert [sa[k] for k in ("policy_version", "lr_scheduler_steps")] == [sb[k] for k in
                                                                         ("policy_version", "lr_scheduler_steps")]
    assert sa["policy_version"] == 4 and sa["lr_scheduler_steps"] == 8
    for rollout_id in (2, 3):
        da, db = (d / "artifacts" / "t2i" / f"rollout_{rollout_id:07d}" for d in (a, b))
        pngs = sorted(p.name for p in da.glob("*.png"))
        assert len(pngs) == 8 and pngs == sorted(p.name for p in db.glob("*.png"))
        assert all((da / n).read_bytes() == (db / n).read_bytes() for n in pngs)
    _check_exports(a, tmp_path, tiny_sd3_model_dir)


def _check_exports(run, tmp_path, model_dir) -> None:
    """Export iteration 2 both ways and replay rollout 3 (sampled at policy version 3, i.e. with
    iteration 2's weights) through each loaded transformer."""
    from diffusers import DiffusionPipeline, StableDiffusion3Pipeline

    from tools.export_checkpoint import export_checkpoint
    from trainer import artifacts

    merged_dir, adapter_dir = tmp_path / "merged", tmp_path / "adapter"
    # no --model-adapter-path: the run's adapter_contract.json names the SD3 adapter
    info = export_checkpoint(run / "ckpt", "t2i", 2, merged_dir, form="merged", base_model_path=model_dir,
                             verify=True)
    assert info["verify"]["lora_modules_checked"] > 0
    export_checkpoint(run / "ckpt", "t2i", 2, adapter_dir, form="adapter", verify=True)
    adapter = SD3Adapter()
    sidecars = sorted(artifacts.iter_sidecars(run / "artifacts" / "t2i" / "rollout_0000003"))
    payloads = [artifacts.read_sidecar(p) for p in sidecars]
    groups = [artifacts.sidecar_to_trajectory(*payload) for payload in payloads]
    assert groups and all(int(g.policy_versions.max()) == 3 for g in groups)
    cfg = parse_sampling_config(json.loads(payloads[0][1]["sampling"]))

    def replays(transformer):
        with torch.no_grad():
            return [(adapter.replay_transitions(transformer.eval(), g), g.log_probs) for g in groups]

    merged = DiffusionPipeline.from_pretrained(str(merged_dir), dtype=torch.float32)
    assert isinstance(merged, StableDiffusion3Pipeline)
    base = StableDiffusion3Pipeline.from_pretrained(str(model_dir), dtype=torch.float32)
    base.load_lora_weights(str(adapter_dir))  # pytorch_lora_weights.safetensors, diffusers' default name
    assert {n for n, _ in base.transformer.named_parameters() if ".lora_" in n}
    for transformer in (merged.transformer, base.transformer):
        for got, recorded in replays(transformer):
            torch.testing.assert_close(got, recorded, rtol=0, atol=1e-5)
    # and the base alone does not: the exports carry the training
    plain = StableDiffusion3Pipeline.from_pretrained(str(model_dir), dtype=torch.float32).transformer
    assert max(float((got - rec).abs().max()) for got, rec in replays(plain)) > 1e-4  # 10x the tolerance


# ---------------------------------------------------------------- tools


def test_sample_tool_picks_the_family_from_model_index(tiny_sd3_model_dir, tmp_path, capsys):
    """tools/sample.py without --model-adapter-path samples the SD3 directory with the SD3 adapter."""
    from tools.sample import main
    from trainer import artifacts

    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "a red ball", "metadata": {"task": "t2i", "sample_id": "a"}}) + "\n")
    assert main(["--model-path", str(tiny_sd3_model_dir), "--prompt-data", str(prompts), "--output-dir",
                 str(tmp_path / "out"), "--n-samples-per-prompt", "2", "--device", "cpu",
                 "--sampling-config", json.dumps(CFG)]) == 0
    out = tmp_path / "out" / "t2i" / "rollout_0000000"
    assert len(list(out.glob("*.png"))) == 2
    tensors, meta = artifacts.read_sidecar(next(iter(artifacts.iter_sidecars(out))))
    assert {"conditions.pooled_prompt_embeds", "conditions.negative_pooled_prompt_embeds"} <= set(tensors)
    assert tensors["tracks.latents"].shape == (2, 3, 4, 16, 16) and float(meta["guidance_scale"]) == 4.5

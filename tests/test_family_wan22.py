"""Wan2.2 A14B's two experts on a tiny two-expert model (CPU, fp32), through WanAdapter.

The tiny directory (tools/tiny_wan.py, boundary_ratio 0.7) has two DiTs of the tiny Wan2.1 config
with different weights. At 4 steps its timesteps are 1000, 857.7, 602.2 and 8.9: steps 0 and 1
run the high-noise expert (`transformer`), steps 2 and 3 the low-noise one (`transformer_2`), so
the trained steps [1, 2] put one column on each side of the boundary.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil

import pytest
import torch

from trainer.engine.native import NativeEngine
from trainer.models.wan import WanAdapter, WanExperts, load_wan_transformer, read_boundary_ratio
from trainer.sampling import initial_noise, parse_sampling_config

pytestmark = pytest.mark.filterwarnings("ignore:FSDP2-wrapped module.*returned a view tensor")

SAMPLING = {"height": 32, "width": 32, "num_frames": 5, "num_inference_steps": 4, "eta": 0.7, "sde_type": "sde",
            "sde_indices": [1, 2], "cfg_renorm": False, "negative_prompt": ""}
CFG = {**SAMPLING, "guidance_scale": 4.5}
#: Wan2.2's own recipe gives the low-noise expert a lower scale (4.0 / 3.0 for A14B)
CFG_2 = {**CFG, "guidance_scale_2": 3.0}
PROMPTS = ["a cat", "a considerably longer prompt about a red panda drinking tea"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tools.tiny_wan import TINY_WAN22_BOUNDARY_RATIO, build_tiny_wan_pipeline

    return build_tiny_wan_pipeline(tmp_path_factory.mktemp("wan22") / "model", seed=0,
                                   boundary_ratio=TINY_WAN22_BOUNDARY_RATIO)


@pytest.fixture(scope="module")
def adapter():
    return WanAdapter()


@pytest.fixture(scope="module")
def engine(model_dir, adapter):
    return NativeEngine(str(model_dir), device="cpu", dtype=torch.float32, adapter=adapter)


def rollout(engine, adapter, sampling: dict, seed=7):
    cfg = parse_sampling_config(sampling)
    sigmas = engine.sigma_schedule(cfg.height, cfg.width, cfg.num_inference_steps)
    reqs = [adapter.build_rollout_request(p, group_index=g, slot=s, sample_id=f"p{g}:s{s}", sampling=cfg,
                                          sde_indices=list(cfg.sde_indices), sigmas=sigmas, generation_seed=seed)
            for g, p in enumerate(PROMPTS) for s in range(2)]
    return engine.generate(reqs), cfg


def variant(model_dir, tmp_path, **index_changes):
    """A copy of the tiny directory (subfolders linked) whose model_index.json has `index_changes`
    (a value None removes the key); `drop` names a subfolder left out."""
    drop = index_changes.pop("drop", None)
    out = tmp_path / "variant"
    out.mkdir()
    for entry in model_dir.iterdir():
        if entry.is_dir() and entry.name != drop:
            (out / entry.name).symlink_to(entry)
    index = json.loads((model_dir / "model_index.json").read_text())
    for k, v in index_changes.items():
        index.pop(k) if v is None else index.__setitem__(k, v)
    (out / "model_index.json").write_text(json.dumps(index))
    return out


# ---------------------------------------------------------------- loading


def test_a_two_expert_directory_loads_as_one_module_of_both(model_dir, adapter):
    from trainer.config import adapter_for_model_dir

    assert adapter_for_model_dir(model_dir) == "trainer.models.wan.WanAdapter"  # the same family and flags
    model = load_wan_transformer(model_dir, dtype=torch.float32)
    assert isinstance(model, WanExperts) and model.boundary_ratio == 0.7 and model.boundary == 700.0
    names = [n for n, _ in model.named_parameters()]
    high = [n for n in names if n.startswith("transformer.")]
    assert len(high) * 2 == len(names) and sorted(names) == sorted(high + [n.replace("transformer.", "transformer_2.", 1)
                                                                           for n in high])
    assert not torch.equal(model.transformer.proj_out.weight, model.transformer_2.proj_out.weight)
    from trainer.core.modules import repeated_blocks

    assert len(repeated_blocks(model)) == 4  # both experts' blocks: FSDP2 units, checkpointing, compile


@pytest.mark.parametrize("change, message", [
    ({"drop": "transformer_2"}, "has no transformer_2/ subfolder"),
    ({"boundary_ratio": 1.0}, "boundary_ratio is 1.0: it must be a number in (0, 1)"),
    ({"boundary_ratio": 0}, "boundary_ratio is 0: it must be a number in (0, 1)"),
    ({"boundary_ratio": "0.9"}, "boundary_ratio is '0.9': it must be a number in (0, 1)"),
    ({"boundary_ratio": None}, "boundary_ratio is None: it must be a number in (0, 1)"),
    ({"transformer_2": [None, None]}, "sets boundary_ratio 0.7 but declares no transformer_2"),
    ({"expand_timesteps": True}, "expand_timesteps (Wan2.2 TI2V-5B"),
], ids=["no-subfolder", "ratio-1", "ratio-0", "ratio-string", "no-ratio", "no-second-expert", "ti2v"])
def test_a_broken_two_expert_directory_is_refused_before_loading(model_dir, tmp_path, change, message):
    bad = variant(model_dir, tmp_path, **change)
    with pytest.raises((ValueError, FileNotFoundError)) as e:
        load_wan_transformer(bad)
    assert message in str(e.value) and "--model-path" in str(e.value)


def test_the_tiny_builder_cli_writes_a_two_expert_directory(tmp_path):
    from tools.tiny_wan import main

    assert main(["--output-dir", str(tmp_path / "m"), "--two-experts"]) == 0
    assert read_boundary_ratio(tmp_path / "m") == 0.7 and (tmp_path / "m" / "transformer_2").is_dir()


# ---------------------------------------------------------------- sampling == WanPipeline


@pytest.mark.parametrize("guidance_2", [None, 3.0], ids=["one-scale", "guidance_scale_2"])
def test_the_engine_samples_what_wanpipeline_samples_with_both_experts(engine, adapter, guidance_2):
    """Every step deterministic (as tests/test_family_wan.py does it): the engine's video is
    WanPipeline's with transformer, transformer_2 and boundary_ratio 0.7, CFG 4.5 (and 3.0 for
    the low-noise expert); running the high-noise expert everywhere gives another video."""
    from trainer.sampling import SamplingConfig

    cfg = dataclasses.replace(SamplingConfig(), **{**{k: v for k, v in CFG.items() if k != "sde_indices"},
                                                   "guidance_scale_2": guidance_2, "sde_type": "cps", "eta": 0.5})
    sigmas = engine.sigma_schedule(32, 32, 4)
    req = adapter.build_rollout_request(PROMPTS[1], group_index=0, slot=0, sample_id="p", sampling=cfg,
                                        sde_indices=[3], sigmas=sigmas, generation_seed=5)
    assert req.expert_boundary == 700.0 and req.guidance_scale_2 == guidance_2
    ours = engine.generate([req]).images
    pipe = engine.prompt_encoder.pipeline
    assert pipe.transformer_2 is engine.transformer.transformer_2 and pipe.config.boundary_ratio == 0.7
    pipe.scheduler = type(pipe.scheduler).from_config(engine.scheduler_config)
    pipe.set_progress_bar_config(disable=True)
    x_t = initial_noise([16, 2, 4, 4], 5, "p")[None]
    kw = dict(negative_prompt="", height=32, width=32, num_frames=5, num_inference_steps=4, guidance_scale=4.5,
              guidance_scale_2=guidance_2, latents=x_t, output_type="pt")
    theirs = pipe(PROMPTS[1], **kw).frames
    assert ours.shape == theirs.shape == (1, 5, 3, 32, 32)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)
    pipe.transformer_2, low = pipe.transformer, pipe.transformer_2
    try:
        high_only = pipe(PROMPTS[1], **kw).frames
    finally:
        pipe.transformer_2 = low
    assert (high_only - theirs).abs().max() > 1e-3  # the low-noise expert did run


# ---------------------------------------------------------------- replay == sampler


@pytest.mark.parametrize("sampling", [SAMPLING, CFG, CFG_2], ids=["no-cfg", "cfg-4.5", "cfg-4.5-and-3"])
def test_replay_runs_the_expert_the_sampler_ran(engine, adapter, model_dir, sampling):
    """Columns on both sides of the boundary: each column's replay through a separately loaded
    two-expert actor is the sampler's log-prob exactly, both columns in one forward (a mixed
    batch) to 1e-6, a sidecar round trip (which records the boundary and guidance_scale_2)
    replays the same; with the experts swapped the replay differs on every column."""
    from trainer.artifacts import group_sidecar_payload, sidecar_to_trajectory

    traj, cfg = rollout(engine, adapter, sampling)
    assert traj.sampler.expert_boundary == 700.0 and traj.sampler.guidance_scale_2 == sampling.get("guidance_scale_2")
    assert traj.timesteps[0, 0] >= 700.0 > traj.timesteps[0, 1]
    actor = load_wan_transformer(model_dir, dtype=torch.float32)
    with torch.no_grad():
        cols = torch.stack([adapter.replay_transition(actor, traj, c) for c in range(traj.num_steps)], 1)
        together = adapter.replay_transitions(actor, traj)
        tensors, metadata = group_sidecar_payload(traj[0:2], task="t2v", rollout_id=0, sampling=cfg)
        back = sidecar_to_trajectory(tensors, metadata)
        from_sidecar = adapter.replay_transitions(actor, back)
        actor.transformer, actor.transformer_2 = actor.transformer_2, actor.transformer
        swapped = torch.stack([adapter.replay_transition(actor, traj, c) for c in range(traj.num_steps)], 1)
    assert back.sampler == traj.sampler
    assert torch.equal(cols, traj.log_probs) and torch.isfinite(traj.log_probs).all()
    torch.testing.assert_close(together, traj.log_probs, rtol=0, atol=1e-6)
    assert torch.equal(from_sidecar, together[0:2])
    assert ((swapped - traj.log_probs).abs() > 1e-4).all()


def test_a_replay_on_another_boundary_or_a_one_dit_model_is_refused(engine, adapter, model_dir):
    traj, _ = rollout(engine, adapter, CFG)
    actor = load_wan_transformer(model_dir, dtype=torch.float32)
    moved = dataclasses.replace(traj, sampler=dataclasses.replace(traj.sampler, expert_boundary=800.0))
    with pytest.raises(ValueError, match="sampled with expert boundary 800.0 .* this transformer's is 700.0"):
        adapter.replay_transitions(actor, moved)
    with pytest.raises(ValueError, match="this transformer's is None"):
        adapter.replay_transitions(actor.transformer, traj)


def test_guidance_scale_2_needs_cfg_and_two_experts(engine, adapter):
    cfg = parse_sampling_config({**SAMPLING, "guidance_scale_2": 3.0})
    with pytest.raises(ValueError, match="guidance_scale_2 is 3.0 but guidance_scale is 1.0"):
        adapter.build_rollout_request("a", group_index=0, slot=0, sample_id="a", sampling=cfg, sde_indices=[1],
                                      sigmas=engine.sigma_schedule(32, 32, 4), generation_seed=1)
    one_dit = WanAdapter()
    with pytest.raises(ValueError, match="guidance_scale_2 is set, but --model-path has one DiT"):
        one_dit.build_rollout_request("a", group_index=0, slot=0, sample_id="a", sampling=parse_sampling_config(CFG_2),
                                      sde_indices=[1], sigmas=engine.sigma_schedule(32, 32, 4), generation_seed=1)
    # a later key: a config without it keeps the fingerprint its artifacts already carry
    plain = parse_sampling_config(CFG)
    assert plain.guidance_scale_2 is None
    assert plain.fingerprint() == parse_sampling_config({**CFG, "guidance_scale_2": None}).fingerprint() != \
        parse_sampling_config(CFG_2).fingerprint()


# ---------------------------------------------------------------- training


@pytest.mark.parametrize("mode, columns, experts", [
    ("lora", (0, 2), ("transformer", "transformer_2")),
    ("lora", (0, 1), ("transformer",)),
    ("full", (1, 2), ("transformer_2",)),
], ids=["lora-both-sides", "lora-high-noise-column", "full-low-noise-column"])
def test_first_ratio_is_one_and_each_expert_learns_only_from_its_columns(engine, adapter, model_dir, mode, columns,
                                                                         experts):
    """The actor holds both experts under FSDP2 (one rank), LoRA on to_q / to_k / to_v / to_out.0
    of both or a full fine-tune: ratio exactly 1 on the first update, and exactly the trainable
    parameters of the experts that ran a trained column move (every one of them): trained on a
    column of each side, both experts; on one side only, the other expert gets no gradient and
    stays put. Nothing frozen moves."""
    from tests.dist.tiny import full_params, make_cfg, one_rank_mesh
    from trainer.actor import Actor
    from trainer.core.names import model_name
    from trainer.loop import make_replay_fn

    batch, _ = rollout(engine, adapter, {**CFG_2, "eta": 1.0})
    rows = batch.without_images().columns(*columns)
    gen = one_rank_mesh()
    mesh = next(gen)
    try:
        run_cfg = make_cfg(mode, optim__lr=1e-2, fsdp__fsdp_master_dtype="fp32", grpo__eps_clip=0.5)
        actor = Actor.from_adapter(adapter, str(model_dir), mesh, run_cfg, device=torch.device("cpu"))
        before = full_params(actor.model)
        m = actor.train_step(rows, torch.tensor([1.0, -1.0, 0.5, -0.5]), make_replay_fn(adapter))
        after = full_params(actor.model)
        first = actor.last_update_stats[0]
        assert first["ratio_max"].item() == 1.0 == first["ratio_min"].item()
        assert math.isfinite(m["train/loss"])
        trainable = {model_name(n) for n, p in actor.model.named_parameters() if p.requires_grad}
        assert all(".lora_" in n for n in trainable) == (mode == "lora")
        assert {n.split(".")[0] for n in trainable} == {"transformer", "transformer_2"}
        moved = {n for n in trainable if not torch.equal(before[n], after[n])}
        assert moved == {n for n in trainable if n.split(".")[0] in experts}, sorted(trainable - moved)[:4]
        assert all(torch.equal(before[n], after[n]) for n in before if n not in trainable)
    finally:
        next(gen, None)


def test_preflight_checks_the_experts_and_guidance_scale_2(model_dir, tmp_path, monkeypatch):
    """configs/wan22_t2v_tiny.toml passes on the two-expert model; a broken declaration, a missing
    expert and guidance_scale_2 without CFG or on a one-DiT model are each one named violation."""
    from pathlib import Path

    from tools.tiny_wan import build_tiny_wan_pipeline
    from trainer.config import load_config
    from trainer.preflight import PreflightError, validate

    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "a red ball", "metadata": {"task": "t2v", "sample_id": "t0"}}) + "\n")
    monkeypatch.setenv("PROMPTS", str(prompts))
    recipe = str(Path(__file__).resolve().parents[1] / "configs" / "wan22_t2v_tiny.toml")

    def problems(model, *argv: str) -> list[str]:
        monkeypatch.setenv("TINY_WAN22", str(model))
        try:
            validate(load_config(["--config", recipe, "--save", str(tmp_path / "ckpt"), "--num-rollout", "2",
                                  "--artifact-root", str(tmp_path / "art"), *argv]), 2)
        except PreflightError as e:
            return e.problems
        return []

    assert problems(model_dir) == []
    nft = problems(model_dir, "--algorithm", "nft", "--adv-clip-max", "5", "--sampling-config.guidance_scale",
                   "1.0", "--sampling-config.guidance_scale_2", "null")
    assert len(nft) == 1 and "--algorithm nft with --model-path" in nft[0] and "use --algorithm flowgrpo" in nft[0]
    (p,) = problems(model_dir, "--sampling-config.guidance_scale", "1.0")
    assert "guidance_scale_2 is 3.0 but guidance_scale is 1.0" in p
    (p,) = problems(variant(model_dir, tmp_path, boundary_ratio=2))
    assert "boundary_ratio is 2: it must be a number in (0, 1)" in p and "--model-path" in p
    shutil.rmtree(tmp_path / "variant")
    (p,) = problems(variant(model_dir, tmp_path, drop="transformer_2"))
    assert "declares transformer_2" in p and "no transformer_2/ subfolder" in p
    one_dit = build_tiny_wan_pipeline(tmp_path / "wan21", seed=0)
    (p,) = problems(one_dit)
    assert "guidance_scale_2 is 3.0, but --model-path" in p and "has one DiT" in p

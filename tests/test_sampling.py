"""Unit tests for trainer/sampling.py: the --sampling-config keys, trained-step resolution, the
step-0 routes, the sigma schedule against diffusers, the latent grid and the seeds."""

import dataclasses
import hashlib
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from tools.make_tiny_model import QWEN_IMAGE_SCHEDULER_CONFIG
from trainer import sampling as sp

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The validated LoRA recipe's --sampling-config (reference "Reference configuration").
RECIPE = {
    "height": 384, "width": 384, "num_inference_steps": 12, "guidance_scale": 1.0, "eta": 0.7,
    "sde_type": "sde", "sde_indices": [3, 4, 5], "sde_resample_per_rollout": True, "num_sde_steps": 3,
    "sde_pool": [1, 2, 3, 4, 5], "driver_xt": True, "sample_id_mode": "metadata",
}

# Qwen/Qwen-Image scheduler/scheduler_config.json (public), as saved with its class name.
QWEN_IMAGE_SCHEDULER = {"_class_name": "FlowMatchEulerDiscreteScheduler", **QWEN_IMAGE_SCHEDULER_CONFIG}


# ---------------------------------------------------------------- config keys


def test_defaults_match_reference_table():
    c = sp.parse_sampling_config(None)
    assert (c.height, c.width, c.num_inference_steps) == (384, 384, 12)
    assert c.guidance_scale == 1.0 and c.eta == 0.7 and c.sigma_max == 0.99
    assert c.sde_type == "sde" and c.driver_sigmas is True and c.driver_xt is True
    assert c.init_noise_latent_shape is None and c.sample_id_mode == "metadata"
    assert c.sde_resample_per_rollout is False and c.sde_pool is None and c.sde_indices is None
    assert c.num_sde_steps == 0 and c.sde_timestep_fraction == [0.0, 1.0]
    assert c.sde_window_size == 0 and c.sde_window_range is None
    assert set(c.to_dict()) == {f.name for f in dataclasses.fields(sp.SamplingConfig)}
    assert c.num_frames == 1  # the video key, added later (an image is one frame)
    assert c.guidance_scale_2 is None  # a two-expert model's low-noise scale, added later
    assert len(c.to_dict()) == 22
    assert c.negative_prompt == " " and c.cfg_renorm is True  # used only when guidance_scale > 1
    assert sp.parse_sampling_config({}) == c == sp.parse_sampling_config("{}")


def test_parse_dict_and_json_string_and_fingerprint():
    a = sp.parse_sampling_config(RECIPE)
    b = sp.parse_sampling_config(json.dumps(dict(reversed(list(RECIPE.items())))))
    assert a == b and a.sde_pool == [1, 2, 3, 4, 5] and a.sde_resample_per_rollout
    # the keys added later are left out at their defaults: older artifacts keep their fingerprint
    d = {k: v for k, v in a.to_dict().items()
         if k not in ("sde_window_size", "sde_window_range", "negative_prompt", "cfg_renorm", "num_frames",
                      "guidance_scale_2")}
    blob = json.dumps(d, sort_keys=True, separators=(",", ":"))
    assert a.fingerprint() == hashlib.sha256(blob.encode()).hexdigest() == b.fingerprint()
    assert sp.parse_sampling_config(None).fingerprint() == (
        "c6f8fc22625e30aa2aad8660f50251a7447bf9d92b92b9e1972018c717a67a55")
    windowed = {"num_inference_steps": 12, "sde_window_size": 2, "sde_window_range": [1, 6]}
    assert sp.parse_sampling_config(windowed).fingerprint() != sp.parse_sampling_config(
        dict(windowed, sde_window_range=[1, 7])).fingerprint()
    assert sp.parse_sampling_config(dict(RECIPE, eta=0.8)).fingerprint() != a.fingerprint()
    assert sp.parse_sampling_config(a) == a  # a parsed config passes through
    assert sp.parse_sampling_config({"eta": 1}).eta == 1.0 and isinstance(sp.parse_sampling_config({"eta": 1}).eta, float)


def test_parse_collects_every_problem_in_one_error():
    bad = {
        "etaa": 0.7, "heigth": 384, "sde_type": "ode", "sample_id_mode": "random", "eta": -0.1,
        "width": 0, "num_inference_steps": 12.0, "sde_timestep_fraction": [0.5, 0.5],
        "sde_indices": [1, 12], "driver_xt": 1, "guidance_scale": 0.5, "sigma_max": 1.0,
        "init_noise_latent_shape": [16, 0, 48],
    }
    with pytest.raises(ValueError) as e:
        sp.parse_sampling_config(bad)
    lines = str(e.value).splitlines()[1:]
    assert len(lines) == 12, str(e.value)  # 13 keys, sde_indices unchecked (N invalid)
    assert all("--sampling-config key '" in ln for ln in lines)
    msg = str(e.value)
    assert "'etaa': unknown key (did you mean 'eta'?)" in msg
    assert "'heigth': unknown key (did you mean 'height'?)" in msg
    for key in ("sde_type", "sample_id_mode", "eta", "width", "num_inference_steps", "sde_timestep_fraction",
                "driver_xt", "guidance_scale", "sigma_max", "init_noise_latent_shape"):
        assert f"key '{key}'" in msg
    # indices are range-checked against num_inference_steps only when that key is valid
    assert "key 'sde_indices'" not in msg
    # the same problems as data, for preflight: one line each, and the keys they name
    assert isinstance(e.value, sp.SamplingConfigError) and e.value.problems == [ln.strip() for ln in lines]
    assert e.value.keys == set(bad) - {"sde_indices"}
    with pytest.raises(ValueError, match=r"'sde_indices': step indices \[12\] are outside \[0, num_inference_steps=12\)"):
        sp.parse_sampling_config({"sde_indices": [1, 12]})


def test_parse_cross_key_checks():
    def problems(d):
        with pytest.raises(ValueError) as e:
            sp.parse_sampling_config(d)
        return str(e.value)

    assert "cannot be drawn without replacement" in problems(
        {"sde_resample_per_rollout": True, "num_sde_steps": 4, "sde_pool": [1, 2, 3]})
    assert "must be >= 1 when sde_resample_per_rollout" in problems({"sde_resample_per_rollout": True})
    assert "do not fit" in problems({"num_sde_steps": 3, "sde_timestep_fraction": [0.0, 0.2]})  # window [0, 1]
    assert "repeated steps" in problems({"sde_pool": [1, 1, 2]})
    assert "'eta': is 0 while SDE steps are trained" in problems({"eta": 0.0, "sde_indices": [2]})
    assert "not valid JSON" in problems("{eta: 1}")
    assert "use null, not []" in problems({"sde_indices": []})
    with pytest.raises(ValueError, match="must be a JSON object"):
        sp.parse_sampling_config("[1, 2]")
    # fine: eta 0 with nothing trained, a pool only used by a redraw that is off
    assert sp.parse_sampling_config({"eta": 0}).eta == 0.0
    assert sp.parse_sampling_config({"sde_pool": [0, 1], "sde_indices": [1]}).sde_pool == [0, 1]


# ---------------------------------------------------------------- trained steps


def test_fraction_window_example_resolves_to_0_2_4():
    cfg = {"sde_timestep_fraction": [0.0, 0.5], "num_sde_steps": 3}
    assert sp.resolve_sde_indices(cfg, 12, None) == [0, 2, 4]
    assert sp.resolve_sde_indices(cfg, 12, 7) == [0, 2, 4]  # no redraw configured
    # window range(int(2.4), int(9.6)) = [2..8] (7 steps); 4 picks at floor(k*7/4) = 0, 1, 3, 5
    assert sp.resolve_sde_indices({"sde_timestep_fraction": [0.2, 0.8], "num_sde_steps": 4}, 12, None) == [2, 3, 5, 7]
    # whole window when num_sde_steps == len(window)
    assert sp.resolve_sde_indices({"sde_timestep_fraction": [0.5, 1.0], "num_sde_steps": 6}, 12, None) == list(range(6, 12))


def test_explicit_indices_sorted_deduplicated_and_empty_default():
    assert sp.resolve_sde_indices({"sde_indices": [5, 3, 3, 1]}, 12, None) == [1, 3, 5]
    assert sp.resolve_sde_indices({"sde_indices": [5, 3], "num_sde_steps": 2}, 12, 3) == [3, 5]
    assert sp.resolve_sde_indices({}, 12, None) == []
    assert sp.resolve_sde_indices(sp.SamplingConfig(), 12, 4) == []


def test_resample_reproducible_per_rollout_and_identical_across_calls():
    cfg = sp.parse_sampling_config(RECIPE)
    draws = {k: sp.resolve_sde_indices(cfg, 12, k) for k in range(20)}
    for k, idx in draws.items():
        assert idx == sp.resolve_sde_indices(dict(RECIPE), 12, k)  # same from the raw dict, every call
        expected = sorted(int(i) for i in np.random.default_rng(k).choice([1, 2, 3, 4, 5], size=3, replace=False))
        assert idx == expected
        assert len(idx) == 3 and len(set(idx)) == 3 and set(idx) <= {1, 2, 3, 4, 5}
        assert all(type(i) is int for i in idx)
    assert len({tuple(v) for v in draws.values()}) > 3  # it really redraws
    # evaluation (no rollout id) falls back to the explicit indices
    assert sp.resolve_sde_indices(cfg, 12, None) == [3, 4, 5]
    # the pool defaults to the fraction window
    win = {"sde_resample_per_rollout": True, "num_sde_steps": 2, "sde_timestep_fraction": [0.25, 0.75]}
    for k in range(10):
        idx = sp.resolve_sde_indices(win, 12, k)
        assert idx == sorted(int(i) for i in np.random.default_rng(k).choice(list(range(3, 9)), size=2, replace=False))
    with pytest.raises(ValueError, match="rollout_id"):
        sp.resolve_sde_indices(cfg, 12, -1)


def test_resample_is_the_same_in_another_process():
    code = ("import json,sys; from trainer.sampling import resolve_sde_indices as r; "
            f"print(json.dumps([r({RECIPE!r}, 12, k) for k in range(8)]))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True,
                         env=dict(os.environ, PYTHONHASHSEED="123"))
    assert json.loads(out.stdout) == [sp.resolve_sde_indices(RECIPE, 12, k) for k in range(8)]


def test_step_zero_routes():
    # the recipe (pool and indices without 0) is clean
    assert sp.trainable_step_zero_routes(sp.parse_sampling_config(RECIPE)) == []
    assert sp.trainable_step_zero_routes(sp.SamplingConfig()) == []
    # explicit indices
    r = sp.trainable_step_zero_routes(sp.parse_sampling_config({"sde_indices": [0, 3]}))
    assert len(r) == 1 and "'sde_indices'" in r[0] and r[0].startswith("--sampling-config")
    # the pool of a redraw
    r = sp.trainable_step_zero_routes(sp.parse_sampling_config(
        dict(RECIPE, sde_pool=[0, 1, 2, 3], sde_indices=[1, 2, 3])))
    assert len(r) == 1 and "'sde_pool'" in r[0]
    # the derived window, through stride picks: the documented [0.0, 0.5] example
    r = sp.trainable_step_zero_routes({"sde_timestep_fraction": [0.0, 0.5], "num_sde_steps": 3})
    assert len(r) == 1 and "'sde_timestep_fraction'" in r[0] and "[0, 2, 4]" in r[0]
    # the derived window as the redraw pool (explicit indices hide the stride route)
    r = sp.trainable_step_zero_routes({"sde_resample_per_rollout": True, "num_sde_steps": 2, "sde_indices": [2, 4]})
    assert len(r) == 1 and "redraw" in r[0]
    # every route at once
    r = sp.trainable_step_zero_routes({"sde_resample_per_rollout": True, "num_sde_steps": 2,
                                       "sde_indices": [0, 4], "sde_pool": [0, 5]})
    assert len(r) == 2
    # a window starting above 1/N is fine, so is a pool with 0 when no redraw uses it
    assert sp.trainable_step_zero_routes({"sde_timestep_fraction": [0.1, 0.5], "num_sde_steps": 3}) == []
    assert sp.trainable_step_zero_routes({"sde_pool": [0, 1], "sde_indices": [1]}) == []
    # dance is exempt on every route
    assert sp.trainable_step_zero_routes({"sde_type": "dance", "sde_indices": [0], "sde_pool": [0, 1],
                                          "sde_resample_per_rollout": True, "num_sde_steps": 1}) == []


def test_step_zero_route_lines_match_what_would_be_trained():
    """A config flagged by the window route really resolves to a list containing 0 for some id."""
    cfg = {"sde_resample_per_rollout": True, "num_sde_steps": 3, "sde_timestep_fraction": [0.0, 0.5]}
    assert sp.trainable_step_zero_routes(cfg)
    assert any(0 in sp.resolve_sde_indices(cfg, 12, k) for k in range(50))
    clean = dict(cfg, sde_timestep_fraction=[0.1, 0.6])
    assert sp.trainable_step_zero_routes(clean) == []
    assert not any(0 in sp.resolve_sde_indices(clean, 12, k) for k in range(50))
    assert sp.resolve_sde_indices(clean, 12, None) == [1, 3, 5]


# ---------------------------------------------------------------- invariants of every rollout


def test_guidance_scale_problem_allows_1_and_true_cfg_above():
    for good in (1.0, 1, 4.0, 4.5):
        assert sp.guidance_scale_problem(good) is None, good
    for bad in (0.5, 0.0, "1.0", None, float("nan")):
        assert sp.guidance_scale_problem(bad).startswith("must be a number >= 1.0"), bad
    # the parser reports the same rule under its key, and takes the CFG keys
    with pytest.raises(sp.SamplingConfigError, match=r"key 'guidance_scale': must be a number >= 1.0"):
        sp.parse_sampling_config({"guidance_scale": 0.9})
    c = sp.parse_sampling_config({"guidance_scale": 4.0, "negative_prompt": "blurry", "cfg_renorm": False})
    assert (c.guidance_scale, c.negative_prompt, c.cfg_renorm) == (4.0, "blurry", False)
    with pytest.raises(sp.SamplingConfigError, match="key 'negative_prompt': must be a string"):
        sp.parse_sampling_config({"negative_prompt": 3})


def test_trained_steps_problem_needs_steps_in_range():
    assert sp.trained_steps_problem([1, 3, 5], 6) is None
    assert "the trained SDE step set is empty" in sp.trained_steps_problem([], 6)
    assert sp.trained_steps_problem([1, 6, -1], 6) == "step indices [6, -1] are outside [0, num_inference_steps=6)"
    # resolving trained steps applies the same rule
    with pytest.raises(ValueError, match=r"key 'sde_indices': step indices \[8\] are outside"):
        sp.resolve_sde_indices(sp.SamplingConfig(sde_indices=[1, 8]), 8, None)


def test_step_zero_problem_only_under_sde():
    assert "step 0 under sde_type 'sde' is singular" in sp.step_zero_problem([2, 0], "sde")
    assert sp.step_zero_problem([0, 2], "dance") is None
    assert sp.step_zero_problem([1, 2], "sde") is None
    assert sp.step_zero_problem([], "sde") is None


def test_sigma_count_problem_wants_n_plus_one():
    sigmas = sp.sigma_schedule(QWEN_IMAGE_SCHEDULER, 6, 256)
    assert len(sigmas) == 7 and sp.sigma_count_problem(sigmas, 6) is None
    assert sp.sigma_count_problem(sigmas[:-1], 6).startswith("6 sigmas for 6 steps")


# ---------------------------------------------------------------- sigma schedule


def _diffusers_sigmas(config, n, seq_len):
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift, retrieve_timesteps

    sched = FlowMatchEulerDiscreteScheduler.from_config(config)
    sigmas = np.linspace(1.0, 1 / n, n)  # exactly what QwenImagePipeline.__call__ does
    mu = calculate_shift(
        seq_len,
        sched.config.get("base_image_seq_len", 256),
        sched.config.get("max_image_seq_len", 4096),
        sched.config.get("base_shift", 0.5),
        sched.config.get("max_shift", 1.15),
    )
    timesteps, _ = retrieve_timesteps(sched, n, "cpu", sigmas=sigmas, mu=mu)
    return sched.sigmas, timesteps, mu


@pytest.mark.parametrize("n,height,width", [(12, 384, 384), (10, 512, 768), (28, 1024, 1024), (2, 64, 64)])
def test_sigma_schedule_matches_qwen_image_pipeline(n, height, width):
    seq = sp.image_seq_len(height, width)
    ref_sigmas, ref_t, mu = _diffusers_sigmas(QWEN_IMAGE_SCHEDULER, n, seq)
    assert mu == pytest.approx(sp.calculate_shift(seq, 256, 8192, 0.5, 0.9), abs=1e-12)
    ours = sp.sigma_schedule(QWEN_IMAGE_SCHEDULER, n, seq)
    assert len(ours) == n + 1 and ours[-1] == 0.0 and ours[0] == 1.0
    assert ours == ref_sigmas.tolist()  # float32-exact
    assert abs(ours[-2] - 0.02) < 1e-6  # shift_terminal
    assert all(a > b for a, b in zip(ours, ours[1:]))
    assert sp.timesteps_from_sigmas(ours[:-1]) == ref_t.tolist()


@pytest.mark.parametrize("overrides", [
    {"use_dynamic_shifting": False, "shift": 3.0, "shift_terminal": None},
    {"use_dynamic_shifting": False, "shift": 1.0, "shift_terminal": None},
    {"time_shift_type": "linear"},
    {"shift_terminal": None, "max_image_seq_len": 4096, "max_shift": 1.15},
])
def test_sigma_schedule_other_scheduler_settings(overrides):
    config = dict(QWEN_IMAGE_SCHEDULER, **overrides)
    ref_sigmas, _, _ = _diffusers_sigmas(config, 12, 576)
    assert sp.sigma_schedule(config, 12, 576) == ref_sigmas.tolist()


def test_sigma_schedule_depends_on_resolution_and_rejects_unsupported():
    lo = sp.sigma_schedule(QWEN_IMAGE_SCHEDULER, 12, 256)
    hi = sp.sigma_schedule(QWEN_IMAGE_SCHEDULER, 12, 4096)
    assert all(a < b for a, b in zip(lo[1:-2], hi[1:-2]))  # more tokens -> more shift -> higher sigmas
    with pytest.raises(ValueError, match="use_karras_sigmas"):
        sp.sigma_schedule(dict(QWEN_IMAGE_SCHEDULER, use_karras_sigmas=True), 12, 576)
    with pytest.raises(ValueError, match="not supported"):
        sp.sigma_schedule(dict(QWEN_IMAGE_SCHEDULER, _class_name="DDIMScheduler"), 12, 576)
    with pytest.raises(ValueError, match="non-finite"):
        sp.sigma_schedule(QWEN_IMAGE_SCHEDULER, 1, 576)


def test_load_scheduler_config(tmp_path):
    (tmp_path / "scheduler").mkdir()
    (tmp_path / "scheduler" / "scheduler_config.json").write_text(json.dumps(QWEN_IMAGE_SCHEDULER))
    assert sp.load_scheduler_config(str(tmp_path)) == QWEN_IMAGE_SCHEDULER
    with pytest.raises(ValueError, match="--model-path"):
        sp.load_scheduler_config(str(tmp_path / "missing"))


def test_transformer_timestep_is_pipeline_rounding():
    t = sp.timesteps_from_sigmas(sp.sigma_schedule(QWEN_IMAGE_SCHEDULER, 12, 576)[:-1])
    got = sp.transformer_timestep(t[3], torch.bfloat16, batch_size=4)
    exp = torch.tensor(t[3]).expand(4).to(torch.bfloat16) / 1000
    assert got.shape == (4,) and got.dtype == torch.bfloat16 and torch.equal(got, exp)
    fp32 = sp.transformer_timestep(t, torch.float32)
    torch.testing.assert_close(fp32, torch.tensor(sp.sigma_schedule(QWEN_IMAGE_SCHEDULER, 12, 576)[:-1]))


# ---------------------------------------------------------------- geometry


def test_latent_grid_and_seq_len():
    assert sp.latent_grid(384, 384) == (48, 48)
    assert sp.latent_grid(512, 768) == (64, 96)
    assert sp.image_seq_len(384, 384) == 576
    assert sp.latent_grid(64, 96, vae_scale_factor=4) == (16, 24)  # the tiny test VAE
    with pytest.raises(ValueError, match=r"height=392 .* multiple of 16"):
        sp.latent_grid(392, 384)
    with pytest.raises(ValueError, match="width=0"):
        sp.latent_grid(384, 0)
    cfg = sp.parse_sampling_config({"height": 512, "width": 768})
    assert sp.init_noise_shape(cfg) == [16, 64, 96]
    assert sp.init_noise_shape(sp.parse_sampling_config({"init_noise_latent_shape": [4, 8, 8]})) == [4, 8, 8]


# ---------------------------------------------------------------- seeds and sample ids


def test_candidate_seed_range_and_inputs():
    s = sp.candidate_seed(1234, "prompt:p1:sample:0")
    assert 0 <= s < 2**63
    assert s == sp.candidate_seed(1234, "prompt:p1:sample:0")
    assert s != sp.candidate_seed(1234, "prompt:p1:sample:1")
    assert s != sp.candidate_seed(1235, "prompt:p1:sample:0")
    with pytest.raises(TypeError):
        sp.candidate_seed("1234", "x")


def test_candidate_seed_identical_under_different_hash_seeds():
    code = "from trainer.sampling import candidate_seed, step_seed; print(candidate_seed(1234, 'prompt:p1:sample:0'), step_seed(1234, 'prompt:p1:sample:0', 3))"
    runs = [subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True,
                           env=dict(os.environ, PYTHONHASHSEED=h)).stdout.split() for h in ("1", "2")]
    assert runs[0] == runs[1]
    assert runs[0] == [str(sp.candidate_seed(1234, "prompt:p1:sample:0")),
                       str(sp.step_seed(1234, "prompt:p1:sample:0", 3))]


def test_initial_and_step_noise_are_pure_functions_of_seed_id_step():
    shape = (16, 8, 8)
    a = sp.initial_noise(shape, 42, "prompt:a:sample:0")
    assert a.shape == shape and a.dtype == torch.float32 and a.device.type == "cpu"
    # same candidate, regardless of what else is drawn before or in between (batch composition)
    torch.manual_seed(0)
    _ = sp.initial_noise(shape, 42, "prompt:b:sample:3")
    _ = torch.randn(100)
    assert torch.equal(sp.initial_noise(shape, 42, "prompt:a:sample:0"), a)
    assert not torch.equal(sp.initial_noise(shape, 42, "prompt:a:sample:1"), a)
    assert not torch.equal(sp.initial_noise(shape, 43, "prompt:a:sample:0"), a)
    assert abs(a.mean().item()) < 0.15 and abs(a.std().item() - 1) < 0.1
    e3 = sp.step_noise(shape, 42, "prompt:a:sample:0", 3)
    assert torch.equal(e3, sp.step_noise(shape, 42, "prompt:a:sample:0", 3))
    assert not torch.equal(e3, sp.step_noise(shape, 42, "prompt:a:sample:0", 4))
    assert not torch.equal(e3, a) and not torch.equal(sp.step_noise(shape, 42, "prompt:a:sample:0", 0), a)
    # the global RNG is untouched
    torch.manual_seed(7)
    ref = torch.rand(3)
    torch.manual_seed(7)
    sp.step_noise(shape, 42, "prompt:a:sample:0", 1)
    assert torch.equal(torch.rand(3), ref)


def test_make_sample_id_modes():
    md = {"prompt_id": "p17", "sample_id": "pickapic_0001"}
    assert sp.make_sample_id("metadata", 3, 2, md) == "prompt:p17:sample:2"
    assert sp.make_sample_id("metadata", 3, 2, {"sample_id": "pickapic_0001"}) == "prompt:pickapic_0001:sample:2"
    assert sp.make_sample_id("metadata", 3, 2, {}) == "prompt:3:sample:2"
    assert sp.make_sample_id("metadata", 3, 2, None) == "prompt:3:sample:2"
    assert sp.make_sample_id("positional", 3, 2, md) == "prompt:3:sample:2"
    assert sp.make_sample_id("group_index", 5, 0, md) == "prompt:5:sample:0"
    with pytest.raises(ValueError, match="sample_id_mode"):
        sp.make_sample_id("random", 0, 0, md)


def test_importable_without_torch():
    code = "import sys, trainer.sampling as s; s.parse_sampling_config({}); s.resolve_sde_indices({}, 12, 1); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_rollout_generation_seed_fresh_per_rollout_and_reproducible():
    from trainer.sampling import rollout_generation_seed

    seeds = [rollout_generation_seed(42, k) for k in range(50)]
    assert len(set(seeds)) == 50
    assert seeds == [rollout_generation_seed(42, k) for k in range(50)]
    assert rollout_generation_seed(43, 0) != seeds[0]
    assert all(0 <= s < 2**63 for s in seeds)
    with pytest.raises(ValueError, match="rollout_id"):
        rollout_generation_seed(42, -1)


#: SD3.5-Medium's and -Large's scheduler/scheduler_config.json: a static shift of 3
SD3_SCHEDULER = {"_class_name": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": 1000, "shift": 3.0}


@pytest.mark.parametrize("config", [
    SD3_SCHEDULER,
    dict(SD3_SCHEDULER, shift=1.0),
    dict(SD3_SCHEDULER, shift=2.5, shift_terminal=0.05),
    dict(QWEN_IMAGE_SCHEDULER),  # dynamic exponential shift + terminal stretch
    dict(QWEN_IMAGE_SCHEDULER, time_shift_type="linear", shift_terminal=None),
])
@pytest.mark.parametrize("n", [2, 10, 28, 40])
def test_scheduler_sigma_schedule_is_the_stable_diffusion_3_pipelines(config, n):
    """StableDiffusion3Pipeline passes no sigmas: retrieve_timesteps(scheduler, n) (with mu only
    under dynamic shifting). Our schedule is that scheduler's float32 sigmas and timesteps exactly."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import calculate_shift, retrieve_timesteps

    seq = sp.image_seq_len(512, 512)
    sched = FlowMatchEulerDiscreteScheduler.from_config(config)
    kwargs = {}
    if sched.config.use_dynamic_shifting:
        kwargs["mu"] = calculate_shift(seq, sched.config.get("base_image_seq_len", 256),
                                       sched.config.get("max_image_seq_len", 4096),
                                       sched.config.get("base_shift", 0.5), sched.config.get("max_shift", 1.15))
    timesteps, _ = retrieve_timesteps(sched, n, "cpu", **kwargs)
    ours = sp.scheduler_sigma_schedule(config, n, seq)
    assert ours == sched.sigmas.tolist() and len(ours) == n + 1 and ours[-1] == 0.0
    assert sp.timesteps_from_sigmas(ours[:-1]) == timesteps.tolist()
    if not sched.config.use_dynamic_shifting and config["shift"] != 1.0:
        # not the explicit-linspace schedule of the other pipelines: the static shift applies twice
        assert ours != sp.sigma_schedule(config, n, seq)


def test_scheduler_sigma_schedule_rejects_unsupported():
    with pytest.raises(ValueError, match="use_karras_sigmas"):
        sp.scheduler_sigma_schedule(dict(SD3_SCHEDULER, use_karras_sigmas=True), 10, 1024)
    with pytest.raises(ValueError, match="num_inference_steps must be >= 1"):
        sp.scheduler_sigma_schedule(SD3_SCHEDULER, 0, 1024)

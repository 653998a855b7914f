"""sde_type "cps" (FlowGRPO's coefficients-preserving sampler) and the SDE window: the math
against a direct transcription of FlowGRPO's formulas, sampler == replay on the tiny model,
the window's draw and the parse-time rules, and a short update that learns."""

from __future__ import annotations

import math

import pytest
import torch

from trainer.engine.native import NativeEngine
from trainer.flow_grpo import (cps_log_prob, cps_transition_moments, flow_sde_transition_moments,
                               replay_transition_logp, sde_std_dev_t, sde_step)
from trainer.models.qwen_image import QwenImageAdapter
from trainer.train_model import full_tensor
from trainer.sampling import (SamplingConfigError, parse_sampling_config, resolve_sde_indices,
                              trainable_step_zero_routes)

pytestmark = pytest.mark.filterwarnings("ignore:FSDP2-wrapped module.*returned a view tensor")


def flowgrpo_cps(sample, model_output, sigma, sigma_prev, noise_level, noise):
    """FlowGRPO's sde_step_with_logprob, branch sde_type == "cps", transcribed line by line."""
    std_dev_t = sigma_prev * math.sin(noise_level * math.pi / 2)
    pred_original_sample = sample - sigma * model_output
    noise_estimate = sample + model_output * (1 - sigma)
    prev_sample_mean = pred_original_sample * (1 - sigma_prev) + noise_estimate * math.sqrt(
        sigma_prev**2 - std_dev_t**2)
    prev_sample = prev_sample_mean + std_dev_t * noise
    log_prob = -((prev_sample.detach() - prev_sample_mean) ** 2)
    log_prob = log_prob.mean(dim=tuple(range(1, log_prob.ndim)))
    return prev_sample, log_prob, prev_sample_mean, std_dev_t


# ---------------------------------------------------------------------------- the math


@pytest.mark.parametrize("sigma,sigma_next,eta", [(1.0, 0.9, 0.7), (0.6, 0.45, 0.3), (0.3, 0.1, 1.0)])
def test_cps_step_matches_flowgrpo(sigma, sigma_next, eta):
    g = torch.Generator().manual_seed(0)
    x, v, noise = (torch.randn(3, 16, 8, generator=g, dtype=torch.float64) for _ in range(3))
    ref_next, ref_logp, ref_mean, ref_std = flowgrpo_cps(x, v, sigma, sigma_next, eta, noise)
    mean, std = cps_transition_moments(x, v, sigma, sigma_next, eta)
    assert mean.dtype == torch.float32 and std.dtype == torch.float32
    torch.testing.assert_close(mean.double(), ref_mean, atol=1e-6, rtol=1e-6)
    assert std.flatten().item() == pytest.approx(ref_std, rel=1e-6)
    nxt, logp = sde_step(x, v, sigma, sigma_next, eta, noise, sde_type="cps")
    torch.testing.assert_close(nxt.double(), ref_next, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(logp.double(), ref_logp, atol=1e-9, rtol=1e-5)
    # the replay of the sample with the same velocity is the sampler's log-prob, bit for bit
    assert torch.equal(replay_transition_logp(x, nxt, v, sigma, sigma_next, eta, "cps"), logp)
    # and another velocity scores it by FlowGRPO's formula, with a gradient through the velocity
    v2 = (v + 0.1).float().requires_grad_(True)
    got = replay_transition_logp(x, nxt, v2, sigma, sigma_next, eta, "cps")
    _, _, mean2, _ = flowgrpo_cps(x, v2.detach().double(), sigma, sigma_next, eta, noise)
    torch.testing.assert_close(got.detach().double(), (-(nxt.double() - mean2) ** 2).mean(dim=(1, 2)),
                               atol=1e-7, rtol=1e-5)
    got.sum().backward()
    assert v2.grad is not None and v2.grad.abs().sum() > 0


def test_cps_preserves_the_marginal_coefficients_and_dispatch():
    """mean's noise coefficient and the std add up to sigma_next in quadrature (the name's
    promise); the shared moments function dispatches to it; "cps" has no g(sigma)."""
    s, s_next, eta = 0.8, 0.5, 0.6
    std = s_next * math.sin(eta * math.pi / 2)
    assert math.sqrt(s_next**2 - std**2) ** 2 + std**2 == pytest.approx(s_next**2)
    x, v = torch.randn(2, 5), torch.randn(2, 5)
    a = flow_sde_transition_moments(x, v, s, s_next, eta, "cps")
    b = cps_transition_moments(x, v, s, s_next, eta)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    with pytest.raises(ValueError, match="no diffusion coefficient"):
        sde_std_dev_t(0.5, 0.7, "cps")
    # the last step (sigma_next 0) is deterministic: std 0, the log-prob of the mean is 0, finite
    mean, std0 = cps_transition_moments(x, v, 0.2, 0.0, eta)
    assert std0.item() == 0.0 and torch.equal(cps_log_prob(mean, mean), torch.zeros(2))
    # a per-row [B] sigma broadcasts like a scalar one
    mb, _ = cps_transition_moments(x, v, torch.tensor([s, s]), torch.tensor([s_next, s_next]), eta)
    torch.testing.assert_close(mb, b[0])


# ---------------------------------------------------------------------------- the window


WINDOW = {"num_inference_steps": 12, "eta": 0.7, "sde_type": "cps", "sde_window_size": 2, "sde_window_range": [0, 6]}


def test_window_draw_is_reproducible_and_varies():
    cfg = parse_sampling_config(WINDOW)
    draws = {k: resolve_sde_indices(cfg, 12, k) for k in range(40)}
    assert draws == {k: resolve_sde_indices(cfg, 12, k) for k in range(40)}  # a pure function of the id
    assert all(len(w) == 2 and w[1] == w[0] + 1 and 0 <= w[0] and w[1] < 6 for w in draws.values())
    starts = {w[0] for w in draws.values()}
    assert starts == {0, 1, 2, 3, 4}  # every start in lo .. hi - size is drawn, nothing outside
    assert resolve_sde_indices(cfg, 12, None) == [0, 1]  # evaluation: the window at lo
    # the default range is FlowGRPO's first half; the draw is the same generator as the redraw's
    dflt = parse_sampling_config({k: v for k, v in WINDOW.items() if k != "sde_window_range"})
    import numpy as np

    assert resolve_sde_indices(dflt, 12, 7)[0] == int(np.random.default_rng(7).integers(0, 6 - 2 + 1))


def _problems(d):
    with pytest.raises(SamplingConfigError) as exc:
        parse_sampling_config(d)
    return exc.value.problems


def test_window_parse_errors_name_the_flag_and_key():
    (p,) = _problems(dict(WINDOW, sde_window_range=[2, 3]))
    assert p.startswith("--sampling-config key 'sde_window_size'") and "does not fit" in p
    (p,) = _problems(dict(WINDOW, sde_window_range=[3, 13]))
    assert p.startswith("--sampling-config key 'sde_window_range'") and "num_inference_steps=12" in p
    (p,) = _problems(dict(WINDOW, sde_window_range=[4, 4]))
    assert "'sde_window_range'" in p and "lo < hi" in p
    (p,) = _problems({"sde_window_range": [1, 4], "sde_indices": [1]})
    assert "'sde_window_range'" in p and "no effect without sde_window_size" in p
    (p,) = _problems(dict(WINDOW, sde_window_size=-1))
    assert "'sde_window_size'" in p
    ps = _problems(dict(WINDOW, sde_indices=[1, 2], sde_pool=[1, 2, 3], num_sde_steps=2, sde_resample_per_rollout=True))
    assert {p.split("'")[1] for p in ps} == {"sde_indices", "sde_pool", "num_sde_steps", "sde_resample_per_rollout"}
    assert all("cannot be combined with sde_window_size=2" in p for p in ps)


def test_window_at_step_zero_under_sde_is_refused():
    sde = dict(WINDOW, sde_type="sde")
    (line,) = trainable_step_zero_routes(parse_sampling_config(sde))
    assert "'sde_window_size' / 'sde_window_range'" in line and "step 0" in line and "[1, 6]" in line
    assert trainable_step_zero_routes(parse_sampling_config(dict(sde, sde_window_range=[1, 6]))) == []
    assert trainable_step_zero_routes(parse_sampling_config(WINDOW)) == []  # cps: step 0 is regular
    assert trainable_step_zero_routes(parse_sampling_config({"sde_type": "cps", "sde_indices": [0, 1]})) == []


def test_cps_rules_eta_and_last_step():
    (p,) = _problems(dict(WINDOW, eta=1.5))
    assert p.startswith("--sampling-config key 'eta'") and "(0, 1]" in p
    (p,) = _problems({"num_inference_steps": 6, "sde_type": "cps", "sde_indices": [1, 5]})
    assert p.startswith("--sampling-config key 'sde_indices'") and "last step 5" in p
    (p,) = _problems(dict(WINDOW, sde_window_range=[8, 12]))
    assert p.startswith("--sampling-config key 'sde_window_range'") and "last step 11" in p
    (p,) = _problems({"num_inference_steps": 6, "sde_type": "cps", "sde_resample_per_rollout": True,
                      "num_sde_steps": 2, "sde_pool": [2, 5]})
    assert "'sde_pool'" in p and "last step 5" in p
    (p,) = _problems({"num_inference_steps": 6, "sde_type": "cps", "num_sde_steps": 6})
    assert "'sde_timestep_fraction'" in p and "last step 5" in p
    assert parse_sampling_config({"num_inference_steps": 6, "sde_type": "cps", "num_sde_steps": 2}).sde_type == "cps"
    # the same steps are fine under "sde" (std > 0 at the last step there)
    assert parse_sampling_config({"num_inference_steps": 6, "sde_indices": [1, 5]}).sde_indices == [1, 5]


# ---------------------------------------------------------------------------- the tiny model


@pytest.fixture(scope="module")
def adapter():
    return QwenImageAdapter()


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return NativeEngine(str(tiny_model_dir), device="cpu", dtype=torch.float32, max_batch_size=8)


def rollout(adapter, engine, sampling, rollout_id, prompts=("a cat", "a longer prompt about a red panda")):
    steps = resolve_sde_indices(sampling, sampling.num_inference_steps, rollout_id)
    sigmas = engine.sigma_schedule(sampling.height, sampling.width, sampling.num_inference_steps)
    reqs = [adapter.build_rollout_request(p, group_index=g, slot=s, sample_id=f"prompt:{g}:sample:{s}",
                                          sampling=sampling, sde_indices=steps, sigmas=sigmas, generation_seed=3)
            for g, p in enumerate(prompts) for s in range(2)]
    return engine.generate(reqs)


CPS = {"height": 32, "width": 32, "num_inference_steps": 6, "eta": 0.7, "sde_type": "cps"}


@pytest.mark.parametrize("keys", [{"sde_indices": [0, 2, 4]}, {"sde_window_size": 2, "sde_window_range": [0, 5]}],
                         ids=["indices_with_step_0", "window"])
def test_cps_sampler_logprob_replays(adapter, engine, tiny_model_dir, keys):
    cfg = parse_sampling_config(dict(CPS, **keys))
    batch = rollout(adapter, engine, cfg, rollout_id=5)
    assert batch.sde_type == "cps" and batch.sde_indices == resolve_sde_indices(cfg, 6, 5)
    assert torch.isfinite(batch.log_probs).all() and (batch.log_probs < 0).all()
    actor = adapter.load_train_model(str(tiny_model_dir), dtype=torch.float32)
    with torch.no_grad():
        one = adapter.replay_transitions(actor, batch)
        torch.testing.assert_close(one, batch.log_probs, atol=1e-5, rtol=0)
        for col in range(batch.num_steps):
            torch.testing.assert_close(adapter.replay_transition(actor, batch[[1, 2]], col),
                                       batch.log_probs[[1, 2], col], atol=1e-5, rtol=0)
    if "sde_window_size" in keys:  # another rollout id trains another window
        others = {tuple(resolve_sde_indices(cfg, 6, k)) for k in range(10)}
        assert len(others) > 1


def test_cps_window_update_learns(adapter, engine, tiny_model_dir):
    """Sample with cps + a window, update twice at a high learning rate: the first update's ratio
    is exactly 1, the loss finite, every trainable parameter moves and every frozen one does not."""
    from tests.dist.tiny import make_cfg, one_rank_mesh
    from trainer.actor import Actor
    from trainer.loop import make_replay_fn

    cfg = parse_sampling_config(dict(CPS, sde_window_size=2, sde_window_range=[0, 5]))
    batch = rollout(adapter, engine, cfg, rollout_id=1)
    mesh_gen = one_rank_mesh()
    mesh = next(mesh_gen)
    try:
        actor = Actor(adapter.load_train_model(str(tiny_model_dir), dtype=torch.float32), mesh,
                      make_cfg("full", optim__lr=1e-2, grpo__eps_clip=0.2), device=torch.device("cpu"),
                      adapter=adapter)
        before = {n: full_tensor(p).clone() for n, p in actor.model.named_parameters()}
        trainable = {n for n, p in actor.model.named_parameters() if p.requires_grad}
        metrics = actor.train_step(batch, torch.tensor([1.0, -1.0, 0.5, -0.5]), make_replay_fn(adapter))
        first = actor.last_update_stats[0]
        assert first["ratio_max"].item() == 1.0 and first["ratio_min"].item() == 1.0
        assert all(math.isfinite(v) for v in metrics.values())
        after = {n: full_tensor(p) for n, p in actor.model.named_parameters()}
        unchanged = [n for n in trainable if torch.equal(before[n], after[n])]
        assert trainable and unchanged == []
        assert all(torch.equal(before[n], after[n]) for n in before if n not in trainable)
    finally:
        next(mesh_gen, None)

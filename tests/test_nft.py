"""trainer/nft.py (DiffusionNFT) and the GRPO-Guard functions of trainer/flow_grpo.py, each
against an independent element-by-element reference in numpy (loops, float64), plus the
properties the formulas promise (limits, directions, finite gradients); the flags and preflight;
the nft and GRPO-Guard updates on the tiny model in process; and both through the trainer (one
torchrun pair for nft's exact resume, one single-process pair for GRPO-Guard: a run and its resume;
nft on the video and editing tasks, one single-process run each)."""

import math
import subprocess
import sys

import numpy as np
import pytest
import torch

from trainer import flow_grpo as fg
from trainer import nft


def _rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------- references (numpy loops)

def ref_r(adv, c):
    out = []
    for a in adv:
        a = min(max(a, -c), c)
        out.append(min(max(0.5 + a / c / 2.0, 0.0), 1.0))
    return np.array(out)


def ref_adaptive(xt, sigma, v, x0):
    """per sample: sum((xt - s v - x0)^2) / n / max(sum|.| / n, 1e-5)"""
    out = []
    for i in range(xt.shape[0]):
        e = (xt[i] - sigma[i] * v[i] - x0[i]).ravel()
        n = e.size
        sq = sum(float(x) * float(x) for x in e) / n
        ab = sum(abs(float(x)) for x in e) / n
        out.append(sq / max(ab, 1e-5))
    return np.array(out)


def ref_nft_loss(vt, vo, xt, x0, sigma, r, beta, c):
    total = 0.0
    for i in range(xt.shape[0]):
        vp = vo[i] + beta * (vt[i] - vo[i])
        vn = vo[i] - beta * (vt[i] - vo[i])
        lp = ref_adaptive(xt[i:i + 1], sigma[i:i + 1], vp[None], x0[i:i + 1])[0]
        ln = ref_adaptive(xt[i:i + 1], sigma[i:i + 1], vn[None], x0[i:i + 1])[0]
        total += r[i] * lp + (1 - r[i]) * ln
    return total / xt.shape[0] * c / beta


# ---------------------------------------------------------------- optimality probability

def test_optimality_probability_matches_reference_and_bounds():
    adv = torch.tensor([-9.0, -5.0, -2.5, 0.0, 1.0, 5.0, 7.0])
    r = nft.optimality_probability(adv, 5.0)
    np.testing.assert_allclose(r.numpy(), ref_r(adv.tolist(), 5.0), atol=1e-7)
    assert r[3].item() == 0.5 and r[0].item() == 0.0 and r[-1].item() == 1.0
    assert r.dtype == torch.float32 and not r.requires_grad
    with pytest.raises(ValueError, match="--adv-clip-max"):
        nft.optimality_probability(adv, 0.0)


# ---------------------------------------------------------------- forward process and policies

def test_forward_noise_endpoints_and_reference():
    x0, eps = _rand(3, 4, 5, seed=1), _rand(3, 4, 5, seed=2)
    sig = torch.tensor([0.0, 0.3, 1.0])
    xt = nft.forward_noise(x0.bfloat16(), eps, sig)
    assert xt.dtype == torch.float32
    x0b = x0.bfloat16().float()
    for i, s in enumerate(sig.tolist()):
        np.testing.assert_allclose(xt[i].numpy(), ((1 - s) * x0b[i] + s * eps[i]).numpy(), atol=1e-6)
    assert torch.equal(xt[0], x0b[0]) and torch.equal(xt[2], eps[2])


def test_implicit_velocities_mirror_about_old_and_limits():
    vt, vo = _rand(2, 8, seed=3), _rand(2, 8, seed=4)
    vp, vn = nft.implicit_velocities(vt, vo, 0.3)
    torch.testing.assert_close(vp + vn, 2 * vo)
    torch.testing.assert_close(vp, 0.7 * vo + 0.3 * vt)
    vp1, vn1 = nft.implicit_velocities(vt, vo, 1.0)
    torch.testing.assert_close(vp1, vt)
    torch.testing.assert_close(vn1, 2 * vo - vt)
    vp0, vn0 = nft.implicit_velocities(vt, vo, 1e-9)  # beta -> 0: both collapse onto the old policy
    torch.testing.assert_close(vp0, vo, atol=1e-7, rtol=0)
    torch.testing.assert_close(vn0, vo, atol=1e-7, rtol=0)


def test_adaptive_x0_loss_matches_reference():
    x0, eps, v = _rand(3, 2, 6, seed=5), _rand(3, 2, 6, seed=6), _rand(3, 2, 6, seed=7)
    sig = torch.tensor([0.2, 0.5, 0.9])
    xt = nft.forward_noise(x0, eps, sig)
    got = nft.adaptive_x0_loss(xt, sig, v, x0)
    want = ref_adaptive(xt.double().numpy(), sig.double().numpy(), v.double().numpy(), x0.double().numpy())
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-5)
    # the exact velocity eps - x0 has zero error; the weight's floor keeps the loss finite
    exact = nft.adaptive_x0_loss(xt, sig, eps - x0, x0)
    assert torch.isfinite(exact).all() and exact.abs().max() < 1e-6


# ---------------------------------------------------------------- the loss

@pytest.mark.parametrize("beta", [1.0, 0.1])
def test_nft_loss_matches_reference(beta):
    b = 4
    x0, eps = _rand(b, 3, 5, seed=8), _rand(b, 3, 5, seed=9)
    vt, vo = _rand(b, 3, 5, seed=10), _rand(b, 3, 5, seed=11)
    sig = torch.tensor([0.1, 0.4, 0.7, 0.95])
    r = torch.tensor([0.0, 0.3, 0.5, 1.0])
    xt = nft.forward_noise(x0, eps, sig)
    loss, st = nft.nft_loss(vt, vo, xt, x0, sig, r, beta, 5.0)
    want = ref_nft_loss(vt.double().numpy(), vo.double().numpy(), xt.double().numpy(), x0.double().numpy(),
                        sig.double().numpy(), r.double().numpy(), beta, 5.0)
    assert loss.item() == pytest.approx(want, rel=1e-5)
    assert loss.dim() == 0 and loss.dtype == torch.float32
    assert st["old_deviation"].item() == pytest.approx(float(((vt - vo) ** 2).mean()), rel=1e-6)
    assert st["r_mean"].item() == pytest.approx(0.45)


def test_nft_loss_gradient_pulls_positive_towards_data_and_negative_away():
    torch.manual_seed(0)
    x0, eps = _rand(1, 64, seed=12), _rand(1, 64, seed=13)
    sig = torch.tensor([0.6])
    xt = nft.forward_noise(x0, eps, sig)
    target = eps - x0  # the velocity that reproduces this sample exactly
    vo = target + 0.5 * _rand(1, 64, seed=14)  # the old policy misses it
    dist_before = ((vo - target) ** 2).sum().item()
    for r_val, closer in ((1.0, True), (0.0, False)):
        vt = vo.clone().requires_grad_(True)
        loss, _ = nft.nft_loss(vt, vo, xt, x0, sig, torch.tensor([r_val]), 0.5, 5.0)
        loss.backward()
        assert torch.isfinite(vt.grad).all()
        stepped = (vt - 1e-3 * vt.grad).detach()
        dist_after = ((stepped - target) ** 2).sum().item()
        assert (dist_after < dist_before) == closer, (r_val, dist_before, dist_after)


def test_nft_loss_r_half_has_no_first_order_pull_at_the_old_policy():
    # r = 1/2 at v_theta = v_old: the positive and negative terms' gradients cancel exactly
    x0, eps, vo = _rand(2, 16, seed=15), _rand(2, 16, seed=16), _rand(2, 16, seed=17)
    sig = torch.tensor([0.3, 0.8])
    xt = nft.forward_noise(x0, eps, sig)
    vt = vo.clone().requires_grad_(True)
    loss, _ = nft.nft_loss(vt, vo, xt, x0, sig, torch.full((2,), 0.5), 1.0, 5.0)
    loss.backward()
    assert vt.grad.abs().max().item() < 1e-6


def test_nft_loss_bad_beta_and_shapes():
    x = _rand(2, 4)
    with pytest.raises(ValueError, match="--nft-beta"):
        nft.nft_loss(x, x, x, x, 0.5, torch.ones(2), 0.0, 5.0)
    with pytest.raises(ValueError, match="B=2"):
        nft.nft_loss(x, x, x, x, 0.5, torch.ones(3), 1.0, 5.0)


# ---------------------------------------------------------------- schedules

def test_old_policy_decay_schedule():
    # the recipe's default (flat 0, +0.001 a step, capped at 0.5) and its slow one (flat 75, 0.0075, 0.999)
    assert nft.old_policy_decay(0, 0, 0.001, 0.5) == 0.0
    assert nft.old_policy_decay(100, 0, 0.001, 0.5) == pytest.approx(0.1)
    assert nft.old_policy_decay(10_000, 0, 0.001, 0.5) == 0.5
    assert nft.old_policy_decay(74, 75, 0.0075, 0.999) == 0.0
    assert nft.old_policy_decay(175, 75, 0.0075, 0.999) == pytest.approx(0.75)
    assert nft.old_policy_decay(10_000, 75, 0.0075, 0.999) == 0.999
    with pytest.raises(ValueError, match="cap"):
        nft.old_policy_decay(1, 0, 0.1, 1.0)


def test_draw_train_sigmas_schedule_distinct_and_deterministic():
    sched = torch.tensor([1.0, 0.9, 0.75, 0.5, 0.25])
    a = nft.draw_train_sigmas(sched, 6, 4, torch.Generator().manual_seed(3))
    b = nft.draw_train_sigmas(sched, 6, 4, torch.Generator().manual_seed(3))
    assert torch.equal(a, b) and a.shape == (6, 4)
    for row in a.tolist():
        assert len(set(row)) == 4 and set(row) <= set(sched.tolist())
    with pytest.raises(ValueError, match="--nft-timestep-fraction"):
        nft.draw_train_sigmas(sched, 1, 6, torch.Generator())
    u = nft.draw_train_sigmas(sched, 50, 3, torch.Generator().manual_seed(0), "uniform")
    assert u.min() >= 0.25 and u.max() <= 1.0 and len(set(u.flatten().tolist())) == 150
    with pytest.raises(ValueError, match="--nft-timestep-distribution"):
        nft.draw_train_sigmas(sched, 1, 1, torch.Generator(), "logit")


def test_num_train_timesteps():
    assert nft.num_train_timesteps(10, 0.99) == 9
    assert nft.num_train_timesteps(4, 0.1) == 1
    with pytest.raises(ValueError):
        nft.num_train_timesteps(10, 0.0)


# ---------------------------------------------------------------- GRPO-Guard

def ref_guard_log_ratio(logp, old, mean, old_mean, std):
    b, s = logp.shape
    out = np.zeros((b, s))
    for i in range(b):
        for k in range(s):
            d = (mean[i, k] - old_mean[i, k]).ravel()
            bias = sum(x * x for x in d) / d.size / (2 * std[i, k] ** 2)
            out[i, k] = (logp[i, k] - old[i, k] + bias) * std[i, k]
    return out


def test_guard_log_ratio_matches_reference():
    b, s = 3, 2
    logp, old = _rand(b, s, seed=20) * 0.01, _rand(b, s, seed=21) * 0.01
    mean, old_mean = _rand(b, s, 4, 5, seed=22), _rand(b, s, 4, 5, seed=23)
    std = torch.tensor([[0.1, 0.3], [0.2, 0.05], [0.4, 0.15]])
    got = fg.guard_log_ratio(logp, old, mean, old_mean, std)
    want = ref_guard_log_ratio(*(t.double().numpy() for t in (logp, old, mean, old_mean, std)))
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-8)


def test_guard_log_ratio_is_centred_and_scale_free_across_steps():
    # x' = old_mean + std z; the plain log-ratio has mean -b (drifts with std), the guarded one ~0
    # and the same spread at every step
    torch.manual_seed(0)
    n, elems = 4000, 16
    old_mean = torch.zeros(n, 2, elems)
    dmu = 0.01 * torch.ones(elems)
    mean = old_mean + dmu
    std = torch.tensor([0.3, 0.03]).expand(n, 2)
    z = torch.randn(n, 2, elems)
    x = old_mean + std[..., None] * z
    lp = fg.flow_sde_log_prob(x.flatten(0, 1), mean.flatten(0, 1), std.reshape(-1, 1)).view(n, 2)
    olp = fg.flow_sde_log_prob(x.flatten(0, 1), old_mean.flatten(0, 1), std.reshape(-1, 1)).view(n, 2)
    plain = lp - olp
    guarded = fg.guard_log_ratio(lp, olp, mean, old_mean, std)
    bias = (dmu ** 2).mean() / (2 * std[0] ** 2)
    torch.testing.assert_close(plain.mean(0), -bias, rtol=0.1, atol=1e-6)  # the drift grows as std shrinks
    assert guarded.mean(0).abs().max() < 3 * 0.01 / math.sqrt(n * elems) * 3
    spread = guarded.std(0)
    assert spread[0].item() == pytest.approx(spread[1].item(), rel=0.1)


def test_guard_step_weight_and_loss_reference():
    sig = torch.tensor([[0.9, 0.5], [0.9, 0.5]])
    nxt = torch.tensor([[0.8, 0.25], [0.8, 0.25]])
    w = fg.guard_step_weight(sig, nxt)
    torch.testing.assert_close(w, torch.tensor([[10.0, 4.0], [10.0, 4.0]]))
    with pytest.raises(ValueError):
        fg.guard_step_weight(torch.tensor([0.5]), torch.tensor([0.5]))
    logp = (_rand(2, 2, seed=30) * 1e-3).requires_grad_(True)
    old = _rand(2, 2, seed=31) * 1e-3
    mean = _rand(2, 2, 6, seed=32)
    old_mean = mean + 1e-3 * _rand(2, 2, 6, seed=33)
    std = torch.tensor([[0.2, 0.1], [0.2, 0.1]])
    adv = torch.tensor([1.5, -0.5])
    loss, st = fg.grpo_guard_clip_loss(logp, old, mean, old_mean, std, adv, 1e-4, step_weight=w)
    lr = ref_guard_log_ratio(*(t.detach().double().numpy() for t in (logp, old, mean, old_mean, std)))
    total = 0.0
    for i in range(2):
        for k in range(2):
            r = math.exp(lr[i, k])
            a = float(adv[i])
            total += float(w[i, k]) * max(-a * r, -a * min(max(r, 1 - 1e-4), 1 + 1e-4))
    assert loss.item() == pytest.approx(total / 4, rel=1e-5)
    loss.backward()
    assert torch.isfinite(logp.grad).all()
    # no normalisation, no weight: the guard reduces to the plain objective when mean == old_mean and std == 1
    plain, _ = fg.grpo_clip_loss(logp.detach(), old, adv, 0.2)
    same, _ = fg.grpo_guard_clip_loss(logp.detach(), old, mean, mean, torch.ones(2, 2), adv, 0.2)
    assert same.item() == pytest.approx(plain.item(), rel=1e-6)


# ---------------------------------------------------------------- flags and preflight

from tests.test_preflight import base, problems  # noqa: E402,F401  (the valid 2-rank argv fixture)


def test_algorithm_defaults_keep_flowgrpo(base):
    from trainer.config import load_config

    cfg = load_config(base)
    assert cfg.grpo.algorithm == "flowgrpo" and cfg.grpo.grpo_guard is False
    assert (cfg.grpo.nft_beta, cfg.grpo.nft_timestep_fraction, cfg.grpo.nft_old_decay_max) == (1.0, 0.99, 0.5)


def test_nft_passes_with_its_requirements_and_no_trained_steps(base):
    argv = [a for a in base]
    i = argv.index("--sampling-config")
    argv[i + 1] = '{"num_inference_steps": 10, "height": 256, "width": 256}'  # no SDE key: nft ignores them
    assert problems(argv + ["--algorithm", "nft", "--adv-clip-max", "5"]) == []


def test_nft_refuses_what_it_does_not_combine_with_all_at_once(base):
    found = problems(base + ["--algorithm", "nft", "--grpo-guard", "--use-kl-loss", "--kl-coef", "0.04",
                             "--fsdp-trainable-mode", "lora", "--lora-rank", "8", "--fsdp-master-dtype", "fp32",
                             "--nft-beta", "0", "--nft-old-decay-max", "1.0", "--nft-timestep-fraction", "1.5",
                             "--nft-sigmas-per-forward", "-1",
                             "--rollout-engine-class-path", "sglang"])
    text = "\n".join(found)
    for needle in ("--grpo-guard with --algorithm nft", "--adv-clip-max > 0", "--use-kl-loss", "--nft-beta",
                   "--nft-old-decay-max", "--nft-timestep-fraction", "--nft-sigmas-per-forward must be >= 0",
                   "only the native engine"):
        assert needle in text, (needle, found)


def test_nft_engine_is_asked_through_its_capabilities(base):
    """The native engine declares the ODE rollout nft needs, SGLang does not (its reason is
    quoted), and a custom engine, which declares nothing preflight trusts, is refused too."""
    from trainer.engine.native import NativeEngine
    from trainer.engine.sglang_engine import SGLangEngine

    assert NativeEngine.capabilities.ode_final_latents and not SGLangEngine.capabilities.ode_final_latents
    nft_argv = base + ["--algorithm", "nft", "--adv-clip-max", "5", "--rollout-engine-class-path"]
    assert not any("--algorithm nft with --rollout-engine-class-path" in p for p in problems(nft_argv + ["native"]))
    assert any("only the native engine returns (the SGLang engine does not sample the 'cps'" in p
               for p in problems(nft_argv + ["sglang"]))
    assert any("--algorithm nft with --rollout-engine-class-path mypkg.engine.CustomEngine" in p
               for p in problems(nft_argv + ["mypkg.engine.CustomEngine"]))


def test_nft_refuses_cfg(base):
    argv = [a for a in base]
    i = argv.index("--sampling-config")
    argv[i + 1] = '{"num_inference_steps": 10, "height": 256, "width": 256, "guidance_scale": 4.0}'
    assert any("CFG-free" in p for p in problems(argv + ["--algorithm", "nft", "--adv-clip-max", "5"]))


def test_grpo_guard_needs_a_gaussian_sde_type(base):
    assert problems(base + ["--grpo-guard"]) == []
    argv = [a for a in base]
    i = argv.index("--sampling-config")
    argv[i + 1] = '{"num_inference_steps": 10, "height": 256, "width": 256, "sde_type": "cps", "eta": 0.5, ' \
                  '"sde_indices": [1, 2]}'
    assert any("--grpo-guard with --sampling-config sde_type 'cps'" in p for p in problems(argv + ["--grpo-guard"]))


# ---------------------------------------------------------------- the update on the tiny model

NFT_GRPO = {"grpo__algorithm": "nft", "grpo__adv_clip_max": 5.0, "grpo__nft_beta": 1.0,
            "grpo__nft_timestep_fraction": 0.5, "grpo__nft_timestep_distribution": "schedule",
            "grpo__nft_old_decay_flat": 0, "grpo__nft_old_decay_rate": 0.001, "grpo__nft_old_decay_max": 0.5,
            "grpo__num_updates_per_batch": 1, "grpo__micro_batch_size": 2}
SCHEDULE = torch.tensor([1.0, 0.9, 0.7, 0.4])
NFT_ADV = torch.tensor([1.0, -1.0, 0.5, -0.5])


@pytest.fixture(scope="module")
def mesh():
    from tests.dist.tiny import one_rank_mesh

    yield from one_rank_mesh()


def _nft_actor(mesh, **over):
    from tests.dist.tiny import ADAPTER, make_cfg, tiny_transformer
    from trainer.actor import Actor

    return Actor(tiny_transformer(), mesh, make_cfg("full", **{**NFT_GRPO, **over}), device=torch.device("cpu"),
                 adapter=ADAPTER)


def _velocity_fn():
    from tests.dist.tiny import ADAPTER
    from trainer.loop import make_velocity_fn

    return make_velocity_fn(ADAPTER)


pytestmark = pytest.mark.filterwarnings("ignore:FSDP2-wrapped module.*returned a view tensor")


def test_nft_update_trains_every_trainable_param_and_moves_the_old_policy(mesh):
    from tests.dist.tiny import full_params, make_batch
    from trainer.core.names import model_name

    actor = _nft_actor(mesh)
    before = full_params(actor.model)
    def full(t):
        return t.full_tensor() if hasattr(t, "full_tensor") else t

    old_before = {k: full(v).clone() for k, v in actor.nft_old.state_dict().items()}
    m = actor.nft_train_step(make_batch(4), NFT_ADV, _velocity_fn(), SCHEDULE, seed=3)
    after = full_params(actor.model)
    trainable = {model_name(n) for n, p in actor.model.named_parameters() if p.requires_grad}
    assert trainable and all(not torch.equal(before[n], after[n]) for n in trainable)
    assert all(torch.equal(before[n], after[n]) for n in actor.never_trained)
    assert m["train/optimizer_steps"] == 1 and actor.optimizer_steps == 1
    # the first round's old policy IS the policy: v_theta == v_old in every forward
    assert m["train/old_deviation"] == 0.0
    assert math.isfinite(m["train/loss"]) and m["train/grad_norm"] > 0 and 0 < m["train/r_mean"] < 1
    # old <- d old + (1 - d) theta with d = min(1 x 0.001, 0.5)
    assert m["train/nft_old_decay"] == pytest.approx(0.001)
    for name, old in actor.nft_old.state_dict().items():
        want = 0.001 * old_before[name] + 0.999 * after[name].float()
        torch.testing.assert_close(full(old), want, rtol=1e-5, atol=1e-7)


def test_nft_update_lowers_its_loss_and_is_deterministic(mesh):
    from tests.dist.tiny import full_params, make_batch
    from trainer.nft import forward_noise, nft_loss, optimality_probability

    vfn = _velocity_fn()
    batch = make_batch(4)

    def loss_of(actor, draws, v_old):
        total = 0.0
        r = optimality_probability(NFT_ADV, 5.0)
        with torch.no_grad():
            for (s, e), (sig, noise) in draws.items():
                x0 = batch[s:e].next_latents[:, -1].float()
                for j in range(sig.shape[1]):
                    xt = forward_noise(x0, noise[j], sig[:, j])
                    total += nft_loss(vfn(actor.model, batch[s:e], xt, sig[:, j]), v_old[(s, e)][j], xt, x0,
                                      sig[:, j], r[s:e], 1.0, 5.0)[0].item()
        return total

    actor = _nft_actor(mesh, optim__lr=1e-4)
    plan = actor._plan(NFT_ADV, torch.ones(4, dtype=torch.bool))
    draws = actor._nft_draws(batch, plan, SCHEDULE, 3)
    v_old = actor._nft_old_velocities(batch, plan, draws, vfn, None)
    first = loss_of(actor, draws, v_old)
    actor.nft_train_step(batch, NFT_ADV, vfn, SCHEDULE, seed=3)
    assert loss_of(actor, draws, v_old) < first
    twin = _nft_actor(mesh, optim__lr=1e-4)
    twin.nft_train_step(batch, NFT_ADV, vfn, SCHEDULE, seed=3)
    a, b = full_params(actor.model), full_params(twin.model)
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("per_forward", [2, 0])
def test_nft_levels_stacked_in_one_forward_train_the_same(mesh, per_forward):
    """--nft-sigmas-per-forward: a micro-batch's K = 3 noise levels in forwards of 2 (then 1) or
    all 3 at once give the update of one level per forward (fp32, up to the GEMMs' batch-size
    rounding), in fewer DiT forwards: micro-batches x ceil(K / per_forward), for the old-policy
    pass and the update alike."""
    from tests.dist.tiny import full_params, make_batch

    batch, vfn = make_batch(4), _velocity_fn()
    results = {}
    for c in (1, per_forward):
        actor = _nft_actor(mesh, optim__lr=1e-3, grpo__nft_sigmas_per_forward=c, grpo__nft_timestep_fraction=0.99)
        start = full_params(actor.model)
        calls = []
        hook = actor.model.register_forward_pre_hook(lambda mod, args, kwargs: calls.append(1), with_kwargs=True)
        grads, close = {}, actor._close_update

        def snapshot_then_close(*args, model=actor.model, close=close, grads=grads, **kwargs):
            # the update's gradient, before its optimizer step clears it
            grads.update({n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
                          for n, p in model.named_parameters() if p.grad is not None})
            return close(*args, **kwargs)

        actor._close_update = snapshot_then_close
        m = actor.nft_train_step(batch, NFT_ADV, vfn, SCHEDULE, seed=3)
        hook.remove()
        results[c] = (grads, m, len(calls))
        assert grads and any(not torch.equal(start[k], v) for k, v in full_params(actor.model).items())
    (g1, m1, n1), (gc, mc, nc) = results[1], results[per_forward]
    chunks = {1: 3, 2: 2, 0: 1}
    assert (n1, nc) == (2 * 2 * 3, 2 * 2 * chunks[per_forward])  # 2 micro-batches, old pass + update
    assert g1.keys() == gc.keys()
    for k in g1:
        torch.testing.assert_close(gc[k], g1[k], rtol=1e-4, atol=1e-7)
    for key in ("train/loss", "train/grad_norm", "train/r_mean"):
        assert mc[key] == pytest.approx(m1[key], rel=1e-5, abs=1e-7), key


def test_grpo_guard_update_runs_and_first_update_ratio_is_one(mesh):
    from tests.dist.tiny import ADAPTER, full_params, make_batch, make_cfg, replay, tiny_transformer
    from tests.dist.tiny import replay_moments as tiny_replay_moments
    from trainer.actor import Actor
    from trainer.flow_grpo import transition_log_prob

    class ReplayMoments:
        """The tiny replay as a ReplayFn with .moments: the guard's transition means and stds."""

        def __call__(self, model, rows):
            return replay(model, rows)

        def moments(self, model, rows):
            return tiny_replay_moments(model, rows)

    replay_moments = ReplayMoments()

    actor = Actor(tiny_transformer(), mesh, make_cfg("full", grpo__grpo_guard=True, grpo__eps_clip=1e-5),
                  device=torch.device("cpu"), adapter=ADAPTER)
    before = full_params(actor.model)
    m = actor.train_step(make_batch(4), torch.tensor([1.0, -1.0, 0.5, -0.5]), replay_moments)
    first, second = actor.last_update_stats
    assert first["ratio_max"].item() == 1.0 and first["ratio_min"].item() == 1.0
    assert math.isfinite(m["train/loss"]) and m["train/optimizer_steps"] == 2
    after = full_params(actor.model)
    assert any(not torch.equal(before[k], after[k]) for k in before)
    # a partly valid micro-batch takes its valid rows of the guard's tensors too; an invalid
    # candidate's advantage does not matter
    results = []
    for bad in (5.0, -5.0):
        a = Actor(tiny_transformer(), mesh, make_cfg("full", grpo__grpo_guard=True, grpo__eps_clip=1e-5,
                                                      grpo__micro_batch_size=2),
                  device=torch.device("cpu"), adapter=ADAPTER)
        m = a.train_step(make_batch(4), torch.tensor([1.0, bad, 0.5, -0.5]), replay_moments,
                         valid=torch.tensor([True, False, True, True]))
        assert math.isfinite(m["train/loss"])
        results.append(full_params(a.model))
    assert all(torch.equal(results[0][k], results[1][k]) for k in results[0])


# ---------------------------------------------------------------- through the trainer (torchrun, 2 ranks)

def test_nft_through_the_trainer_resumes_exactly_and_exports(tmp_path, tiny_model_dir):
    """One launch pair: an uninterrupted nft run of 2 rollouts, and a run resumed from its
    iteration 0 (--ckpt-step 0) for the second rollout; the weights, the old policy, the
    schedules' step count and the images sampled after the resume agree bit for bit; the
    checkpoint exports; the hacking watch's series are logged."""
    from tests.test_e2e import _dcp_keys, _recipe, _state, _train, assert_resume_is_exact
    from tools.export_checkpoint import dcp_model_metadata, export_checkpoint, read_dcp_tensors

    extra = ('algorithm = "nft"\nadv-clip-max = 5.0\nnft-timestep-fraction = 0.5\nnft-old-decay-rate = 0.25\n'
             'nft-old-decay-max = 0.9')
    recipe = _recipe(tmp_path, tiny_model_dir, "full", extra=extra)
    a, b = tmp_path / "a", tmp_path / "b"
    log = _train(recipe, a, "--num-rollout", "2")
    assert "Traceback" not in log
    log_b = _train(recipe, b, "--num-rollout", "2", "--load", str(a / "ckpt"), "--ckpt-step", "0")
    assert "continuing at rollout 1" in log_b
    assert_resume_is_exact(a, b, 1, (1,), 8, policy_version=2, lr_steps=4)

    keys = _dcp_keys(a / "ckpt", 1)
    old_keys = sorted(k for k in keys if k.startswith("nft_old."))
    assert old_keys and {k.split(".")[0] for k in keys} == {"model", "optim", "nft_old"}
    fa, fb = a / "ckpt" / "t2i" / "iter_0000001" / "fsdp", b / "ckpt" / "t2i" / "iter_0000001" / "fsdp"
    ta = read_dcp_tensors(fa, old_keys, dcp_model_metadata(fa, "nft_old."))
    tb = read_dcp_tensors(fb, old_keys, dcp_model_metadata(fb, "nft_old."))
    assert all(torch.equal(ta[k], tb[k]) for k in old_keys)
    live = read_dcp_tensors(fa, [f"model.{k[len('nft_old.'):]}" for k in old_keys], dcp_model_metadata(fa))
    # the old policy lags the policy: after 4 steps its decay is min(4 x 0.25, 0.9) = 0.9
    assert any(not torch.equal(ta[k], live[f"model.{k[len('nft_old.'):]}"].float()) for k in old_keys)
    assert _state(a / "ckpt", 1)["nft_old_updates"] == 2

    from trainer.metrics import read_scalars

    scalars = read_scalars(a / "tb")
    for series in ("train/loss", "train/positive_loss", "train/negative_loss", "train/nft_old_decay",
                   "train/grad_norm", "reward/advantage_std", "reward/hacking_suspect"):
        assert series in scalars, series
    assert [v for _, v in scalars["train/nft_old_decay"]] == pytest.approx([0.5, 0.9])

    info = export_checkpoint(a / "ckpt", "t2i", 1, tmp_path / "export", form="merged", verify=True)
    assert info["mode"] == "full" and (tmp_path / "export" / "transformer").is_dir()
    # the old policy exports like the EMA does
    info = export_checkpoint(a / "ckpt", "t2i", 1, tmp_path / "old_export", form="merged", verify=True,
                             old_policy=True)
    assert info["weights"] == "nft_old_policy"
    from safetensors.torch import load_file

    written: dict[str, torch.Tensor] = {}
    for f in (tmp_path / "old_export" / "transformer").glob("*.safetensors"):
        written.update(load_file(f))
    lagging = next(k for k in old_keys if not torch.equal(ta[k], live[f"model.{k[len('nft_old.'):]}"].float()))
    name = lagging[len("nft_old."):]
    assert torch.equal(written[name], ta[lagging].to(written[name].dtype))


def test_grpo_guard_through_the_trainer(tmp_path, tiny_model_dir):
    """--grpo-guard on the real replay (the adapter's transition means and stds), one process:
    2 rollouts train, checkpoint and log finite losses with the first update's ratio at 1; a run
    resumed from the first rollout's checkpoint ends with the same weights, policy version and lr
    step, and samples the second rollout's images byte for byte (the guard keeps no state of its
    own: it is a function of the replayed transitions)."""
    from tests.test_e2e import _recipe, assert_resume_is_exact
    from tests.workers.launch import ROOT

    recipe = _recipe(tmp_path, tiny_model_dir, "full", extra="grpo-guard = true")
    env = {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}

    def train(out, *args):
        cmd = [sys.executable, "-m", "trainer.train", "--config", str(recipe), "--actor-num-gpus-per-node", "1",
               "--num-rollout", "2", "--eps-clip", "1e-5", "--artifact-root", str(out / "artifacts"),
               "--save", str(out / "ckpt"), "--tensorboard-dir", str(out / "tb"), *args]
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-4000:]
        return proc.stdout + proc.stderr

    out, resumed = tmp_path / "g", tmp_path / "g_resumed"
    train(out)
    assert "continuing at rollout 1" in train(resumed, "--load", str(out / "ckpt"), "--ckpt-step", "0")
    pngs = len(list((out / "artifacts" / "t2i" / "rollout_0000001").glob("*.png")))
    assert pngs > 0
    assert_resume_is_exact(out, resumed, 1, (1,), pngs, policy_version=2, lr_steps=4)
    from trainer.metrics import read_scalars

    scalars = read_scalars(out / "tb")
    assert all(math.isfinite(v) for _, v in scalars["train/loss"]) and len(scalars["train/loss"]) == 2
    for (_, lo), (_, hi) in zip(scalars["train/ratio_min"], scalars["train/ratio_max"]):
        assert lo <= 1.0 <= hi
    assert (out / "ckpt" / "t2i" / "iter_0000001" / "COMMITTED").is_file()
    # the guard trains the same weights' layout: the checkpoint exports and verifies like any other
    from tools.export_checkpoint import export_checkpoint

    info = export_checkpoint(out / "ckpt", "t2i", 1, tmp_path / "export", form="merged", verify=True)
    assert info["mode"] == "full" and (tmp_path / "export" / "transformer").is_dir()


# ---------------------------------------------------------------- the demo comparison tool

def test_compare_runs_draws_and_tabulates_two_logged_runs(tmp_path, capsys):
    from PIL import Image

    from tools.compare_runs import main
    from trainer.metrics import MetricsLogger

    for name, slope, secs in (("flowgrpo", 0.01, 3.0), ("nft", 0.03, 4.0)):
        log = MetricsLogger(tmp_path / name, 0, run_name=name)
        for k in range(6):
            m = {"reward/named_color_mean": 0.2 + slope * k, "perf/step_time": secs}
            if k % 2 == 1:
                m["eval/held_out/named_color_mean"] = 0.1 + slope * k
            log.log(k, m)
        log.close()
    out = tmp_path / "cmp.png"
    code = main(["--run", "flowgrpo", str(tmp_path / "flowgrpo"), "--run", "nft", str(tmp_path / "nft"),
                 "--component", "named_color", "--output", str(out), "--window", "2"])
    text = capsys.readouterr().out
    assert code == 0 and Image.open(out).size == (1120, 660)
    rows = [line for line in text.splitlines() if line.startswith("| flowgrpo") or line.startswith("| nft")]
    assert rows[0].split(" | ")[1:6] == ["6", "0.200 -> 0.245", "0.110 (r1) -> 0.150 (r5)", "3.0", "18 |"]
    assert rows[1].split(" | ")[2] == "0.200 -> 0.335"
    assert main(["--run", "a", str(tmp_path / "nft"), "--run", "b", str(tmp_path / "nft"),
                 "--component", "color", "--output", str(out)]) == 2


def test_nft_demo_recipe_differs_from_the_flowgrpo_demo_only_in_the_algorithm_and_outputs():
    from tests.workers.launch import ROOT
    from trainer.config import load_config

    flow = load_config(["--config", str(ROOT / "configs" / "tiny_cpu_demo.toml")]).to_dict()
    nft_ = load_config(["--config", str(ROOT / "configs" / "tiny_cpu_demo_nft.toml")]).to_dict()
    diff = {(sec, k) for sec in flow for k in flow[sec] if flow[sec][k] != nft_[sec][k]}
    assert {k for _, k in diff} == {"algorithm", "adv_clip_max", "nft_timestep_fraction",
                                    "artifact_root", "tensorboard_dir", "save"}, diff
    assert nft_["grpo"]["algorithm"] == "nft" and nft_["checkpoint"]["save"].endswith("/nft/checkpoints")


def test_nft_invalid_candidates_do_not_matter_and_zero_advantages_skip(mesh):
    from tests.dist.tiny import full_params, make_batch

    vfn = _velocity_fn()
    valid = torch.tensor([True, False, True, True])
    results = []
    for bad in (5.0, -5.0):
        actor = _nft_actor(mesh)
        adv = NFT_ADV.clone()
        adv[1] = bad
        m = actor.nft_train_step(make_batch(4), adv, vfn, SCHEDULE, seed=1, valid=valid)
        assert math.isfinite(m["train/loss"])
        results.append(full_params(actor.model))
    assert all(torch.equal(results[0][k], results[1][k]) for k in results[0])
    actor = _nft_actor(mesh)
    before = full_params(actor.model)
    m = actor.nft_train_step(make_batch(4), torch.zeros(4), vfn, SCHEDULE, seed=1)
    assert m["train/optimizer_steps"] == 0 and actor.skipped_rounds == 1
    assert all(torch.equal(v, full_params(actor.model)[k]) for k, v in before.items())


# ---------------------------------------------------------------- nft on the video and editing tasks

@pytest.mark.parametrize("task", ["t2v", "i2i"])
def test_nft_trains_the_video_and_editing_tasks_through_the_trainer(tmp_path, task):
    """--algorithm nft on the tiny Wan model (t2v: 5-frame videos, 6-D latents) and the tiny
    Qwen-Image-Edit model (i2i: the source latents in the conditioning), one process, 2 rollouts,
    CFG-free as nft samples: finite losses, the old policy in the checkpoint, videos / images
    written. The nft update needs only the clean final latents and the conditions, which both
    tasks record as t2i does."""
    from tests.family_e2e import edit_recipe, write_edit_records
    from tests.workers.launch import ROOT
    from trainer.metrics import read_scalars

    if task == "t2v":
        from tests.test_family_wan_e2e import recipe
        from tools.tiny_wan import build_tiny_wan_pipeline

        config = recipe(tmp_path, build_tiny_wan_pipeline(tmp_path / "model", seed=0, vae_output_gain=8.0))
        media = "*.webp"
    else:
        from tools.tiny_qwen_image_edit import build_tiny_qwen_image_edit_pipeline

        model = build_tiny_qwen_image_edit_pipeline(tmp_path / "model", seed=0, vae_output_gain=8.0, variant="2511")
        config = edit_recipe(tmp_path, model, write_edit_records(tmp_path / "data"))
        media = "*.png"
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "trainer.train", "--config", str(config), "--actor-num-gpus-per-node", "1",
           "--num-rollout", "2", "--algorithm", "nft", "--adv-clip-max", "5", "--sampling-config.guidance_scale",
           "1.0", "--artifact-root", str(out / "artifacts"), "--save", str(out / "ckpt"),
           "--tensorboard-dir", str(out / "tb")]
    env = {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    losses = [v for _, v in read_scalars(out / "tb")["train/loss"]]
    assert len(losses) == 2 and all(math.isfinite(v) for v in losses)
    from torch.distributed.checkpoint import FileSystemReader

    keys = FileSystemReader(str(out / "ckpt" / task / "iter_0000001" / "fsdp")).read_metadata().state_dict_metadata
    assert any(k.startswith("nft_old.") for k in keys)
    assert list((out / "artifacts" / task / "rollout_0000001").glob(media))

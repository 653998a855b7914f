"""Unit tests for trainer/flow_grpo.py: formulas on hand-computed values, the log-prob against
torch.distributions, the clipped objective's gradient, advantages, and sampler/replay parity."""

import math

import pytest
import torch

from trainer import flow_grpo as fg


# ---------------------------------------------------------------- std_dev_t and moments


def test_std_dev_t_sde_hand_values():
    # sigma = 0.5: sqrt(0.5 / 0.5) = 1 -> g = eta
    assert fg.sde_std_dev_t(torch.tensor(0.5), 0.7).item() == pytest.approx(0.7, abs=1e-7)
    # sigma = 0.8: sqrt(0.8 / 0.2) = 2 -> g = 2 eta
    assert fg.sde_std_dev_t(torch.tensor(0.8), 0.7).item() == pytest.approx(1.4, abs=1e-6)
    # sigma = 0.2: sqrt(0.2 / 0.8) = 0.5
    assert fg.sde_std_dev_t(0.2, 1.0).item() == pytest.approx(0.5, abs=1e-7)


def test_std_dev_t_sigma_one_uses_sigma_max():
    g = fg.sde_std_dev_t(torch.tensor([1.0, 0.5]), 0.7, sigma_max=0.99)
    # sigma == 1: sqrt(1 / (1 - 0.99)) = 10 -> 7.0 (the value the reference measured vs ~2.92)
    assert g[0].item() == pytest.approx(7.0, rel=1e-5)
    assert g[1].item() == pytest.approx(0.7, rel=1e-6)
    g2 = fg.sde_std_dev_t(torch.tensor(1.0), 0.7, sigma_max=0.96)
    assert g2.item() == pytest.approx(0.7 * 5.0, rel=1e-5)
    assert torch.isfinite(g).all()


def test_std_dev_t_dance_is_constant():
    sig = torch.tensor([1.0, 0.9, 0.3, 0.01])
    g = fg.sde_std_dev_t(sig, 0.3, sde_type="dance")
    assert torch.equal(g, torch.full_like(sig, 0.3))
    with pytest.raises(ValueError, match="sde_type"):
        fg.sde_std_dev_t(sig, 0.3, sde_type="ode")


def test_moments_hand_computed():
    # sigma = 0.5, sigma_next = 0.25, eta = 0.7 -> g = 0.7, g^2 = 0.49, dt = -0.25
    x = torch.tensor([[2.0, -1.0]])
    v = torch.tensor([[0.5, 4.0]])
    mean, std = fg.flow_sde_transition_moments(x, v, 0.5, 0.25, 0.7)
    g2, dt, s = 0.49, -0.25, 0.5
    cx = 1 + g2 * dt / (2 * s)  # 0.8775
    cv = (1 + g2 * (1 - s) / (2 * s)) * dt  # -0.30625
    expected = torch.tensor([[2.0 * cx + 0.5 * cv, -1.0 * cx + 4.0 * cv]])
    torch.testing.assert_close(mean, expected, atol=1e-6, rtol=0)
    assert std.reshape(-1).item() == pytest.approx(0.7 * 0.5, abs=1e-7)  # g * sqrt(0.25)
    assert mean.dtype == torch.float32 and std.dtype == torch.float32


def test_moments_per_sample_sigma_broadcast_and_fp32_from_bf16():
    torch.manual_seed(0)
    x = torch.randn(3, 5, 4)
    v = torch.randn(3, 5, 4)
    sig = torch.tensor([0.9, 0.6, 0.3])
    sig_next = torch.tensor([0.8, 0.4, 0.0])
    mean, std = fg.flow_sde_transition_moments(x, v, sig, sig_next, 0.7)
    assert mean.shape == (3, 5, 4) and std.shape == (3, 1, 1)
    for b in range(3):
        mb, sb = fg.flow_sde_transition_moments(x[b : b + 1], v[b : b + 1], sig[b].item(), sig_next[b].item(), 0.7)
        torch.testing.assert_close(mean[b : b + 1], mb, atol=1e-6, rtol=0)
        torch.testing.assert_close(std[b].reshape(-1), sb.reshape(-1), atol=1e-7, rtol=0)
    mean16, _ = fg.flow_sde_transition_moments(x.bfloat16(), v.bfloat16(), sig, sig_next, 0.7)
    assert mean16.dtype == torch.float32
    with pytest.raises(ValueError, match="sigma"):
        fg.flow_sde_transition_moments(x, v, torch.tensor([0.5, 0.4]), 0.3, 0.7)


def test_dance_equals_sde_formula_with_constant_g():
    """dance == the same moments with g replaced by the constant eta."""
    torch.manual_seed(1)
    x, v = torch.randn(2, 6), torch.randn(2, 6)
    sigma, sigma_next, eta = 0.6, 0.45, 0.3
    mean, std = fg.flow_sde_transition_moments(x, v, sigma, sigma_next, eta, sde_type="dance")
    g2, dt = eta**2, sigma_next - sigma
    exp_mean = x * (1 + g2 * dt / (2 * sigma)) + v * (1 + g2 * (1 - sigma) / (2 * sigma)) * dt
    torch.testing.assert_close(mean, exp_mean, atol=1e-6, rtol=0)
    assert std.reshape(-1).item() == pytest.approx(eta * math.sqrt(-dt), rel=1e-6)
    # and differs from "sde" at the same eta, where g = eta * sqrt(0.6 / 0.4)
    mean_sde, std_sde = fg.flow_sde_transition_moments(x, v, sigma, sigma_next, eta, sde_type="sde")
    assert std_sde.reshape(-1).item() == pytest.approx(eta * math.sqrt(1.5) * math.sqrt(-dt), rel=1e-6)
    assert not torch.allclose(mean, mean_sde)


def test_zero_noise_mean_tends_to_euler_step_as_eta_vanishes():
    torch.manual_seed(2)
    x, v = torch.randn(2, 8), torch.randn(2, 8)
    mean, _ = fg.flow_sde_transition_moments(x, v, 0.7, 0.5, 1e-4)
    torch.testing.assert_close(mean, fg.ode_step(x, v, 0.7, 0.5), atol=1e-6, rtol=0)
    torch.testing.assert_close(fg.ode_step(x, v, 0.7, 0.5), x + v * (0.5 - 0.7), atol=1e-7, rtol=0)
    assert fg.ode_step(x.bfloat16(), v.bfloat16(), 0.7, 0.5).dtype == torch.float32


# ---------------------------------------------------------------- log-prob


def test_log_prob_matches_torch_normal_mean():
    torch.manual_seed(3)
    mean = torch.randn(4, 7, 3)
    std = torch.tensor([0.3, 0.5, 1.2, 2.0]).reshape(4, 1, 1)
    x = mean + std * torch.randn(4, 7, 3)
    lp = fg.flow_sde_log_prob(x, mean, std)
    ref = torch.distributions.Normal(mean, std.expand_as(mean)).log_prob(x).mean(dim=(1, 2))
    assert lp.shape == (4,)
    torch.testing.assert_close(lp, ref, atol=1e-6, rtol=0)


def test_log_prob_hand_value_and_gradient_only_through_mean():
    # x' = mean: -log std - log sqrt(2 pi)
    mean = torch.zeros(1, 3, requires_grad=True)
    std = torch.tensor([[0.5]])
    x = torch.zeros(1, 3, requires_grad=True)
    lp = fg.flow_sde_log_prob(x, mean, std)
    assert lp.item() == pytest.approx(-math.log(0.5) - 0.5 * math.log(2 * math.pi), abs=1e-6)
    (lp.sum() + 0).backward()
    assert x.grad is None  # next_latents is data
    assert mean.grad is not None


# ---------------------------------------------------------------- sampler / replay parity


@pytest.mark.parametrize("sde_type", ["sde", "dance"])
def test_sampled_step_replays_to_same_log_prob(sde_type):
    torch.manual_seed(4)
    B = 3
    x = torch.randn(B, 16, 8)
    v = torch.randn(B, 16, 8)
    noise = torch.randn(B, 16, 8)
    sig, sig_next = torch.tensor([0.95, 0.7, 0.2]), torch.tensor([0.9, 0.6, 0.0])
    nxt, lp = fg.sde_step(x, v, sig, sig_next, 0.7, noise, sde_type=sde_type)
    assert nxt.dtype == torch.float32 and lp.shape == (B,)
    replay = fg.replay_transition_logp(x, nxt, v, sig, sig_next, 0.7, sde_type=sde_type)
    assert (replay - lp).abs().max().item() <= 1e-6
    # micro-batched replay of one sample reproduces it too
    one = fg.replay_transition_logp(x[1:2], nxt[1:2], v[1:2], sig[1:2], sig_next[1:2], 0.7, sde_type=sde_type)
    assert abs(one.item() - lp[1].item()) <= 1e-6
    # x' = mean + std * eps exactly
    mean, std = fg.flow_sde_transition_moments(x, v, sig, sig_next, 0.7, sde_type)
    torch.testing.assert_close(nxt, mean + std * noise, atol=0, rtol=0)


def test_replay_with_other_velocity_differs_and_is_differentiable():
    torch.manual_seed(5)
    x, v, eps = torch.randn(2, 10), torch.randn(2, 10), torch.randn(2, 10)
    nxt, lp = fg.sde_step(x, v, 0.6, 0.5, 0.7, eps)
    v2 = (v + 0.1).requires_grad_(True)
    lp2 = fg.replay_transition_logp(x, nxt, v2, 0.6, 0.5, 0.7)
    assert (lp2 - lp).abs().min().item() > 1e-4
    lp2.sum().backward()
    assert v2.grad is not None and torch.isfinite(v2.grad).all()


def test_sde_step_out_dtype_logs_the_recorded_value():
    torch.manual_seed(6)
    x, v, eps = torch.randn(2, 32), torch.randn(2, 32), torch.randn(2, 32)
    nxt16, lp16 = fg.sde_step(x.bfloat16(), v.bfloat16(), 0.6, 0.5, 0.7, eps, out_dtype=torch.bfloat16)
    assert nxt16.dtype == torch.bfloat16 and lp16.dtype == torch.float32
    replay = fg.replay_transition_logp(x.bfloat16(), nxt16, v.bfloat16(), 0.6, 0.5, 0.7)
    assert (replay - lp16).abs().max().item() <= 1e-6


# ---------------------------------------------------------------- clipped objective


def test_clip_loss_ratio_one():
    logp = torch.randn(4, 3)
    adv = torch.tensor([1.0, -2.0, 0.5, 0.5])
    loss, st = fg.grpo_clip_loss(logp.clone().requires_grad_(True), logp, adv, 1e-4)
    assert loss.item() == pytest.approx(-adv.mean().item(), abs=1e-6)
    assert st["clip_fraction"].item() == 0.0
    assert st["approx_kl"].item() == pytest.approx(0.0, abs=1e-7)
    assert st["ratio_mean"].item() == 1.0 and st["ratio_std"].item() == 0.0
    assert st["ratio_min"].item() == 1.0 and st["ratio_max"].item() == 1.0
    # group-centred advantages at ratio 1: loss is exactly zero
    centred = fg.normalize_grouped(torch.tensor([1.0, 2.0, 3.0, 6.0]), 2)
    loss0, _ = fg.grpo_clip_loss(logp, logp, centred, 1e-4)
    assert loss0.item() == pytest.approx(0.0, abs=1e-7)


def test_clip_loss_gradient_zero_where_clipped_minus_a_dr_elsewhere():
    eps = 0.1
    # one step per sample; ratios chosen in / out of the band
    ratios = torch.tensor([1.05, 1.3, 0.7, 0.7, 1.3, 0.95])
    adv = torch.tensor([2.0, 2.0, 2.0, -1.5, -1.5, -1.5])
    old = torch.zeros(6, 1)
    logp = torch.log(ratios)[:, None].clone().requires_grad_(True)
    loss, st = fg.grpo_clip_loss(logp, old, adv, eps)
    loss.backward()
    n = 6
    # d loss / d logp = -A * r / n where the unclipped term is active, 0 where clipping wins:
    #   A > 0 and r > 1 + eps  -> clipped (zero grad); A > 0 and r < 1 - eps -> unclipped
    #   A < 0 and r < 1 - eps  -> clipped (zero grad); A < 0 and r > 1 + eps -> unclipped
    active = torch.tensor([True, False, True, False, True, True])
    expected = torch.where(active, -adv * ratios / n, torch.zeros(6))
    torch.testing.assert_close(logp.grad[:, 0], expected, atol=1e-6, rtol=0)
    assert st["clip_fraction"].item() == pytest.approx(4 / 6)
    # value: mean of max(-A r, -A clip(r))
    clipped_r = ratios.clamp(1 - eps, 1 + eps)
    exp_loss = torch.maximum(-adv * ratios, -adv * clipped_r).mean()
    assert loss.item() == pytest.approx(exp_loss.item(), abs=1e-6)
    r = ratios
    assert st["approx_kl"].item() == pytest.approx(((r - 1) - torch.log(r)).mean().item(), abs=1e-6)
    assert st["ratio_max"].item() == pytest.approx(1.3, abs=1e-6)
    assert st["ratio_std"].item() == pytest.approx(r.std(unbiased=False).item(), abs=1e-6)


def test_clip_loss_asymmetric_upper_and_per_step_columns():
    old = torch.zeros(1, 2)
    adv = torch.tensor([1.0])
    # column 0: r = 1.15 inside the asymmetric band (0.9, 1.2); column 1 outside it
    logp = torch.log(torch.tensor([[1.15, 1.25]])).requires_grad_(True)
    loss, st = fg.grpo_clip_loss(logp, old, adv, 0.1, eps_clip_high=0.2)
    loss.backward()
    assert logp.grad[0, 0].item() == pytest.approx(-1.15 / 2, abs=1e-6)  # not zeroed by column 1
    assert logp.grad[0, 1].item() == 0.0
    assert st["clip_fraction"].item() == pytest.approx(0.5)
    with pytest.raises(ValueError, match="advantages"):
        fg.grpo_clip_loss(torch.zeros(3, 2), torch.zeros(3, 2), torch.zeros(2), 0.1)


# ---------------------------------------------------------------- advantages


def test_normalize_grouped_modes():
    r = torch.tensor([1.0, 3.0, 10.0, 10.0, 0.0, 4.0])
    g = fg.normalize_grouped(r, 2, "group", eps=0.0 + 1e-6)
    torch.testing.assert_close(g[:2], torch.tensor([-1.0, 1.0]), atol=1e-5, rtol=0)
    assert g[2:4].abs().max().item() == 0.0  # zero-variance group -> zero advantage, not NaN
    torch.testing.assert_close(g[4:], torch.tensor([-1.0, 1.0]), atol=1e-5, rtol=0)
    none = fg.normalize_grouped(r, 2, "none")
    torch.testing.assert_close(none, torch.tensor([-1.0, 1.0, 0.0, 0.0, -2.0, 2.0]))
    batch = fg.normalize_grouped(r, 2, "batch")
    pop_std = r.std(unbiased=False).item()
    torch.testing.assert_close(batch, none / (pop_std + 1e-6))
    # groups of 3
    g3 = fg.normalize_grouped(torch.tensor([0.0, 1.0, 2.0]), 3)
    torch.testing.assert_close(g3, torch.tensor([-1.0, 0.0, 1.0]) / (math.sqrt(2 / 3) + 1e-6))
    with pytest.raises(ValueError, match="groups of 4"):
        fg.normalize_grouped(r, 4)
    with pytest.raises(ValueError, match="std_mode"):
        fg.normalize_grouped(r, 2, "global")


def test_combine_component_advantages():
    a = torch.tensor([1.0, 3.0, 0.0, 4.0])
    b = torch.tensor([5.0, 1.0, 2.0, 2.0])
    out = fg.combine_component_advantages({"pick": a, "ocr": b}, {"pick": 1.0, "ocr": 0.5}, 2)
    exp = fg.normalize_grouped(a, 2) + 0.5 * fg.normalize_grouped(b, 2)
    torch.testing.assert_close(out, exp)
    out_none = fg.combine_component_advantages({"pick": a}, {"pick": 2.0}, 2, std_mode="none")
    torch.testing.assert_close(out_none, 2.0 * torch.tensor([-1.0, 1.0, -2.0, 2.0]))
    with pytest.raises(ValueError, match="without a weight"):
        fg.combine_component_advantages({"pick": a, "ocr": b}, {"pick": 1.0}, 2)
    with pytest.raises(ValueError, match="did not produce"):
        fg.combine_component_advantages({"pick": a}, {"pick": 1.0, "ocr": 1.0}, 2)


# ---------------------------------------------------------------- a whole trajectory


class _TinyVelocity(torch.nn.Module):
    """A stand-in DiT: v = MLP([x, sigma]) per token."""

    def __init__(self, dim=8):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(dim + 1, 32), torch.nn.SiLU(), torch.nn.Linear(32, dim))

    def forward(self, x, sigma):
        s = torch.as_tensor(sigma, dtype=x.dtype).reshape(-1, 1, 1).expand(x.shape[0], x.shape[1], 1)
        return self.net(torch.cat([x, s], dim=-1))


def test_trajectory_sampled_with_seeds_replays_exactly_in_microbatches():
    """Sampler (sde_step at trained steps, ode_step elsewhere, noise from the candidate seeds)
    then a replay of the recorded trained steps through the same weights, one candidate at a
    time: the log-probs agree to <= 1e-6 and the pi_old ratio is exactly 1."""
    from trainer import sampling as sp

    torch.manual_seed(0)
    model = _TinyVelocity()
    cfg = sp.parse_sampling_config({"num_inference_steps": 6, "sde_indices": [1, 3, 5], "eta": 0.7})
    sigmas = sp.sigma_schedule({"use_dynamic_shifting": True, "base_shift": 0.5, "max_shift": 0.9,
                                "max_image_seq_len": 8192, "shift_terminal": 0.02}, 6, 16)
    trained = sp.resolve_sde_indices(cfg, 6, None)
    ids = [sp.make_sample_id("positional", 0, slot, None) for slot in range(4)]
    x = torch.stack([sp.initial_noise((16, 8), 1234, sid) for sid in ids])
    x_T = x.clone()
    rec_x, rec_next, rec_lp = [], [], []
    with torch.no_grad():
        for i in range(6):
            v = model(x, sigmas[i])
            if i in trained:
                eps = torch.stack([sp.step_noise((16, 8), 1234, sid, i) for sid in ids])
                nxt, lp = fg.sde_step(x, v, sigmas[i], sigmas[i + 1], cfg.eta, eps, cfg.sde_type, cfg.sigma_max)
                rec_x.append(x)
                rec_next.append(nxt)
                rec_lp.append(lp)
            else:
                nxt = fg.ode_step(x, v, sigmas[i], sigmas[i + 1])
            x = nxt
    recorded = torch.stack(rec_lp, dim=1)  # [B, S]
    assert torch.isfinite(x).all() and recorded.shape == (4, 3)

    replay = torch.zeros(4, 3)
    for b in range(4):  # micro-batches of one candidate
        for col, i in enumerate(trained):
            v = model(rec_x[col][b : b + 1], sigmas[i])
            replay[b, col] = fg.replay_transition_logp(rec_x[col][b : b + 1], rec_next[col][b : b + 1], v,
                                                       sigmas[i], sigmas[i + 1], cfg.eta, cfg.sde_type, cfg.sigma_max)[0]
    assert (replay - recorded).abs().max().item() <= 1e-6
    loss, st = fg.grpo_clip_loss(replay, recorded, torch.tensor([1.0, -1.0, 0.5, -0.5]), 1e-4)
    assert abs(st["ratio_mean"].item() - 1.0) <= 1e-5 and st["clip_fraction"].item() == 0.0
    # a candidate regenerated alone (another batch composition) starts from the same x_T
    alone = sp.initial_noise((16, 8), 1234, ids[2])
    assert torch.equal(alone, x_T[2]) and not torch.equal(alone, x_T[1])


def test_transition_kl_is_the_closed_form_of_equal_std_gaussians():
    from trainer.flow_grpo import transition_kl

    g = torch.Generator().manual_seed(0)
    mean, ref = torch.randn(3, 4, 5, generator=g), torch.randn(3, 4, 5, generator=g)
    std = torch.tensor([0.5, 1.0, 2.0]).view(3, 1, 1)
    want = ((mean - ref) ** 2 / (2 * std ** 2)).mean(dim=(1, 2))
    torch.testing.assert_close(transition_kl(mean, ref, std), want, rtol=1e-6, atol=0)
    assert torch.equal(transition_kl(mean, mean.clone(), std), torch.zeros(3))
    mean.requires_grad_(True)
    transition_kl(mean, ref, std).sum().backward()
    assert mean.grad is not None and mean.grad.abs().sum() > 0

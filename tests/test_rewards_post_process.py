"""Advantages from raw rewards: normalisation modes, weights, failed groups, degenerate batches,
the reward/* metrics; the manager's runtimes and batching, its scorer built once; gather across ranks."""

from __future__ import annotations

import math
import os
from types import SimpleNamespace

import pytest
import torch

from trainer.config import GrpoConfig, RewardConfig, RolloutConfig, RunConfig
from trainer.rewards.base import RewardError
from trainer.rewards.color import color_palette
from trainer.rewards.manager import RewardManager
from trainer.rewards.post_process import (
    compute_advantages,
    post_process,
    post_process_from_config,
    resolve_std_mode,
)

R = torch.tensor([1.0, 3.0, 10.0, 14.0])  # two groups of two


def test_std_modes_by_hand():
    group = compute_advantages({"r": R}, 2, std_mode="group").advantages
    torch.testing.assert_close(group, torch.tensor([-1.0, 1.0, -1.0, 1.0]), atol=1e-5, rtol=0)
    none = compute_advantages({"r": R}, 2, std_mode="none").advantages
    torch.testing.assert_close(none, torch.tensor([-1.0, 1.0, -2.0, 2.0]))
    batch = compute_advantages({"r": R}, 2, std_mode="batch").advantages
    std = math.sqrt(((1 - 7) ** 2 + (3 - 7) ** 2 + (10 - 7) ** 2 + (14 - 7) ** 2) / 4)  # population std of R
    torch.testing.assert_close(batch, torch.tensor([-1.0, 1.0, -2.0, 2.0]) / std, atol=1e-5, rtol=1e-5)


def test_weights_combine_normalised_components():
    a = torch.tensor([0.0, 1.0, 5.0, 6.0])
    b = torch.tensor([3.0, 1.0, 2.0, 2.5])
    res = compute_advantages({"a": a, "b": b}, 2, component_weights={"a": 1.0, "b": 0.5}, std_mode="group")
    # a normalises to [-1, 1, -1, 1], b to [1, -1, -1, 1]
    torch.testing.assert_close(res.advantages, torch.tensor([-0.5, 0.5, -1.5, 1.5]), atol=1e-5, rtol=0)
    # without weights: every component at 1.0
    res = compute_advantages({"a": a, "b": b}, 2, std_mode="group")
    torch.testing.assert_close(res.advantages, torch.tensor([0.0, 0.0, -2.0, 2.0]), atol=1e-5, rtol=0)
    # an unweighted extra component is logged, not trained on
    res = compute_advantages({"a": a, "b": b}, 2, component_weights={"a": 1.0}, std_mode="group")
    torch.testing.assert_close(res.advantages, torch.tensor([-1.0, 1.0, -1.0, 1.0]), atol=1e-5, rtol=0)
    assert "reward/b_mean" in res.metrics


def test_non_finite_component_fails_only_its_group():
    r = torch.tensor([1.0, 2.0, 4.0, float("nan"), 0.0, 3.0, 5.0, 9.0])  # 4 groups of 2; group 1 broken
    res = compute_advantages({"pickscore": r}, 2, required_components=["pickscore"], std_mode="batch")
    assert res.failed_groups == [1]
    assert res.valid.tolist() == [True, True, False, False, True, True, True, True]
    assert torch.isfinite(res.advantages).all()
    # the valid groups are normalised exactly as if the failed group had never been there
    keep = torch.tensor([1.0, 2.0, 0.0, 3.0, 5.0, 9.0])
    alone = compute_advantages({"pickscore": keep}, 2, std_mode="batch").advantages
    torch.testing.assert_close(res.advantages[res.valid], alone)
    assert res.metrics["reward/num_groups"] == 3 and res.metrics["reward/failed_groups"] == 1
    assert res.metrics["reward/pickscore_max"] == 9.0  # stats over finite values
    assert math.isnan(res.components["pickscore"][3])  # raw value kept as scored
    # inf fails its group too; a weighted, non-required component counts as well
    other = torch.tensor([0.0, 1.0, 0.0, 1.0, float("inf"), 1.0, 0.0, 1.0])
    res = compute_advantages({"pickscore": r.nan_to_num(0.0), "x": other}, 2,
                             required_components=["pickscore"], component_weights={"pickscore": 1, "x": 1})
    assert res.failed_groups == [2]


def test_missing_required_component_is_a_configuration_error():
    with pytest.raises(RewardError, match="--reward-required-components"):
        compute_advantages({"color": R}, 2, required_components=["pickscore"])
    with pytest.raises(RewardError, match="not produced by the scorer"):
        compute_advantages({"color": R}, 2, component_weights={"pickscore": 1.0})
    with pytest.raises(ValueError, match="--n-samples-per-prompt"):
        compute_advantages({"color": R}, 3)


def test_degenerate_and_metrics():
    flat = compute_advantages({"c": torch.full((6,), 0.5)}, 3)
    assert flat.degenerate and flat.metrics["reward/degenerate"] == 1.0
    assert flat.metrics["reward/group_std_mean"] == 0.0
    all_failed = compute_advantages({"c": torch.full((4,), float("nan"))}, 2)
    assert all_failed.degenerate and not all_failed.valid.any() and all_failed.failed_groups == [0, 1]
    res = compute_advantages({"c": R}, 2, score_time=0.5)
    assert not res.degenerate
    m = res.metrics
    assert m["reward/c_mean"] == pytest.approx(7.0) and m["reward/c_min"] == 1.0 and m["reward/c_max"] == 14.0
    assert m["reward/c_std"] == pytest.approx(math.sqrt(27.5))
    assert m["reward/group_std_mean"] == pytest.approx((1.0 + 2.0) / 2)  # population std per group
    assert m["reward/advantage_mean"] == pytest.approx(0.0, abs=1e-6)
    assert m["reward/advantage_std"] == pytest.approx(1.0, abs=1e-5)
    assert m["reward/num_groups"] == 2 and m["reward/degenerate"] == 0.0
    assert m["reward/score_time"] == 0.5 and m["reward/score_samples_per_s"] == 8.0
    assert res.advantages.dtype == torch.float32 and res.valid.dtype == torch.bool


def test_resolve_std_mode():
    assert resolve_std_mode(None, False) == "group"
    assert resolve_std_mode(None, True) == "none"
    assert resolve_std_mode("batch", False) == "batch"
    assert resolve_std_mode("none", True) == "none"
    assert resolve_std_mode("group", False, group_size=1) == "none"
    with pytest.raises(ValueError, match="contradicts"):
        resolve_std_mode("group", True)
    with pytest.raises(ValueError, match="--generative-advantage-std-mode"):
        resolve_std_mode("global", False)


# --- manager -----------------------------------------------------------------------------------

class ProbeScorer:
    """Records where it was built / called and what it saw."""

    components = ("probe",)
    required_tracks = ("image",)
    built = 0

    def __init__(self, model_path=None, device="cpu"):
        type(self).built += 1
        self.device = device
        self.model_path = model_path
        self.cuda_at_init = torch.cuda.is_available()
        self.calls = []

    def score(self, images, prompts, metadata):
        self.calls.append((len(images), torch.cuda.is_available()))
        return {"probe": torch.tensor([float(img.mean()) for img in images.float_tensors])}


PROBE = f"{__name__}.ProbeScorer"


def test_the_runtime_picks_the_device_the_scorer_is_built_on(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # pretend a GPU is present
    cpu = RewardManager("cpu", PROBE, device="cuda:3")
    cpu.score(torch.rand(2, 3, 4, 4), ["a", "b"])
    assert cpu.device == "cpu" and cpu.scorer.device == "cpu"  # cpu ignores the engine's device
    # the device is the constructor's argument only: the manager patches nothing process-wide
    assert cpu.scorer.cuda_at_init is True and cpu.scorer.calls[0][1] is True
    assert torch.cuda.is_available() is True
    colo = RewardManager("colocate", PROBE, device="cuda:3")
    colo.score(torch.rand(2, 3, 4, 4), ["a", "b"])
    assert colo.device == "cuda:3" and colo.scorer.device == "cuda:3"
    assert colo.scorer.cuda_at_init is True and colo.scorer.calls[0][1] is True


def test_manager_builds_its_scorer_once_and_batches_in_order():
    ProbeScorer.built = 0
    m = RewardManager("cpu", PROBE, "/m", device="cuda:0", batch_size=3)
    assert ProbeScorer.built == 1 and m.scorer.model_path == "/m"
    images = torch.stack([torch.full((3, 2, 2), i / 10) for i in range(7)])
    out = m.score(images, [str(i) for i in range(7)])
    assert [n for n, _ in m.scorer.calls] == [3, 3, 1]
    torch.testing.assert_close(out.components["probe"], torch.round(torch.arange(7) / 10 * 255) / 255)
    assert out.num_samples == 7 and out.score_time > 0
    m.score(images[:2], ["a", "b"])
    assert ProbeScorer.built == 1  # scoring builds nothing: every call goes to the scorer built with m
    assert [n for n, _ in m.scorer.calls] == [3, 3, 1, 2]
    with pytest.raises(ValueError, match="--reward-runtime"):
        RewardManager("dedicated", PROBE)
    with pytest.raises(ValueError, match="--reward-scorer-path"):
        RewardManager("cpu", None)
    with pytest.raises(ValueError, match="--reward-endpoint"):
        RewardManager("remote", PROBE)


def test_post_process_end_to_end_with_color_scorer():
    pal = color_palette()
    # 2 prompts x 3 candidates, group-major; candidate c of group g mixes the target colour in
    groups = [("a red cube", pal["red"]), ("a blue cube", pal["blue"]), ("a green cube", pal["green"])]
    images, prompts = [], []
    for prompt, rgb in groups[:2]:
        for t in (0.2, 0.5, 0.9):
            target = torch.tensor(rgb).view(3, 1, 1).expand(3, 8, 8)
            images.append(t * target + (1 - t) * 0.5)
            prompts.append(prompt)
    images += [torch.full((3, 8, 8), 0.5)] * 3
    prompts += ["a cube"] * 3  # names no colour: NaN, the group fails
    manager = RewardManager("cpu", "trainer.rewards.color.ColorScorer", batch_size=4)
    assert RewardManager("cpu", "color").scorer_path == manager.scorer_path  # short names resolve to the dotpath
    res = post_process(torch.stack(images), prompts, group_size=3, manager=manager,
                       required_components=["color"], component_weights={"color": 1.0})
    assert res.failed_groups == [2] and res.valid.sum() == 6
    adv = res.advantages.view(3, 3)
    assert (adv[:2, 2] > adv[:2, 1]).all() and (adv[:2, 1] > adv[:2, 0]).all()
    assert res.metrics["reward/num_groups"] == 2 and "reward/score_time" in res.metrics

    cfg = RunConfig(
        reward=RewardConfig(reward_runtime="cpu", reward_scorer_path="trainer.rewards.color.ColorScorer",
                            reward_model_path=None, reward_endpoint=None,
                            reward_required_components=["color"], reward_component_weights={"color": 1.0}),
        grpo=GrpoConfig(generative_advantage_std_mode=None, disable_grpo_std_normalization=True),
        rollout=RolloutConfig(n_samples_per_prompt=3),
    )
    res_cfg = post_process_from_config(cfg, torch.stack(images), prompts)
    raw = res.components["color"].view(3, 3)[:2]
    torch.testing.assert_close(res_cfg.advantages.view(3, 3)[:2], raw - raw.mean(dim=1, keepdim=True))
    # the manager one holds scores the same
    held = post_process_from_config(cfg, torch.stack(images), prompts, manager=manager)
    torch.testing.assert_close(held.advantages, res_cfg.advantages)


# --- gather across ranks -------------------------------------------------------------------------

def _gather_worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    import torch.distributed as dist

    from trainer.rewards.post_process import compute_advantages, gather_scores

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        # 8 candidates (4 groups of 2) dealt round-robin; rank 1 cannot score position 3
        idx = torch.arange(rank, 8, world)
        values = idx.float() * 10
        if rank == 1:
            values[idx == 3] = float("nan")
        local = {"c": values}
        if rank == 0:
            local["extra"] = torch.ones(idx.numel())  # only rank 0 has it
        full = gather_scores(local, idx, 8)
        res = compute_advantages({"c": full["c"]}, 2, std_mode="none")
        torch.save({"full": full, "adv": res.advantages, "failed": res.failed_groups},
                   os.path.join(out_dir, f"rank{rank}.pt"))
        try:
            gather_scores({"c": torch.zeros(1)}, torch.tensor([0]), 8)  # positions 1..7 unscored
        except RewardError as e:
            torch.save(str(e), os.path.join(out_dir, f"err{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_gather_scores_two_ranks(tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_gather_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    expected = torch.arange(8).float() * 10
    expected[3] = float("nan")
    torch.testing.assert_close(r0["full"]["c"], expected, equal_nan=True)
    assert r0["full"]["extra"][0::2].eq(1).all() and r0["full"]["extra"][1::2].isnan().all()
    assert r0["failed"] == r1["failed"] == [1]
    assert torch.equal(r0["adv"], r1["adv"])  # every rank computes the same advantages
    assert "scored by" in torch.load(tmp_path / "err0.pt")


def test_adv_clip_max_clamps_after_normalisation_and_counts():
    """One outlier in a group of 8 normalises to sqrt(7) ~ 2.65 (the others to -1/sqrt(7)):
    a clamp at 1.5 clips exactly that one candidate of each group; 0 leaves everything alone."""
    r = torch.tensor([10.0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, -3.0])
    off = compute_advantages({"r": r}, 8, std_mode="group")
    assert "reward/adv_clipped_fraction" not in off.metrics
    assert off.advantages.max().item() == pytest.approx(math.sqrt(7), rel=1e-5)
    on = compute_advantages({"r": r}, 8, std_mode="group", adv_clip_max=1.5)
    assert on.advantages.max().item() == 1.5 and on.advantages.min().item() == -1.5
    assert on.metrics["reward/adv_clipped_fraction"] == pytest.approx(2 / 16)
    inside = off.advantages.abs() <= 1.5
    assert torch.equal(on.advantages[inside], off.advantages[inside])
    assert on.metrics["reward/advantage_mean"] != off.metrics["reward/advantage_mean"]
    # a failed group stays 0 and out of the share
    nan = r.clone()
    nan[8] = float("nan")
    part = compute_advantages({"r": nan}, 8, std_mode="group", adv_clip_max=1.5)
    assert part.metrics["reward/adv_clipped_fraction"] == pytest.approx(1 / 8)
    assert torch.equal(part.advantages[8:], torch.zeros(8))
    with pytest.raises(ValueError, match="--adv-clip-max"):
        compute_advantages({"r": r}, 8, adv_clip_max=-1.0)


def test_adv_clip_max_flag_reaches_post_process_and_preflight():
    from trainer.config import load_config
    from trainer.preflight import PreflightError, validate

    assert load_config([]).grpo.adv_clip_max == 0.0
    assert load_config(["--adv-clip-max", "5"]).grpo.adv_clip_max == 5.0
    cfg = RunConfig(rollout=RolloutConfig(n_samples_per_prompt=8),
                    grpo=GrpoConfig(generative_advantage_std_mode=None, disable_grpo_std_normalization=False,
                                    adv_clip_max=1.5))
    r = torch.tensor([10.0, 0, 0, 0, 0, 0, 0, 0])

    class Manager:
        def score(self, images, prompts, metadata, batch_size=None):
            return SimpleNamespace(components={"r": r}, score_time=None)

    res = post_process_from_config(cfg, [None] * 8, ["p"] * 8, manager=Manager())
    assert res.advantages.max().item() == 1.5
    for value, refused in (("-1", True), ("5", False)):
        with pytest.raises(PreflightError) as exc:  # the bare config has other problems too
            validate(load_config(["--adv-clip-max", value]), 1, torchrun=False)
        assert any(p.startswith("--adv-clip-max") for p in exc.value.problems) is refused


def test_weighted_total_and_each_components_raw_group_std():
    """reward/weighted_total_* is sum_c w_c * raw_c over the valid candidates; every component's
    reward/<c>_group_std_mean is its own raw spread, also for one left out of the weights."""
    a = torch.tensor([0.0, 1.0, 2.0, 4.0])        # groups [0, 1], [2, 4]: stds 0.5, 1.0
    b = torch.tensor([10.0, 10.0, 0.0, 2.0])      # stds 0, 1
    extra = torch.tensor([0.0, 3.0, 0.0, 0.0])    # not trained on: stds 1.5, 0
    res = compute_advantages({"a": a, "b": b, "extra": extra}, 2, component_weights={"a": 2.0, "b": 0.5})
    m = res.metrics
    total = 2.0 * a + 0.5 * b                     # [5, 7, 4, 9]
    assert m["reward/weighted_total_mean"] == pytest.approx(float(total.mean()))
    assert m["reward/weighted_total_min"] == 4.0 and m["reward/weighted_total_max"] == 9.0
    assert m["reward/a_group_std_mean"] == pytest.approx(0.75)
    assert m["reward/b_group_std_mean"] == pytest.approx(0.5)
    assert m["reward/extra_group_std_mean"] == pytest.approx(0.75)
    assert m["reward/group_std_mean"] == pytest.approx((1.0 + 2.5) / 2)  # the weighted reward's
    # a failed group (NaN in a weighted component) is left out of the total's figures: [2, 6] remain
    failed = compute_advantages({"a": torch.tensor([0.0, float("nan"), 2.0, 4.0]), "b": b}, 2,
                                component_weights={"a": 1.0, "b": 1.0})
    assert failed.metrics["reward/weighted_total_min"] == 2.0 and failed.metrics["reward/weighted_total_max"] == 6.0

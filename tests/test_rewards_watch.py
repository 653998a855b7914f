"""The reward-hacking watch: its image statistics on constructed images, and the rule on
synthetic runs (trained reward up while a held-out score falls -> flagged at the rollout the
rule names; both up -> never flagged; a drifting statistic -> flagged)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from trainer.rewards.watch import (HackingWatch, WatchSettings, group_diversity, image_statistics,
                                   parse_eval_scorers, per_image_statistics, rollout_statistics)


def test_statistics_on_constructed_images():
    rng = np.random.default_rng(0)
    black = np.zeros((32, 32, 3), np.uint8)
    red = np.zeros((32, 32, 3), np.uint8)
    red[..., 0] = 255
    noise = rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)
    grid = np.full((32, 32, 3), 128, np.uint8)
    grid[::4] = 255
    s_black, s_red, s_noise, s_grid = (image_statistics(a) for a in (black, red, noise, grid))
    assert s_black["dark_fraction"] == 1.0 and s_red["dark_fraction"] == 0.0
    assert s_red["saturated_fraction"] == 1.0 and s_black["saturated_fraction"] == 0.0
    assert s_black["color_entropy"] == 0.0 and s_noise["color_entropy"] > 9.0  # 1024 pixels, 4096 bins
    assert s_black["edge_density"] == 0.0 and s_grid["edge_density"] > 0.3 and s_noise["edge_density"] > 0.5
    assert s_noise["high_freq_energy"] > s_grid["high_freq_energy"] > s_black["high_freq_energy"] == 0.0
    assert s_noise["jpeg_bytes_per_pixel"] > 2 * s_black["jpeg_bytes_per_pixel"]  # 32x32: headers weigh
    # diversity: identical candidates -> 0; different ones -> > 0
    cols = per_image_statistics([black, black, black, noise])
    means, stds = rollout_statistics(cols, group_size=2)
    div = group_diversity(torch.stack([cols[k] for k in sorted(cols) if k.startswith("thumb_")], 1), 2)
    assert div[0] == 0.0 and div[1] > 0.2
    assert means["group_diversity"] == pytest.approx(float(div.mean()))
    assert means["dark_fraction"] == pytest.approx(0.75) and stds["dark_fraction"] == pytest.approx(0.4330127)


def run(watch, rewards, heldout=None, stat=None, eval_every=2):
    """Feed a synthetic run; returns the rollouts at which reward/hacking_suspect was 1."""
    flagged = []
    for k, r in enumerate(rewards):
        means = {"edge_density": stat[k] if stat else 0.1}
        m = watch.update(r, 0.1, means, {"edge_density": 0.02})
        if m["reward/hacking_suspect"]:
            flagged.append(k)
        if heldout is not None and k % eval_every == 0:  # eval after the update, seen from the next rollout
            watch.observe_eval({"eval/aesthetic": heldout[k]}, {"eval/aesthetic": 0.1})
    return flagged


def test_held_out_falling_while_trained_rises_is_flagged_at_the_right_rollout():
    s = WatchSettings(baseline_rollouts=3, reward_rise=0.5, heldout_drop=1.0, patience=2)
    rewards = [0.02 * k for k in range(20)]  # rises 0.2 group stds per rollout
    heldout = [1.0 if k < 8 else 1.0 - 0.05 * (k - 7) for k in range(20)]
    flagged = run(HackingWatch(s), rewards, heldout)
    # the rule by hand: rising from rollout 5 on (mean of last 3 - mean of first 3 = 0.06 > 0.05);
    # the held-out drop passes 1 std (0.1) at the eval of rollout 10 (0.85 -> 1.5 stds), seen at 11;
    # the patience of 2 makes rollout 12 the first flagged one, and it stays flagged
    assert flagged and flagged[0] == 12 and flagged == list(range(12, 20))
    # patience 1: one rollout earlier
    assert run(HackingWatch(WatchSettings(3, 0.5, 3.0, 1.0, 1)), rewards, heldout)[0] == 11


def test_both_rising_is_not_flagged():
    rewards = [0.02 * k for k in range(20)]
    heldout = [1.0 + 0.01 * k for k in range(20)]
    assert run(HackingWatch(WatchSettings(baseline_rollouts=3)), rewards, heldout) == []
    # a falling held-out score alone (the trained reward flat) is not reward hacking either
    assert run(HackingWatch(WatchSettings(baseline_rollouts=3)), [0.5] * 20, [1.0 - 0.05 * k for k in range(20)]) == []


def test_a_drifting_statistic_is_flagged_and_named():
    w = HackingWatch(WatchSettings(baseline_rollouts=3, stat_threshold=3.0, patience=1))
    stat = [0.1] * 6 + [0.1 + 0.01 * k for k in range(14)]  # edges appear: +0.5 std per rollout
    flagged = run(w, [0.02 * k for k in range(20)], stat=stat)
    # drift (x - 0.1) / 0.02 > 3 first when 0.01 * k > 0.06, i.e. k = 7 -> rollout 13
    assert flagged[0] == 13 and "edge_density" in w.message()


def test_eval_scorer_entries_parse():
    assert parse_eval_scorers(["aesthetic=/m/a", "jpeg_compressibility"]) == [
        ("aesthetic", "/m/a"), ("jpeg_compressibility", None)]
    with pytest.raises(ValueError, match="--eval-reward-scorers"):
        parse_eval_scorers(["=/m/a"])

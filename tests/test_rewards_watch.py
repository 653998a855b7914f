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


def _reference(images):
    """The per-image numpy reference, as per_image_statistics' columns."""
    from trainer.rewards.watch import STATS, thumbnail
    rows = [image_statistics(a) for a in images]
    return {k: np.array([r[k] for r in rows]) for k in STATS}, np.stack([thumbnail(a) for a in images])


def _assert_matches_reference(cols, images):
    ref, thumbs = _reference(images)
    for k in ("dark_fraction", "saturated_fraction", "edge_density", "jpeg_bytes_per_pixel"):
        # identical float32 arithmetic before each threshold: the same pixels count
        np.testing.assert_array_equal(cols[k].numpy(), ref[k].astype(np.float32), err_msg=k)
    np.testing.assert_allclose(cols["color_entropy"].numpy(), ref["color_entropy"], rtol=0, atol=1e-6)
    # float32 sums in a different order
    np.testing.assert_allclose(cols["high_freq_energy"].numpy(), ref["high_freq_energy"], rtol=1e-6, atol=1e-9)
    got = torch.stack([cols[k] for k in sorted(cols) if k.startswith("thumb_")], 1).numpy()
    np.testing.assert_array_equal(got, thumbs)


def _constructed(h=40, w=48):
    rng = np.random.default_rng(1)
    black = np.zeros((h, w, 3), np.uint8)
    red = black.copy()
    red[..., 0] = 255
    noise = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
    grid = np.full((h, w, 3), 128, np.uint8)
    grid[::4] = 255
    grid[:, ::5] = 0
    yy, xx = np.meshgrid(np.linspace(0, 1, h), np.linspace(0, 1, w), indexing="ij")
    smooth = np.round(np.stack([xx, yy, (xx + yy) / 2], -1) * 255).astype(np.uint8)
    # every value near the thresholds: maxima around 16 and 64, saturations around 0.9, steps near 0.1
    near = np.stack([rng.integers(10, 70, (h, w)), rng.integers(0, 12, (h, w)), rng.integers(0, 30, (h, w))], -1)
    # pixels on the thresholds themselves: (10k, k, k) has saturation 0.9 in exact arithmetic and
    # 0.90000004 in float32; the pairs side by side have a float32 luminance step of exactly
    # float32(0.1) (first six), or one on the other side of 0.1 than the step computed as
    # r w0 + (g w1 + b w2) (last six): a search over all colours for such pairs
    edge_pairs = [((40, 21, 6), (10, 57, 123)), ((51, 2, 24), (17, 48, 100)), ((61, 8, 46), (1, 62, 149)),
                  ((7, 35, 20), (0, 42, 226)), ((3, 14, 194), (1, 94, 11)), ((0, 1, 18), (4, 9, 190)),
                  ((110, 175, 158), (232, 173, 72)), ((230, 54, 55), (249, 53, 234)),
                  ((86, 187, 255), (249, 168, 149)), ((170, 206, 40), (233, 209, 83)),
                  ((213, 210, 217), (216, 249, 232)), ((192, 65, 171), (254, 99, 57))]
    row = [(10 * k, k, k) for k in range(7, 26)] + [p for pair in edge_pairs for p in pair]
    boundary = np.repeat(np.array(row, np.uint8)[None], 6, axis=0)  # identical rows: dy = 0
    return [black, red, noise, grid, smooth, near.astype(np.uint8), boundary]


def test_batched_statistics_equal_the_per_image_reference(monkeypatch):
    from trainer.rewards import watch
    from trainer.rewards.watch import pixel_statistics

    monkeypatch.setitem(watch._CHUNK_PIXELS, "cpu", 3 * 33 * 29)  # the random batch in 4 chunks

    images = _constructed()
    _assert_matches_reference(per_image_statistics(images), images)
    rng = np.random.default_rng(2)
    batch = [rng.integers(0, 256, (33, 29, 3), dtype=np.uint8) for _ in range(10)]
    _assert_matches_reference(per_image_statistics(batch), batch)
    # a uint8 [B, 3, H, W] tensor gives the same columns as its HWC arrays
    t = torch.from_numpy(np.stack(batch)).permute(0, 3, 1, 2).contiguous()
    via_tensor, via_arrays = per_image_statistics(t), per_image_statistics(batch)
    assert via_tensor.keys() == via_arrays.keys() and all(torch.equal(via_tensor[k], via_arrays[k]) for k in via_arrays)
    # mixed sizes fall back to one batch per image; tiny images have no gradients (0, like numpy)
    mixed = [batch[0], images[2], images[-1], np.full((1, 5, 3), 200, np.uint8), np.full((2, 2, 3), 9, np.uint8)]
    _assert_matches_reference(per_image_statistics(mixed), mixed)
    assert per_image_statistics([])["dark_fraction"].shape == (0,)
    with pytest.raises(ValueError, match=r"uint8 images \[B, 3, H, W\]"):
        pixel_statistics(t.float())


def test_the_watch_quantises_float_images_like_the_png_writer():
    """rollout_watch_metrics' input (float [3, H, W] in [0, 1], out of range too) gives the
    statistics of round(clamp(x, 0, 1) * 255), the bytes a PNG of it holds."""
    from trainer.rewards.base import ImageBatch
    from trainer.rewards.watch import _as_uint8_batch

    g = torch.Generator().manual_seed(3)
    floats = [torch.rand(3, 24, 20, generator=g) * 1.2 - 0.1 for _ in range(4)]
    floats[1] = (torch.arange(24 * 20 * 3).reshape(3, 24, 20) % 256).float() / 255  # exact x / 255 values
    floats[2] = floats[2].bfloat16()
    batch = _as_uint8_batch(floats)
    assert batch.dtype == torch.uint8 and batch.shape == (4, 3, 24, 20)
    png_bytes = ImageBatch.from_any(floats).uint8
    assert all(np.array_equal(a, b) for a, b in zip(batch.permute(0, 2, 3, 1).numpy(), png_bytes))
    assert torch.equal(_as_uint8_batch(torch.stack([f.float() for f in floats])), batch)
    cols = per_image_statistics(batch)
    _assert_matches_reference(cols, png_bytes)
    # mixed geometries go through ImageBatch to per-image arrays, same figures per image
    mixed = _as_uint8_batch([floats[0], floats[1][:, :10]])
    assert isinstance(mixed, list) and np.array_equal(mixed[0], png_bytes[0])

"""trainer.metrics: what a run's TensorBoard files hold, read back with tensorboard's own
EventAccumulator (no screenshot): the run directory named after the recipe, the captioned
grid, per-prompt eval images under one tag across steps, the run's text."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from trainer.metrics import MetricsLogger, captioned_grid, event_run_dir, read_scalars


def _accumulator(path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(path), size_guidance={"images": 0, "tensors": 0, "scalars": 0})
    acc.Reload()
    return acc


def test_captions_are_drawn_under_each_tile():
    tiles = [torch.full((3, 32, 32), v) for v in (0.0, 0.5, 1.0)]
    grid = captioned_grid(tiles, ["g0 s0 color=0.1 | a red ball", "", "g0 s2 color=0.3 | a blue cup"])
    # small tiles are enlarged to 160 px; a 3-line caption strip sits under each
    assert grid.dtype == np.uint8 and grid.shape[1] == 3 * 160 + 2 * 4 and grid.shape[0] > 160
    strip = grid[160:, :, :]
    ink = (strip.min(axis=2) < 128)
    assert ink[:, :160].any() and ink[:, 2 * 164:].any(), "a caption is missing"
    assert not ink[:, 164:164 + 160].any(), "an empty caption drew something"
    assert (grid[:160, :160] == 0).all() and (grid[:160, 2 * 164:] == 255).all(), "the tiles' pixels moved"
    with pytest.raises(ValueError, match="3 images but 2 captions"):
        captioned_grid(tiles, ["a", "b"])


def test_event_files_hold_the_run_name_grid_and_eval_images(tmp_path):
    m = MetricsLogger(tmp_path / "tb", rank=0, run_name="my_recipe")
    m.log_run(0, "my_recipe", {"lr": 1e-4})
    for step in (1, 3):
        m.log(step, {"reward/color_mean": 0.1 * step})
        m.log_image_grid(step, "rollout/candidates", [torch.rand(3, 16, 16)] * 2, ["g0 s0 a", "g0 s1 b"])
        m.log_image_grid(step, "eval/demo/prompt_000", [torch.rand(3, 16, 16)] * 2, ["s0 a", "s1 a"], cols=2)
    m.close()
    MetricsLogger(tmp_path / "tb", rank=1, run_name="my_recipe").log(0, {"x": 1.0})  # other ranks write nothing

    run = event_run_dir(tmp_path / "tb")
    assert run == tmp_path / "tb" / "my_recipe"
    acc = _accumulator(run)
    tags = acc.Tags()
    assert {"rollout/candidates", "eval/demo/prompt_000"} <= set(tags["images"])
    assert [e.step for e in acc.Images("eval/demo/prompt_000")] == [1, 3]
    png = Image.open(io.BytesIO(acc.Images("rollout/candidates")[0].encoded_image_string))
    assert png.size[0] == 2 * 160 + 4 and png.size[1] > 160  # tiles plus their caption strips
    # add_text stores <tag>/text_summary tensors
    assert {"run/text_summary", "rollout/candidates/captions/text_summary"} <= set(tags["tensors"])
    text = acc.Tensors("run/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "my_recipe" in text and '"lr": 0.0001' in text
    assert read_scalars(tmp_path / "tb")["reward/color_mean"] == [(1, pytest.approx(0.1)), (3, pytest.approx(0.3))]

    MetricsLogger(tmp_path / "tb", rank=0, run_name="other").log(0, {"x": 1.0})
    with pytest.raises(ValueError, match="holds 2 runs"):
        read_scalars(tmp_path / "tb")
    assert read_scalars(tmp_path / "tb" / "other")["x"] == [(0, 1.0)]


def test_only_the_root_transformers_view_warning_is_silenced():
    import warnings

    from trainer.loop import silence_known_harmless_warnings

    text = "FSDP2-wrapped module ({}) returned a view tensor. An in-place op on this view ..."
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        silence_known_harmless_warnings()
        warnings.warn(text.format("FSDPQwenImageTransformer2DModel"), UserWarning)
        warnings.warn(text.format("FSDPQwenImageTransformerBlock"), UserWarning)
    assert [str(w.message) for w in seen] == [text.format("FSDPQwenImageTransformerBlock")]


# ----------------------------------------------------------------------------- what a user looks for first


def test_rows_grid_gives_each_prompt_a_row_and_its_whole_text():
    from trainer.metrics import TILE_SIDE, prompt_rows_grid

    short = ("a red ball", [torch.zeros(3, 16, 16)] * 3, ["s0 c=0.1", "s1 c=0.2", "s2 c=0.3"])
    long_prompt = " ".join(f"word{i}" for i in range(80))  # far more than one tile's caption holds
    long = (long_prompt, [torch.ones(3, 16, 16)] * 2, ["s0", "s1"])
    one = prompt_rows_grid([short])
    both = prompt_rows_grid([short, long])
    tile = TILE_SIDE[0]
    assert one.shape[1] == both.shape[1] == 3 * tile + 2 * 4  # the widest row sets the width
    # the second row: its title strip is taller than the first's (the prompt wraps, not cut),
    # then its two white tiles
    second_title = both.shape[0] - one.shape[0] - tile
    first_title = one.shape[0] - tile
    assert second_title > first_title
    white_rows = np.where((both[:, :tile] == 255).all(axis=(1, 2)))[0]
    assert (white_rows >= one.shape[0]).any(), "the second row's tiles are missing"
    with pytest.raises(ValueError, match="2 images and 1 captions"):
        prompt_rows_grid([("p", [torch.zeros(3, 4, 4)] * 2, ["x"])])


def test_histograms_text_and_rows_grid_reach_the_event_file(tmp_path):
    m = MetricsLogger(tmp_path / "tb", rank=0, run_name="r")
    m.log_histograms(2, {"reward/color_hist": torch.tensor([0.1, 0.2, float("nan"), 0.9]),
                         "reward/advantage_hist": [-1.0, 1.0], "reward/empty_hist": [float("nan")]})
    m.log_text(2, "eval/demo/per_prompt", "| # | prompt |\n|---|---|\n| 0 | a red ball |")
    m.log_rows_grid(2, "rollout/candidates", [("a red ball", [torch.rand(3, 8, 8)] * 2, ["s0", "s1"]),
                                              ("a blue cup", [torch.rand(3, 8, 8)] * 2, ["s0", "s1"])])
    m.close()
    acc = _accumulator(tmp_path / "tb" / "r")
    acc_h = acc.Histograms("reward/color_hist")
    assert [e.step for e in acc_h] == [2] and acc_h[0].histogram_value.num == 3  # NaN left out
    assert acc.Histograms("reward/advantage_hist")[0].histogram_value.num == 2
    assert "reward/empty_hist" not in acc.Tags()["histograms"]
    assert {"eval/demo/per_prompt/text_summary", "rollout/candidates/captions/text_summary"} <= set(acc.Tags()["tensors"])
    assert [e.step for e in acc.Images("rollout/candidates")] == [2]


def test_eval_figures_table_throughput_and_summary():
    from trainer.loop import (eval_set_metrics, gather_to_rank0, per_prompt_table, rollout_throughput,
                              summarize)

    comps = {"color": torch.tensor([0.0, 1.0, 0.5, float("nan")])}  # 2 prompts x 2 candidates
    m = eval_set_metrics("demo", comps)
    assert m["eval/demo/color_mean"] == pytest.approx(0.5) and m["eval/demo/color_std"] == pytest.approx(0.40825, abs=1e-4)
    table = per_prompt_table(["a red | ball", "a cup"], comps, 2, limit=1).splitlines()
    assert table[0] == "| # | prompt | color (mean of 2) |"
    assert table[2] == "| 0 | a red \\| ball | 0.5000 |" and "the first 1 of 2 prompts" in table[-1]
    assert per_prompt_table(["a", "b"], comps, 2, 10).splitlines()[-1] == "| 1 | b | 0.5000 |"  # NaN left out
    assert rollout_throughput(64, 4.0, 8) == {"perf/rollout_images_per_s": 16.0,
                                              "perf/rollout_images_per_s_per_gpu": 2.0}
    assert rollout_throughput(64, 0.0, 8) == {}
    assert gather_to_rank0({"x": 1}) == [{"x": 1}]  # no process group: this process's own
    # the summary's group std is each component's raw one, not the weighted reward's
    history = [{"reward/a_mean": 0.1, "reward/a_group_std_mean": 0.3, "reward/group_std_mean": 9.0,
                "reward/extra_mean": 0.5, "reward/extra_group_std_mean": 0.2}]
    s = summarize(history, ["a", "extra"])
    assert s["a"]["group_std_first"] == 0.3 and s["extra"]["group_std_last"] == 0.2


def test_an_eval_pass_draws_nothing_from_the_training_rng(tiny_model_dir, tmp_path):
    """What --eval-base adds before rollout 0 (an eval rollout plus scoring) leaves the global
    torch, numpy and random states as they were: the training streams are unchanged."""
    import random

    from trainer.engine.native import NativeEngine
    from trainer.models.qwen_image import QwenImageAdapter
    from trainer.rewards.manager import RewardManager
    from trainer.rollout import generate_rollout
    from trainer.sampling import parse_sampling_config

    engine = NativeEngine(str(tiny_model_dir), device="cpu", dtype=torch.float32, max_batch_size=4)
    from trainer.data import PromptRecord

    records = [PromptRecord("a red ball", "t2i", "e0"), PromptRecord("a blue cup", "t2i", "e1")]
    sampling = parse_sampling_config({"height": 32, "width": 32, "num_inference_steps": 4, "eta": 0.7,
                                      "sde_type": "sde", "sde_indices": [1, 2]})
    torch.manual_seed(5)
    np.random.seed(5)
    random.seed(5)
    before = (torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate())
    out = generate_rollout(engine, QwenImageAdapter(), records, rollout_id=0, sampling=sampling, group_size=2,
                           generation_seed=3, artifact_root=str(tmp_path / "eval_base"), task="t2i", retention=0,
                           eval=True)
    RewardManager("cpu", "color", None, "cpu").score(list(out.trajectory.images.unbind(0)), list(out.trajectory.prompts))
    assert torch.equal(torch.get_rng_state(), before[0])
    assert (np.random.get_state()[1] == before[1]).all() and random.getstate() == before[2]


def test_plot_rewards_defaults_to_the_trained_reward_with_clean_ticks_and_legend(tmp_path, capsys):
    from PIL import Image as PILImage

    from tools import plot_rewards

    m = MetricsLogger(tmp_path / "tb", rank=0, run_name="r")
    for step in range(4):
        m.log(step, {"reward/a_untrained_mean": 0.0, "reward/weighted_total_mean": 0.1 * step,
                     "reward/zz_mean": 0.2 * step})
    m.log(3, {"eval/a_rather_long_eval_set_name_for_the_legend/weighted_total_mean": 0.5})
    m.close()
    out = tmp_path / "c.png"
    assert plot_rewards.main(["--tensorboard-dir", str(tmp_path / "tb"), "--output", str(out)]) == 0
    said = capsys.readouterr().out
    assert f"wrote {out}: reward/weighted_total_mean, eval/a_rather_long_eval_set_name_for_the_legend/" in said
    # older runs without the total: the first series that moves, not a flat one first in order
    assert plot_rewards.default_series({"reward/a_mean": [(0, 0.0), (1, 0.0)], "reward/b_mean": [(0, 0.0), (1, 1.0)]}) \
        == "reward/b_mean"
    # whole rollout ids, each once
    assert plot_rewards.integer_ticks(0, 3) == [0, 1, 2, 3]
    ticks = plot_rewards.integer_ticks(0, 39)
    assert ticks == [0, 5, 10, 15, 20, 25, 30, 35] and len(set(ticks)) == len(ticks)
    assert plot_rewards.integer_ticks(2, 2) == [2]
    # the legend is under the plot and the picture widens for a long label instead of cutting it
    label = "eval/" + "x" * 200 + "/weighted_total_mean"
    plot_rewards.plot({"reward/weighted_total_mean": [(0, 0.0), (1, 1.0)], label: [(1, 0.5)]}, out, "t")
    from PIL import ImageFont

    with PILImage.open(out) as im:
        assert im.size[0] >= ImageFont.load_default().getlength(f"{label} (dots)") + 70 and im.size[1] > 480


def test_gc_clock_counts_the_collections_of_every_thread_between_takes():
    """perf/gc_time: the collector's seconds and its full collections since the last take, from
    any thread; nothing after close()."""
    import gc
    import threading

    from trainer.loop import GcClock

    def garbage(n=20000):  # reference cycles only the cyclic collector frees
        for _ in range(n):
            a = []
            a.append(a)

    clock = GcClock()
    try:
        clock.take()
        garbage()
        gc.collect()  # a full collection on this thread
        worker = threading.Thread(target=lambda: (garbage(), gc.collect()))
        worker.start()
        worker.join()
        got = clock.take()
        assert got["perf/gc_full_collections"] >= 2 and got["perf/gc_time"] > 0
        again = clock.take()
        assert again["perf/gc_full_collections"] == 0 and again["perf/gc_time"] < got["perf/gc_time"]
    finally:
        clock.close()
    gc.collect()
    assert clock.take() == {"perf/gc_time": 0.0, "perf/gc_full_collections": 0.0}

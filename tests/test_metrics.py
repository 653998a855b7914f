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

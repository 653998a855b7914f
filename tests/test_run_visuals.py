"""What a person sees of an editing or a video run: TensorBoard's grids show an edit beside the
source it was conditioned on and a video as frames at a readable height, and every rollout
directory holds an index (index.jsonl, index.html) naming each candidate's file beside its
prompt, scores and source, written atomically and escaped, since prompts come from a file the
run does not trust. Unit level on the tiny edit and Wan models; the families' end-to-end tests
check the same through a real run."""

from __future__ import annotations

import io
import json
import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from trainer import artifacts

pytestmark = pytest.mark.filterwarnings("ignore:FSDP2-wrapped module.*returned a view tensor")

EDIT_SAMPLING = {"height": 32, "width": 32, "num_inference_steps": 2, "eta": 1.0, "sde_type": "sde",
                 "sde_indices": [1]}
WAN_SAMPLING = {"height": 32, "width": 32, "num_frames": 5, "num_inference_steps": 2, "eta": 0.7,
                "sde_type": "sde", "sde_indices": [1], "cfg_renorm": False, "negative_prompt": ""}


def tb_images(run_dir) -> dict[str, np.ndarray]:
    """{tag: the last HWC uint8 image logged under it} of a TensorBoard directory."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from trainer.metrics import event_run_dir

    acc = EventAccumulator(str(event_run_dir(run_dir)), size_guidance={"images": 0, "tensors": 0})
    acc.Reload()
    return {tag: np.asarray(Image.open(io.BytesIO(acc.Images(tag)[-1].encoded_image_string)).convert("RGB"))
            for tag in acc.Tags()["images"]}


def tb_texts(run_dir) -> dict[str, str]:
    """{tag: the last text logged under it} of a TensorBoard directory."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from trainer.metrics import event_run_dir

    acc = EventAccumulator(str(event_run_dir(run_dir)), size_guidance={"tensors": 0})
    acc.Reload()
    return {tag.removesuffix("/text_summary"): acc.Tensors(tag)[-1].tensor_proto.string_val[0].decode()
            for tag in acc.Tags()["tensors"] if tag.endswith("/text_summary")}


def fake_trainer(tmp_path, group_size: int, task: str):
    """What Trainer's image and index methods read of the trainer: rank, group size, task and
    a rank-0 MetricsLogger."""
    from trainer.metrics import MetricsLogger

    return SimpleNamespace(rank=0, group_size=group_size, task=task, metrics=MetricsLogger(tmp_path / "tb"))


def has_pixels(grid: np.ndarray, tile: np.ndarray) -> bool:
    """Whether `tile` (HWC uint8) occurs in `grid` exactly, at any position (a brute search over
    the positions where its top-left pixel matches)."""
    h, w = tile.shape[:2]
    for y, x in zip(*np.nonzero((grid[:, :, :] == tile[0, 0]).all(axis=2))):
        if y + h <= grid.shape[0] and x + w <= grid.shape[1] and np.array_equal(grid[y:y + h, x:x + w], tile):
            return True
    return False


# ---------------------------------------------------------------- an edit's source in the grids


@pytest.fixture(scope="module")
def edit_rollout(tmp_path_factory):
    """Two i2i records (a red and a blue square source) x 2 candidates on the tiny edit model,
    written under an artifact root, with the scorer inputs the loop hands the scorers."""
    from tools.tiny_qwen_image_edit import build_tiny_qwen_image_edit_pipeline
    from trainer.data import PromptRecord
    from trainer.engine.native import NativeEngine
    from trainer.loop import _scorer_inputs, take_sources
    from trainer.models.qwen_image_edit import QwenImageEditAdapter
    from trainer.rollout import generate_rollout
    from trainer.sampling import parse_sampling_config

    tmp = tmp_path_factory.mktemp("visuals_edit")
    model = build_tiny_qwen_image_edit_pipeline(tmp / "model", seed=0, variant="2511")
    adapter = QwenImageEditAdapter()
    engine = NativeEngine(str(model), device="cpu", dtype=torch.float32, adapter=adapter)
    records = []
    for i, colour in enumerate(((220, 30, 30), (30, 30, 220))):
        im = Image.new("RGB", (40, 40), (240, 240, 240))
        im.paste(Image.new("RGB", (20, 20), colour), (10, 10))
        im.save(tmp / f"src{i}.png")
        records.append(PromptRecord(prompt=f"<image> make square {i} green <b>now</b>", task="i2i",
                                    sample_id=f"e{i}", images=(str(tmp / f"src{i}.png"),)))
    out = generate_rollout(engine, adapter, records, rollout_id=3, sampling=parse_sampling_config(EDIT_SAMPLING),
                           group_size=2, generation_seed=3, artifact_root=tmp / "art", task="i2i")
    inputs = _scorer_inputs(out.trajectory, take_sources(engine))
    return SimpleNamespace(out=out, records=records, metadata=inputs[2], tmp=tmp)


def test_the_rollout_grid_shows_each_edit_beside_its_source(edit_rollout, tmp_path):
    """rollout/candidates: each group's row starts with the pixels its candidates were conditioned
    on (the scorers' pixels, at the candidates' size), captioned with the source's file name."""
    from trainer.loop import Trainer
    from trainer.models.edit_source import source_pixels
    from trainer.rewards.base import SOURCE_IMAGES_KEY

    out, md = edit_rollout.out, edit_rollout.metadata
    fake = fake_trainer(tmp_path, 2, "i2i")
    reward = SimpleNamespace(components={"color_edit": torch.tensor([0.1, 0.2, 0.3, 0.4])})
    Trainer._log_images(fake, 3, out, reward, md)
    fake.metrics.close()
    grid = tb_images(tmp_path / "tb")["rollout/candidates"]
    caps = tb_texts(tmp_path / "tb")["rollout/candidates/captions"]
    assert "source: src0.png" in caps and "source: src1.png" in caps and "s1 color_edit=0.200" in caps
    # the tiles are enlarged (nearest) from 32 to 160 px: the source's pixels, each 5 x 5
    for g in (0, 1):
        want = np.repeat(np.repeat(md[2 * g][SOURCE_IMAGES_KEY][0], 5, axis=0), 5, axis=1)
        assert np.array_equal(md[2 * g][SOURCE_IMAGES_KEY][0], source_pixels(edit_rollout.records[g].images[0], 32, 32))
        assert has_pixels(grid, want), f"group {g}'s source is not in the grid"
    # three tiles a row: the source and the two candidates
    assert grid.shape[1] == 3 * 160 + 2 * 4


def test_the_eval_grid_shows_each_edit_beside_its_source(edit_rollout, tmp_path):
    """eval/<set>/prompt_<g>: the source first, then the prompt's candidates; the source crosses
    to rank 0 once per group (on its first candidate), as a thumbnail."""
    from trainer.loop import Trainer, _eval_thumbnails
    from trainer.rewards.base import SOURCE_IMAGES_KEY

    out, md = edit_rollout.out, edit_rollout.metadata
    thumbs = _eval_thumbnails(out.trajectory, 16, md)
    assert [len(t.sources) for t in thumbs] == [1, 0, 1, 0] and not any(t.video for t in thumbs)
    assert thumbs[0].sources[0][0] == "source: src0.png"
    assert torch.equal(thumbs[0].sources[0][1], torch.from_numpy(md[0][SOURCE_IMAGES_KEY][0]).permute(2, 0, 1))
    fake = fake_trainer(tmp_path, 2, "i2i")
    Trainer._log_eval_images(fake, 5, "edits", out.trajectory, {"color_edit": torch.tensor([0.1, 0.2, 0.3, 0.4])},
                             2, md)
    fake.metrics.close()
    images, texts = tb_images(tmp_path / "tb"), tb_texts(tmp_path / "tb")
    assert set(images) == {"eval/edits/prompt_000", "eval/edits/prompt_001"}
    assert texts["eval/edits/prompt_001/captions"].startswith("0: source: src1.png\n\n1: s0 color_edit=0.300")
    want = np.repeat(np.repeat(md[2][SOURCE_IMAGES_KEY][0], 5, axis=0), 5, axis=1)
    assert has_pixels(images["eval/edits/prompt_001"], want)


# ---------------------------------------------------------------- the rollout index


def test_the_index_names_every_file_beside_its_prompt_scores_and_source(edit_rollout, tmp_path):
    """index.jsonl: one line per group with its prompt, its source's name (never its directory),
    and each candidate's file (which exists), scores and advantage; index.html shows them, the
    prompt's markup escaped, under a policy that runs no script."""
    from trainer.loop import Trainer

    out = edit_rollout.out
    fake = fake_trainer(tmp_path, 2, "i2i")
    comps = {"color_edit": torch.tensor([0.1, float("nan"), 0.3, 0.4])}
    Trainer._write_index(fake, out, edit_rollout.records, 2, comps, torch.tensor([1.0, 0.0, -1.0, 1.0]),
                         title="i2i rollout 3")
    lines = (out.artifact_dir / "index.jsonl").read_text().splitlines()
    entries = [json.loads(line) for line in lines]
    assert [e["group"] for e in entries] == [0, 1]
    assert entries[1]["prompt"] == "<image> make square 1 green <b>now</b>" and entries[1]["sources"] == ["src1.png"]
    assert entries[0]["sidecar"] == "group_00000000.safetensors"
    c = entries[0]["candidates"]
    assert c[0] == {"slot": 0, "file": "group_00000000_sample_0000.png", "scores": {"color_edit": pytest.approx(0.1)},
                    "advantage": 1.0}
    assert c[1]["scores"] == {"color_edit": None}  # NaN (a failed score) is JSON null
    assert all((out.artifact_dir / cand["file"]).is_file() for e in entries for cand in e["candidates"])
    assert str(edit_rollout.tmp) not in "".join(lines)  # no host directory in the index
    page = (out.artifact_dir / "index.html").read_text()
    assert "&lt;image&gt; make square 1 green &lt;b&gt;now&lt;/b&gt;" in page and "<b>now" not in page
    assert 'src="group_00000001_sample_0001.png"' in page and "Content-Security-Policy" in page
    assert "default-src 'none'" in page and "<script" not in page
    # an index is written once: a second write (or anything already there) is refused
    with pytest.raises(FileExistsError):
        Trainer._write_index(fake, out, edit_rollout.records, 2, comps, None, title="again")


def test_an_untrusted_prompt_cannot_break_the_index_or_choose_a_file(tmp_path):
    """A prompt with a closing tag, quotes, a line separator and 5000 characters: the page holds
    it escaped, the JSONL keeps one line per group (ASCII, the separator escaped) and the prompt
    cut to INDEX_PROMPT_CHARS; the files' names are fixed, whatever the prompt says."""
    evil = '</p><script>alert(1)</script>"\' onerror=x \u2028 ../../etc/passwd ' + "x" * 5000
    entries = artifacts.rollout_index([(evil, ["/secret/dir/src.png"]), ("plain", [])], 2,
                                      {"s<b>": torch.tensor([1.0, 2.0, 3.0, float("inf")])})
    jsonl, page = artifacts.write_rollout_index(tmp_path / "rollout_0000000", entries, title="<t>")
    assert sorted(p.name for p in (tmp_path / "rollout_0000000").iterdir()) == ["index.html", "index.jsonl"]
    assert (jsonl.name, page.name) == ("index.jsonl", "index.html")
    raw = jsonl.read_bytes()
    assert raw.isascii() and len(raw.decode().splitlines()) == 2
    first = json.loads(raw.decode().splitlines()[0])
    assert len(first["prompt"]) == artifacts.INDEX_PROMPT_CHARS + 3 and first["prompt"].endswith("...")
    assert first["sources"] == ["src.png"] and first["candidates"][1]["scores"] == {"s<b>": 2.0}
    html = page.read_text()
    assert "<script" not in html and "</p><" not in html.split('class="prompt">')[1].split("</p>")[0]
    assert "&lt;/p&gt;&lt;script&gt;" in html and "s&lt;b&gt;=" in html and "<title>&lt;t&gt;</title>" in html
    assert os.path.getsize(page) < 8 * 1024  # bounded: the prompt is cut, whatever its length


def test_the_index_is_written_atomically_and_never_through_a_planted_link(tmp_path):
    """A link planted at index.jsonl is not followed (the write is refused and its target kept);
    a failed write leaves no index and no temporary behind."""
    d = tmp_path / "rollout_0000001"
    d.mkdir()
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    (d / "index.jsonl").symlink_to(victim)
    entries = artifacts.rollout_index([("a red ball", [])], 1, {"c": torch.tensor([0.5])})
    with pytest.raises(FileExistsError, match="never overwritten"):
        artifacts.write_rollout_index(d, entries, title="t")
    assert victim.read_text() == "keep me" and sorted(p.name for p in d.iterdir()) == ["index.jsonl"]


def test_retention_reaps_the_index_with_its_rollout(tmp_path):
    """The index lives in its rollout's directory, so --artifact-retention-rollouts removes it with
    the rollout's images and sidecars."""
    for k in range(3):
        d = artifacts.prepare_rollout_dir(tmp_path, "t2i", k)
        artifacts.write_rollout_index(d, artifacts.rollout_index([("p", [])], 1, {"c": torch.tensor([1.0])}),
                                      title=f"rollout {k}")
        artifacts.prune_stale_artifacts(tmp_path, "t2i", 2, up_to=k)
    assert [i for i, _ in artifacts.list_rollout_dirs(tmp_path, "t2i")] == [1, 2]
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("index.*")) == [
        "t2i/rollout_0000001/index.html", "t2i/rollout_0000001/index.jsonl",
        "t2i/rollout_0000002/index.html", "t2i/rollout_0000002/index.jsonl"]


# ---------------------------------------------------------------- videos at a readable size


def test_view_strip_brings_frames_to_a_readable_height():
    """A 32 px clip's frames are enlarged to 128 px (nearest: its pixels as they are), a 240 x
    416 one's shrunk to 128 px; 4 evenly spaced frames, first and last included."""
    from trainer.video_artifacts import VIEW_FRAMES, frame_strip, view_size, view_strip

    frames = torch.rand(9, 3, 32, 32)
    strip = view_strip(frames, gap=2)
    assert strip.shape == (3, 128, VIEW_FRAMES * 128 + (VIEW_FRAMES - 1) * 2)
    assert torch.equal(strip[:, ::4, :128:4], frames[0]) and torch.equal(strip[:, ::4, -128::4], frames[-1])
    assert view_size(240, 416) == (128, 222) and view_size(120, 2000) == (15, 256)  # width capped too
    assert view_strip(torch.rand(5, 3, 240, 416), gap=0).shape == (3, 128, 4 * 222)
    assert frame_strip(frames).shape == (3, 32, 8 * 32 + 7 * 2)  # the watch's strip is unchanged


@pytest.fixture(scope="module")
def wan_rollout(tmp_path_factory):
    from tools.tiny_wan import build_tiny_wan_pipeline
    from trainer.data import PromptRecord
    from trainer.engine.native import NativeEngine
    from trainer.models.wan import WanAdapter
    from trainer.rollout import generate_rollout
    from trainer.sampling import parse_sampling_config

    tmp = tmp_path_factory.mktemp("visuals_wan")
    adapter = WanAdapter()
    engine = NativeEngine(str(build_tiny_wan_pipeline(tmp / "model", seed=0)), device="cpu", dtype=torch.float32,
                          adapter=adapter)
    records = [PromptRecord(prompt="a red ball", task="t2v", sample_id="v0")]
    out = generate_rollout(engine, adapter, records, rollout_id=0, sampling=parse_sampling_config(WAN_SAMPLING),
                           group_size=2, generation_seed=3, artifact_root=tmp / "art", task="t2v")
    return SimpleNamespace(out=out, records=records)


def test_videos_reach_tensorboard_at_a_readable_height(wan_rollout, tmp_path):
    """The rollout grid and the eval grid show a 32 px clip's frames at 128 px (they were 32 px
    strips, shrunk further by the grid), and the index names the clips' WebP files."""
    from trainer.loop import Trainer, _eval_thumbnails

    out = wan_rollout.out
    fake = fake_trainer(tmp_path, 2, "t2v")
    comps = {"temporal": torch.tensor([0.5, 0.25])}
    Trainer._log_images(fake, 0, out, SimpleNamespace(components=comps), None)
    thumbs = _eval_thumbnails(out.trajectory, 16)
    assert all(t.video and t.image.dtype == torch.uint8 and t.image.shape[1] == 128 for t in thumbs)
    Trainer._log_eval_images(fake, 0, "clips", out.trajectory, comps, 2)
    fake.metrics.close()
    images = tb_images(tmp_path / "tb")
    strip_w = 4 * 128 + 3 * 2
    assert images["rollout/candidates"].shape[1] == 2 * strip_w + 4  # two strips, as _shown sized them
    assert images["eval/clips/prompt_000"].shape[1] == 2 * strip_w + 4
    # a frame's pixel is a 4 x 4 block: the frame was enlarged, not shrunk
    first = (out.trajectory.images[0, 0].permute(1, 2, 0).clamp(0, 1) * 255).round().to(torch.uint8).numpy()
    assert has_pixels(images["rollout/candidates"], np.repeat(np.repeat(first, 4, axis=0), 4, axis=1))
    Trainer._write_index(fake, out, wan_rollout.records, 2, comps, None, title="t2v eval")
    entry = json.loads((out.artifact_dir / "index.jsonl").read_text())
    assert [c["file"] for c in entry["candidates"]] == ["group_00000000_sample_0000.webp",
                                                        "group_00000000_sample_0001.webp"]
    assert all((out.artifact_dir / c["file"]).is_file() for c in entry["candidates"])


def test_a_video_grid_is_bounded_in_prompts_candidates_and_frames(tmp_path):
    """Readable strips cost pixels, so a video's rollout grid shows one prompt's first 4
    candidates and its eval grids the first 2 prompts' first 4, whatever the group size: the
    event file grows by a bounded image per rollout (the bound: docs/training.md)."""
    from trainer.loop import (EVAL_VIDEO_PROMPTS, ROLLOUT_GRID_VIDEO_CANDIDATES, ROLLOUT_GRID_VIDEO_PROMPTS, Trainer,
                              _eval_thumbnails)

    groups, size = 3, 6
    n = groups * size
    traj = SimpleNamespace(images=torch.rand(n, 5, 3, 120, 208), group_indices=torch.arange(n) // size,
                           slots=torch.arange(n) % size, prompts=[f"clip {i // size}" for i in range(n)],
                           metadata=[{}] * n, rows_of_group=lambda g: list(range(g * size, (g + 1) * size)))
    fake = fake_trainer(tmp_path, size, "t2v")
    comps = {"c": torch.rand(n)}
    Trainer._log_images(fake, 0, SimpleNamespace(trajectory=traj), SimpleNamespace(components=comps), None)
    assert len(_eval_thumbnails(traj, EVAL_VIDEO_PROMPTS)) == EVAL_VIDEO_PROMPTS * ROLLOUT_GRID_VIDEO_CANDIDATES
    Trainer._log_eval_images(fake, 0, "clips", traj, comps, size)
    fake.metrics.close()
    images, texts = tb_images(tmp_path / "tb"), tb_texts(tmp_path / "tb")
    strip_w = 4 * 222 + 3 * 2  # 4 frames of 120 x 208 at 128 x 222, 2 px apart
    grid = images["rollout/candidates"]
    assert ROLLOUT_GRID_VIDEO_PROMPTS == 1 and grid.shape[1] == ROLLOUT_GRID_VIDEO_CANDIDATES * (strip_w + 4) - 4
    assert texts["rollout/candidates/captions"].count("**group") == ROLLOUT_GRID_VIDEO_PROMPTS
    assert sorted(t for t in images if t.startswith("eval/")) == ["eval/clips/prompt_000", "eval/clips/prompt_001"]
    assert images["eval/clips/prompt_001"].shape[1] == ROLLOUT_GRID_VIDEO_CANDIDATES * (strip_w + 4) - 4

"""Source images and every other image file read from outside the run, through the public
commands: only PNG, JPEG or WebP is decoded (a PostScript file named .png never reaches
Ghostscript), a prompt file names sources only under its own directory or --media-root, a source
no rollout could use is refused by preflight and tools/sample.py from its header before anything
loads, tools/prepare_data.py writes source bytes through no planted link, tools/curate_data.py
keeps edits whose metadata differ, and tools/score.py bounds a video's frames and pixels from its
header and prints each component's mean.

The model directory is a model_index.json alone: every command here must stop before a model
would load, so a message about a missing weight file would mean the check came too late."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from tests.family_e2e import edit_recipe, write_edit_records

ROOT = Path(__file__).resolve().parents[1]
ACCEPTED = "PNG, JPEG or WebP"
EPS = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 8 8\n%%EndComments\n0 0 moveto 8 8 lineto stroke\nshowpage\n"
SAMPLING = json.dumps({"height": 16, "width": 16, "num_inference_steps": 3, "sde_indices": [0, 1, 2], "eta": 1.0})


def run(*argv, env=None, timeout=120) -> subprocess.CompletedProcess:
    """A command of this checkout (`-m module` or a tools/ script), its output as text."""
    return subprocess.run([sys.executable, *argv], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def output(p: subprocess.CompletedProcess) -> str:
    return p.stdout + p.stderr


@pytest.fixture
def fake_gs(tmp_path, monkeypatch):
    """(environment with a `gs` first on PATH that only writes a marker, the marker's path); this
    process's PATH too, for the in-process routes."""
    bin_dir, marker = tmp_path / "bin", tmp_path / "GHOSTSCRIPT_RAN"
    bin_dir.mkdir()
    gs = bin_dir / "gs"
    gs.write_text(f"#!/bin/sh\necho \"$@\" >> {marker}\nexit 0\n")
    gs.chmod(0o755)
    path = f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"
    monkeypatch.setenv("PATH", path)
    from PIL import EpsImagePlugin

    monkeypatch.setattr(EpsImagePlugin, "gs_binary", None, raising=False)  # found again on this PATH
    return {**os.environ, "PATH": path}, marker


@pytest.fixture
def model_dir(tmp_path) -> Path:
    d = tmp_path / "model"
    d.mkdir()
    (d / "model_index.json").write_text(json.dumps({"_class_name": "QwenImageEditPlusPipeline"}))
    return d


def recipe(tmp_path: Path, model_dir: Path, data: Path) -> Path:
    """configs/tiny_cpu_edit.toml on `data`, one process (so preflight's only complaint can be the
    sources), its outputs under tmp_path."""
    return edit_recipe(tmp_path, model_dir, data, actor_num_gpus_per_node="1",
                       artifact_root=json.dumps(str(tmp_path / "art")), save=json.dumps(str(tmp_path / "ckpt")),
                       tensorboard_dir=json.dumps(str(tmp_path / "tb")))


def preflight(cfg: Path, *extra: str, env=None) -> subprocess.CompletedProcess:
    return run("-m", "trainer.train", "--config", str(cfg), "--preflight-only", *extra, env=env)


def sample(model_dir: Path, data: Path, out: Path, *extra: str, env=None) -> subprocess.CompletedProcess:
    return run("tools/sample.py", "--model-path", str(model_dir), "--prompt-data", str(data), "--output-dir",
               str(out), "--sampling-config", SAMPLING, *extra, env=env)


def png_bytes(size=(16, 16), color=(200, 30, 30)) -> bytes:
    import io

    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format="PNG")
    return buf.getvalue()


# ------------------------------------------------------------------------------------------- formats


def test_a_postscript_file_named_png_never_reaches_ghostscript(tmp_path, fake_gs, model_dir):
    env, marker = fake_gs
    # the fake gs is live: Pillow with every format would run it on this file
    (tmp_path / "probe.png").write_bytes(EPS)
    with pytest.raises(Exception), Image.open(tmp_path / "probe.png") as im:
        im.load()
    assert marker.exists()
    marker.unlink()

    data = write_edit_records(tmp_path / "data")
    src = tmp_path / "data" / "media" / "src0.png"
    src.write_bytes(EPS)

    p = preflight(recipe(tmp_path, model_dir, data), env=env)
    assert p.returncode == 2 and f"{data}:1: source image {src} is not a {ACCEPTED} image" in output(p)

    p = sample(model_dir, data, tmp_path / "out", env=env)
    assert p.returncode == 2 and f"{data}:1: source image {src} is not a {ACCEPTED} image" in output(p)

    p = run("tools/inspect_data.py", "--train", str(data), "--decode-media", env=env)
    assert p.returncode == 2 and f"{data}:1: images file 'media/src0.png' does not decode: src0.png is not a " \
                                 f"{ACCEPTED} image" in output(p)

    # the edit scorers' file route: a prompt line's metadata.source_images names the file
    images = tmp_path / "edits"
    images.mkdir()
    (images / "a.png").write_bytes(png_bytes())
    prompts = tmp_path / "data" / "score.jsonl"
    prompts.write_text(json.dumps({"prompt": "make the square red", "metadata": {"source_images": ["media/src0.png"]}})
                       + "\n")
    p = run("tools/score.py", "--reward-scorer-path", "color_edit", "--images", str(images), "--prompt-data",
            str(prompts), env=env)
    assert p.returncode == 2 and f"source image {src} is not a {ACCEPTED} image" in output(p)
    # and an image to score that is PostScript
    (images / "a.png").write_bytes(EPS)
    p = run("tools/score.py", "--reward-scorer-path", "color", "--images", str(images), "--prompt-data", str(prompts),
            env=env)
    assert p.returncode == 2 and f"{images / 'a.png'} is not a {ACCEPTED} image" in output(p)

    # the engine's loader, the reward's file route and the demo's PNG reader, in process
    from tools.demo_grid import _load_pngs
    from trainer.models.edit_source import load_source
    from trainer.rewards.base import ImageBatch, RewardError
    from trainer.rewards.edit import source_batch

    with pytest.raises(ValueError, match=f"source image {src} is not a {ACCEPTED} image"):
        load_source(src)
    with pytest.raises(RewardError, match=f"source image {src} is not a {ACCEPTED} image"):
        source_batch(ImageBatch.from_any([Image.new("RGB", (8, 8))]), [{"source_images": [str(src)]}])
    (tmp_path / "eval").mkdir()
    (tmp_path / "eval" / "group_00000000_sample_0000.png").write_bytes(EPS)
    with pytest.raises(ValueError, match=f"is not a {ACCEPTED} image"):
        _load_pngs(tmp_path / "eval", 1, 1)
    assert not marker.exists()


# ---------------------------------------------------------------------------------- where sources lie


@pytest.fixture
def outside(tmp_path) -> tuple[Path, Path, Path]:
    """(data file, its private neighbour directory, secret.png in it): the data file's three lines
    name the secret as ../private/secret.png, by its absolute path, and through a symlink
    media/link.png placed inside the data directory."""
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    secret = private / "secret.png"
    secret.write_bytes(png_bytes())
    secret.chmod(0o600)
    d = tmp_path / "data"
    (d / "media").mkdir(parents=True)
    (d / "media" / "link.png").symlink_to(secret)
    lines = [{"prompt": "<image> make the square red", "images": [ref], "metadata": {"task": "i2i", "sample_id": f"e{i}"}}
             for i, ref in enumerate(["../private/secret.png", str(secret), "media/link.png"])]
    data = d / "edit.jsonl"
    data.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return data, private, secret


def test_sources_outside_the_data_directory_are_refused_unless_a_root_is_named(tmp_path, model_dir, outside):
    data, private, secret = outside
    cfg = recipe(tmp_path, model_dir, data)

    p = preflight(cfg)
    assert p.returncode == 2, output(p)
    text = output(p)
    assert "3 media file(s) lie outside" in text and "--media-root DIR" in text
    for line, ref in ((1, "../private/secret.png"), (2, str(secret)), (3, "media/link.png")):
        assert f"{data}:{line}: {ref!r} ({secret})" in text
    p = preflight(cfg, "--media-root", str(private))
    assert p.returncode == 0, output(p)
    p = preflight(cfg, "--media-root", str(tmp_path / "nowhere"))
    assert p.returncode == 2 and f"--media-root {tmp_path / 'nowhere'}: does not exist" in output(p)

    p = run("tools/inspect_data.py", "--train", str(data))
    assert p.returncode == 2 and output(p).count("lies outside the prompt file's directory") == 3
    assert run("tools/inspect_data.py", "--train", str(data), "--media-root", str(private)).returncode == 0

    # curate_data hashes media to dedup: it reads none outside either, and writes nothing
    curate_in, curated = data.parent / "curate.jsonl", tmp_path / "curated"
    curate_in.write_text("".join(json.dumps({"prompt": f"<image> make it {c}", "images": ["../private/secret.png"],
                                             "metadata": {"task": "i2i", "sample_id": f"c{c}"}}) + "\n"
                                 for c in ("red", "green", "blue")))
    p = run("tools/curate_data.py", "--input", str(curate_in), "--output-dir", str(curated))
    assert p.returncode == 2 and "3 media reference(s)" in output(p) and "--media-root DIR" in output(p), output(p)
    assert f"{curate_in}:1: '../private/secret.png' is {secret}" in output(p) and not curated.exists()
    p = run("tools/curate_data.py", "--input", str(curate_in), "--output-dir", str(curated), "--media-root",
            str(private), "--eval-size", "1")
    assert p.returncode == 0 and "train 2, eval 1" in output(p), output(p)

    p = sample(model_dir, data, tmp_path / "out")
    assert p.returncode == 2 and f"{data}:1: '../private/secret.png' ({secret})" in output(p)

    # the edit judge's and every edit scorer's sources from a prompt file
    images = tmp_path / "edits"
    images.mkdir()
    (images / "a.png").write_bytes(png_bytes())
    prompts = data.parent / "score.jsonl"
    prompts.write_text(json.dumps({"prompt": "x", "metadata": {"source_images": ["../private/secret.png"]}}) + "\n")
    p = run("tools/score.py", "--reward-scorer-path", "color_edit", "--images", str(images), "--prompt-data",
            str(prompts))
    assert p.returncode == 2 and f"a.png: source image '../private/secret.png' ({secret}) lies outside" in output(p)
    # nor an image to score that is a link out of --images
    (images / "b.png").symlink_to(secret)
    p = run("tools/score.py", "--reward-scorer-path", "color", "--images", str(images), "--prompt-data", str(prompts))
    assert p.returncode == 2 and f"b.png is a link to {secret}, outside the folder" in output(p)


def test_prepare_edit_refuses_sources_outside_its_media_root(tmp_path, outside):
    _, private, secret = outside
    raw = tmp_path / "raw" / "pairs.jsonl"
    raw.parent.mkdir()
    raw.write_text(json.dumps({"instruction": "make it red", "image": "../private/secret.png"}) + "\n")
    out = tmp_path / "prepared" / "edit.jsonl"
    args = ("tools/prepare_data.py", "--source", "edit", "--task", "i2i", "--input", str(raw), "--output", str(out))
    p = run(*args)
    assert p.returncode == 2 and not out.exists()
    assert f"{raw}:1: source image '../private/secret.png' ({secret}) lies outside --media-root" in output(p)
    assert "--allow-media-outside-root" in output(p)
    p = run(*args, "--allow-media-outside-root")
    assert p.returncode == 0, output(p)


# ------------------------------------------------------------------------------- no planted link


def test_prepare_edit_writes_source_bytes_through_no_planted_link(tmp_path, capsys):
    import hashlib

    import pyarrow as pa
    import pyarrow.parquet as pq

    from tools import prepare_data

    a, b = png_bytes(color=(250, 0, 0)), png_bytes(color=(0, 250, 0))
    raw = tmp_path / "pairs.parquet"
    pq.write_table(pa.table({"instruction": ["make it blue", "make it round"], "image": [a, b]}), raw)
    media = tmp_path / "out" / "media"
    media.mkdir(parents=True)
    victims = {name: tmp_path / f"victim_{name}" for name in ("tmp", "final")}
    for v in victims.values():
        v.write_bytes(b"precious")
    # the name earlier versions wrote through, and the final name of the other image
    (media / f"{hashlib.sha256(a).hexdigest()}.png.tmp{os.getpid()}").symlink_to(victims["tmp"])
    final = media / f"{hashlib.sha256(b).hexdigest()}.png"
    final.symlink_to(victims["final"])

    assert prepare_data.main(["--source", "edit", "--task", "i2i", "--input", str(raw),
                              "--output", str(tmp_path / "out" / "edit.jsonl")]) == 0
    assert all(v.read_bytes() == b"precious" for v in victims.values())
    assert not final.is_symlink() and final.read_bytes() == b
    assert (media / f"{hashlib.sha256(a).hexdigest()}.png").read_bytes() == a
    assert not [p for p in media.iterdir() if p.name.endswith(".tmp") and not p.is_symlink()]


# ------------------------------------------------------------------------------------- dedup key


def test_curate_keeps_edits_of_one_source_whose_metadata_differ(tmp_path, capsys):
    from tools import curate_data

    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "a.png").write_bytes(png_bytes())
    (tmp_path / "m" / "a_copy.png").write_bytes(png_bytes())

    def rec(sid, image, **md):
        return {"prompt": "<image> recolour the square", "images": [image],
                "metadata": {"task": "i2i", "sample_id": sid, **md}}

    rows = [rec("r", "m/a.png", color="red"), rec("g", "m/a.png", color="green"),
            rec("r2", "m/a_copy.png", color="red", source="other_set")]  # r's content under another name
    src = tmp_path / "raw.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert curate_data.main(["--input", str(src), "--output-dir", str(tmp_path / "p"), "--eval-size", "1"]) == 0
    kept = [json.loads(line) for f in ("train.jsonl", "eval.jsonl") for line in (tmp_path / "p" / f).open()]
    assert sorted(r["metadata"]["color"] for r in kept) == ["green", "red"]
    assert "dropped 1: duplicate prompt" in capsys.readouterr().out


# ------------------------------------------------------------------------------ unusable sources


def test_preflight_refuses_every_source_no_rollout_can_use(tmp_path, model_dir):
    data = write_edit_records(tmp_path / "data", n=4)
    media = tmp_path / "data" / "media"
    Image.new("L", (5000, 5000)).save(media / "src0.png")
    (media / "src1.png").write_text("just some text\n")
    Image.new("RGB", (4096, 1)).save(media / "src2.png")
    cfg = recipe(tmp_path, model_dir, data)

    p = preflight(cfg)
    text = output(p)
    assert p.returncode == 2 and "3 source image(s) no rollout can use" in text
    assert f"{data}:1: source image {media / 'src0.png'} is 5000x5000, more than 16777216 pixels" in text
    assert f"{data}:2: source image {media / 'src1.png'} is not a {ACCEPTED} image" in text
    assert f"{data}:3: source image {media / 'src2.png'} is 4096x1, an aspect ratio over 200:1" in text
    assert "src3.png" not in text

    # the rollout's own read names the file too (a source changed after preflight)
    from trainer.models.edit_source import load_source

    with pytest.raises(ValueError, match=f"source image {media / 'src2.png'} is 4096x1"):
        load_source(media / "src2.png")

    # a run (not --preflight-only) with a corrupt source: one preflight error, exit 2, no traceback
    (media / "src0.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0" * 40)
    data.write_text(data.read_text().splitlines()[0] + "\n")
    p = run("-m", "trainer.train", "--config", str(cfg))
    assert p.returncode == 2 and "Traceback" not in output(p), output(p)
    assert f"{data}:1: source image {media / 'src0.png'} does not decode" in output(p)
    assert len(output(p).splitlines()) <= 3


def test_sample_checks_sources_before_loading_the_model(tmp_path, model_dir):
    data = write_edit_records(tmp_path / "data", n=2)
    media = tmp_path / "data" / "media"
    (media / "src0.png").unlink()
    (media / "src1.png").write_bytes(png_bytes()[:40])  # cut inside the header
    p = sample(model_dir, data, tmp_path / "out")
    text = output(p)
    assert p.returncode == 2 and "Traceback" not in text, text
    assert f"{data}:1: source image {media / 'src0.png'} does not exist" in text
    assert f"{data}:2: source image {media / 'src1.png'} does not decode" in text


# ----------------------------------------------------------------------------------------- score


def test_score_bounds_a_video_from_its_header_and_prints_the_means(tmp_path):
    from tools.score import MAX_VIDEO_FRAMES, MAX_VIDEO_PIXELS

    videos = tmp_path / "videos"
    videos.mkdir()
    frames = [Image.new("RGB", (2500, 2500), ((255, 0, 0), (0, 0, 255))[i % 2]) for i in range(26)]
    assert 26 * 2500 * 2500 > MAX_VIDEO_PIXELS
    frames[0].save(videos / "group_00000000_sample_0000.webp", save_all=True, append_images=frames[1:], duration=40,
                   lossless=True, quality=0, method=0, kmax=1)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "a red square"}) + "\n")
    args = ("tools/score.py", "--reward-scorer-path", "temporal_consistency", "--images", str(videos),
            "--prompt-data", str(prompts))
    p = run(*args, timeout=60)
    assert p.returncode == 2, output(p)
    assert f"holds 26 frames of 2500x2500, 162500000 pixels in all, more than {MAX_VIDEO_PIXELS}" in output(p)

    (videos / "group_00000000_sample_0000.webp").unlink()
    tiny = [Image.new("RGB", (1, 1), ((255, 0, 0), (0, 0, 255))[i % 2]) for i in range(MAX_VIDEO_FRAMES + 1)]
    tiny[0].save(videos / "group_00000000_sample_0000.webp", save_all=True, append_images=tiny[1:], duration=40,
                 lossless=True, kmax=1)
    p = run(*args, timeout=60)
    assert p.returncode == 2 and f"holds {MAX_VIDEO_FRAMES + 1} frames, more than {MAX_VIDEO_FRAMES}" in output(p)

    images = tmp_path / "images"
    images.mkdir()
    for name, color in (("a.png", (250, 10, 10)), ("b.png", (10, 10, 250))):
        Image.new("RGB", (16, 16), color).save(images / name)
    prompts.write_text(json.dumps({"prompt": "a red square"}) + "\n" + json.dumps({"prompt": "a red square"}) + "\n")
    p = run("tools/score.py", "--reward-scorer-path", "color", "--images", str(images), "--prompt-data", str(prompts))
    assert p.returncode == 0, output(p)
    scores = [json.loads(line)["scores"]["color"] for line in p.stdout.splitlines()]
    assert f"score: color: mean {sum(scores) / 2:.6g} over 2 images" in p.stderr


# ----------------------------------------------------------------------------------------- sidecar


def test_the_sidecar_records_sources_relative_to_the_data_directory(tmp_path, capsys):
    """tools/sample.py on the tiny edit model: the sidecar names the source as the prompt file
    did (no directory of this host), tools/score.py reads it back under --media-root, and a
    sidecar of the earlier layout (absolute paths) still loads and scores there."""
    from tools.score import main as score_main
    from tools.tiny_qwen_image_edit import build_tiny_qwen_image_edit_pipeline
    from trainer import artifacts

    model = build_tiny_qwen_image_edit_pipeline(tmp_path / "model", seed=0, variant="2511")
    data = write_edit_records(tmp_path / "data")
    sampling = json.dumps({"height": 16, "width": 16, "num_inference_steps": 3, "sde_indices": [1, 2], "eta": 1.0})
    p = run("tools/sample.py", "--model-path", str(model), "--prompt-data", str(data), "--output-dir",
            str(tmp_path / "out"), "--sampling-config", sampling, timeout=300)
    assert p.returncode == 0, output(p)
    rollout = tmp_path / "out" / "i2i" / "rollout_0000000"
    side = rollout / "group_00000000.safetensors"
    tensors, metadata = artifacts.read_sidecar(side)
    assert json.loads(metadata["prompt_metadata"])["source_paths"] == ["media/src0.png"]
    assert not [k for k, v in metadata.items() if str(tmp_path) in v]

    def score(*extra):
        capsys.readouterr()
        rc = score_main(["--reward-scorer-path", "color_edit", "--images", str(rollout), *extra])
        out = capsys.readouterr()
        return rc, out.out, out.err

    rc, _, err = score()
    assert rc == 2 and "pass --media-root DIR" in err
    rc, out, err = score("--media-root", str(data.parent))
    assert rc == 0 and "score: color_edit: mean" in err
    first = json.loads(out.splitlines()[0])["scores"]["color_edit"]
    assert first is not None

    old = json.loads(metadata["prompt_metadata"])
    old["source_paths"] = [str(data.parent / "media" / "src0.png")]
    artifacts.write_sidecar(side, tensors, {**metadata, "prompt_metadata": json.dumps(old)}, overwrite=True)
    assert artifacts.sidecar_to_trajectory(*artifacts.read_sidecar(side)).metadata[0]["source_paths"] == \
        old["source_paths"]
    rc, out, _ = score("--media-root", str(data.parent))
    assert rc == 0 and json.loads(out.splitlines()[0])["scores"]["color_edit"] == first
    rc, _, err = score("--media-root", str(tmp_path / "out"))
    assert rc == 2 and "lies outside" in err


def test_inspect_decodes_videos_as_animated_webp_only(tmp_path):
    """inspect_data --decode-media on a prompt file's videos: an FFmpeg concat playlist named
    .mp4 (which a general demuxer would follow to another file of the host) is reported as not an
    accepted format, never followed; an animated WebP decodes frame by frame; one whose header
    declares more frames than MAX_VIDEO_FRAMES is reported from its header."""
    from trainer.core.image_file import MAX_VIDEO_FRAMES

    d = tmp_path / "data"
    d.mkdir()
    secret = tmp_path / "secret.webp"
    Image.new("RGB", (8, 8), (255, 0, 0)).save(secret)
    (d / "playlist.mp4").write_text(f"ffconcat version 1.0\nfile '{secret}'\n")
    frames = [Image.new("RGB", (16, 16), (0, 10 * i, 0)) for i in range(3)]
    frames[0].save(d / "ok.webp", save_all=True, append_images=frames[1:], duration=100)
    many = [Image.new("RGB", (2, 2), (i % 256, 0, 0)) for i in range(MAX_VIDEO_FRAMES + 1)]
    many[0].save(d / "long.webp", save_all=True, append_images=many[1:], duration=10, lossless=True)
    lines = [{"prompt": f"<video> clip {i}", "videos": [name], "metadata": {"task": "t2v", "sample_id": f"v{i}"}}
             for i, name in enumerate(["playlist.mp4", "ok.webp", "long.webp"])]
    data = d / "clips.jsonl"
    data.write_text("".join(json.dumps(x) + "\n" for x in lines))
    p = run("tools/inspect_data.py", "--train", str(data), "--decode-media")
    text = output(p)
    assert p.returncode == 2, text
    assert f"playlist.mp4 is not a {ACCEPTED} image" in text and "animated WebP" in text, text
    assert f"long.webp holds {MAX_VIDEO_FRAMES + 1} frames" in text, text
    assert "ok.webp" not in text, text

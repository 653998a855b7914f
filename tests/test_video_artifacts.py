"""Video artifacts (trainer/video_artifacts.py): one animated WebP per candidate, deterministic
bytes, read back by Pillow with the frames and the playing time it was given, bounded in size,
written atomically beside the sidecar; and the frame strip for TensorBoard."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from trainer import artifacts, video_artifacts as va


def moving_square(num_frames=9, h=32, w=48, size=8, step=4) -> torch.Tensor:
    """A white square sliding right over black: every frame differs from the one before."""
    frames = torch.zeros(num_frames, 3, h, w)
    for i in range(num_frames):
        x = (i * step) % (w - size)
        frames[i, :, 10:10 + size, x:x + size] = 1.0
    return frames


def read_webp(data: bytes) -> tuple[list[torch.Tensor], list[int]]:
    """Every stored frame as [3, H, W] uint8 and its duration in ms, as Pillow decodes them."""
    im = Image.open(io.BytesIO(data))
    assert im.format == "WEBP"
    frames, durations = [], []
    for i in range(im.n_frames):
        im.seek(i)
        im.load()
        frames.append(torch.from_numpy(np.array(im.convert("RGB"))).permute(2, 0, 1))
        durations.append(im.info["duration"])
    return frames, durations


def test_same_frames_same_bytes_other_frames_other_bytes():
    frames = moving_square()
    a, b = va.encode_webp(frames), va.encode_webp(frames.clone())
    assert a == b
    other = frames.clone()
    other[3, :, 0, 0] = 0.5
    assert va.encode_webp(other) != a
    assert va.encode_webp(frames, fps=8) != a  # the timing is part of the file


def test_frame_count_and_playing_time_round_trip():
    frames = moving_square(num_frames=9)
    got, durations = read_webp(va.encode_webp(frames, fps=16))
    assert len(got) == 9 and got[0].shape == (3, 32, 48)
    assert sum(durations) == round(9 * 1000 / 16)  # 562 ms: 9 frames at 16 fps, not 9 x 62
    # lossy, yet each frame is recognisably its own frame: the square is where it was drawn
    for i, frame in enumerate(got):
        x = (i * 4) % 40
        assert float(frame[:, 10:18, x:x + 8].float().mean()) > 200
        assert float(frame[:, 24:, :].float().mean()) < 30


def test_lossless_stores_every_pixel():
    frames = torch.rand(5, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    got, _ = read_webp(va.encode_webp(frames, lossless=True))
    want = va.frames_to_uint8(frames).permute(0, 3, 1, 2)
    assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_repeated_frames_keep_the_playing_time():
    """The WebP animation encoder merges consecutive identical frames into one longer frame: the
    frame count may drop, the playing time may not."""
    frames = torch.zeros(9, 3, 16, 16)
    frames[4:] = 0.8
    got, durations = read_webp(va.encode_webp(frames, fps=16))
    assert len(got) == 2 and sum(durations) == round(9 * 1000 / 16)


def test_size_is_bounded():
    smooth = moving_square(num_frames=33, h=240, w=416, size=40, step=10)
    n_smooth = len(va.encode_webp(smooth))
    assert n_smooth < 64 * 1024, n_smooth  # measured ~6 KB
    noise = torch.rand(33, 3, 240, 416, generator=torch.Generator().manual_seed(0))
    n_noise = len(va.encode_webp(noise))
    raw = 33 * 3 * 240 * 416
    assert n_noise < raw / 2, (n_noise, raw)  # even incompressible noise stays well under raw RGB


@pytest.mark.parametrize("fps, expected", [(16, [62, 63, 63, 62, 62]), (8, [125] * 5), (30, [33, 34, 33, 33, 34])])
def test_frame_durations_keep_the_running_time_exact(fps, expected):
    assert va.frame_durations_ms(5, fps) == expected


@pytest.mark.parametrize("bad", [torch.zeros(3, 16, 16), torch.zeros(2, 4, 16, 16), torch.zeros(0, 3, 16, 16),
                                 torch.full((2, 3, 16, 16), float("nan"))])
def test_bad_frames_are_refused_clearly(bad):
    with pytest.raises(ValueError, match="frames"):
        va.encode_webp(bad)


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="fps"):
        va.encode_webp(moving_square(), fps=0)
    with pytest.raises(ValueError, match="quality"):
        va.encode_webp(moving_square(), quality=101)


def test_written_atomically_beside_the_sidecar_and_never_overwritten(tmp_path):
    path = va.video_path(tmp_path, "t2v", 3, 7, 2)
    assert path.parent == artifacts.rollout_dir(tmp_path, "t2v", 3)
    assert path.name == "group_00000007_sample_0002.webp"
    assert path.with_suffix(".png").name == artifacts.image_name(7, 2)  # same stem as the image path
    va.write_video(path, moving_square())
    assert path.read_bytes() == va.encode_webp(moving_square())
    assert not path.with_name(path.name + ".tmp").exists()
    with pytest.raises(FileExistsError):
        va.write_video(path, moving_square())
    va.write_video(path, moving_square(num_frames=5), overwrite=True)
    assert len(read_webp(path.read_bytes())[0]) == 5
    assert va.video_path(tmp_path, "t2v", 3, 7, 2, eval=True).parts[-4:-2] == ("eval", "t2v")


def test_videos_follow_rollout_retention(tmp_path):
    for rollout in range(3):
        artifacts.prepare_rollout_dir(tmp_path, "t2v", rollout)
        va.write_video(va.video_path(tmp_path, "t2v", rollout, 0, 0), moving_square(num_frames=5))
    artifacts.prune_stale_artifacts(tmp_path, "t2v", keep=1, up_to=2)
    assert [p.parent.name for p in tmp_path.rglob("*.webp")] == ["rollout_0000002"]


def test_frame_strip_lays_evenly_spaced_frames_side_by_side(tmp_path):
    frames = torch.stack([torch.full((3, 8, 10), i / 10.0) for i in range(9)])  # frame i is grey level i/10
    strip = va.frame_strip(frames, count=3, gap=2)
    assert strip.shape == (3, 8, 3 * 10 + 2 * 2)
    assert [round(float(strip[0, 0, x]), 2) for x in (0, 12, 24)] == [0.0, 0.4, 0.8]  # frames 0, 4, 8
    assert float(strip[:, :, 10:12].min()) == 1.0  # white gaps
    assert va.frame_strip(frames[:2], count=8, gap=0).shape == (3, 8, 20)  # fewer frames than asked: all
    path = va.write_frame_strip(tmp_path / "strip.png", frames, count=3)
    with Image.open(path) as im:
        assert im.format == "PNG" and im.size == (34, 8)

"""The condition-cache key: prompt AND media (by content, in order) AND the size they are resized
to; a text-only key is the prompt alone; file keys agree with the data tools' keys."""

from __future__ import annotations

import os

import numpy as np
import pytest

from trainer.core.media_key import ConditionKey, MediaKeys, condition_key, pixels_key


def test_keys_separate_media_order_and_size_and_join_same_bytes(tmp_path):
    (tmp_path / "a.png").write_bytes(b"\x89PNG red")
    (tmp_path / "copy_of_a.png").write_bytes(b"\x89PNG red")
    (tmp_path / "b.png").write_bytes(b"\x89PNG blue")
    keys = MediaKeys()
    def k(prompt, media, size=(64, 64)):
        return keys.condition_key(prompt, [tmp_path / m for m in media], size)

    base = k("make it green", ["a.png"])
    assert base == k("make it green", ["copy_of_a.png"])          # same bytes, other name
    assert base != k("make it green", ["b.png"])                  # same prompt, other source
    assert base != k("make it blue", ["a.png"])                   # same source, other prompt
    assert base != k("make it green", ["a.png"], (32, 64))        # resized otherwise
    assert k("x", ["a.png", "b.png"]) != k("x", ["b.png", "a.png"])  # Picture 1 / Picture 2
    assert len({base, k("make it green", ["copy_of_a.png"]), k("make it green", ["b.png"])}) == 2  # hashable
    # text only: the prompt alone, whatever size is given
    assert condition_key("a cat") == ConditionKey("a cat") == condition_key("a cat", (), (64, 64))


def test_file_keys_follow_content_and_agree_with_the_data_tools(tmp_path):
    from trainer.data import MediaDigests

    path = tmp_path / "src.png"
    path.write_bytes(b"first")
    keys = MediaKeys()
    first = keys.key(path)
    assert first == MediaDigests().key(str(path)) and first.startswith("sha256:")
    path.write_bytes(b"second, longer")  # rewritten in place: read again
    os.utime(path, ns=(1, 1))
    assert keys.key(path) != first
    with pytest.raises(FileNotFoundError):
        keys.key(tmp_path / "gone.png")
    # the cache is bounded: the oldest file is forgotten (and would be read again)
    small = MediaKeys(max_entries=1)
    small.key(path)
    (tmp_path / "b").write_bytes(b"b")
    small.key(tmp_path / "b")
    assert len(small._keys) == 1 and next(iter(small._keys))[0].endswith("b")


def test_pixel_keys_and_bad_keys():
    a = np.zeros((4, 4, 3), np.uint8)
    b = a.copy()
    b[0, 0, 0] = 1
    assert pixels_key(a) == pixels_key(a.copy()) != pixels_key(b)
    assert pixels_key(a) != pixels_key(a.reshape(4, 12, 1))  # same bytes, other shape
    assert MediaKeys().condition_key("p", [a], (8, 8)).media == (pixels_key(a),)
    with pytest.raises(ValueError, match="content key"):
        condition_key("p", ["/some/path.png"], (8, 8))
    with pytest.raises(ValueError, match="height, width"):
        condition_key("p", [pixels_key(a)])

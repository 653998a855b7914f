"""The condition-cache key: prompt AND media (by content, in order) AND the size they are resized
to; a text-only key is the prompt alone; file keys agree with the data tools' keys."""

from __future__ import annotations

import pytest

from trainer.core.media_key import ConditionKey, bytes_key, condition_key


def test_keys_separate_media_order_and_size_and_join_same_bytes(tmp_path):
    (tmp_path / "a.png").write_bytes(b"\x89PNG red")
    (tmp_path / "copy_of_a.png").write_bytes(b"\x89PNG red")
    (tmp_path / "b.png").write_bytes(b"\x89PNG blue")
    def k(prompt, media, size=(64, 64)):
        return condition_key(prompt, [bytes_key((tmp_path / m).read_bytes()) for m in media], size)

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
    first = bytes_key(path.read_bytes())
    assert first == MediaDigests().key(str(path)) and first.startswith("sha256:")
    path.write_bytes(b"second, longer")
    assert bytes_key(path.read_bytes()) != first


def test_bad_keys():
    with pytest.raises(ValueError, match="content key"):
        condition_key("p", ["/some/path.png"], (8, 8))
    with pytest.raises(ValueError, match="content key"):
        condition_key("p", ["pixels:00"], (8, 8))
    with pytest.raises(ValueError, match="height, width"):
        condition_key("p", [bytes_key(b"x")])

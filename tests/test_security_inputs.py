"""Prompt files and their metadata are untrusted input: deep nesting, 5000-digit integers, a
50 MB line and a plain-text file become file:line errors with memory bounded, and an OCR
target of any length costs bounded time."""

from __future__ import annotations

import json
import math
import random
import time
import tracemalloc

import numpy as np
import pytest

from trainer.data import MAX_LINE_BYTES, DataError, PromptDataset, iter_jsonl_lines
from trainer.rewards.base import ImageBatch

GOOD = json.dumps({"prompt": "a red panda", "metadata": {"task": "t2i", "sample_id": "p_1"}})


@pytest.mark.parametrize("line, needle", [
    ('{"prompt": ' + "[" * 100_000 + "]" * 100_000 + "}", "nests too deeply"),
    ('{"prompt": "a", "metadata": {"task": "t2i", "sample_id": "x", "n": ' + "7" * 5000 + "}}", "4300 digits"),
    ('{"prompt": "a",, "metadata": {}}', "not valid JSON (Expecting property name enclosed in double quotes at "
                                         "column 16)"),
    ("\ufeff" + GOOD, "byte-order mark"),
])
def test_hostile_lines_are_file_line_errors(tmp_path, line, needle):
    path = tmp_path / "p.jsonl"
    path.write_text(GOOD + "\n" + line + "\n", encoding="utf-8")
    with pytest.raises(DataError) as err:
        PromptDataset.from_jsonl(path)
    assert str(err.value).startswith(f"{path}:2: ") and needle in str(err.value), str(err.value)


def test_a_50_mb_line_is_refused_without_being_read_whole(tmp_path):
    path = tmp_path / "huge.jsonl"
    with open(path, "wb") as f:
        f.write(GOOD.encode() + b"\n" + b'{"prompt": "')
        chunk = b"a" * (1 << 20)
        for _ in range(50):
            f.write(chunk)
        f.write(b'"}\n' + GOOD.replace("p_1", "p_3").encode() + b"\n")
    tracemalloc.start()
    try:
        rows = list(iter_jsonl_lines(path))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 * MAX_LINE_BYTES  # the line is 50x the bound; only bounded chunks were held
    assert [(n, obj is not None) for n, obj, _ in rows] == [(1, True), (2, False), (3, True)]  # counted on
    assert f"longer than {MAX_LINE_BYTES} bytes" in rows[1][2]
    with pytest.raises(DataError, match=rf"^{path}:2: line longer than"):
        PromptDataset.from_jsonl(path)


def test_a_plain_text_prompt_file_names_the_conversion(tmp_path):
    from tools import prepare_data

    path = tmp_path / "prompts.txt"
    path.write_text("a red panda in a teacup\n3 cats on a mat\n")
    with pytest.raises(DataError) as err:
        PromptDataset.from_jsonl(path)
    msg = str(err.value)
    assert msg.startswith(f"{path}:1: not JSON") and "column 1" in msg
    assert f"flowgrpo-prepare-data --source prompts --input {path} --output" in msg
    # "3 cats" parses as the number 3 followed by text: still plain text at column 1, not "column 3"
    rows = list(iter_jsonl_lines(path))
    assert "column 1" in rows[1][2] and "plain text" in rows[1][2]
    # the fix the message names works
    out = tmp_path / "prompts.jsonl"
    assert prepare_data.main(["--source", "prompts", "--input", str(path), "--output", str(out)]) == 0
    assert len(PromptDataset.from_jsonl(out)) == 2
    # a line that is a JSON string is a prompt without its record around it
    path.write_text('"a red panda"\n')
    with pytest.raises(DataError, match="got a string.*flowgrpo-prepare-data --source prompts"):
        PromptDataset.from_jsonl(path)


def test_prepare_data_text_source_bounds_its_lines(tmp_path, capsys):
    from tools import prepare_data

    src = tmp_path / "prompts.txt"
    with open(src, "wb") as f:
        f.write(b"a red panda\n" + b"b" * (MAX_LINE_BYTES + 10) + b"\n")
    assert prepare_data.main(["--source", "prompts", "--input", str(src), "--output", str(tmp_path / "o.jsonl")]) == 2
    assert f"{src}:2: line longer than {MAX_LINE_BYTES} bytes" in capsys.readouterr().err


# --- OCR -----------------------------------------------------------------------------------------

def _reference_distance(a: str, b: str) -> int:
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i]
        for j, cb in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))
        prev = cur
    return prev[-1]


def test_edit_distance_matches_the_textbook_table():
    from trainer.rewards.ocr import edit_distance

    rng = random.Random(0)
    for _ in range(300):
        a = "".join(rng.choice("abé𝄞") for _ in range(rng.randint(0, 9)))
        b = "".join(rng.choice("abé𝄞") for _ in range(rng.randint(0, 9)))
        assert edit_distance(a, b) == _reference_distance(a, b), (a, b)


def test_ocr_cost_is_bounded_whatever_the_target():
    pytest.importorskip("rapidocr_onnxruntime")
    from trainer.rewards.ocr import MAX_OCR_TARGET_CHARS, OcrScorer, ocr_reward

    rng = random.Random(1)
    recognised = "".join(rng.choice("abcdefgh") for _ in range(200))
    t0 = time.perf_counter()
    assert math.isnan(ocr_reward(recognised, "x" * 20_000))  # refused, not truncated
    longest = "".join(rng.choice("abcdefgh") for _ in range(MAX_OCR_TARGET_CHARS))
    assert 0.0 <= ocr_reward(recognised + "z" * 1500, longest) <= 1.0  # the largest table still computed
    assert time.perf_counter() - t0 < 0.2
    scorer = OcrScorer()
    blank = ImageBatch([np.full((32, 96, 3), 255, np.uint8)])
    t0 = time.perf_counter()
    out = scorer(blank, ['a sign that says "hi"'], [{"ocr_text": "y" * 20_000}])["ocr"]
    assert math.isnan(out[0]) and time.perf_counter() - t0 < 0.2

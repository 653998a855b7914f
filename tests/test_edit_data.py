"""Edit pairs through the data tools: prepare_data --source edit, then curate and inspect keyed
by the prompt AND the bytes of its media (in-process CLI calls on small files made here)."""

from __future__ import annotations

import io
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from tests.test_data_tools import read_jsonl, write_jsonl
import tools.curate_data as curate_data
import tools.inspect_data as inspect_data
import tools.prepare_data as prepare_data


def png(color, size=(8, 8)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format="PNG")
    return buf.getvalue()


def prepare(*argv):
    return prepare_data.main(["--source", "edit", "--task", "t2i", *map(str, argv)])


def test_jsonl_paths_default_columns_and_stable_ids(tmp_path, capsys):
    src = tmp_path / "src"
    (src / "imgs").mkdir(parents=True)
    (src / "imgs" / "red.png").write_bytes(png((255, 0, 0)))
    (src / "imgs" / "blue.png").write_bytes(png((0, 0, 255)))
    rows = [{"source_image": "imgs/red.png", "instruction": "make the square  green"},
            {"source_image": "imgs/blue.png", "instruction": "make the square green"},
            {"source_image": "imgs/red.png", "instruction": "make the square green"},  # duplicate of row 1
            {"source_image": "imgs/red.png", "instruction": "   "}]
    out = tmp_path / "out" / "edit.jsonl"
    assert prepare("--input", write_jsonl(src / "pairs.jsonl", rows), "--output", out) == 0
    printed = capsys.readouterr().out
    assert "wrote 2 record(s)" in printed and "1 empty instruction(s)" in printed and "1 duplicate(s)" in printed
    recs = read_jsonl(out)
    assert [r["prompt"] for r in recs] == ["<image> make the square green"] * 2
    assert recs[0]["images"] == ["../src/imgs/red.png"]  # relative to the output's directory
    assert (out.parent / recs[0]["images"][0]).resolve() == (src / "imgs" / "red.png").resolve()
    # same instruction, different image bytes: different ids
    assert recs[0]["metadata"]["sample_id"] != recs[1]["metadata"]["sample_id"]
    assert all(r["metadata"]["sample_id"].startswith("edit_") for r in recs)
    # the id is a function of instruction + bytes: renamed files and reordered rows give the same ids
    os.rename(src / "imgs" / "red.png", src / "imgs" / "r.png")
    moved = [{"source_image": "imgs/blue.png", "instruction": "make the square green"},
             {"source_image": "imgs/r.png", "instruction": "make the square green"}]
    assert prepare("--input", write_jsonl(src / "moved.jsonl", moved), "--output", tmp_path / "o2.jsonl") == 0
    assert {r["metadata"]["sample_id"] for r in read_jsonl(tmp_path / "o2.jsonl")} == \
        {r["metadata"]["sample_id"] for r in recs}
    # inspect passes the output, decoding the images
    assert inspect_data.main(["--train", str(tmp_path / "o2.jsonl"), "--decode-media"]) == 0


def test_parquet_bytes_structs_written_once_and_multi_image(tmp_path, capsys):
    red, blue = png((255, 0, 0)), png((0, 0, 255))
    table = pa.table({
        "edit_prompt": ["make it green", "make it green", "swap the colours", "make it green"],
        "image": [{"bytes": red, "path": "a.png"}, {"bytes": blue, "path": "b.png"}, None,
                  {"bytes": red, "path": None}],
        "edited_image": [b"unused"] * 4,  # the target column of a supervised set: never read
    })
    pq.write_table(table, tmp_path / "pairs.parquet")
    out = tmp_path / "out" / "edit.jsonl"
    assert prepare("--input", tmp_path / "pairs.parquet", "--output", out, "--id-prefix", "pp") == 0
    printed = capsys.readouterr().out
    assert "1 row(s) without a source image" in printed and "1 duplicate(s)" in printed
    assert "wrote 2 image file(s)" in printed
    recs = read_jsonl(out)
    assert len(recs) == 2 and all(r["images"][0].startswith("media/") for r in recs)
    files = sorted(os.listdir(out.parent / "media"))
    assert len(files) == 2 and all(f.endswith(".png") and len(f) == 64 + 4 for f in files)
    assert (out.parent / recs[0]["images"][0]).read_bytes() == red
    # a rerun writes identical bytes and no new image file
    first = out.read_bytes()
    assert prepare("--input", tmp_path / "pairs.parquet", "--output", out, "--id-prefix", "pp") == 0
    assert out.read_bytes() == first and "wrote 0 image file(s)" in capsys.readouterr().out
    # several sources in one cell: one placeholder each, in order
    multi = pa.table({"instruction": ["put the second on the first"], "images": [[red, blue]]})
    pq.write_table(multi, tmp_path / "multi.parquet")
    assert prepare("--input", tmp_path / "multi.parquet", "--output", tmp_path / "m.jsonl") == 0
    (rec,) = read_jsonl(tmp_path / "m.jsonl")
    assert rec["prompt"] == "<image> <image> put the second on the first" and len(rec["images"]) == 2
    assert (tmp_path / rec["images"][1]).read_bytes() == blue


@pytest.mark.parametrize("rows, extra, needle", [
    ([{"image": "x.png", "note": "no instruction"}], [], "--column"),
    ([{"picture": "x.png", "instruction": "a"}], [], "--image-column"),
    ([{"image": "nope.png", "instruction": "a"}], [], "--media-root"),
    ([{"image": 7, "instruction": "a"}], [], "not an image path"),
])
def test_jsonl_errors_name_the_flag(tmp_path, capsys, rows, extra, needle):
    src = write_jsonl(tmp_path / "pairs.jsonl", rows)
    assert prepare("--input", src, "--output", tmp_path / "o.jsonl", *extra) == 2
    err = capsys.readouterr().err
    assert needle in err and "pairs.jsonl" in err and not (tmp_path / "o.jsonl").exists()


def test_bytes_that_are_no_image_and_edit_flags_elsewhere(tmp_path, capsys):
    pq.write_table(pa.table({"instruction": ["a"], "source_image": [b"#!/bin/sh\nrm -rf /"]}), tmp_path / "p.parquet")
    assert prepare("--input", tmp_path / "p.parquet", "--output", tmp_path / "o.jsonl") == 2
    err = capsys.readouterr().err
    assert "row 0" in err and "no PNG / JPEG" in err and not (tmp_path / "media").exists()
    (tmp_path / "t.txt").write_text("a prompt\n")
    assert prepare_data.main(["--source", "prompts", "--input", str(tmp_path / "t.txt"), "--output",
                              str(tmp_path / "t.jsonl"), "--image-column", "img"]) == 2
    assert "--image-column only apply to --source edit" in capsys.readouterr().err


def rec(prompt, sid, images):
    return {"prompt": prompt, "metadata": {"task": "t2i", "sample_id": sid}, "images": images}


def test_curate_dedups_by_media_bytes_not_names(tmp_path, capsys):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "a.png").write_bytes(png((255, 0, 0)))
    (tmp_path / "m" / "a_copy.png").write_bytes(png((255, 0, 0)))
    (tmp_path / "m" / "b.png").write_bytes(png((0, 255, 0)))
    objs = [rec("<image> make it blue", "x1", ["m/a.png"]),
            rec("<image> make it blue", "x0", ["m/a_copy.png"]),   # same bytes, other name: duplicate
            rec("<image> make it blue", "x2", ["m/b.png"]),        # same instruction, other image: kept
            rec("<image> make it round", "x3", ["m/a.png"])]       # same image, other instruction: kept
    src = write_jsonl(tmp_path / "raw.jsonl", objs)
    assert curate_data.main(["--input", str(src), "--output-dir", str(tmp_path / "p"), "--eval-size", "1"]) == 0
    printed = capsys.readouterr().out
    assert "dropped 1: duplicate prompt" in printed and "input lines 1)" in printed  # x0 < x1 is kept
    kept = {r["metadata"]["sample_id"] for f in ("train.jsonl", "eval.jsonl") for r in read_jsonl(tmp_path / "p" / f)}
    assert kept == {"x0", "x2", "x3"}


def test_inspect_leakage_and_repeats_by_media_bytes(tmp_path, capsys):
    for d in ("tr", "ev"):
        (tmp_path / d).mkdir()
    (tmp_path / "tr" / "img.png").write_bytes(png((255, 0, 0)))
    (tmp_path / "ev" / "copy.png").write_bytes(png((255, 0, 0)))   # train's image under another name
    (tmp_path / "ev" / "img.png").write_bytes(png((0, 0, 255)))    # train's name, other bytes
    train = write_jsonl(tmp_path / "tr" / "train.jsonl", [rec("<image> make it blue", "t0", ["img.png"])])
    clean = write_jsonl(tmp_path / "ev" / "clean.jsonl", [rec("<image> make it blue", "e0", ["img.png"])])
    assert inspect_data.main(["--train", str(train), "--eval", str(clean)]) == 0
    leaky = write_jsonl(tmp_path / "ev" / "leaky.jsonl", [rec("<image> make it blue", "e1", ["copy.png"])])
    assert inspect_data.main(["--train", str(train), "--eval", str(leaky)]) == 2
    assert f"{leaky}:1: leakage: the same prompt is also in {train}:1" in capsys.readouterr().out
    # within one file: same instruction on two copies of one image is a repeat warning
    rep = write_jsonl(tmp_path / "ev" / "rep.jsonl", [rec("<image> make it blue", "r0", ["copy.png"]),
                                                      rec("<image>  make it blue", "r1", ["../tr/img.png"])])
    # (line 2 names a file outside the eval file's directory: allowed by naming their common root)
    assert inspect_data.main(["--eval", str(rep), "--media-root", str(tmp_path)]) == 0
    assert f"{rep}:2: same prompt as line 1" in capsys.readouterr().out


def test_find_leakage_keys_must_match_records():
    from trainer.data import PromptRecord, find_leakage

    a = [PromptRecord(prompt="p", task="t2i", sample_id="a")]
    with pytest.raises(ValueError, match="one key per record"):
        find_leakage(a, a, keys_a=[], keys_b=["k"])
    assert find_leakage(a, [PromptRecord(prompt="p", task="t2i", sample_id="b")]) == [("prompt", 0, 0)]

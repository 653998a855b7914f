"""prepare_data / curate_data / inspect_data on small parquet, JSONL and text files made here."""

import json
import os
import random
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import tools.curate_data as curate_data
import tools.inspect_data as inspect_data
import tools.prepare_data as prepare_data
from trainer.data import DataError, split_unit, stable_sample_id

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def read_jsonl(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def write_jsonl(path, objs):
    path.write_text("".join(json.dumps(o) + "\n" for o in objs), encoding="utf-8")
    return path


def rec(prompt, sid, task="t2i", **extra):
    obj = {"prompt": prompt, "metadata": {"task": task, "sample_id": sid}}
    obj.update(extra)
    return obj


def pickapic_table(captions):
    """A Pick-a-Pic-like table: caption plus columns the converter must not read."""
    n = len(captions)
    return pa.table({
        "ranking_id": pa.array(range(n), pa.int64()),
        "caption": pa.array(captions, pa.string()),
        "jpg_0": pa.array([b"\xff\xd8" + bytes(64)] * n, pa.binary()),
        "label_0": pa.array([0.5] * n, pa.float64()),
    })


def many_prompts(n, words=7, seed=0):
    rng = random.Random(seed)
    vocab = ["red", "panda", "teacup", "castle", "neon", "forest", "robot", "ocean", "glass", "tiny",
             "giant", "golden", "misty", "city", "portrait", "of", "a", "in", "the", "rain"]
    return [" ".join(rng.choice(vocab) for _ in range(words)) + f" {i}" for i in range(n)]


# ----------------------------------------------------------------------------- prepare_data


def test_pickapic_directory_streams_caption_column_only(tmp_path, monkeypatch, capsys):
    d = tmp_path / "pick"
    (d / "sub").mkdir(parents=True)
    pq.write_table(pickapic_table(["a red panda  in a teacup", None, "a castle", "  "]), d / "b.parquet",
                   row_group_size=2)
    pq.write_table(pickapic_table(["a castle", "neon city\nat night", "a red panda in a teacup"]),
                   d / "sub" / "a.parquet")
    (d / "notes.txt").write_text("not parquet")
    calls = []
    real = pq.ParquetFile.iter_batches

    def spy(self, *args, **kwargs):
        calls.append(kwargs.get("columns"))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(pq.ParquetFile, "iter_batches", spy)
    monkeypatch.setattr(prepare_data, "PARQUET_BATCH_ROWS", 2)
    out = tmp_path / "out" / "pickapic.jsonl"
    assert prepare_data.main(["--source", "pickapic", "--input", str(d), "--task", "t2i", "--output", str(out)]) == 0
    # only the caption column is read, one row group at a time (b.parquet has two)
    assert calls == [["caption"]] * 3
    rows = read_jsonl(out)
    # sorted path order: b.parquet before sub/a.parquet; whitespace normalised; repeats written once
    assert [r["prompt"] for r in rows] == ["a red panda in a teacup", "a castle", "neon city at night"]
    for r in rows:
        assert r["metadata"] == {"task": "t2i", "source": "pickapic",
                                 "sample_id": stable_sample_id("pickapic", r["prompt"])}
    printed = capsys.readouterr().out
    assert "read 7 prompt(s)" in printed and "wrote 3 record(s)" in printed
    assert "skipped 2 empty prompt(s), 2 duplicate(s)" in printed


def test_pickapic_ids_stable_under_row_order_and_output_reproducible(tmp_path):
    caps = many_prompts(30)
    pq.write_table(pickapic_table(caps), tmp_path / "x.parquet")
    shuffled = caps[:]
    random.Random(1).shuffle(shuffled)
    pq.write_table(pickapic_table(shuffled), tmp_path / "y.parquet")
    outs = []
    for name in ["x", "y", "x"]:
        out = tmp_path / f"{name}{len(outs)}.jsonl"
        prepare_data.prepare("pickapic", str(tmp_path / f"{name}.parquet"), "t2i", str(out))
        outs.append(out)
    assert outs[0].read_bytes() == outs[2].read_bytes()
    by_prompt = lambda p: {r["prompt"]: r["metadata"]["sample_id"] for r in read_jsonl(p)}  # noqa: E731
    assert by_prompt(outs[0]) == by_prompt(outs[1])
    text = outs[0].read_text(encoding="utf-8")
    assert text.endswith("\n") and ", " not in text.replace(caps[0], "") and '": ' not in text


def test_pickapic_missing_column_is_an_error(tmp_path, capsys):
    pq.write_table(pa.table({"text": ["a"]}), tmp_path / "p.parquet")
    rc = prepare_data.main(["--source", "pickapic", "--input", str(tmp_path / "p.parquet"), "--task", "t2i",
                            "--output", str(tmp_path / "o.jsonl")])
    err = capsys.readouterr().err
    assert rc == 2 and "no column 'caption'" in err and "['text']" in err and "--column" in err
    assert not (tmp_path / "o.jsonl").exists() and not (tmp_path / "o.jsonl.tmp").exists()


def test_prompts_parquet_default_and_explicit_column(tmp_path):
    pq.write_table(pa.table({"id": [1, 2], "caption": ["a b", "c d"], "prompt": ["p one", "p two"]}),
                   tmp_path / "p.parquet")
    out = tmp_path / "o.jsonl"
    prepare_data.prepare("prompts", str(tmp_path / "p.parquet"), "t2i", str(out))
    assert [r["prompt"] for r in read_jsonl(out)] == ["p one", "p two"]  # "prompt" preferred
    prepare_data.prepare("prompts", str(tmp_path / "p.parquet"), "t2i", str(out), column="caption", id_prefix="cc")
    rows = read_jsonl(out)
    assert [r["prompt"] for r in rows] == ["a b", "c d"]
    assert rows[0]["metadata"]["sample_id"] == stable_sample_id("cc", "a b")
    assert rows[0]["metadata"]["source"] == "prompts"


def test_prompts_jsonl_and_malformed_line(tmp_path, capsys):
    src = tmp_path / "in.jsonl"
    src.write_text('{"prompt": "first one"}\n{"prompt": "second", "x": 1}\n', encoding="utf-8")
    out = tmp_path / "o.jsonl"
    prepare_data.prepare("prompts", str(src), "t2i", str(out))
    assert [r["prompt"] for r in read_jsonl(out)] == ["first one", "second"]
    src.write_text('{"prompt": "first one"}\n{"prompt": "second"\n{"prompt": "third"}\n', encoding="utf-8")
    rc = prepare_data.main(["--source", "prompts", "--input", str(src), "--task", "t2i", "--output", str(out)])
    err = capsys.readouterr().err
    assert rc == 2 and f"{src}:2: not valid JSON" in err
    src.write_text('{"prompt": "ok"}\n{"text": "no prompt"}\n', encoding="utf-8")
    with pytest.raises(DataError, match=r"in.jsonl:2: expected an object with a 'prompt' field"):
        prepare_data.prepare("prompts", str(src), "t2i", str(out))


def test_prompts_text_file(tmp_path, capsys):
    src = tmp_path / "prompts.txt"
    src.write_bytes("\ufeffa  cat on a mat\n\n   \nsecond prompt\r\na cat on a mat\nbad \xff".encode("utf-8")[:-2]
                    + b"\xff\n")
    out = tmp_path / "o.jsonl"
    rc = prepare_data.main(["--source", "prompts", "--input", str(src), "--task", "t2i", "--output", str(out)])
    assert rc == 2 and f"{src}:6: not valid UTF-8" in capsys.readouterr().err
    src.write_bytes("\ufeffa  cat on a mat\n\n   \nsecond prompt\r\na cat on a mat\n".encode("utf-8"))
    counts = prepare_data.prepare("prompts", str(src), "t2i", str(out))
    assert [r["prompt"] for r in read_jsonl(out)] == ["a cat on a mat", "second prompt"]
    assert (counts["read"], counts["written"], counts["empty"], counts["duplicate"]) == (5, 2, 2, 1)


def test_prepare_rejects_bad_task(tmp_path):
    src = tmp_path / "p.txt"
    src.write_text("x\n")
    with pytest.raises(DataError, match="--task 'video'"):
        prepare_data.prepare("prompts", str(src), "video", str(tmp_path / "o.jsonl"))


# ----------------------------------------------------------------------------- curate_data


def curated(out_dir, prefix=""):
    return {name: read_jsonl(os.path.join(out_dir, name)) for name in sorted(os.listdir(out_dir))
            if name.startswith(prefix) and name.endswith(".jsonl")}


def ids(rows):
    return {r["metadata"]["sample_id"] for r in rows}


def test_curate_reference_file_names_nested_subsets_and_byte_reproducible(tmp_path, capsys):
    src = write_jsonl(tmp_path / "raw.jsonl", [rec(p, f"id{i:03d}") for i, p in enumerate(many_prompts(120))])
    args = ["--input", str(src), "--out-dir", str(tmp_path / "out"), "--prefix", "pickapic_",
            "--eval-size", "40", "--eval-subset-sizes", "8", "16", "--no-check-media"]
    assert curate_data.main(args) == 0
    files = curated(tmp_path / "out")
    assert sorted(files) == ["pickapic_eval.jsonl", "pickapic_eval16.jsonl", "pickapic_eval8.jsonl",
                             "pickapic_train.jsonl"]
    train, ev = ids(files["pickapic_train.jsonl"]), ids(files["pickapic_eval.jsonl"])
    assert len(train) == 80 and len(ev) == 40 and not train & ev
    assert ids(files["pickapic_eval8.jsonl"]) < ids(files["pickapic_eval16.jsonl"]) < ev
    ranked = sorted(train | ev, key=lambda s: (split_unit(s), s))
    assert ev == set(ranked[:40]) and ids(files["pickapic_eval8.jsonl"]) == set(ranked[:8])
    # input order kept
    assert [r["metadata"]["sample_id"] for r in files["pickapic_train.jsonl"]] == sorted(train)
    before = {n: (tmp_path / "out" / n).read_bytes() for n in files}
    capsys.readouterr()
    assert curate_data.main(args) == 0
    assert "replaced the existing file" in capsys.readouterr().out
    assert {n: (tmp_path / "out" / n).read_bytes() for n in files} == before


def test_curate_default_names_and_fraction_split(tmp_path):
    src = write_jsonl(tmp_path / "raw.jsonl", [rec(p, f"s{i}") for i, p in enumerate(many_prompts(200))])
    report = curate_data.curate(str(src), str(tmp_path / "out"), eval_fraction=0.2)
    assert sorted(os.listdir(tmp_path / "out")) == ["eval.jsonl", "train.jsonl"]
    ev = ids(read_jsonl(tmp_path / "out" / "eval.jsonl"))
    assert ev == {f"s{i}" for i in range(200) if split_unit(f"s{i}") < 0.2}
    assert report.train + report.eval == 200 and 20 < report.eval < 60


def test_curate_split_stable_under_reordering_and_additions(tmp_path):
    base = [rec(p, f"s{i}") for i, p in enumerate(many_prompts(150))]
    shuffled = base[:]
    random.Random(3).shuffle(shuffled)
    grown = shuffled + [rec(p + " extra", f"new{i}") for i, p in enumerate(many_prompts(100, seed=9))]
    random.Random(4).shuffle(grown)

    def split(objs, name, **kw):
        src = write_jsonl(tmp_path / f"{name}.jsonl", objs)
        curate_data.curate(str(src), str(tmp_path / name), **kw)
        return (ids(read_jsonl(tmp_path / name / "train.jsonl")), ids(read_jsonl(tmp_path / name / "eval.jsonl")))

    # fraction split: every existing record keeps its side
    t0, e0 = split(base, "a", eval_fraction=0.25)
    t1, e1 = split(shuffled, "b", eval_fraction=0.25)
    t2, e2 = split(grown, "c", eval_fraction=0.25)
    assert (t0, e0) == (t1, e1)
    assert t0 <= t2 and e0 <= e2 and not (t2 & e0)
    # size split: reordering changes nothing; additions never move a train record to eval
    t0, e0 = split(base, "d", eval_size=30)
    t1, e1 = split(shuffled, "e", eval_size=30)
    t2, e2 = split(grown, "f", eval_size=30)
    assert (t0, e0) == (t1, e1)
    assert t0 <= t2 and not (t0 & e2) and len(e2) == 30


def test_curate_dedup_min_words_and_media(tmp_path, capsys):
    (tmp_path / "media").mkdir()
    (tmp_path / "media" / "a.png").write_bytes(b"x")
    objs = [
        rec("one two three four five six", "b"),
        rec("one  two three four\nfive six", "a"),       # duplicate of "b" after whitespace normalisation
        rec("One two three four five six", "c"),         # case differs: kept
        rec("too short prompt", "d"),
        rec("edit <image> one two three four five six", "e", images=["media/a.png"]),
        rec("edit <image> one two three four five six", "f", images=["media/missing.png"]),
    ] + [rec(p, f"z{i}") for i, p in enumerate(many_prompts(40))]
    src = write_jsonl(tmp_path / "raw.jsonl", objs)
    out = tmp_path / "processed"
    assert curate_data.main(["--input", str(src), "--out-dir", str(out), "--min-prompt-words", "6",
                             "--eval-size", "5"]) == 0
    printed = capsys.readouterr().out
    assert "dropped 1: missing media file" in printed and "input lines 6)" in printed
    assert "dropped 1: fewer than 6 words" in printed and "input lines 4)" in printed
    # of the duplicates the smaller sample id ("a", line 2) is kept and line 1 dropped
    assert "dropped 1: duplicate prompt" in printed and "input lines 1)" in printed
    rows = read_jsonl(out / "train.jsonl") + read_jsonl(out / "eval.jsonl")
    kept = ids(rows)
    assert {"a", "c", "e"} <= kept and not kept & {"b", "d", "f"} and len(rows) == 43
    (edit,) = [r for r in rows if r["metadata"]["sample_id"] == "e"]
    assert edit["images"] == ["../media/a.png"]  # rebased so it still points at the file
    assert os.path.isfile(os.path.normpath(out / edit["images"][0]))
    # --no-check-media keeps the record with the missing file
    curate_data.curate(str(src), str(tmp_path / "p2"), min_prompt_words=6, eval_size=5, check_media=False)
    assert "f" in ids(read_jsonl(tmp_path / "p2" / "train.jsonl") + read_jsonl(tmp_path / "p2" / "eval.jsonl"))


def test_curate_dedup_independent_of_input_order(tmp_path):
    objs = [rec("same prompt here", f"x{i}") for i in (5, 2, 9)] + [rec(p, f"u{i}") for i, p in enumerate(many_prompts(30))]
    results = []
    for k in range(3):
        random.Random(k).shuffle(objs)
        src = write_jsonl(tmp_path / f"r{k}.jsonl", objs)
        curate_data.curate(str(src), str(tmp_path / f"o{k}"), eval_size=4)
        results.append(ids(read_jsonl(tmp_path / f"o{k}" / "train.jsonl")) | ids(read_jsonl(tmp_path / f"o{k}" / "eval.jsonl")))
    assert results[0] == results[1] == results[2]
    assert "x2" in results[0] and not {"x5", "x9"} & results[0]


def test_curate_reports_bad_lines_and_writes_nothing(tmp_path, capsys):
    src = tmp_path / "raw.jsonl"
    src.write_text("\n".join([json.dumps(rec("fine prompt", "a")), '{"prompt": "broken"',
                              json.dumps(rec("bad task", "b", task="nope")),
                              json.dumps(rec("other prompt", "a"))]) + "\n", encoding="utf-8")
    rc = curate_data.main(["--input", str(src), "--out-dir", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert rc == 2 and "3 bad line(s)" in err
    assert f"{src}:2: not valid JSON" in err and f"{src}:3: metadata.task 'nope'" in err
    assert f"{src}:4: sample_id 'a' already used at line 1" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("kw, needle", [
    (dict(eval_size=10), "--eval-size 10: only 10 record"),
    (dict(eval_size=3, eval_subset_sizes=[4]), "--eval-subset-sizes 4"),
    (dict(eval_size=3, eval_fraction=0.1), "alternatives"),
    (dict(eval_fraction=1.5), "--eval-fraction must be in"),
    (dict(eval_fraction=1e-9), "no record of 10 falls in eval"),
    (dict(eval_size=3, eval_subset_sizes=[2, 2]), "distinct"),
])
def test_curate_flag_errors(tmp_path, kw, needle):
    src = write_jsonl(tmp_path / "raw.jsonl", [rec(p, f"s{i}") for i, p in enumerate(many_prompts(10))])
    with pytest.raises(DataError, match=needle):
        curate_data.curate(str(src), str(tmp_path / "out"), **kw)


def test_curate_refuses_to_overwrite_its_input(tmp_path):
    src = write_jsonl(tmp_path / "train.jsonl", [rec(p, f"s{i}") for i, p in enumerate(many_prompts(10))])
    with pytest.raises(DataError, match="would be overwritten"):
        curate_data.curate(str(src), str(tmp_path), eval_size=2)


# ----------------------------------------------------------------------------- inspect_data


@pytest.fixture
def clean_split(tmp_path):
    from PIL import Image

    (tmp_path / "m").mkdir()
    Image.new("RGB", (4, 4), (255, 0, 0)).save(tmp_path / "m" / "ok.png")
    train = write_jsonl(tmp_path / "train.jsonl", [rec(p, f"t{i}") for i, p in enumerate(many_prompts(6))]
                        + [rec("look <image> here", "timg", images=["m/ok.png"])])
    ev = write_jsonl(tmp_path / "eval.jsonl", [rec(p, f"e{i}") for i, p in enumerate(many_prompts(3, seed=5))])
    return tmp_path, train, ev


def run_inspect(capsys, *argv):
    rc = inspect_data.main(list(argv))
    return rc, capsys.readouterr().out


def test_inspect_passes_clean_data(clean_split, capsys):
    _, train, ev = clean_split
    rc, out = run_inspect(capsys, "--train", str(train), "--eval", str(ev), "--decode-media")
    assert rc == 0 and "inspect_data: OK" in out and "error:" not in out


def append(path, *lines):
    with open(path, "a", encoding="utf-8") as f:
        for line in lines:
            f.write((line if isinstance(line, str) else json.dumps(line)) + "\n")


@pytest.mark.parametrize("planted, where_, needle", [
    ({"metadata": {"task": "t2i", "sample_id": "q"}}, "train:8", "missing required key 'prompt'"),
    (rec("a prompt", "q", task="bogus"), "train:8", "metadata.task 'bogus'"),
    ({"prompt": "x", "metadata": {"task": "t2i"}}, "train:8", "missing required key 'metadata.sample_id'"),
    ("{oops", "train:8", "not valid JSON"),
    (rec("two <image> <image>", "q", images=["m/ok.png"]), "train:8", "placeholder"),
    (rec("x <image>", "q", images=["m/gone.png"]), "train:8", "does not exist"),
    (rec("dup id", "t0"), "train:8", "sample_id 't0' already used at line 1"),
])
def test_inspect_finds_planted_train_problem(clean_split, capsys, planted, where_, needle):
    tmp_path, train, ev = clean_split
    append(train, planted)
    rc, out = run_inspect(capsys, "--train", str(train), "--eval", str(ev))
    file, line = where_.split(":")
    assert rc == 2 and "FAILED: 1 error(s)" in out
    assert f"error: {tmp_path / (file + '.jsonl')}:{line}: " in out and needle in out


def test_inspect_finds_leakage_by_id_and_by_prompt(clean_split, capsys):
    tmp_path, train, ev = clean_split
    train_rows = read_jsonl(train)
    append(ev, rec("entirely new prompt", "t2"), rec(train_rows[3]["prompt"].upper().lower(), "fresh"))
    rc, out = run_inspect(capsys, "--train", str(train), "--eval", str(ev))
    assert rc == 2
    assert f"{ev}:4: leakage: sample_id 't2' is also in {train}:3" in out
    assert f"{ev}:5: leakage: the same prompt is also in {train}:4" in out


def test_inspect_decode_media_finds_undecodable_file(clean_split, capsys):
    tmp_path, train, ev = clean_split
    (tmp_path / "m" / "bad.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"garbage" * 4)
    append(ev, rec("see <image>", "ebad", images=["m/bad.png"]))
    rc, out = run_inspect(capsys, "--train", str(train), "--eval", str(ev))
    assert rc == 0  # exists: only --decode-media opens it
    rc, out = run_inspect(capsys, "--train", str(train), "--eval", str(ev), "--decode-media")
    assert rc == 2 and f"{ev}:4: images file 'm/bad.png' does not decode" in out


def test_inspect_empty_file_and_duplicate_prompt_warning(clean_split, capsys):
    tmp_path, train, ev = clean_split
    append(train, rec(read_jsonl(train)[0]["prompt"], "other"))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    rc, out = run_inspect(capsys, "--train", str(train), "--eval", str(ev), str(empty))
    assert rc == 2 and f"error: {empty}: the file is empty" in out
    assert f"warning: {train}:8: same prompt as line 1" in out and "1 error(s), 1 warning(s)" in out


# ----------------------------------------------------------------------------- CLIs end to end


def test_cli_pipeline_prepare_curate_inspect(tmp_path):
    src = tmp_path / "prompts.txt"
    src.write_text("\n".join(many_prompts(50)) + "\n", encoding="utf-8")
    raw = tmp_path / "raw" / "t2i" / "prompts.jsonl"
    out = tmp_path / "processed" / "t2i"

    def cli(tool, *args):
        return subprocess.run([sys.executable, os.path.join(REPO, "tools", tool), *args], cwd=tmp_path,
                              capture_output=True, text=True)

    p = cli("prepare_data.py", "--source", "prompts", "--input", str(src), "--task", "t2i", "--output", str(raw))
    assert p.returncode == 0, p.stderr
    p = cli("curate_data.py", "--input", str(raw), "--out-dir", str(out), "--prefix", "pp_", "--min-prompt-words", "6",
            "--eval-size", "10", "--eval-subset-sizes", "4", "--no-check-media")
    assert p.returncode == 0, p.stderr
    assert "train 40, eval 10" in p.stdout
    p = cli("inspect_data.py", "--train", str(out / "pp_train.jsonl"), "--eval", str(out / "pp_eval4.jsonl"),
            "--decode-media")
    assert p.returncode == 0 and "OK" in p.stdout, p.stdout + p.stderr
    p = cli("inspect_data.py", "--train", str(out / "pp_train.jsonl"), "--eval", str(out / "pp_train.jsonl"))
    assert p.returncode == 2 and "leakage" in p.stdout


# ----------------------------------------------------------------------------- one rule for every data tool


def _err_lines(capsys):
    return capsys.readouterr().err.strip().splitlines()


def test_curate_prefix_gets_a_separator(tmp_path):
    """--prefix pickapic and --prefix pickapic_ name the same files (docs/data.md's names)."""
    src = write_jsonl(tmp_path / "raw.jsonl", [rec(p, f"s{i}") for i, p in enumerate(many_prompts(30))])
    for prefix, out in (("pickapic", "a"), ("pickapic_", "b")):
        assert curate_data.main(["--input", str(src), "--output-dir", str(tmp_path / out), "--prefix", prefix,
                                 "--eval-size", "5", "--eval-subset-sizes", "2", "--no-check-media"]) == 0
        assert sorted(os.listdir(tmp_path / out)) == ["pickapic_eval.jsonl", "pickapic_eval2.jsonl",
                                                      "pickapic_train.jsonl"]
    assert curate_data.output_names("pp-", [])[0] == "pp-train.jsonl"
    assert curate_data.output_names("", [])[0] == "train.jsonl"


def test_output_paths_that_cannot_be_written_are_one_line_errors(tmp_path, capsys):
    """An --output that is a directory, under a file, or an --output-dir that is a file: exit 2,
    one line naming the flag, nothing written, no .tmp left behind."""
    src = tmp_path / "p.txt"
    src.write_text("a red ball\na blue cube\n")
    (tmp_path / "adir").mkdir()
    afile = tmp_path / "afile"
    afile.write_text("x")
    cases = [
        (prepare_data, ["--source", "prompts", "--input", str(src), "--output", str(tmp_path / "adir")],
         "flowgrpo-prepare-data: error: --output", "is a directory"),
        (prepare_data, ["--source", "prompts", "--input", str(src), "--output", str(afile / "x.jsonl")],
         "flowgrpo-prepare-data: error: --output", "is a file, not a directory"),
        (curate_data, ["--input", str(src), "--output-dir", str(afile)],
         "flowgrpo-curate-data: error: --output-dir", "is a file, not a directory"),
    ]
    for tool, argv, head, what in cases:
        assert tool.main(argv) == 2
        lines = _err_lines(capsys)
        assert len(lines) == 1 and lines[0].startswith(head) and what in lines[0], lines
    assert sorted(os.listdir(tmp_path)) == ["adir", "afile", "p.txt"]
    assert os.listdir(tmp_path / "adir") == []
    # curate: an output file name taken by a directory
    raw = write_jsonl(tmp_path / "raw.jsonl", [rec(p, f"s{i}") for i, p in enumerate(many_prompts(20))])
    (tmp_path / "cur" / "x_train.jsonl").mkdir(parents=True)
    assert curate_data.main(["--input", str(raw), "--output-dir", str(tmp_path / "cur"), "--prefix", "x",
                             "--eval-size", "4", "--no-check-media"]) == 2
    lines = _err_lines(capsys)
    assert len(lines) == 1 and "x_train.jsonl is a directory" in lines[0], lines


def test_prepare_replaces_a_stale_tmp_and_a_failed_rename_leaves_none(tmp_path, capsys):
    from trainer.data import write_jsonl as write_rows

    src = tmp_path / "p.txt"
    src.write_text("a red ball\n")
    out = tmp_path / "o.jsonl"
    (tmp_path / "o.jsonl.tmp").write_text("half a line from a killed run")
    assert prepare_data.main(["--source", "prompts", "--input", str(src), "--output", str(out)]) == 0
    assert "o.jsonl.tmp is left from an interrupted run; it is replaced" in capsys.readouterr().out
    assert sorted(os.listdir(tmp_path)) == ["o.jsonl", "p.txt"] and len(read_jsonl(out)) == 1
    # the rename itself fails (the target is a non-empty directory): the .tmp goes too
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "keep").write_text("")
    with pytest.raises(OSError):
        write_rows(tmp_path / "d", [{"a": 1}])
    assert not (tmp_path / "d.tmp").exists()


def test_inspect_takes_either_file_set_and_needs_one(clean_split, capsys):
    _, train, ev = clean_split
    assert inspect_data.main(["--eval", str(ev)]) == 0
    assert inspect_data.main(["--train", str(train)]) == 0
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        inspect_data.main([])
    assert e.value.code == 2
    lines = _err_lines(capsys)
    assert len(lines) == 1 and lines[0].startswith("flowgrpo-inspect-data: error: give --train"), lines
    append(ev, "{oops")
    assert inspect_data.main(["--eval", str(ev)]) == 2  # bad data: the input-error status, like a bad flag


def test_first_seen_counts_duplicates_and_refuses_an_id_collision():
    from collections import Counter

    seen, counts = {}, Counter()
    assert prepare_data.first_seen(seen, "p-1", "hash-a", counts, "f.jsonl:1: sample id p-1 collides")
    assert not prepare_data.first_seen(seen, "p-1", "hash-a", counts, "f.jsonl:2: sample id p-1 collides")
    assert counts["duplicate"] == 1 and seen == {"p-1": "hash-a"}
    with pytest.raises(DataError, match=r"^f\.jsonl:3: sample id p-1 collides .*64-bit hash collision.*--id-prefix"):
        prepare_data.first_seen(seen, "p-1", "hash-b", counts, "f.jsonl:3: sample id p-1 collides")
    assert counts["duplicate"] == 1 and seen == {"p-1": "hash-a"}

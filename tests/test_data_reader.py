"""The training-side prompt reader: schema validation, deterministic resumable order, eval sets."""

import json
import subprocess
import sys

import numpy as np
import pytest

from trainer.data import (DataError, PromptDataset, PromptOrder, canonical_json, content_hash,
                          load_eval_sets, split_unit, stable_sample_id, write_jsonl)


def write_lines(path, lines):
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def rec(prompt, sid, task="t2i", **extra):
    obj = {"prompt": prompt, "metadata": {"task": task, "sample_id": sid}}
    obj.update(extra)
    return json.dumps(obj)


def test_from_jsonl_reads_records_and_resolves_media(tmp_path):
    (tmp_path / "img").mkdir()
    path = write_lines(tmp_path / "p.jsonl", [
        rec("a cat", "s1"),
        json.dumps({"prompt": "edit <image> please", "images": ["img/a.png"],
                    "metadata": {"task": "t2i", "sample_id": "s2", "source": "x"}}),
    ])
    ds = PromptDataset.from_jsonl(path)
    assert len(ds) == 2 and ds.lines == [1, 2]
    assert ds[0].prompt == "a cat" and ds[0].sample_id == "s1" and ds[0].media() == ()
    assert ds[1].images == (str(tmp_path / "img" / "a.png"),)
    assert ds[1].extra == {"source": "x"}


@pytest.mark.parametrize("bad_line, needle", [
    ("{not json", "not valid JSON"),
    ("", "blank line"),
    ("[1, 2]", "expected a JSON object"),
    (json.dumps({"metadata": {"task": "t2i", "sample_id": "z"}}), "missing required key 'prompt'"),
    (rec("x", "z", task="t3d"), "metadata.task 't3d'"),  # not a task (t2v became one)
    (rec("x", "has space"), "sample_id"),
    (rec("a <image>", "z"), "placeholder"),
    (json.dumps({"prompt": "x", "image": ["a.png"], "metadata": {"task": "t2i", "sample_id": "z"}}),
     "unknown top-level key"),
])
def test_from_jsonl_errors_name_file_and_line(tmp_path, bad_line, needle):
    path = write_lines(tmp_path / "p.jsonl", [rec("ok", "a"), rec("ok two", "b"), bad_line, rec("ok 3", "c")])
    with pytest.raises(DataError) as e:
        PromptDataset.from_jsonl(path)
    assert f"{path}:3:" in str(e.value) and needle in str(e.value)


def test_from_jsonl_duplicate_id_wrong_task_and_empty(tmp_path):
    path = write_lines(tmp_path / "p.jsonl", [rec("a", "s"), rec("b", "s")])
    with pytest.raises(DataError, match=r"p.jsonl:2: sample_id 's' already used at line 1"):
        PromptDataset.from_jsonl(path)
    path = write_lines(tmp_path / "q.jsonl", [rec("a", "s")])
    with pytest.raises(DataError, match="--generation-task"):
        PromptDataset.from_jsonl(path, task="edit")
    empty = tmp_path / "e.jsonl"
    empty.write_text("")
    with pytest.raises(DataError, match="empty"):
        PromptDataset.from_jsonl(empty)
    with pytest.raises(DataError, match="no such file"):
        PromptDataset.from_jsonl(tmp_path / "missing.jsonl")


def test_prompt_order_matches_documented_formula():
    order = PromptOrder(num_prompts=10, rollout_batch_size=3, seed=7)
    assert order.batches_per_epoch == 3
    for k in range(8):
        epoch, b = divmod(k, 3)
        expect = np.random.default_rng((7, epoch)).permutation(10)[3 * b:3 * b + 3].tolist()
        assert order.groups_for_rollout(k) == expect


def test_prompt_order_epochs_do_not_straddle_and_cover_distinct_prompts():
    order = PromptOrder(num_prompts=11, rollout_batch_size=4, seed=0)
    for epoch in range(3):
        batches = [order.groups_for_rollout(epoch * 2 + j) for j in range(2)]
        flat = [i for b in batches for i in b]
        assert all(len(b) == 4 for b in batches)
        assert len(set(flat)) == 8  # distinct within the epoch; 11 % 4 = 3 left out this epoch
        assert flat == order.permutation(epoch)[:8].tolist()
    # fresh permutations: the left-out tail differs between epochs
    tails = {tuple(sorted(order.permutation(e)[8:].tolist())) for e in range(6)}
    assert len(tails) > 1


def test_prompt_order_is_resumable_and_rank_independent():
    seq = PromptOrder(1000, 32, seed=42)
    sequential = [seq.groups_for_rollout(k) for k in range(100)]
    # A "resumed" (or other-rank) instance asked out of order gives the same answers.
    other = PromptOrder(1000, 32, seed=42)
    for k in [99, 0, 31, 62, 30, 31, 5]:
        assert other.groups_for_rollout(k) == sequential[k]
    assert PromptOrder(1000, 32, seed=43).groups_for_rollout(0) != sequential[0]
    assert all(isinstance(i, int) for i in sequential[0])


def test_prompt_order_errors():
    with pytest.raises(ValueError, match=r"3 prompt\(s\), fewer than --rollout-batch-size 4"):
        PromptOrder(3, 4, seed=0)
    with pytest.raises(ValueError, match="--rollout-seed"):
        PromptOrder(10, 4, seed=-1)
    with pytest.raises(ValueError, match="rollout id"):
        PromptOrder(10, 4, seed=0).groups_for_rollout(-1)
    with pytest.raises(ValueError, match="--rollout-batch-size must be >= 1"):
        PromptOrder(10, 0, seed=0)


def test_dataset_order_names_the_file_when_too_small(tmp_path):
    path = write_lines(tmp_path / "small.jsonl", [rec("a", "s1"), rec("b", "s2")])
    ds = PromptDataset.from_jsonl(path)
    assert ds.order(2, seed=1).groups_for_rollout(3) == PromptOrder(2, 2, 1).groups_for_rollout(3)
    with pytest.raises(DataError, match=rf"{path} has 2 prompt\(s\), fewer than --rollout-batch-size 3"):
        ds.order(3, seed=1)


def test_load_eval_sets_keeps_order_and_checks_names(tmp_path):
    a = write_lines(tmp_path / "a.jsonl", [rec("a one", "a1")])
    b = write_lines(tmp_path / "b.jsonl", [rec("b one", "b1"), rec("b two", "b2")])
    sets = load_eval_sets([("zeta", str(b)), ("alpha", str(a))])
    assert list(sets) == ["zeta", "alpha"] and len(sets["zeta"]) == 2 and sets["alpha"][0].sample_id == "a1"
    with pytest.raises(DataError, match="given twice"):
        load_eval_sets([("x", str(a)), ("x", str(b))])
    bad = write_lines(tmp_path / "bad.jsonl", [rec("ok", "o"), "{"])
    with pytest.raises(DataError, match=r"bad.jsonl:2:"):
        load_eval_sets([("x", str(bad))])


def test_hashes_are_stable_and_normalised():
    assert content_hash("a  red\ncat") == content_hash(" a red cat ")
    assert content_hash("a red cat") != content_hash("A red cat")
    assert content_hash("x <image>", ["b.png", "a.png"]) == content_hash("x <image>", ["a.png", "b.png"])
    assert content_hash("x", ["a.png"]) != content_hash("x")
    # pinned formulas (a change here silently reshuffles every existing split)
    import hashlib
    assert stable_sample_id("pp", "a cat") == "pp_" + hashlib.sha256(
        canonical_json({"media": [], "prompt": "a cat"}).encode()).hexdigest()[:16]
    u = split_unit("s1")
    assert 0.0 <= u < 1.0
    assert u == int.from_bytes(hashlib.sha256(b"split:s1").digest()[:8], "big") / 2.0**64


def test_canonical_json_is_sorted_compact_utf8():
    assert canonical_json({"b": 1, "a": {"d": "é", "c": [1, 2]}}) == '{"a":{"c":[1,2],"d":"é"},"b":1}'


def test_module_does_not_import_torch():
    code = "import sys, trainer.data; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_write_jsonl_failure_keeps_the_old_file_and_leaves_no_tmp(tmp_path):
    path = tmp_path / "p.jsonl"
    assert write_jsonl(path, [{"prompt": "old"}]) == 1
    before = path.read_bytes()

    def rows():
        yield {"prompt": "new"}
        raise DataError("source broke mid-way")

    with pytest.raises(DataError, match="mid-way"):
        write_jsonl(path, rows())
    assert path.read_bytes() == before
    assert list(tmp_path.iterdir()) == [path]  # no temporary left behind, whatever its name

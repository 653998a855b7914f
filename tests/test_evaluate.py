"""tools/evaluate.py (flowgrpo-eval): the base against a LoRA checkpoint and its merged export on the
tiny model, the report's fields and statistics, the page and its grids, the same numbers on 1 and
2 ranks, two reports compared, bad input refused before the model loads."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from tests.test_sample_tool import _lora_checkpoint, _lora_dir, _no_model_load
from tools.evaluate import main
from trainer.evaluation import bootstrap_mean, paired_win_rate

SMALL = json.dumps({"height": 32, "width": 32, "num_inference_steps": 4, "sde_indices": [1]})
PROMPTS = ["a red circle", "a green square", "a blue triangle"]


@pytest.fixture(scope="module")
def inputs(tiny_model_dir, tmp_path_factory):
    """The base, a LoRA checkpoint of it in the trainer's layout (iteration 3, named by its
    iter_ directory), the checkpoint's merged and adapter exports, a prompt set, and the flags of
    one evaluation of all four."""
    from tools.export_checkpoint import export_checkpoint

    root = tmp_path_factory.mktemp("evaluate")
    peft = _lora_dir(Path(tiny_model_dir), root / "peft")
    _lora_checkpoint(peft, root / "save", iteration=3)
    export_checkpoint(root / "save", "t2i", 3, root / "merged", form="merged", base_model_path=tiny_model_dir)
    export_checkpoint(root / "save", "t2i", 3, root / "adapter", form="adapter")
    prompts = root / "held_out.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p, "metadata": {"task": "t2i", "sample_id": f"p{i}"}}) + "\n"
                               for i, p in enumerate(PROMPTS)))
    argv = ["--model-path", str(tiny_model_dir), "--eval-prompt-data", "held_out", str(prompts),
            "--candidate", "trained", str(root / "save" / "t2i" / "iter_0000003"),
            "--candidate", "export", str(root / "merged"), "--candidate", "adapter", str(root / "adapter"),
            "--scorer", "color", "--sampling-config", SMALL, "--n-samples-per-prompt", "3",
            "--engine-batch-size", "4"]
    return {"root": root, "argv": argv, "prompts": prompts}


@pytest.fixture(scope="module")
def one_rank(inputs):
    """The evaluation in this process, on one thread as each torchrun rank of tests.workers.launch
    (a CPU GEMM's rounding depends on its thread count)."""
    import torch

    out = inputs["root"] / "out1"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert main(inputs["argv"] + ["--output-dir", str(out)]) == 0
    finally:
        torch.set_num_threads(threads)
    return out


def test_report_fields_intervals_and_win_rate(one_rank, inputs):
    report = json.loads((one_rank / "report.json").read_text())
    st = report["settings"]
    assert st["sampling_config"]["height"] == 32 and st["sampling_config"]["num_inference_steps"] == 4
    assert st["generation_seed"] == 1234 and st["n_samples_per_prompt"] == 3 and st["engine_batch_size"] == 4
    assert st["engine_dtype"] == "fp32"
    assert st["scorers"] == [{"scorer": "color", "model_path": None}]
    assert st["bootstrap"] == {"seed": 0, "resamples": 1000, "level": 0.95}
    assert [c["name"] for c in report["candidates"]] == ["base", "trained", "export", "adapter"]
    assert [c["source"]["kind"] for c in report["candidates"]] == ["base", "checkpoint", "pipeline", "adapter"]
    assert report["candidates"][1]["source"]["iteration"] == 3
    held = report["sets"]["held_out"]
    assert held["prompts"] == 3 and len(held["sha256"]) == 64 and held["sde_indices"] == [1]
    assert [r["prompt"] for r in held["per_prompt"]] == PROMPTS
    for cand, comps in held["summary"].items():
        row = comps["color"]
        assert row["n"] == 9 and row["lo"] <= row["mean"] <= row["hi"], (cand, row)
        table = np.array([r["scores"][cand]["color"] for r in held["per_prompt"]])
        assert row["mean"] == pytest.approx(table.mean())
    # the checkpoint and its two exports are the same weights: the same scores
    for export in ("export", "adapter"):
        assert held["summary"][export]["color"]["mean"] == pytest.approx(held["summary"]["trained"]["color"]["mean"],
                                                                         abs=1e-5)
    base = np.array([r["scores"]["base"]["color"] for r in held["per_prompt"]])
    trained = np.array([r["scores"]["trained"]["color"] for r in held["per_prompt"]])
    win = held["summary"]["trained"]["color"]["win_rate_vs_base"]
    assert win["pairs"] == 9 and win["wins"] == int((trained > base).sum())
    assert win["win_rate"] == pytest.approx((win["wins"] + 0.5 * win["ties"]) / 9)
    assert win["lo"] <= win["win_rate"] <= win["hi"]
    assert not (trained == base).all()  # the LoRA changed the samples
    assert "win_rate_vs_base" not in held["summary"]["base"]["color"]


def test_page_and_grids_reference_each_other(one_rank):
    page = (one_rank / "report.md").read_text()
    linked = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", page)
    assert linked == ["grid_held_out_trained.png", "grid_held_out_export.png", "grid_held_out_adapter.png"]
    from PIL import Image

    for name in linked:
        with Image.open(one_rank / name) as im:
            assert im.format == "PNG" and im.width > 6 * 32  # the base's and the candidate's samples side by side
    assert "| trained | color |" in page and "a blue triangle" in page
    assert len(list((one_rank / "artifacts" / "trained" / "held_out").glob("*.png"))) == 9
    assert not list(one_rank.parent.glob(".out1.partial-*"))  # staged, then renamed into place


def test_same_numbers_on_two_ranks_and_the_two_reports_compare(one_rank, inputs, capsys):
    from tests.workers.launch import torchrun

    out2 = inputs["root"] / "out2"
    torchrun("tools/evaluate.py", nproc=2, args=inputs["argv"] + ["--output-dir", str(out2)], timeout=300)
    a = json.loads((one_rank / "report.json").read_text())
    b = json.loads((out2 / "report.json").read_text())
    assert (a["world_size"], b["world_size"]) == (1, 2)
    assert a["sets"] == b["sets"]  # every score, interval and win rate
    capsys.readouterr()
    assert main(["--compare", str(one_rank / "report.json"), str(out2 / "report.json"),
                 "--output-dir", str(inputs["root"] / "cmp")]) == 0
    page = (inputs["root"] / "cmp" / "compare.md").read_text()
    # the same candidates on the same seeds: every pair a tie
    assert "| trained | color |" in page and "| 0.5000 [0.5000, 0.5000] |" in page
    other = json.loads(json.dumps(b))
    other["settings"]["generation_seed"] = 7
    (inputs["root"] / "other.json").write_text(json.dumps(other))
    assert main(["--compare", str(one_rank / "report.json"), str(inputs["root"] / "other.json"),
                 "--output-dir", str(inputs["root"] / "cmp2")]) == 2
    assert "settings.generation_seed differs" in capsys.readouterr().err


def test_bootstrap_is_seeded_and_the_win_rate_counts_pairs():
    rng = np.random.default_rng(3)
    v = rng.normal(size=(20, 4))
    assert bootstrap_mean(v, seed=5) == bootstrap_mean(v, seed=5)
    assert bootstrap_mean(v, seed=5)["lo"] != bootstrap_mean(v, seed=6)["lo"]
    row = bootstrap_mean(v, seed=5)
    assert row["lo"] < row["mean"] < row["hi"] and row["n"] == 80
    assert row["mean"] == pytest.approx(v.mean())
    v[0, 0] = np.nan
    assert bootstrap_mean(v, seed=5)["n"] == 79
    assert np.isnan(bootstrap_mean(np.full((2, 2), np.nan), seed=0)["mean"])
    c = np.array([[1.0, 2.0], [0.0, np.nan]])
    b = np.array([[0.0, 2.0], [1.0, 1.0]])
    w = paired_win_rate(c, b, seed=0)
    assert (w["wins"], w["ties"], w["losses"], w["pairs"]) == (1, 1, 1, 3)
    assert w["win_rate"] == pytest.approx(0.5)


def test_bad_input_is_refused_before_the_model_loads(inputs, tmp_path, capsys, monkeypatch):
    _no_model_load(monkeypatch)
    argv = inputs["argv"]

    def fails(args: list[str], match: str) -> None:
        assert main(args) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and err.startswith("flowgrpo-eval: error: "), err
        assert re.search(match, err), err

    out = ["--output-dir", str(tmp_path / "o")]
    i = argv.index("--scorer")
    fails(argv[:i] + argv[i + 2:] + out, "--scorer is required")
    fails(argv + ["--scorer", "colr"] + out, "colr")
    j = argv.index("--eval-prompt-data")
    fails(argv[:j + 2] + argv[j + 3:] + out, "--eval-prompt-data takes NAME PATH pairs")
    fails(argv + ["--eval-prompt-data", "../x", str(inputs["prompts"])] + out, "name '../x'")
    fails(argv + ["--candidate", "base", str(tmp_path)] + out, "--candidate name 'base'")
    fails(argv + ["--candidate", "odd", str(tmp_path)] + out, "--candidate odd: .*neither a PEFT adapter")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "x", "images": ["/etc/hostname"], "metadata": {"task": "t2i"}}\n')
    k = argv.index(str(inputs["prompts"]))
    fails(argv[:k] + [str(bad)] + argv[k + 1:] + out, "bad.jsonl")
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "report.json").write_text("{}")
    fails(argv + ["--output-dir", str(tmp_path / "used")], "already holds files .*--overwrite")


def test_one_rank_scores_are_the_trainer_eval_calls(one_rank, inputs, tiny_model_dir):
    """The base's scores equal what Trainer.evaluate's own call gives at world size 1 (one
    generate_rollout of the whole set, eval=True, the engine chunking it by the same batch size),
    to the bit."""
    import torch

    from trainer.data import PromptDataset
    from trainer.engine.native import NativeEngine
    from trainer.loop import _scorer_inputs
    from trainer.models.qwen_image import QwenImageAdapter
    from trainer.rewards.manager import RewardManager
    from trainer.rollout import generate_rollout
    from trainer.sampling import parse_sampling_config

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        adapter = QwenImageAdapter()
        engine = NativeEngine(str(tiny_model_dir), device="cpu", dtype="fp32", max_batch_size=4, adapter=adapter)
        report = json.loads((one_rank / "report.json").read_text())
        sampling = parse_sampling_config(report["settings"]["sampling_config"])
        records = PromptDataset.from_jsonl(inputs["prompts"], task="t2i").records
        out = generate_rollout(engine, adapter, records, rollout_id=0, sampling=sampling, group_size=3,
                               generation_seed=1234, artifact_root=None, eval=True)
        scores = RewardManager("cpu", "color").score(*_scorer_inputs(out.trajectory)).components["color"]
    finally:
        torch.set_num_threads(threads)
    got = [r["scores"]["base"]["color"] for r in report["sets"]["held_out"]["per_prompt"]]
    assert np.array(got).ravel().tolist() == scores.double().tolist()


def test_an_edit_set_shows_each_source_beside_its_edits(tmp_path):
    """i2i: the grid's rows start with the source image the edits were conditioned on, and the
    edit scorers get the sources' pixels, as in training."""
    from PIL import Image

    from tools.tiny_qwen_image_edit import build_tiny_qwen_image_edit_pipeline

    model = build_tiny_qwen_image_edit_pipeline(tmp_path / "model", seed=0, variant="2511")
    for name, colour in (("red", (220, 30, 30)), ("blue", (30, 30, 220))):
        im = Image.new("RGB", (40, 40), (240, 240, 240))
        im.paste(Image.new("RGB", (20, 20), colour), (10, 10))
        im.save(tmp_path / f"{name}.png")
    prompts = tmp_path / "edits.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": "<image> make the square green", "images": [f"{n}.png"],
                                           "metadata": {"task": "i2i", "sample_id": n}}) + "\n"
                               for n in ("red", "blue")))
    out = tmp_path / "report"
    assert main(["--model-path", str(model), "--eval-prompt-data", "edits", str(prompts), "--scorer", "color_edit",
                 "--sampling-config", SMALL, "--n-samples-per-prompt", "2", "--output-dir", str(out)]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["settings"]["task"] == "i2i"
    assert {"color_edit", "edit_color", "edit_preserve"} <= set(report["sets"]["edits"]["summary"]["base"])
    grid = np.asarray(Image.open(out / "grid_edits_base.png").convert("RGB")).astype(int)
    for colour in ((220, 30, 30), (30, 30, 220)):  # each source's square is drawn in its row
        assert (np.abs(grid - np.array(colour)).sum(axis=-1) < 10).sum() > 100, colour
    assert "![edits: the base](grid_edits_base.png)" in (out / "report.md").read_text()


def test_a_video_set_draws_frame_strips(tmp_path):
    """t2v: every sample is an animated WebP beside the report and a strip of frames in the grid."""
    from PIL import Image

    from tools.tiny_wan import build_tiny_wan_pipeline

    model = build_tiny_wan_pipeline(tmp_path / "model", seed=0)
    prompts = tmp_path / "clips.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p, "metadata": {"task": "t2v", "sample_id": str(i)}}) + "\n"
                               for i, p in enumerate(["a red ball", "a green box"])))
    out = tmp_path / "report"
    assert main(["--model-path", str(model), "--eval-prompt-data", "clips", str(prompts),
                 "--scorer", "temporal_consistency", "--n-samples-per-prompt", "2", "--output-dir", str(out),
                 "--sampling-config", '{"height": 32, "width": 32, "num_frames": 5, "num_inference_steps": 4}']) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["settings"]["sampling_config"]["num_frames"] == 5
    assert report["sets"]["clips"]["summary"]["base"]["temporal_consistency"]["n"] == 4
    assert len(list((out / "artifacts" / "base" / "clips").glob("*.webp"))) == 4
    with Image.open(out / "grid_clips_base.png") as grid:
        assert grid.width > 2 * 4 * 32  # two samples, each a strip of several frames


def test_a_recipe_gives_the_eval_settings(inputs, tiny_model_dir, tmp_path):
    """--config: the recipe's model, eval sets, sampling config, samples per eval prompt, seed,
    engine batch and scorer are the defaults; a flag given beside it wins."""
    from tests.workers.recipes import tiny_recipe

    recipe = tmp_path / "recipe.toml"
    recipe.write_text(tiny_recipe(tiny_model_dir, inputs["prompts"], extra=f"""
reward-scorer-path = "color"
eval-prompt-data = ["held_out", "{inputs['prompts']}"]
n-samples-per-eval-prompt = 2
generation-seed = 7
engine-batch-size = 3
"""))
    out = tmp_path / "report"
    assert main(["--config", str(recipe), "--output-dir", str(out), "--generation-seed", "8"]) == 0
    st = json.loads((out / "report.json").read_text())["settings"]
    assert st["sampling_config"]["sde_indices"] == [1, 2] and st["sampling_config"]["eta"] == 1.0
    assert (st["n_samples_per_prompt"], st["generation_seed"], st["engine_batch_size"]) == (2, 8, 3)
    assert st["scorers"] == [{"scorer": "trainer.rewards.color.ColorScorer", "model_path": None}]
    assert st["engine_dtype"] == "fp32" and st["engine_options"] == {}  # the recipe's replay dtype


def test_overwrite_replaces_a_report_with_the_same_bytes(one_rank, inputs):
    """A second run of the same settings replaces the report only with --overwrite, and writes it
    byte for byte again: seeds, batches and the bootstrap are all pinned."""
    import torch

    before = (one_rank / "report.json").read_bytes()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert main(inputs["argv"] + ["--output-dir", str(one_rank), "--overwrite"]) == 0
    finally:
        torch.set_num_threads(threads)
    assert (one_rank / "report.json").read_bytes() == before
    assert not list(one_rank.parent.glob(".out1.partial-*"))

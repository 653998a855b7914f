"""Bounds of the data tools and the model / adapter loaders against hostile or broken input,
driven through the public commands: a parquet cell that decompresses to hundreds of MB, a prompt
longer than the trainer takes, media paths naming /proc files or FIFOs, adapter configs whose rank
or alpha would allocate without bound or sample NaN, and a Wan model index that would drop an
expert. Each must end in a clear message (exit 2), in bounded memory and time, nothing written."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable

#: runs argv[1:] and prints the child's peak RSS in KiB (ru_maxrss of the waited-for children: only
#: the tool, not this test process nor the one that wrote the input)
PEAK_RSS = """import json, resource, subprocess, sys
p = subprocess.run(sys.argv[1:], capture_output=True, text=True)
print(json.dumps({"rc": p.returncode, "out": p.stdout, "err": p.stderr,
                  "rss_kib": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss}))"""


def tool(name: str, *args, timeout: float = 60, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([PY, str(REPO / "tools" / name), *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd or REPO)


def tool_peak_rss(name: str, *args, timeout: float = 120) -> dict:
    p = subprocess.run([PY, "-c", PEAK_RSS, PY, str(REPO / "tools" / name), *map(str, args)], capture_output=True,
                       text=True, timeout=timeout, cwd=REPO)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def write_parquet(path: Path, prompts_code: str, row_group_size: int | None = None) -> None:
    """A parquet file with a "prompt" column of the list `prompts_code` evaluates to, written by a
    child process so the big string it may hold never counts against this test's memory."""
    code = ("import pyarrow as pa, pyarrow.parquet as pq, sys\n"
            f"pq.write_table(pa.table({{'prompt': {prompts_code}}}), sys.argv[1], compression='zstd', "
            f"row_group_size={row_group_size!r})")
    subprocess.run([PY, "-c", code, str(path)], check=True, timeout=120)


# ------------------------------------------------------------------------------ prepare_data


def test_prepare_data_parquet_huge_cell_is_refused_from_metadata_in_bounded_memory(tmp_path):
    """A 128 MiB cell (a few KB on disk) among small rows: refused from the row group's metadata
    before it is read (--max-parquet-chunk-mb 64), naming the file and rows; the tool's peak RSS
    stays near an idle interpreter with pyarrow, far below the cell (reading it took 4.5x the cell)."""
    src = tmp_path / "huge.parquet"
    write_parquet(src, "['a cat'] * 100 + ['x' * (128 << 20)] + ['a dog'] * 100")
    assert src.stat().st_size < 1 << 20
    out = tmp_path / "out.jsonl"
    r = tool_peak_rss("prepare_data.py", "--source", "prompts", "--input", src, "--output", out,
                      "--max-parquet-chunk-mb", "64")
    assert r["rc"] == 2, r
    assert f"{src}:rows 0-200: column 'prompt' holds" in r["err"] and "--max-parquet-chunk-mb" in r["err"], r["err"]
    assert "Traceback" not in r["err"]
    assert r["rss_kib"] < 200 << 10, f"peak RSS {r['rss_kib'] >> 10} MiB for a refused 128 MiB cell"
    assert not out.exists() and not list(tmp_path.glob("out.jsonl*"))


def test_prepare_data_parquet_row_group_of_oversized_rows_is_refused_at_default_bound(tmp_path):
    """A row group whose rows average more than a prompt line may hold (1 MiB): refused at the
    default bound, before reading, naming the row; the pickapic route too."""
    src = tmp_path / "one.parquet"
    write_parquet(src, "['x' * (48 << 20)]")
    out = tmp_path / "out.jsonl"
    for source in ("prompts", "pickapic"):
        r = tool_peak_rss("prepare_data.py", "--source", source, "--input", src, "--output", out,
                          *(["--column", "prompt"] if source == "pickapic" else []))
        assert r["rc"] == 2, r
        assert f"{src}:row 0: column 'prompt' holds" in r["err"] and "1048576 bytes a row" in r["err"], r["err"]
        assert r["rss_kib"] < 200 << 10, r["rss_kib"]
        assert not out.exists()


def test_prepare_data_edit_parquet_huge_cells_are_refused_from_metadata(tmp_path):
    """The edit route's parquet: a 48 MiB instruction or a 96 MiB "image" (KBs on disk) is refused
    from the row group's metadata before it is decoded, naming the row; memory stays bounded."""
    src = tmp_path / "pairs.parquet"
    png = b"\x89PNG\r\n\x1a\n"
    cases = {"instruction": (f"{{'instruction': ['x' * (48 << 20)], 'image': [{png!r} + bytes(64)]}}",
                             "column 'instruction' holds", "1048576 bytes a row"),
             "image": (f"{{'instruction': ['make it red'], 'image': [{png!r} + bytes(96 << 20)]}}",
                       "column 'image' holds", "67108864 bytes a row")}
    for name, (table, column, limit) in cases.items():
        code = ("import pyarrow as pa, pyarrow.parquet as pq, sys\n"
                f"pq.write_table(pa.table({table}), sys.argv[1], compression='zstd')")
        subprocess.run([PY, "-c", code, str(src)], check=True, timeout=120)
        r = tool_peak_rss("prepare_data.py", "--source", "edit", "--task", "i2i", "--input", src, "--output",
                          tmp_path / "out.jsonl")
        assert r["rc"] == 2, (name, r)
        assert f"{src}:row 0: {column}" in r["err"] and limit in r["err"], (name, r["err"])
        assert r["rss_kib"] < 200 << 10, (name, r["rss_kib"])
        assert not (tmp_path / "out.jsonl").exists() and not (tmp_path / "media").exists()


def test_prepare_data_prompt_over_the_trainer_limit_is_refused_in_every_prompt_route(tmp_path):
    """The trainer's 10,000-character prompt limit holds in prepare_data's parquet, JSONL and text
    routes: the row is named, nothing is written (the output keeps what it held)."""
    long = "word " * 2500  # 12,499 characters after normalisation
    (tmp_path / "p.txt").write_text(f"a short one\n{long}\n")
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "short"}) + "\n" + json.dumps({"prompt": long}) + "\n")
    write_parquet(tmp_path / "p.parquet", f"['short', {long!r}]")
    out = tmp_path / "out.jsonl"
    out.write_text("kept\n")
    for name, where in (("p.txt", ":2:"), ("p.jsonl", ":2:"), ("p.parquet", ":row 1:")):
        r = tool("prepare_data.py", "--source", "prompts", "--input", tmp_path / name, "--output", out)
        assert r.returncode == 2, r.stderr
        assert f"{tmp_path / name}{where} the prompt has 12499 characters, more than the 10000" in r.stderr, r.stderr
        assert out.read_text() == "kept\n"


def test_prepare_data_edit_record_line_over_the_reader_limit_is_refused(tmp_path):
    """An edit record whose line would pass 1 MiB (1,100 sources under a long relative path, within
    the prompt limit) is refused naming its row, not written: every line prepare_data writes is
    one the readers accept."""
    from PIL import Image

    deep = tmp_path.joinpath(*["d" * 250] * 4)  # the sources' directory, far from the output's
    deep.mkdir(parents=True)
    Image.new("RGB", (8, 8)).save(deep / "src.png")
    data = tmp_path / "pairs.jsonl"
    data.write_text(json.dumps({"instruction": "make it red", "image": ["src.png"] * 1100}) + "\n")
    out = tmp_path / "out.jsonl"
    r = tool("prepare_data.py", "--source", "edit", "--task", "i2i", "--input", data, "--output", out,
             "--media-root", deep)
    assert r.returncode == 2 and f"{data}:1: its record would be a line of" in r.stderr, r.stderr
    assert not out.exists()


# ------------------------------------------------------------------------------ media files


def _fifo(path: Path) -> Path:
    os.mkfifo(path)
    return path


def _media_root_flag(name: str) -> list[str]:
    """`--media-root /` where the tool has it (media outside the prompt file's directory need it)."""
    return ["--media-root", "/"] if "--media-root" in tool(name, "--help").stdout else []


@pytest.mark.skipif(not Path("/proc/self/pagemap").exists(), reason="needs Linux /proc")
def test_inspect_data_refuses_proc_files_fifos_and_directories_as_media(tmp_path):
    """/proc/self/pagemap (hashed for minutes before), /proc/self/mem (a traceback before), a FIFO
    (would block) and a directory: each an error naming the file:line and what it is; the run ends
    in seconds, exit 2."""
    _fifo(tmp_path / "pipe.png")
    (tmp_path / "dir.png").mkdir()
    refs = ["/proc/self/pagemap", "/proc/self/mem", "pipe.png", "dir.png"]
    lines = [{"prompt": "<image> make it red", "images": [ref], "metadata": {"task": "i2i", "sample_id": f"s{i}"}}
             for i, ref in enumerate(refs)]
    data = tmp_path / "edit.jsonl"
    data.write_text("".join(json.dumps(x) + "\n" for x in lines))
    r = tool("inspect_data.py", "--train", data, "--decode-media", *_media_root_flag("inspect_data.py"), timeout=30)
    assert r.returncode == 2, r.stdout + r.stderr
    report = r.stdout + r.stderr
    assert "Traceback" not in report
    for line, name in ((1, "pagemap"), (2, "mem")):  # the path as named, or /proc/<pid>/ resolved
        assert re.search(rf"{re.escape(str(data))}:{line}: images file '/proc/self/{name}': /proc/\w+/{name} is a "
                         r"kernel pseudo-file \(/proc or /sys\), not a media file", report), report
    fifo, folder = tmp_path / "pipe.png", tmp_path / "dir.png"
    assert f"{data}:3: images file 'pipe.png': {fifo} is a FIFO (named pipe), not a regular file" in report
    assert f"{data}:4: images file 'dir.png': {folder} is a directory, not a regular file" in report


def test_curate_data_refuses_a_fifo_named_as_media_without_hanging(tmp_path):
    """curate_data hashes media for its dedup key: a FIFO named as a record's image is an error
    naming the file:line (with and without --no-check-media), never opened; exit 2 in seconds."""
    _fifo(tmp_path / "pipe.png")
    data = tmp_path / "edit.jsonl"
    data.write_text(json.dumps({"prompt": "<image> make it red", "images": ["pipe.png"],
                                "metadata": {"task": "i2i", "sample_id": "s0"}}) + "\n")
    for extra in ([], ["--no-check-media"]):
        r = tool("curate_data.py", "--input", data, "--output-dir", tmp_path / "out", "--eval-size", "1", *extra,
                 timeout=30)
        assert r.returncode == 2, r.stdout + r.stderr
        assert f"{data}:1: media file 'pipe.png': {tmp_path / 'pipe.png'} is a FIFO" in r.stderr, r.stderr
        assert not (tmp_path / "out" / "train.jsonl").exists()


@pytest.mark.skipif(not Path("/proc/self/pagemap").exists(), reason="needs Linux /proc")
def test_curate_data_refuses_proc_files_as_media(tmp_path):
    data = tmp_path / "edit.jsonl"
    data.write_text(json.dumps({"prompt": "<image> make it red", "images": ["/proc/self/pagemap"],
                                "metadata": {"task": "i2i", "sample_id": "s0"}}) + "\n")
    r = tool("curate_data.py", "--input", data, "--output-dir", tmp_path / "out", "--eval-size", "1",
             *_media_root_flag("curate_data.py"), timeout=30)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "/proc/self/pagemap" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_prepare_data_edit_refuses_a_fifo_source_path(tmp_path):
    """prepare_data --source edit hashes each source path it keeps: a FIFO is refused naming the
    row, not waited on."""
    _fifo(tmp_path / "pipe.png")
    data = tmp_path / "pairs.jsonl"
    data.write_text(json.dumps({"instruction": "make it red", "image": "pipe.png"}) + "\n")
    r = tool("prepare_data.py", "--source", "edit", "--task", "i2i", "--input", data, "--output",
             tmp_path / "out.jsonl", timeout=30)
    assert r.returncode == 2, r.stdout + r.stderr
    assert f"{data}:1: source image 'pipe.png'" in r.stderr and "is a FIFO" in r.stderr, r.stderr
    assert not (tmp_path / "out.jsonl").exists()


def test_prepare_data_pickapic_refuses_a_fifo_among_its_parquet_files(tmp_path):
    """--source pickapic searches a directory for *.parquet: a FIFO named like one is refused
    naming it (opening it would wait for a writer forever)."""
    (tmp_path / "pick").mkdir()
    write_parquet(tmp_path / "pick" / "a.parquet", "['a cat']")
    _fifo(tmp_path / "pick" / "b.parquet")
    r = tool("prepare_data.py", "--source", "pickapic", "--input", tmp_path / "pick", "--column", "prompt",
             "--output", tmp_path / "out.jsonl", timeout=30)
    assert r.returncode == 2 and f"{tmp_path / 'pick' / 'b.parquet'} is not a regular file" in r.stderr, r.stderr
    assert not (tmp_path / "out.jsonl").exists()


def test_score_refuses_a_fifo_or_proc_link_in_the_images_folder(tmp_path):
    """tools/score.py --images: a FIFO named like an image, or a link to /proc/self/mem, is an
    error naming it before any scorer loads, not a hang or a traceback."""
    images = tmp_path / "imgs"
    images.mkdir()
    _fifo(images / "a.png")
    r = tool("score.py", "--reward-scorer-path", "color", "--images", images, timeout=60)
    assert r.returncode == 2 and f"{images / 'a.png'} is a FIFO (named pipe)" in r.stderr, r.stderr
    if Path("/proc/self/mem").exists():
        (images / "a.png").unlink()
        (images / "b.png").symlink_to("/proc/self/mem")
        r = tool("score.py", "--reward-scorer-path", "color", "--images", images, timeout=60)
        assert r.returncode == 2 and "kernel pseudo-file" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_score_refuses_a_fifo_or_proc_file_named_as_a_source_image(tmp_path):
    """tools/score.py with an edit scorer reads each prompt line's metadata.source_images: a FIFO
    beside the prompt file, or /proc/self/mem under --media-root /, is an error naming the image
    and the source before the scorer loads, never opened."""
    from PIL import Image

    images = tmp_path / "imgs"
    images.mkdir()
    Image.new("RGB", (8, 8), "red").save(images / "a.png")
    _fifo(tmp_path / "pipe.png")
    prompts = tmp_path / "p.jsonl"
    for source, extra, what in (("pipe.png", [], f"{tmp_path / 'pipe.png'} is a FIFO (named pipe)"),
                                ("/proc/self/mem", ["--media-root", "/"], "kernel pseudo-file")):
        prompts.write_text(json.dumps({"prompt": "<image> make it red",
                                       "metadata": {"source_images": [source], "target_color": "red"}}) + "\n")
        r = tool("score.py", "--reward-scorer-path", "color_edit", "--images", images, "--prompt-data", prompts,
                 *extra, timeout=60)
        assert r.returncode == 2, r.stdout + r.stderr
        assert f"a.png: source image {source!r}: " in r.stderr and what in r.stderr, r.stderr
        assert "Traceback" not in r.stderr


# ------------------------------------------------------------------------------ adapter directories

SMALL = json.dumps({"height": 64, "width": 64, "num_inference_steps": 4, "eta": 0.7, "sde_indices": [1, 2]})


def _prompts(path: Path) -> Path:
    path.write_text(json.dumps({"prompt": "a red panda", "metadata": {"task": "t2i", "sample_id": "p0"}}) + "\n")
    return path


def _adapter(model_dir: Path, out: Path, rank: int = 4, config: dict | None = None) -> Path:
    """A PEFT adapter directory of the tiny Qwen-Image model (peft's own layers, nonzero B), with
    adapter_config.json's fields replaced by `config`'s."""
    import torch
    from peft import LoraConfig, get_peft_model_state_dict
    from safetensors.torch import save_file

    from trainer.models.qwen_image import QwenImageAdapter

    adapter = QwenImageAdapter()
    model = adapter.load_train_model(str(model_dir), dtype=torch.float32)
    model.add_adapter(LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(adapter.lora_target_modules)))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.5)
    state = {f"base_model.model.{k}": v.contiguous() for k, v in get_peft_model_state_dict(model).items()}
    out.mkdir(parents=True)
    save_file(state, str(out / "adapter_model.safetensors"))
    cfg = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(adapter.lora_target_modules),
           "use_dora": False, "use_rslora": False, "rank_pattern": {}, "alpha_pattern": {}, "bias": "none"}
    (out / "adapter_config.json").write_text(json.dumps({**cfg, **(config or {})}))
    return out


def test_sample_refuses_a_huge_rank_before_the_model_loads_in_bounded_memory(tmp_path, tiny_model_dir):
    """r = 1e8 (19 GB allocated before the rank was checked): exit 2 naming the file and the field,
    before the model loads; the process stays small."""
    lora = _adapter(tiny_model_dir, tmp_path / "lora", config={"r": 100_000_000})
    r = tool_peak_rss("sample.py", "--model-path", tiny_model_dir, "--prompt-data", _prompts(tmp_path / "p.jsonl"),
                      "--output", tmp_path / "out", "--sampling-config", SMALL, "--lora", lora)
    assert r["rc"] == 2, r
    assert f"{lora / 'adapter_config.json'}: r is 100000000: it must be in [1, 8192]" in r["err"], r["err"]
    assert "Traceback" not in r["err"] and not (tmp_path / "out").exists()
    assert r["rss_kib"] < 1500 << 10, r["rss_kib"]


def test_sample_refuses_adapter_configs_it_would_misload(tmp_path, tiny_model_dir, monkeypatch, capsys):
    """r = Infinity (a traceback before), lora_alpha = NaN (black images with exit 0 before), a
    float rank, a DoRA or rsLoRA adapter, a regex target string, a config that is not an object:
    each exit 2 naming adapter_config.json and the field, before the model loads."""
    from tools.sample import main
    from trainer.engine import native

    def refuse(*a, **k):
        raise AssertionError("the model was loaded before the adapter config was checked")

    monkeypatch.setattr(native.NativeEngine, "__init__", refuse)
    lora = _adapter(tiny_model_dir, tmp_path / "lora")
    cfg_file = lora / "adapter_config.json"
    good = json.loads(cfg_file.read_text())
    prompts = _prompts(tmp_path / "p.jsonl")
    base = ["--model-path", str(tiny_model_dir), "--prompt-data", str(prompts), "--output", str(tmp_path / "out"),
            "--sampling-config", SMALL, "--lora", str(lora)]
    cases = [({"r": float("inf")}, "r is Infinity: it must be a whole number"),
             ({"lora_alpha": float("nan")}, "lora_alpha is NaN: it must be a finite number > 0"),
             ({"lora_alpha": -8}, "lora_alpha is -8: it must be a finite number > 0"),
             ({"r": 4.0}, "r is 4.0: it must be a whole number"),
             ({"use_dora": True}, "use_dora is true (a DoRA adapter"),
             ({"use_rslora": True}, "use_rslora is true (rank-stabilised scaling"),
             ({"rank_pattern": {"transformer_blocks.0.attn.to_q": 64}}, "rank_pattern is"),
             ({"target_modules": ".*to_q"}, "target_modules is \".*to_q\": it must be a non-empty list"),
             ({"peft_type": "IA3"}, "peft_type is \"IA3\"")]
    for change, message in cases:
        cfg_file.write_text(json.dumps({**good, **change}))  # NaN / Infinity as Python's json writes them
        assert main(base) == 2, change
        err = capsys.readouterr().err
        assert f"--lora {lora}: {cfg_file}: " in err and message in err and "Traceback" not in err, (change, err)
    cfg_file.write_text("[4, 8]")
    assert main(base) == 2
    assert f"{cfg_file} holds a JSON list, not an object" in capsys.readouterr().err


def test_sample_refuses_an_adapter_whose_tensors_disagree_with_its_rank_or_the_model(tmp_path, tiny_model_dir,
                                                                                      capsys):
    """The engine checks the tensors' rank (from the safetensors header) against r, and r against
    the width of the layers it targets, before peft allocates a layer: exit 2 naming the file, no
    image written."""
    import torch

    from tools.sample import main
    from trainer.engine.native import _narrowest_target
    from trainer.models.qwen_image import QwenImageAdapter

    prompts = _prompts(tmp_path / "p.jsonl")
    base = ["--model-path", str(tiny_model_dir), "--prompt-data", str(prompts), "--sampling-config", SMALL]
    lora = _adapter(tiny_model_dir, tmp_path / "lora", config={"r": 8, "lora_alpha": 16})  # tensors of rank 4
    assert main(base + ["--output", str(tmp_path / "o1"), "--lora", str(lora)]) == 2
    err = capsys.readouterr().err
    assert f"{lora / 'adapter_config.json'} says r = 8 but {lora / 'adapter_model.safetensors'} holds" in err, err
    assert not list((tmp_path / "o1").rglob("*.png"))

    adapter = QwenImageAdapter()
    model = adapter.load_train_model(str(tiny_model_dir), dtype=torch.float32)
    name, width = _narrowest_target(model, adapter.lora_target_modules)
    wide = _adapter(tiny_model_dir, tmp_path / "wide", rank=width + 1)
    assert main(base + ["--output", str(tmp_path / "o2"), "--lora", str(wide)]) == 2
    err = capsys.readouterr().err
    assert f"r = {width + 1} is above the width {width} of the targeted layer {name}" in err, err
    assert not list((tmp_path / "o2").rglob("*.png"))


# ------------------------------------------------------------------------------ Wan model index


@pytest.fixture(scope="module")
def wan22_dir(tmp_path_factory):
    from tools.tiny_wan import TINY_WAN22_BOUNDARY_RATIO, build_tiny_wan_pipeline

    return build_tiny_wan_pipeline(tmp_path_factory.mktemp("wan22") / "model", seed=0,
                                   boundary_ratio=TINY_WAN22_BOUNDARY_RATIO)


def _wan_variant(model_dir: Path, out: Path, index_text: str) -> Path:
    """The tiny two-expert directory (subfolders linked, both experts present) with
    model_index.json replaced by `index_text`."""
    out.mkdir()
    for entry in model_dir.iterdir():
        if entry.is_dir():
            (out / entry.name).symlink_to(entry)
    (out / "model_index.json").write_text(index_text)
    return out


def _wan_index_variants(wan22_dir: Path, tmp_path: Path) -> dict[str, tuple[Path, str]]:
    index = json.loads((wan22_dir / "model_index.json").read_text())
    one_dit = {k: v for k, v in index.items() if k not in ("transformer_2", "boundary_ratio")}
    return {"not-json": (_wan_variant(wan22_dir, tmp_path / "a", json.dumps(index)[:-5]), "is not valid JSON"),
            "a-list": (_wan_variant(wan22_dir, tmp_path / "b", json.dumps([index])),
                       "holds a JSON list, not an object"),
            "expert-undeclared": (_wan_variant(wan22_dir, tmp_path / "c", json.dumps(one_dit)),
                                  "declares no transformer_2, but the directory holds a transformer_2/ expert")}


def test_wan_preflight_names_a_broken_model_index(wan22_dir, tmp_path):
    """configs/wan22_t2v_tiny.toml --preflight-only on the tiny two-expert model whose
    model_index.json does not parse, is a list, or leaves out the transformer_2/ the directory
    holds: exit 2 naming the file (it passed before, and the run loaded one expert of two)."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "a red ball", "metadata": {"task": "t2v", "sample_id": "t0"}}) + "\n")
    for name, (model, message) in _wan_index_variants(wan22_dir, tmp_path).items():
        env = {**os.environ, "TINY_WAN22": str(model), "PROMPTS": str(prompts)}
        r = subprocess.run([PY, "-m", "trainer.train", "--config", str(REPO / "configs" / "wan22_t2v_tiny.toml"),
                            "--save", str(tmp_path / "ck"), "--artifact-root", str(tmp_path / "art"),
                            "--num-rollout", "2", "--preflight-only"], capture_output=True, text=True, env=env,
                           cwd=REPO, timeout=120)
        assert r.returncode == 2, (name, r.stdout[-2000:], r.stderr[-2000:])
        out = r.stdout + r.stderr
        assert f"--model-path '{model}'" in out and "model_index.json" in out and message in out, (name, out[-3000:])


def test_wan_loader_and_sample_never_drop_an_expert(wan22_dir, tmp_path):
    """The loader itself refuses each broken index (never the one-DiT path), and tools/sample.py
    names the file (exit 2) before the model loads."""
    from trainer.models.wan import load_wan_transformer

    variants = _wan_index_variants(wan22_dir, tmp_path)
    for name, (model, message) in variants.items():
        with pytest.raises(ValueError, match="model_index.json") as e:
            load_wan_transformer(model)
        assert message in str(e.value), (name, str(e.value))
    model, message = variants["not-json"]
    r = tool("sample.py", "--model-path", model, "--prompt-data", _prompts(tmp_path / "p.jsonl"),
             "--output", tmp_path / "out", timeout=120)
    assert r.returncode == 2 and f"{model / 'model_index.json'} {message}" in r.stderr, r.stderr
    assert not (tmp_path / "out").exists()


def test_train_preflight_refuses_a_lora_rank_beyond_any_layer(tmp_path):
    """--lora-rank 100000000 would make peft allocate rank x width per layer at start-up: the
    trainer's preflight names it (exit 2) before anything loads."""
    models, data = tmp_path / "models", tmp_path / "data" / "processed" / "t2i"
    (models / "Qwen-Image").mkdir(parents=True)
    (models / "PickScore_v1").mkdir()
    data.mkdir(parents=True)
    for name in ("pickapic_train", "pickapic_eval256"):
        _prompts(data / f"{name}.jsonl")
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK")}
    env.update(MODEL_DIR=str(models), DATA_DIR=str(tmp_path / "data"), EXP_DIR=str(tmp_path / "exp"))
    r = subprocess.run([PY, "-m", "trainer.train", "--config", str(REPO / "configs" / "qwen_image_t2i_lora_8gpu.toml"),
                        "--preflight-only", "--lora-rank", "100000000"], capture_output=True, text=True, env=env,
                       cwd=REPO, timeout=120)
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    assert "--lora-rank 100000000 is above 8192" in r.stderr, r.stderr

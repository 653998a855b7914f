"""Every tool in tools/ behaves alike on the command line: --help shows the defaults, --version
works, a missing input is one `<tool>: error: ...` line naming it with exit 2 (no traceback),
and the old flag spellings still parse. In-process (main(argv)), so the whole file takes
seconds; one subprocess per tool checks the script form imports this checkout's trainer."""

from __future__ import annotations

import argparse
import configparser
import importlib
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# tool module -> the console script its usage line and errors name (setup.cfg)
TOOLS = {
    "sample": "flowgrpo-sample", "score": "flowgrpo-score", "export_checkpoint": "flowgrpo-export",
    "prepare_data": "flowgrpo-prepare-data", "curate_data": "flowgrpo-curate-data",
    "inspect_data": "flowgrpo-inspect-data", "make_tiny_model": "flowgrpo-make-tiny-model",
    "plot_rewards": "flowgrpo-plot-rewards", "reward_server": "flowgrpo-reward-server", "bench": "flowgrpo-bench",
    "evaluate": "flowgrpo-eval",
}


def _run(module: str, argv: list[str], capsys) -> tuple[int, str, str]:
    main = importlib.import_module(f"tools.{module}").main
    try:
        code = main(argv)
    except SystemExit as e:  # argparse exits from parse_args
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


def _one_line_error(module: str, argv: list[str], capsys, *names: str) -> str:
    code, _, err = _run(module, argv, capsys)
    assert code == 2, (code, err)
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{TOOLS[module]}: error: "), err
    for name in names:
        assert name in lines[0], (name, lines[0])
    return lines[0]


def _help(module: str, capsys) -> str:
    code, out, _ = _run(module, ["--help"], capsys)
    assert code == 0
    return out


@pytest.mark.parametrize("module", sorted(TOOLS))
def test_help_shows_every_default_and_version(module, capsys):
    text = _help(module, capsys)
    flat = " ".join(text.split())
    # every flag with a real default names it; argparse's help wraps lines, so compare flattened
    parser = _build_parser(module)
    shown = 0
    for action in parser._actions:
        if action.required or action.default in (None, False, argparse.SUPPRESS) or not action.option_strings:
            continue
        if isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
            continue
        default = action.default if not isinstance(action.default, Path) else str(action.default)
        assert f"(default: {default})" in flat, (action.option_strings, default)
        shown += 1
    assert shown > 0 or module in ("inspect_data",), f"{module}: no default shown at all"
    code, out, _ = _run(module, ["--version"], capsys)
    assert code == 0 and re.fullmatch(r"flowgrpo-trainer \d+\.\d+\.\d+\S*", out.strip()), out


def _build_parser(module: str) -> argparse.ArgumentParser:
    """The tool's parser, captured by running its main with --help under a patched parse_args."""
    import trainer.cli as cli

    captured: list[argparse.ArgumentParser] = []
    real = cli.ToolParser.parse_args

    def grab(self, *a, **kw):
        captured.append(self)
        raise SystemExit(0)

    cli.ToolParser.parse_args = grab
    try:
        try:
            importlib.import_module(f"tools.{module}").main(["--help"])
        except SystemExit:
            pass
    finally:
        cli.ToolParser.parse_args = real
    assert captured, f"tools/{module}.py does not build its parser with trainer.cli.tool_parser"
    return captured[0]


def test_missing_inputs_are_one_line_errors(tmp_path, capsys):
    nowhere = str(tmp_path / "nowhere")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "a red ball", "metadata": {"task": "t2i"}}) + "\n")
    images = tmp_path / "images"
    images.mkdir()
    cases = [
        ("sample", ["--model-path", nowhere, "--prompt-data", str(prompts), "--output-dir", str(tmp_path / "o")],
         ("--model-path", nowhere)),
        ("sample", ["--model-path", str(tmp_path), "--prompt-data", nowhere, "--output-dir", str(tmp_path / "o")],
         ("--prompt-data", nowhere)),
        ("score", ["--reward-scorer-path", "color", "--images", nowhere], ("--images", nowhere)),
        ("score", ["--images", str(images)], ("--reward-scorer-path",)),
        ("score", ["--reward-scorer-path", "color", "--images", str(images)], ("--images", "no image files")),
        ("score", ["--reward-scorer-path", "no_such_scorer", "--images", str(images), "--prompt-data", str(prompts)],
         ("--images",)),
        ("export_checkpoint", ["--save-dir", nowhere, "--output-dir", str(tmp_path / "x")], ("--save-dir", nowhere)),
        ("export_checkpoint", ["--save-dir", str(tmp_path), "--output-dir", str(tmp_path / "x")],
         ("--save-dir", "has no t2i/")),
        ("prepare_data", ["--source", "prompts", "--input", nowhere, "--output", str(tmp_path / "o.jsonl")],
         ("--input", nowhere)),
        ("curate_data", ["--input", nowhere, "--output-dir", str(tmp_path / "c")], ("--input", nowhere)),
        ("inspect_data", ["--train", str(prompts), "--eval", nowhere], ("--eval", nowhere)),
        ("plot_rewards", ["--tensorboard-dir", nowhere, "--output", str(tmp_path / "c.png")],
         ("--tensorboard-dir", nowhere)),
        ("plot_rewards", ["--tensorboard-dir", str(images), "--output", str(tmp_path / "c.png")],
         ("no TensorBoard event files",)),
        ("reward_server", ["--reward-scorer-path", "color", "--reward-model-path", nowhere],
         ("--reward-model-path", nowhere)),
        ("reward_server", ["--reward-scorer-path", "no_such_scorer", "--port", "0"], ("--reward-scorer-path",)),
        ("make_tiny_model", [], ("--output-dir",)),
        ("bench", ["--micro-batch-size", "3"], ("--micro-batch-size",)),
    ]
    for module, argv, names in cases:
        _one_line_error(module, argv, capsys, *names)


def test_old_flag_spellings_still_parse(tmp_path, capsys):
    """Each alias lands in the same place as the canonical flag (the last of them wins)."""
    pairs = {
        "sample": (["--model-path", str(tmp_path), "--prompt-data", __file__, "--output-dir", "first"],
                   [("--output", "--output-dir", "output_dir", "o"), ("--artifact-root", "--output-dir", "output_dir", "o"),
                    ("--max-batch-size", "--engine-batch-size", "engine_batch_size", "3"),
                    ("--generation-task", "--task", "task", "t2i")]),
        "score": (["--images", str(tmp_path), "--reward-scorer-path", "color"],
                  [("--batch-size", "--reward-batch-size", "batch_size", "3")]),
        "curate_data": (["--input", __file__], [("--out-dir", "--output-dir", "output_dir", "o")]),
        "make_tiny_model": ([], [("--output", "--output-dir", "output_dir", "o")]),
        "bench": ([], [("--out", "--output", "out", "o"), ("--max-batch", "--engine-batch-size", "max_batch", "3"),
                       ("--micro-batch", "--micro-batch-size", "micro_batch", "2"),
                       ("--num-updates", "--num-updates-per-batch", "num_updates", "2"),
                       ("--bucket-mb", "--weight-sync-bucket-size-mb", "bucket_mb", "5.0")]),
        "export_checkpoint": (["--output-dir", "o", "--save-dir", str(tmp_path)], [("--save", "--save-dir", "save_dir", str(tmp_path)),
                                                      ("--generation-task", "--task", "task", "t2i")]),
        "prepare_data": (["--source", "prompts", "--input", __file__, "--output", "o"],
                         [("--generation-task", "--task", "task", "t2i")]),
    }
    for module, (base, aliases) in pairs.items():
        parser = _build_parser(module)
        for old, new, dest, value in aliases:
            a = parser.parse_args(base + [old, value])
            b = parser.parse_args(base + [new, value])
            assert getattr(a, dest) == getattr(b, dest) and str(getattr(a, dest)) == value, (module, old, new)


def test_console_scripts_resolve_to_tool_mains():
    """setup.cfg's console scripts name importable callables: what `pip install .` puts on PATH."""
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    scripts = [line.split("=", 1) for line in cfg["options.entry_points"]["console_scripts"].strip().splitlines()]
    assert len(scripts) == len(TOOLS) + 1
    targets = set()
    for name, target in scripts:
        module, func = target.strip().split(":")
        assert callable(getattr(importlib.import_module(module), func)), target
        targets.add(module)
    assert targets == {"trainer.train"} | {f"tools.{m}" for m in TOOLS}


def test_scripts_import_this_checkouts_trainer(tmp_path):
    """Run as `python tools/X.py` from another directory, a tool imports trainer from the checkout
    it lives in, even when PYTHONPATH points at some other trainer package."""
    decoy = tmp_path / "decoy" / "trainer"
    decoy.mkdir(parents=True)
    (decoy / "__init__.py").write_text("raise ImportError('the decoy trainer package was imported')\n")
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(decoy.parent)}
    for module in sorted(TOOLS):
        proc = subprocess.run([sys.executable, str(ROOT / "tools" / f"{module}.py"), "--version"], cwd=tmp_path,
                              env=env, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0 and proc.stdout.startswith("flowgrpo-trainer"), (module, proc.stderr[-2000:])


def test_usage_lines_name_the_console_scripts(capsys):
    """setup.cfg's script names, trainer.cli's map and every --help usage line agree."""
    import trainer.cli as cli

    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    scripts = dict(line.replace(" ", "").split("=", 1)
                   for line in cfg["options.entry_points"]["console_scripts"].strip().splitlines())
    from_cfg = {target.split(":")[0].removeprefix("tools."): name for name, target in scripts.items()
                if target.startswith("tools.")}
    assert cli.CONSOLE_SCRIPTS == from_cfg == TOOLS
    for module in sorted(TOOLS):
        assert _help(module, capsys).startswith(f"usage: {TOOLS[module]} "), module


def test_help_of_the_light_tools_imports_no_torch():
    """--help answers before any heavy import: torch / diffusers / transformers stay unloaded (they
    cost 1-3 s), for every tool whose work does not need them to build its parser."""
    light = ["inspect_data", "curate_data", "prepare_data", "plot_rewards", "score", "demo_grid"]
    code = (
        "import importlib, sys\n"
        f"for m in {light!r}:\n"
        "    try:\n"
        "        importlib.import_module('tools.' + m).main(['--help'])\n"
        "    except SystemExit as e:\n"
        "        assert e.code == 0, (m, e.code)\n"
        "heavy = [h for h in ('torch', 'diffusers', 'transformers') if h in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_quiet_third_party_silences_loading_bars_and_chatter(monkeypatch):
    """One call quietens transformers' and diffusers' bars and warnings; a user's own verbosity
    variable wins."""
    import os
    import warnings

    import transformers.utils.logging as tlog

    import trainer.cli as cli

    def loud() -> None:
        # huggingface_hub warns when its own switch (read once, at import) stays off: that is fine here
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tlog.enable_progress_bar()
        tlog.set_verbosity_warning()

    for k in cli._QUIET_ENV:  # setenv first: undo then restores whatever was there
        monkeypatch.setenv(k, "")
        monkeypatch.delenv(k)
    loud()
    try:
        cli.quiet_third_party()
        assert os.environ["TRANSFORMERS_VERBOSITY"] == "error" and os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] == "1"
        assert not tlog.is_progress_bar_enabled() and tlog.get_verbosity() == tlog.ERROR
        tlog.set_verbosity_warning()
        monkeypatch.setenv("TRANSFORMERS_VERBOSITY", "info")
        cli.quiet_third_party()
        assert tlog.get_verbosity() == tlog.WARNING  # left as the user has it
    finally:
        loud()


def test_make_tiny_model_never_overwrites_without_being_told(tmp_path, capsys):
    """A non-empty --output-dir (say, a real model directory) is refused with nothing changed; a
    file is a one-line error; --overwrite replaces the contents once the new model is complete."""
    real = tmp_path / "real_model"
    (real / "transformer").mkdir(parents=True)
    weights = real / "transformer" / "diffusion_pytorch_model.safetensors"
    weights.write_bytes(b"the real weights")
    before = sorted((p.relative_to(real), p.stat().st_mtime_ns) for p in real.rglob("*"))
    line = _one_line_error("make_tiny_model", ["--output-dir", str(real)], capsys, "--output-dir", str(real),
                           "not empty", "--overwrite")
    assert "nothing was written" in line
    assert sorted((p.relative_to(real), p.stat().st_mtime_ns) for p in real.rglob("*")) == before
    assert weights.read_bytes() == b"the real weights"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["real_model"]  # no staging left either

    a_file = tmp_path / "model.txt"
    a_file.write_text("x")
    _one_line_error("make_tiny_model", ["--output-dir", str(a_file)], capsys, str(a_file), "is a file")
    assert a_file.read_text() == "x"

    code, out, _ = _run("make_tiny_model", ["--output-dir", str(real), "--family", "sd3", "--overwrite"], capsys)
    assert code == 0 and "wrote tiny Stable Diffusion 3.5 pipeline" in out
    assert weights.read_bytes() != b"the real weights" and json.loads((real / "model_index.json").read_text())["_class_name"] == \
        "StableDiffusion3Pipeline"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.txt", "real_model"]
    # the model follows the umask, safetensors' own 0600 included
    from trainer.core.files import dir_mode, file_mode

    assert {oct(p.stat().st_mode & 0o777) for p in real.rglob("*") if p.is_file()} == {oct(file_mode())}
    assert oct(real.stat().st_mode & 0o777) == oct(dir_mode())


@pytest.mark.parametrize("module", ["tiny_wan", "tiny_flux_kontext", "tiny_qwen_image_edit"])
def test_every_tiny_model_command_refuses_a_non_empty_directory(module, tmp_path, capsys):
    """The standalone tiny builders write through make_tiny_model's staging: a real model
    directory is refused untouched, --overwrite replaces it once the new model is complete."""
    real = tmp_path / "real_model"
    (real / "transformer").mkdir(parents=True)
    weights = real / "transformer" / "diffusion_pytorch_model.safetensors"
    weights.write_bytes(b"the real weights")
    code, _, err = _run(module, ["--output-dir", str(real)], capsys)
    assert code == 2 and "Traceback" not in err and "not empty" in err and "--overwrite" in err, err
    assert weights.read_bytes() == b"the real weights" and sorted(p.name for p in tmp_path.iterdir()) == ["real_model"]
    code, out, err = _run(module, ["--output-dir", str(real), "--overwrite"], capsys)
    assert code == 0 and "wrote tiny" in out, err
    assert weights.read_bytes() != b"the real weights" and (real / "model_index.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["real_model"]  # no staging left

"""docs/video.md, docs/editing.md and docs/evaluation.md, run as a newcomer would: every shell command of their code
blocks, in page order, in a fresh directory laid out like the checkout's root (links to its
run.sh, configs/, tools/, .venv), with nothing prepared beforehand. A command that needs real
weights or a GPU is named with its reason instead; every other one must exit 0, and the tiny
recipes must have trained and sampled."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: what starts a shell command in the docs (after VAR=value assignments); any other block line is
#: a flag fragment, a formula or data
COMMANDS = ("python", "bash", "torchrun", "echo", "printf", "mkdir")
#: the recipes a CPU runs in seconds; the others need their real models on 8 devices
TINY_RECIPES = {"configs/wan21_t2v_tiny.toml", "configs/wan22_t2v_tiny.toml", "configs/tiny_cpu_edit.toml"}


def code_blocks(text: str) -> list[str]:
    """The shell code blocks of a markdown page: fenced ones (```bash, ```sh or bare ```) and
    indented ones (4 spaces after a blank line), in page order."""
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("```"):
            lang, body, i = line[3:].strip(), [], i + 1
            while i < len(lines) and not lines[i].startswith("```"):
                body.append(lines[i])
                i += 1
            if lang in ("", "bash", "sh", "shell"):
                blocks.append("\n".join(body))
        elif line.startswith("    ") and (i == 0 or not lines[i - 1].strip()):
            body = []
            while i < len(lines) and (lines[i].startswith("    ") or not lines[i].strip()):
                body.append(lines[i][4:])
                i += 1
            blocks.append("\n".join(body))
            continue
        i += 1
    return blocks


def commands(block: str) -> list[str]:
    """The block's shell commands, continuation lines joined."""
    out, current = [], ""
    for line in block.splitlines():
        current += line.rstrip()
        if current.endswith("\\"):
            current = current[:-1] + " "
            continue
        words = [w for w in current.split() if not re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", w)]
        if words and words[0] in COMMANDS:
            out.append(current.strip())
        current = ""
    return out


def not_run_here(cmd: str) -> str | None:
    """Why `cmd` is not run by this test (None: it is run)."""
    if re.search(r"tools/bench\w*\.py", cmd):
        return "a benchmark: the real shape needs a GPU, the tiny one is tests/test_bench*.py's"
    if "runs/demo/" in cmd:
        return "the demo's run: `bash run.sh demo` first, minutes; tests/test_evaluate.py runs --config on a tiny recipe"
    if "--compare evals/" in cmd:
        return "two reports of runs named for illustration; tests/test_evaluate.py compares two"
    recipe = re.search(r"bash run\.sh train (\S+)", cmd)
    if recipe and recipe.group(1) not in TINY_RECIPES:
        return "a real recipe: its model's weights on 8 devices"
    return None


def run_page(page: str, tmp_path: Path) -> tuple[list[str], str]:
    """Every command of docs/<page> in page order in a checkout-shaped directory; returns the
    commands run and their output."""
    for name in ("run.sh", "configs", "tools", ".venv", "setup.cfg", "pyproject.toml"):
        (tmp_path / name).symlink_to(ROOT / name)
    env = {**os.environ, "PATH": f"{ROOT / '.venv' / 'bin'}:{os.environ.get('PATH', '/usr/bin:/bin')}",
           "OMP_NUM_THREADS": "1"}
    for var in ("PYTHONPATH", "EXP_DIR", "TORCHINDUCTOR_CACHE_DIR", "NPROC"):
        env.pop(var, None)
    ran, log = [], ""
    for block in code_blocks((ROOT / "docs" / page).read_text()):
        for cmd in commands(block):
            if not_run_here(cmd):
                continue
            proc = subprocess.run(["bash", "-c", cmd], cwd=tmp_path, env=env, capture_output=True, text=True,
                                  timeout=600)
            assert proc.returncode == 0, f"docs/{page}: `{cmd}` exited {proc.returncode}:\n" \
                                         f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
            ran.append(cmd)
            log += proc.stdout + proc.stderr
    return ran, log


def test_the_parser_finds_commands_and_names_what_it_skips():
    page = "text\n\n    python a.py \\\n        --x 1\n    --flag fragment\n\n```bash\nA=1 bash run.sh train " \
           "configs/big.toml   # 8 GPUs\necho hi > f\n```\n```json\n{\"a\": 1}\n```\n"
    cmds = [c for b in code_blocks(page) for c in commands(b)]
    assert cmds == ["python a.py      --x 1", "A=1 bash run.sh train configs/big.toml   # 8 GPUs", "echo hi > f"]
    assert [not_run_here(c) is None for c in cmds] == [True, False, True]


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_every_command_of_docs_video_runs_as_written(tmp_path):
    """The tiny Wan2.1 and Wan2.2 recipes train 2 rollouts each (checkpoints, videos), and
    tools/sample.py writes videos with the trained LoRA, from the page's commands alone."""
    ran, log = run_page("video.md", tmp_path)
    assert sum("bash run.sh train configs/wan2" in c for c in ran) == 2 and any("tools/sample.py" in c for c in ran)
    for run in ("wan21-tiny", "wan22-tiny"):
        assert (tmp_path / "runs" / run / "checkpoints" / "t2v" / "iter_0000001" / "COMMITTED").is_file()
        assert list((tmp_path / "runs" / run / "artifacts" / "t2v" / "rollout_0000001").glob("*.webp"))
    assert len(list((tmp_path / "runs" / "wan21-tiny" / "samples" / "t2v" / "rollout_0000000").glob("*.webp"))) == 1
    assert "returned a view tensor" not in log  # FSDP2's warning on Wan's roots: known harmless, silenced
    assert "sampling 5 frames of 32 x 32, 4 steps" in log


def test_every_command_of_docs_editing_runs_as_written(tmp_path):
    """The page's data commands write the records, the tiny edit recipe trains 2 rollouts on
    them, tools/sample.py edits the source with the trained LoRA, the tiny models build."""
    ran, log = run_page("editing.md", tmp_path)
    assert any("bash run.sh train configs/tiny_cpu_edit.toml" in c for c in ran)
    assert sum(c.startswith("python tools/prepare_data.py") for c in ran) == 2
    edit = tmp_path / "runs" / "edit"
    assert (edit / "checkpoints" / "i2i" / "iter_0000001" / "COMMITTED").is_file()
    assert len(list((edit / "samples" / "i2i" / "rollout_0000000").glob("*.png"))) == 4
    assert (tmp_path / "tiny_edit" / "model_index.json").is_file()
    assert (tmp_path / "tiny_kontext" / "model_index.json").is_file()
    assert "inspect_data: OK" in log


def test_every_command_of_docs_evaluation_runs_as_written(tmp_path):
    """The page's tiny example builds two models and a prompt set, evaluates one against the
    other and writes the report, its page and a grid."""
    import json

    ran, _ = run_page("evaluation.md", tmp_path)
    assert any(c.startswith("python tools/evaluate.py") for c in ran)
    report = tmp_path / "evaldemo" / "report"
    data = json.loads((report / "report.json").read_text())
    assert "seed1" in json.dumps(data) and (report / "report.md").is_file() and list(report.rglob("*.png"))

"""A run says what it did, through the public command (`python -m trainer.train`, one process of
the tiny model): a run that trained nothing exits non-zero saying why; a metrics write that fails
is counted and warned about once, never a traceback that ends the run; a log file (nohup, a job
scheduler) shows `rollout k/N`, the time left, each stage's seconds and each eval, and the end
summary covers the whole run across a resume.
"""

from __future__ import annotations

import contextlib
import http.server
import json
import resource
import signal
import subprocess
import sys
import threading
from pathlib import Path

from tests.workers.launch import ROOT
from tests.workers.recipes import tiny_recipe

ENV = {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}


def _prompts(path: Path, texts: list[str], prefix: str) -> Path:
    with open(path, "w") as f:
        for i, p in enumerate(texts):
            f.write(json.dumps({"prompt": p, "metadata": {"task": "t2i", "sample_id": f"{prefix}{i}"}}) + "\n")
    return path


def _recipe(tmp: Path, model_dir: Path, extra: str = "") -> Path:
    """One process, 2 groups of 4 at 32x32 and 4 steps; `extra`: more top-level TOML."""
    path = tmp / "recipe.toml"
    prompts = _prompts(tmp / "train.jsonl", [f"a red ball {i}" for i in range(4)], "p")
    scorer = 'reward-runtime = "cpu"\nreward-scorer-path = "color"'
    path.write_text(tiny_recipe(model_dir, prompts, extra=f"{scorer}\n{extra}"))
    return path


def _outputs(out: Path) -> list[str]:
    return ["--artifact-root", str(out / "artifacts"), "--save", str(out / "ckpt"),
            "--tensorboard-dir", str(out / "tb")]


def _train(recipe: Path, out: Path, *args: str, **run: object) -> subprocess.CompletedProcess:
    """`python -m trainer.train` of `recipe` into `out`, its output captured."""
    return subprocess.run([sys.executable, "-m", "trainer.train", "--config", str(recipe), *_outputs(out), *args],
                          cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=240, **run)


def _summary(text: str) -> dict:
    lines = [ln for ln in text.splitlines() if ln.startswith('{"summary"')]
    assert len(lines) == 1, text[-4000:]
    return json.loads(lines[0])


@contextlib.contextmanager
def _misbehaving_scorer():
    """A reward endpoint whose GET is correct and whose every POST answer is unusable: an HTML
    page (a proxy's login page), then one score fewer than the images it was sent, in turn."""
    answers = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def _send(self, ctype: str, body: bytes) -> None:
            self.send_response(200)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):  # noqa: N802 - the http.server API
            self._send("application/json", json.dumps({"protocol": 1, "components": ["color"]}).encode())

        def do_POST(self):  # noqa: N802 - the http.server API
            request = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
            if len(answers) % 2 == 0:
                answers.append("html")
                self._send("text/html", b"<html><body>Please log in</body></html>")
            else:
                answers.append("short")
                self._send("application/json", json.dumps({"color": [0.5] * (len(request["images"]) - 1)}).encode())

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/score", answers
    finally:
        server.shutdown()
        server.server_close()


def test_a_run_that_scored_no_rollout_exits_non_zero_and_says_why(tmp_path, tiny_model_dir):
    # 2 rollouts, below the default stop after 3 failed ones in a row: it used to end with exit 0
    with _misbehaving_scorer() as (url, answers):
        proc = _train(_recipe(tmp_path, tiny_model_dir), tmp_path / "run", "--num-rollout", "2",
                      "--reward-runtime", "remote", "--reward-endpoint", url)
    assert {"html", "short"} <= set(answers)
    assert proc.returncode == 1, proc.stderr[-4000:]
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("[rank 0] error: ")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-4000:]
    assert "this run trained nothing: none of its 2 rollout(s) (0-1) scored" in errors[0]
    assert f"--reward-endpoint {url}" in errors[0]
    summary = _summary(proc.stdout)
    assert summary["failed_rollouts"] == 2 and summary["scored_rollouts"] == 0 and summary["rollouts"] == 2
    assert "failed to score" in proc.stderr and "2 failed to score" in proc.stderr


def _no_big_files(limit: int):
    def preexec() -> None:
        # the kernel's answer to a write past the limit is SIGXFSZ (death) unless it is ignored:
        # ignored, the write fails with EFBIG, as on a full disk or a quota
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return preexec


def test_a_metrics_write_that_fails_is_counted_and_warned_once(tmp_path, tiny_model_dir):
    # every file the run writes is limited to 48 KB: the event file passes it with rollout 0's
    # candidate grid, so each rollout's events are lost (a new event file is tried each rollout)
    proc = _train(_recipe(tmp_path, tiny_model_dir), tmp_path / "run", "--num-rollout", "3",
                  preexec_fn=_no_big_files(48 * 1024))
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "Traceback" not in proc.stderr and "Exception in thread" not in proc.stderr, proc.stderr[-4000:]
    warned = [ln for ln in proc.stderr.splitlines() if "TensorBoard events could not be written" in ln]
    assert len(warned) == 1 and "File too large" in warned[0] and "train/metrics_write_failures" in warned[0]
    summary = _summary(proc.stdout)
    assert summary["metrics_write_failures"] == 3, summary  # every rollout's events, each counted once
    assert "metrics write failures 3" in proc.stderr
    assert summary["summary"]["color"]["rollouts"] == 3  # the summary does not depend on the event file
    for event_file in (tmp_path / "run" / "tb").rglob("events.out.tfevents.*"):
        assert event_file.stat().st_size > 0  # no empty file left per failed attempt


def test_a_log_file_shows_progress_evals_and_a_whole_run_summary_across_a_resume(tmp_path, tiny_model_dir):
    evals = _prompts(tmp_path / "eval.jsonl", ["a white ball", "a black cube"], "e")
    recipe = _recipe(tmp_path, tiny_model_dir, f'eval-prompt-data = ["demo", "{evals}"]\neval-interval = 1\n'
                                                'n-samples-per-eval-prompt = 2\nsave-interval = 1')
    out = tmp_path / "run"
    base = [sys.executable, "-m", "trainer.train", "--config", str(recipe), *_outputs(out)]

    def run_to_file(name: str, *args: str) -> str:
        log = tmp_path / name
        with open(log, "w") as f:  # nohup's case: stdout and stderr in one file, no terminal
            proc = subprocess.run([*base, *args], cwd=ROOT, env=ENV, stdout=f, stderr=subprocess.STDOUT,
                                  stdin=subprocess.DEVNULL, timeout=240)
        text = log.read_text()
        assert proc.returncode == 0, text[-4000:]
        return text

    first = run_to_file("first.log", "--num-rollout", "2")
    lines = first.splitlines()
    line0 = next(ln for ln in lines if ln.startswith("rollout 0/2 | "))
    assert "ETA 0:" in line0 and "step_s=" in line0
    stages = line0.split("stages_s: ")[1].split(" | ")[0].split(", ")
    assert [st.split()[0] for st in stages] == ["rollout", "reward", "update", "sync", "save", "eval"], line0
    assert all(float(st.split()[1]) >= 0 for st in stages)
    assert any(ln.startswith("rollout 1/2 | ") and "ETA 0:00:00" in ln for ln in lines)
    assert any(ln.startswith("eval after rollout 1: demo color=") for ln in lines), first[-3000:]
    assert "\r" not in first  # no progress-bar frames in a file

    second = run_to_file("second.log", "--num-rollout", "4", "--load", str(out / "ckpt"))
    assert any(ln.startswith("rollout 2/4 | ") for ln in second.splitlines())
    s = _summary(second)
    color = s["summary"]["color"]
    # the whole run, rollouts 0-3, in two windows that do not overlap
    assert color["rollouts"] == 4 and color["first_rollouts"] == [0, 1] and color["last_rollouts"] == [2, 3]
    assert s["rollouts"] == 4 and s["resumed_at"] == 2 and s["scored_rollouts"] == 4 and s["failed_rollouts"] == 0
    ev = s["eval"]["demo/color"]
    assert ev["first_rollout"] == 0 and ev["last_rollout"] == 3 and ev["evals"] == 4
    assert s["wall_time_s"] > s["this_process_wall_time_s"] > 0
    assert "run summary: 4 rollouts, resumed at rollout 2, 4 scored, 0 failed to score" in second
    assert "eval demo/color: " in second and "at rollout 0 -> " in second

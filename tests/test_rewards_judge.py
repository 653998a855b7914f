"""The VLM judge against a stub OpenAI-compatible chat server on 127.0.0.1: the answer parsed
into a score, a malformed answer and a timeout each a failed candidate counted by reason, the
concurrency limit kept, and the rollout's other groups still trained on."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
import torch

from trainer.config import RewardConfig
from trainer.rewards.manager import RewardManager, reward_manager_from_config
from trainer.rewards.post_process import compute_advantages
from trainer.rewards.vlm_judge import VlmJudgeScorer


@contextlib.contextmanager
def stub_judge(answers: dict[str, str], delay_s: dict[str, float] | None = None):
    """Answers by the prompt text the judge sends; records requests and the peak in-flight count."""
    state = {"requests": [], "in_flight": 0, "peak": 0}
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self):  # noqa: N802
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            content = body["messages"][0]["content"]
            text = next(c["text"] for c in content if c["type"] == "text")
            assert content[0]["image_url"]["url"].startswith("data:image/png;base64,")
            key = next(k for k in answers if k in text)
            # a request the client abandoned (timeout) keeps its handler busy, so only
            # prompt-timed requests count towards the client's in-flight peak
            timed = key not in (delay_s or {})
            with lock:
                state["requests"].append(body)
                state["in_flight"] += timed
                state["peak"] = max(state["peak"], state["in_flight"])
            time.sleep((delay_s or {}).get(key, 0.05))
            with lock:
                state["in_flight"] -= timed
            out = json.dumps({"choices": [{"message": {"role": "assistant", "content": answers[key]}}]}).encode()
            try:
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)
            except (BrokenPipeError, ConnectionResetError):  # the client gave up (timeout)
                pass

        def log_message(self, *a):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    try:
        yield "http://%s:%d/v1/chat/completions" % server.server_address[:2], state
    finally:
        server.shutdown()
        server.server_close()
        t.join(5)


def imgs(n):
    return [np.full((8, 8, 3), 20 * i, dtype=np.uint8) for i in range(n)]


def test_judge_parses_scores_and_counts_failures_by_reason():
    answers = {"cat": "7", "dog": "Score: 2.5 / 10", "owl": "I cannot rate this image.", "eel": "42", "bee": "9"}
    # a 1.5 s timeout: a loaded CI machine must not time out the prompt answers that come at once
    with stub_judge(answers, delay_s={"bee": 6.0}) as (url, state):
        cfg = RewardConfig(reward_runtime="cpu", reward_scorer_path="vlm_judge", reward_judge_endpoint=url,
                           reward_judge_model="Qwen2.5-VL-7B-Instruct", reward_judge_timeout_s=1.5,
                           reward_judge_max_retries=1, reward_judge_max_concurrency=3)
        manager = reward_manager_from_config(cfg)
        assert manager.scorer.timeout_s == 1.5 and manager.scorer.max_concurrency == 3
        manager.scorer.backoff_s = 0.01
        prompts = ["a cat", "a cat", "a dog", "a dog", "an owl", "an owl", "an eel", "an eel", "a bee", "a bee"]
        t0 = time.perf_counter()
        out = manager.score(imgs(10), prompts)
        elapsed = time.perf_counter() - t0
    s = out.components["vlm_judge"]
    assert s[:4].tolist() == pytest.approx([0.7, 0.7, 0.25, 0.25])  # (raw - 0) / (10 - 0)
    assert torch.isnan(s[4:]).all()  # no number; 42 outside [0, 10]; timed out twice
    assert out.failures == {"malformed": 4, "timeout": 2}
    assert out.failure_metrics() == {"reward/failed_candidates_malformed": 4.0, "reward/failed_candidates_timeout": 2.0}
    assert state["peak"] <= 3 and state["peak"] >= 2  # concurrent, within the limit
    assert all(r["model"] == "Qwen2.5-VL-7B-Instruct" and r["temperature"] == 0.0 for r in state["requests"])
    # the timed-out pair was tried twice each (retries = 1), the malformed ones once
    assert sum("bee" in json.dumps(r) for r in state["requests"]) == 4 and len(state["requests"]) == 12
    assert elapsed < 5.5  # bounded by timeout x attempts (2 x 1.5 s), not by the slow server (6 s)
    # the run goes on: the failed groups are left out and counted, the others get advantages
    res = compute_advantages(out.components, 2, component_weights={"vlm_judge": 1.0})
    assert res.failed_groups == [2, 3, 4] and res.metrics["reward/num_groups"] == 2.0
    assert res.valid[:4].all() and not res.valid[4:].any()


def test_judge_settings_are_checked_when_built():
    with pytest.raises(ValueError, match="--reward-judge-prompt-template"):
        VlmJudgeScorer(reward_judge_prompt_template="rate {image} for {prompt}")
    with pytest.raises(ValueError, match="--reward-judge-score-max"):
        VlmJudgeScorer(reward_judge_score_min=5, reward_judge_score_max=5)
    with pytest.raises(ValueError, match="--reward-judge-endpoint"):
        VlmJudgeScorer(reward_judge_endpoint="localhost:8000")
    with pytest.raises(ValueError, match="--reward-judge-score-regex"):
        VlmJudgeScorer(reward_judge_score_regex="(")


def test_dead_judge_endpoint_is_a_connection_failure_not_a_crash():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    m = RewardManager("cpu", "vlm_judge", scorer_options={
        "reward_judge_endpoint": f"http://127.0.0.1:{port}/v1/chat/completions", "reward_judge_max_retries": 0})
    out = m.score(imgs(2), ["a", "b"])
    assert torch.isnan(out.components["vlm_judge"]).all() and out.failures == {"connection": 2}

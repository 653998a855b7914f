"""Launch a torchrun worker script from a test, with a timeout and a clear failure."""

import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(script: str, nproc: int = 2, env: dict | None = None, args: list[str] | None = None,
             timeout: float = 180) -> subprocess.CompletedProcess:
    """Run `script` under torchrun (gloo, CPU); raise with its output if it fails or hangs."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **(env or {})}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(ROOT / script), *(args or [])]
    try:
        proc = subprocess.run(cmd, env=full_env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"{script} hung for {timeout}s:\n{e.stdout}\n{e.stderr}") from None
    if proc.returncode != 0:
        raise AssertionError(f"{script} exited {proc.returncode}:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    return proc

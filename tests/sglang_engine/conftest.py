"""Fixtures of the SGLang engine tests. These run in the SGLang venv only:

    bash run.sh setup-sglang && .venv-sglang/bin/python -m pytest tests/sglang_engine

(the main suite does not recurse into this directory: setup.cfg norecursedirs)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """The tiny random-weight Qwen-Image pipeline (tools/make_tiny_model.py), built offline."""
    from tools.make_tiny_model import build_tiny_pipeline

    return build_tiny_pipeline(tmp_path_factory.mktemp("tiny_qwen_image") / "model", seed=0)


def pytest_configure(config):
    # fp32 on CUDA: the comparisons measure the engines, not TF32 (devices.py says why)
    from tests.sglang_engine.devices import exact_numerics

    exact_numerics()

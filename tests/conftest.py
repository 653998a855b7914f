"""Shared test fixtures. Fixtures used by one test file live in that file."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A tiny random-weight Qwen-Image pipeline directory (diffusers format, ~17 MB), built
    offline once per test session by tools/make_tiny_model.py. Treat it as read-only."""
    from tools.make_tiny_model import build_tiny_pipeline

    return build_tiny_pipeline(tmp_path_factory.mktemp("tiny_qwen_image") / "model", seed=0)


@pytest.fixture(scope="session")
def tiny_flux_dir(tmp_path_factory):
    """A tiny random-weight FLUX.1 pipeline directory (diffusers format, ~1 MB), built offline
    once per test session by tools/tiny_flux.py. Treat it as read-only."""
    from tools.tiny_flux import build_tiny_flux_pipeline

    return build_tiny_flux_pipeline(tmp_path_factory.mktemp("tiny_flux") / "model", seed=0)

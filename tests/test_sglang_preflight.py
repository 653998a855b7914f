"""The SGLang engine without sglang installed (this suite's venv has none): preflight names the
flag and the install command, and the engine's contract check says the same at start-up."""

from __future__ import annotations

import importlib.util

import pytest

from tests.test_preflight import base, problems  # noqa: F401,F811  (base is a fixture)
from trainer import preflight


def test_this_venv_has_no_sglang():
    # the assertions below are about an environment without sglang; the sglang venv runs tests/sglang_engine
    spec = importlib.util.find_spec("sglang")
    assert spec is None or spec.origin is None  # nothing, or a namespace directory that is not sglang
    assert not preflight._sglang_importable()


@pytest.mark.parametrize("flag", ["sglang", "trainer.engine.sglang_engine.SGLangEngine"])
def test_sglang_engine_without_sglang_fails_preflight(base, flag):  # noqa: F811
    got = problems(base + ["--rollout-engine-class-path", flag])
    hits = [p for p in got if "sglang is not installed" in p]
    assert len(hits) == 1, got
    # the config resolves the short name, so the line names the engine's dotpath
    assert hits[0].startswith("--rollout-engine-class-path trainer.engine.sglang_engine.SGLangEngine:")
    assert "pip install .[sglang]" in hits[0] and "bash run.sh setup-sglang" in hits[0]


def test_installed_sglang_passes_the_rule(base, monkeypatch):  # noqa: F811
    monkeypatch.setattr(preflight, "_sglang_importable", lambda: True)
    assert not any("sglang is not installed" in p for p in problems(base + ["--rollout-engine-class-path", "sglang"]))
    # the native engine never asks for sglang
    assert not any("sglang" in p for p in problems(base + ["--rollout-engine-class-path", "native"]))


def test_engine_contract_check_names_the_install_command():
    from trainer.engine.sglang_engine import SGLangContractError, SGLangEngine, check_sglang_contract

    with pytest.raises(SGLangContractError, match=r"pip install \.\[sglang\].*bash run.sh setup-sglang"):
        check_sglang_contract()
    with pytest.raises(SGLangContractError, match="sglang is not installed"):
        SGLangEngine("/nonexistent")


def test_true_cfg_on_the_sglang_engine_fails_preflight_naming_it(base, monkeypatch):  # noqa: F811
    import json

    from tests.test_preflight import SAMPLING

    monkeypatch.setattr(preflight, "_sglang_importable", lambda: True)
    cfg_flags = ["--sampling-config", json.dumps({**SAMPLING, "guidance_scale": 4.0})]
    got = problems(base + ["--rollout-engine-class-path", "sglang"] + cfg_flags)
    hits = [p for p in got if "guidance_scale 4.0" in p]
    assert len(hits) == 1 and "SGLang engine samples without CFG" in hits[0] and "native" in hits[0], got
    assert not problems(base + ["--rollout-engine-class-path", "native"] + cfg_flags)


def test_cps_on_the_sglang_engine_fails_preflight_naming_it(base, monkeypatch):  # noqa: F811
    import json

    from tests.test_preflight import SAMPLING

    monkeypatch.setattr(preflight, "_sglang_importable", lambda: True)
    cps = ["--sampling-config", json.dumps({**SAMPLING, "sde_type": "cps", "eta": 0.8})]
    got = problems(base + ["--rollout-engine-class-path", "sglang"] + cps)
    assert [p for p in got if "sde_type 'cps'" in p and "native" in p], got
    assert not problems(base + ["--rollout-engine-class-path", "native"] + cps)


def test_native_speed_options_on_the_sglang_engine_fail_preflight_together(base, monkeypatch):  # noqa: F811
    monkeypatch.setattr(preflight, "_sglang_importable", lambda: True)
    speed = ["--rollout-compile", "--rollout-precision", "fp8"]
    got = problems(base + ["--rollout-engine-class-path", "sglang"] + speed)
    hits = [p for p in got if "belongs to the native engine" in p]
    assert len(hits) == 2 and "--rollout-compile" in hits[0] and "--rollout-precision fp8" in hits[1], got
    assert not problems(base + ["--rollout-engine-class-path", "native"] + speed)  # no GPU here: CPU FP8 runs


def test_fp8_on_a_gpu_without_fp8_tensor_cores_fails_preflight(base, monkeypatch):  # noqa: F811
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA A100")
    got = problems(base + ["--rollout-precision", "fp8"])
    assert [p for p in got if "compute capability >= 8.9" in p and "8.0 (NVIDIA A100)" in p], got
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    assert not [p for p in problems(base + ["--rollout-precision", "fp8"]) if "compute capability" in p]


def test_sglang_attention_backend_reaches_the_engine_and_only_that_engine(base, monkeypatch):  # noqa: F811
    """--sglang-attention-backend is an SGLang engine keyword (a GPU install without sglang-kernel's
    FlashAttention library runs torch_sdpa); with another engine preflight names the flag."""
    from trainer.config import load_config
    from trainer.loop import engine_options

    monkeypatch.setattr(preflight, "_sglang_importable", lambda: True)
    flag = ["--sglang-attention-backend", "torch_sdpa"]
    assert not problems(base + ["--rollout-engine-class-path", "sglang"] + flag)
    got = problems(base + ["--rollout-engine-class-path", "native"] + flag)
    assert [p for p in got if p.startswith("--sglang-attention-backend torch_sdpa needs --rollout-engine-class-path "
                                           "sglang")], got
    cfg = load_config(base + ["--rollout-engine-class-path", "sglang"] + flag)
    assert engine_options(cfg.rollout)["attention_backend"] == "torch_sdpa"
    assert "attention_backend" not in engine_options(load_config(base).rollout)


def test_preflight_asks_the_engine_class_what_it_can_sample(base, monkeypatch):  # noqa: F811
    """The limits are the engine's own declaration (EngineCapabilities on the class), read without
    importing sglang: a native engine declared without 'cps' is refused 'cps' in the same words."""
    import dataclasses
    import json
    import sys

    from tests.test_preflight import SAMPLING
    from trainer.engine.native import NativeEngine

    caps = preflight.engine_capabilities("trainer.engine.sglang_engine.SGLangEngine")
    assert caps.sde_types == ("sde", "dance") and not caps.true_cfg and "sglang" not in sys.modules
    assert preflight.engine_capabilities("my_pkg.engines.Custom") is None  # a custom engine is not imported
    cps = ["--sampling-config", json.dumps({**SAMPLING, "sde_type": "cps", "eta": 0.8})]
    assert not problems(base + ["--rollout-engine-class-path", "native"] + cps)
    monkeypatch.setattr(NativeEngine, "capabilities", dataclasses.replace(NativeEngine.capabilities,
                                                                          sde_types=("sde",)))
    got = [p for p in problems(base + ["--rollout-engine-class-path", "native"] + cps) if "sde_type 'cps'" in p]
    assert len(got) == 1 and "the native engine's sampler is checked for 'sde' only" in got[0], got

"""The project's SGLang plugin and the engine's static contract check (SGLang venv)."""

from __future__ import annotations

import sys
import types
from importlib.metadata import entry_points

import pytest
import torch

from trainer.engine import sglang_plugin
from trainer.engine.sglang_engine import SGLANG_VERSION, SGLangContractError, check_sglang_contract


def test_plugin_is_an_sglang_entry_point():
    eps = {ep.name: ep.value for ep in entry_points(group="sglang.multimodal_gen.plugins")}
    assert eps.get("flowgrpo_trainer") == "trainer.engine.sglang_plugin:register"


def test_installed_sglang_passes_the_contract_check():
    import sglang

    assert sglang.__version__ == SGLANG_VERSION
    check_sglang_contract()


def test_contract_check_lists_everything_missing(monkeypatch):
    import sglang
    from sglang.multimodal_gen.runtime.post_training import flow_rollout_controller, rollout_hooks

    monkeypatch.setattr(sglang, "__version__", "0.5.99")
    monkeypatch.delattr(rollout_hooks, "prepare_rollout_if_enabled")
    monkeypatch.delattr(flow_rollout_controller.FlowRolloutController, "append_local_rollout_log_probs")
    # a module that lost an attribute the weight path needs
    fake = types.ModuleType("sglang.multimodal_gen.runtime.post_training.weights_updater")
    monkeypatch.setitem(sys.modules, fake.__name__, fake)
    with pytest.raises(SGLangContractError) as exc:
        check_sglang_contract()
    msg = str(exc.value)
    assert "4 problem(s)" in msg
    for needle in ("sglang version 0.5.99, the engine is pinned to 0.5.23",
                   "rollout_hooks.prepare_rollout_if_enabled",
                   "FlowRolloutController.append_local_rollout_log_probs",
                   "weights_updater._build_module_weight_name_mapper",
                   "pip install .[sglang]"):
        assert needle in msg, (needle, msg)


def test_contract_check_sees_a_changed_signature(monkeypatch):
    from sglang.multimodal_gen.runtime.post_training.flow_rollout_controller import FlowRolloutController

    def flow_sde_sampling(self, batch, model_output, sample, sigma, next_sigma, step_index):  # renamed parameter
        raise AssertionError

    monkeypatch.setattr(FlowRolloutController, "flow_sde_sampling", flow_sde_sampling)
    with pytest.raises(SGLangContractError, match="flow_sde_sampling parameter 'current_sigma'"):
        check_sglang_contract()


@pytest.mark.parametrize("norm_type", ["layer", "rms"])
def test_cpu_ops_match_sglangs_norm_modules(norm_type):
    """The pure-PyTorch sgl_kernel CPU ops, called through SGLang's own layers (forward_cpu),
    give norm(x) * (1 + scale) + shift with SGLang's own norm module (the math of its
    forward_native, whose fused scale/shift kernel needs sgl_kernel)."""
    from sglang.multimodal_gen.runtime.layers import layernorm as ln

    sglang_plugin.register_cpu_ops()
    assert sglang_plugin.missing_cpu_ops() == []
    g = torch.Generator().manual_seed(0)
    b, seq, c = 2, 5, 8
    x, res = torch.randn(b, seq, c, generator=g), torch.randn(b, seq, c, generator=g)
    scale, shift, gate = (torch.randn(b, 1, c, generator=g) for _ in range(3))
    names = {"layer": ("LayerNormScaleShift", "ScaleResidualLayerNormScaleShift"),
             "rms": ("RMSNormScaleShift", "ScaleResidualRMSNormScaleShift")}[norm_type]
    for affine in (False, True):
        plain = getattr(ln, names[0])(c, eps=1e-6, elementwise_affine=affine)
        fused = getattr(ln, names[1])(c, eps=1e-6, elementwise_affine=affine)
        for m in (plain, fused):
            for p in m.parameters():
                p.data.copy_(torch.randn(p.shape, generator=g))
        want = plain.norm(x) * (1 + scale) + shift
        torch.testing.assert_close(plain.forward_cpu(x, shift, scale), want, atol=1e-5, rtol=1e-5)
        for gt in (gate, 1):
            r = res + x * gt
            out, r_out = fused.forward_cpu(res, x, gt, shift, scale)
            torch.testing.assert_close(r_out, r, atol=1e-6, rtol=1e-6)
            torch.testing.assert_close(out, fused.norm(r) * (1 + scale) + shift, atol=1e-5, rtol=1e-5)


def test_hooks_leave_serving_requests_alone():
    """A request without the trainer's spec goes through SGLang's own functions unchanged."""
    calls = []

    def original(*args, **kwargs):
        calls.append((args, kwargs))
        return "upstream"

    batch = types.SimpleNamespace(extra={}, rollout_controllers={})
    assert sglang_plugin.prepare_rollout_hook(original, batch=batch, pipeline_config=None) == "upstream"
    assert sglang_plugin.timestep_stage_hook(original, "stage", batch, "args") == "upstream"
    assert len(calls) == 2 and batch.rollout_controllers == {}


@pytest.mark.parametrize("return_attention_mask", [False, True])
def test_text_window_keeps_at_most_max_sequence_length_prompt_tokens(return_attention_mask):
    """The engine's text window holds on both of SGLang's postprocess paths: the plain embeddings
    and the TextConditioningOutput its text encoding stage asks for (return_attention_mask=True,
    the positive prompt's path); the mask and sequence lengths are cut with the embeddings."""
    import inspect

    from sglang.multimodal_gen.configs.pipeline_configs import qwen_image
    from sglang.multimodal_gen.configs.pipeline_configs.base import TextConditioningOutput

    original = inspect.unwrap(qwen_image.qwen_image_postprocess_text)
    saved = dict(sglang_plugin._TEXT_WINDOW)
    try:
        sglang_plugin.set_text_window(3, 4)
        g = torch.Generator().manual_seed(0)
        hidden = torch.randn(2, 12, 5, generator=g)
        mask = torch.ones(2, 12, dtype=torch.long)
        mask[1, 6:] = 0  # the second prompt: 6 tokens, 3 after the template prefix
        outputs = types.SimpleNamespace(hidden_states=[hidden])
        inputs = types.SimpleNamespace(attention_mask=mask)
        out = sglang_plugin.text_postprocess_hook(original, outputs, inputs, return_attention_mask=return_attention_mask)
    finally:
        sglang_plugin._TEXT_WINDOW.clear()
        sglang_plugin._TEXT_WINDOW.update(saved)
    embeds = out.prompt_embeds if return_attention_mask else out
    assert tuple(embeds.shape) == (2, 4, 5)
    torch.testing.assert_close(embeds[0], hidden[0, 3:7], rtol=0, atol=0)
    torch.testing.assert_close(embeds[1, :3], hidden[1, 3:6], rtol=0, atol=0)
    if return_attention_mask:
        assert isinstance(out, TextConditioningOutput)
        assert out.prompt_embeds_mask.tolist() == [[True] * 4, [True] * 3 + [False]]
        assert list(out.prompt_seq_lens) == [4, 3]


def test_index_mismatch_names_the_checkpoint_and_the_flag():
    """A checkpoint whose tensors SGLang's DiT does not hold is refused with the directory read
    and the flag that chose it, not only the tensor names."""
    from trainer.engine.sglang_engine import SGLangEngine

    stub = types.SimpleNamespace(transformer=torch.nn.Linear(2, 3))
    with pytest.raises(SGLangContractError) as exc:
        SGLangEngine._build_index(stub, {"weight": (3, 2), "blocks.0.weight": (3, 2), "bias": (4,)},
                                  source="/models/qwen/transformer")
    msg = str(exc.value)
    for needle in ("/models/qwen/transformer", "--model-path", "blocks.0.weight: no SGLang parameter",
                   "bias: shape (4,), SGLang (3,)", "2 problem(s)"):
        assert needle in msg, (needle, msg)

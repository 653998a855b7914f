"""Parameter names as the actor, the sync, the engines and the export tools spell them.

Two spellings exist: a module's own name with wrapper segments (activation checkpointing, FSDP,
torch.compile) dropped (`model_name`: what the trainable boundary and checkpoints use), and the
engine-side name that also drops peft's base_layer / adapter-name segments
(`strip_wrapper_segments`: what a sync sends and a manifest hashes). Pure string functions: no
torch, importable from anywhere.
"""

from __future__ import annotations

import functools

#: wrapper segments that never belong to a parameter's model name (checkpointing, FSDP, compile)
WRAPPER_SEGMENTS = ("_checkpoint_wrapped_module", "_fsdp_wrapped_module", "_orig_mod")


def model_name(name: str) -> str:
    """A parameter name without checkpoint/FSDP/compile wrapper segments."""
    return ".".join(p for p in name.split(".") if p not in WRAPPER_SEGMENTS)


def is_lora_name(name: str) -> bool:
    """Whether a parameter name is a LoRA A/B tensor (peft: "....lora_A.default.weight")."""
    parts = name.split(".")
    return "lora_A" in parts or "lora_B" in parts


#: module-path segments inserted by wrappers, removed before a name leaves the actor: those
#: model_name drops, plus peft's base_layer (the engine's module holds the base weight itself)
STRIPPED_SEGMENTS = WRAPPER_SEGMENTS + ("base_layer",)
#: prefixes inserted by peft's PeftModel
WRAPPER_PREFIXES = ("base_model.model.",)


@functools.lru_cache(maxsize=1 << 16)
def strip_wrapper_segments(name: str, adapter_name: str = "default") -> str:
    """Remove wrapper segments from a parameter name.

    "transformer_blocks.0._checkpoint_wrapped_module.attn.to_q.base_layer.weight"
        -> "transformer_blocks.0.attn.to_q.weight"
    "transformer_blocks.0.attn.to_q.lora_A.default.weight"
        -> "transformer_blocks.0.attn.to_q.lora_A.weight"   (peft's adapter-name segment)
    """
    for prefix in WRAPPER_PREFIXES:
        if name.startswith(prefix):
            name = name[len(prefix):]
    parts = name.split(".")
    out: list[str] = []
    for i, part in enumerate(parts):
        if part in STRIPPED_SEGMENTS:
            continue
        if part == adapter_name and i > 0 and parts[i - 1] in ("lora_A", "lora_B", "lora_embedding_A",
                                                                 "lora_embedding_B", "lora_magnitude_vector"):
            continue
        out.append(part)
    return ".".join(out)

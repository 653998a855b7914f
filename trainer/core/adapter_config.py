"""A PEFT LoRA adapter directory's adapter_config.json, read with bounds and checked before
anything is allocated for it.

The adapter that `tools/sample.py --lora` (NativeEngine.load_lora_dir) installs is built from this
file's `r` and `lora_alpha`: peft allocates r x (in + out) numbers per targeted layer before a
single tensor is compared, and samples with the scale alpha / r. So a rank of 1e8 would allocate
tens of GB, a rank of Infinity trace back, an alpha of NaN draw black images with exit 0; and a
field this loader does not apply (DoRA, rsLoRA, per-layer rank patterns, trained biases) would
sample another model than the one that was trained, silently. Every such file is refused here,
naming the file, the field and the fix.
"""

from __future__ import annotations

import json
import math
import os
import stat
from pathlib import Path
from typing import Any

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"

#: largest adapter_config.json read, in bytes (peft writes about 1 KB)
MAX_ADAPTER_CONFIG_BYTES = 1 << 20
#: largest LoRA rank accepted before the model is known: above the narrower side of every layer of
#: the supported DiTs (Wan2.1-14B's 5120 the widest). The engine also refuses a rank above the
#: width of the layers it targets (NativeEngine.set_lora_tensors)
MAX_LORA_RANK = 8192
#: largest LoRA scale lora_alpha / r accepted: trained adapters use 0.5-2; a scale this large
#: only turns the update into overflow
MAX_LORA_SCALING = 1024.0
#: most target module names, and the longest name, a config may list
MAX_TARGET_MODULES = 4096
MAX_TARGET_NAME_CHARS = 256

#: peft fields whose non-default value changes the adapter's function in a way the loader does not
#: apply (it builds r, lora_alpha and target_modules only): field -> (values that are the default,
#: what the value would have meant)
UNSUPPORTED_FIELDS = {
    "use_dora": ((False, None), "a DoRA adapter (a learned magnitude per output)"),
    "use_rslora": ((False, None), "rank-stabilised scaling alpha / sqrt(r)"),
    "rank_pattern": (({}, None), "per-layer ranks"),
    "alpha_pattern": (({}, None), "per-layer alphas"),
    "bias": (("none", None), "trained biases"),
    "modules_to_save": (([], None), "fully trained extra modules"),
    "fan_in_fan_out": ((False, None), "transposed weights"),
    "layers_to_transform": ((None, []), "a subset of the layers"),
    "lora_bias": ((False, None), "a trained bias on lora_B"),
    "layer_replication": ((None, []), "replicated layers"),
    "target_parameters": ((None, []), "adapted parameters rather than modules"),
    "trainable_token_indices": ((None, {}, []), "trained token embeddings"),
}

FIX = ("write the adapter with `flowgrpo-export --form adapter` (or peft's save_pretrained of a plain LoRA), "
       "or pass the LoRA run's checkpoint directory itself")


class AdapterConfigError(ValueError):
    """An adapter_config.json that cannot be loaded as it is; the message names the file, the
    field and the fix."""


def _show(value: Any) -> str:
    """`value` as the JSON file spells it (true, NaN, Infinity), cut to 80 characters; None
    (the field absent, or null) as "missing"."""
    if value is None:
        return "missing"
    try:
        return json.dumps(value)[:80]
    except (TypeError, ValueError):
        return repr(value)[:80]


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def lora_config_problems(rank: Any, alpha: Any, targets: Any = None) -> list[str]:
    """What is wrong with a LoRA's rank, alpha and target modules, as "<field> ..." phrases (empty:
    usable): rank a whole number in [1, MAX_LORA_RANK], alpha a finite number > 0 with alpha / rank
    at most MAX_LORA_SCALING, targets None (the family's) or a list of at most MAX_TARGET_MODULES
    non-empty module names."""
    problems = []
    if not isinstance(rank, int) or isinstance(rank, bool):
        problems.append(f"r is {_show(rank)}: it must be a whole number (the adapter's rank, the first "
                        "dimension of its lora_A tensors)")
    elif not 1 <= rank <= MAX_LORA_RANK:
        problems.append(f"r is {rank}: it must be in [1, {MAX_LORA_RANK}]")
    if not _number(alpha) or not math.isfinite(alpha) or alpha <= 0:
        problems.append(f"lora_alpha is {_show(alpha)}: it must be a finite number > 0 (the scale is lora_alpha / r)")
    elif not problems and alpha / rank > MAX_LORA_SCALING:
        problems.append(f"lora_alpha / r is {alpha / rank:g}: at most {MAX_LORA_SCALING:g} is accepted")
    if targets is not None:
        if not isinstance(targets, list) or not targets:
            problems.append(f"target_modules is {_show(targets)}: it must be a non-empty list of module names "
                            "(a regular-expression string is not supported)")
        elif len(targets) > MAX_TARGET_MODULES:
            problems.append(f"target_modules lists {len(targets)} names, more than {MAX_TARGET_MODULES}")
        else:
            bad = [t for t in targets if not isinstance(t, str) or not t or len(t) > MAX_TARGET_NAME_CHARS]
            if bad:
                problems.append(f"target_modules holds {_show(bad[0])}: every entry must be a module name of 1 "
                                f"to {MAX_TARGET_NAME_CHARS} characters")
    return problems


def read_adapter_config(directory: str | os.PathLike) -> dict[str, Any]:
    """{"rank", "alpha", "target_modules" (None: the family's)} of `directory`/adapter_config.json,
    read with bounds (a regular file of at most MAX_ADAPTER_CONFIG_BYTES, JSON, an object) and
    checked (lora_config_problems, UNSUPPORTED_FIELDS, peft_type LORA). FileNotFoundError when
    the file is missing; AdapterConfigError naming the file, every bad field and the fix otherwise.
    Nothing but this file is read."""
    path = Path(directory) / ADAPTER_CONFIG
    st = os.stat(path)  # FileNotFoundError names the file
    if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_ADAPTER_CONFIG_BYTES:
        raise AdapterConfigError(f"{path} is not a regular file of at most {MAX_ADAPTER_CONFIG_BYTES} bytes; {FIX}")
    with open(path, "rb") as f:
        raw = f.read(MAX_ADAPTER_CONFIG_BYTES + 1)
    try:
        cfg = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise AdapterConfigError(f"{path} is not valid JSON ({str(e)[:120]}); {FIX}") from None
    if not isinstance(cfg, dict):
        raise AdapterConfigError(f"{path} holds a JSON {type(cfg).__name__}, not an object; {FIX}")
    problems = []
    if cfg.get("peft_type", "LORA") != "LORA":
        problems.append(f"peft_type is {_show(cfg.get('peft_type'))}: only LORA adapters load")
    problems += lora_config_problems(cfg.get("r"), cfg.get("lora_alpha"), cfg.get("target_modules"))
    for name, (defaults, meaning) in UNSUPPORTED_FIELDS.items():
        if name in cfg and not any(cfg[name] == d and type(cfg[name]) is type(d) for d in defaults):
            problems.append(f"{name} is {_show(cfg[name])} ({meaning}): not supported, the adapter would "
                            "sample another model than the one trained")
    if problems:
        raise AdapterConfigError(f"{path}: " + "; ".join(problems) + f". Fix the field, or {FIX}")
    return {"rank": cfg["r"], "alpha": float(cfg["lora_alpha"]), "target_modules": cfg.get("target_modules")}

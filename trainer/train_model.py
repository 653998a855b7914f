"""Building the trainable model: LoRA, frozen never-trained parameters, the master dtype,
activation checkpointing and FSDP2 sharding, plus loading in waves and the FSDP2 helpers the
actor, the loop and the sync share.

Build order (`build_train_model`), each step before the next:
  1. LoRA (peft) injected on the target modules, base frozen        (--fsdp-trainable-mode lora)
     and, with --replay-precision fp8 / fp8-dgrad, the blocks' frozen base GEMMs in FP8 (set_replay_precision)
  2. parameters that can never receive a gradient frozen            (the adapter's never_trained_param_names)
  3. trainable parameters cast to the master dtype                  (--fsdp-master-dtype)
  4. activation checkpointing around each transformer block         (--fsdp-activation-checkpointing;
     or every K-th one                                                --fsdp-activation-checkpointing-every)
  5. fully_shard per block, then the root, on the job's mesh        (MixedPrecisionPolicy from
                                                                      --fsdp-param-dtype / --fsdp-reduce-dtype);
     the frozen parameters kept out of it, whole on each rank,       (--fsdp-frozen-params)
     where they replicate
  6. _assert_trainable_boundary
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from trainer.config import FsdpConfig, LoraConfig
from trainer.core.dtypes import resolve_dtype
from trainer.core.modules import REGIONAL_COMPILE_KWARGS, raise_recompile_limit, repeated_block_lists
from trainer.core.names import is_lora_name, model_name
from trainer.distributed import barrier

log = logging.getLogger(__name__)


def apply_lora(model: nn.Module, target_modules: Sequence[str], rank: int, alpha: float,
               dropout: float = 0.0) -> dict[str, Any]:
    """Inject a peft LoRA adapter ("default") into `model` in place; freeze everything else.

    target_modules are module-name suffixes ("attn.to_q", "attn.to_out.0"). lora_B starts at 0,
    so the adapted model starts equal to the base. Returns the lora_config dict the engine needs
    ({"rank", "alpha", "target_modules", "dropout"}).
    """
    from peft import LoraConfig, inject_adapter_in_model

    if rank <= 0:
        raise ValueError(f"--lora-rank must be > 0 under --fsdp-trainable-mode lora, got {rank}")
    if dropout != 0.0:
        raise ValueError(f"--lora-dropout must be 0.0, got {dropout}: the pi_old anchor is a replay under "
                         "model.train(), and a stochastic forward breaks ratio == 1 on the first update")
    targets = list(target_modules)
    if not targets:
        raise ValueError("LoRA needs target modules: set --lora-target-modules or use an adapter that "
                         "declares lora_target_modules")
    config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=targets,
                        init_lora_weights=True)
    inject_adapter_in_model(config, model)
    n_lora = 0
    for name, p in model.named_parameters():
        is_lora = is_lora_name(name)
        p.requires_grad_(is_lora)
        n_lora += int(is_lora)
    if n_lora == 0:
        raise ValueError(f"--lora-target-modules {targets} matched no module of {type(model).__name__}")
    return {"rank": rank, "alpha": alpha, "target_modules": targets, "dropout": dropout}


#: --replay-precision: the frozen base GEMMs of the actor's LoRA layers in the compute dtype or in FP8
REPLAY_PRECISIONS = ("default", "fp8", "fp8-dgrad")
#: --replay-fp8-layers: which frozen block linears an FP8 replay precision covers
REPLAY_FP8_LAYERS = ("lora-base", "frozen")
#: --replay-fp8-layers frozen: a linear without an adapter runs its FP8 GEMM only on calls of at
#: least this many rows. Its weight is quantized at every call, which costs more than an FP8 GEMM
#: of a few rows saves: a modulation linear sees one row a sample and keeps the compute dtype
#: (unless linked to an FP8 engine's copy of its weight, share_engine_fp8_weights: nothing to
#: quantize then, and every call runs the engine's FP8 GEMM)
FP8_FROZEN_MIN_ROWS = 128


def lora_base_layers(model: nn.Module) -> list[nn.Module]:
    """The base layers (the frozen nn.Linear a peft LoRA layer wraps) of every LoRA layer inside
    the model's repeated transformer blocks, in module order; the embedders and the final
    projection are not in a block and keep their precision (as the FP8 rollout keeps them)."""
    from peft.tuners.lora import LoraLayer

    return [m.get_base_layer() for blocks in repeated_block_lists(model) for block in blocks
            for m in block.modules() if isinstance(m, LoraLayer)]


def frozen_block_linears(model: nn.Module) -> list[nn.Module]:
    """Every plain nn.Linear inside the model's repeated transformer blocks whose weight is frozen
    and that is no part of a LoRA layer (with LoRA on the attention: the MLPs and the modulation),
    in module order. A LoRA layer's base and its adapter's own linears are left out: an adapter
    frozen as never trained (the last block's text outputs) stays an adapter."""
    from peft.tuners.lora import LoraLayer

    lora = {id(sub) for blocks in repeated_block_lists(model) for block in blocks for m in block.modules()
            if isinstance(m, LoraLayer) for sub in m.modules()}
    return [m for blocks in repeated_block_lists(model) for block in blocks for m in block.modules()
            if type(m) is nn.Linear and id(m) not in lora and not m.weight.requires_grad]


def set_replay_precision(model: nn.Module, precision: str, layers: str = "lora-base", *,
                         fast_accum: bool = False) -> int:
    """--replay-precision for every forward of the actor (anchor, replay, the nft velocity, the
    reference with the adapter disabled): "fp8" turns the eligible LoRA base layers of the blocks
    (lora_base_layers; both dims multiples of 16) into core.fp8.FP8FrozenLinear, whose GEMM is
    FP8 in forward and whose input gradient uses the unquantized weight; "fp8-dgrad" into
    FP8DgradFrozenLinear, whose input gradient is an FP8 GEMM too; "default" turns them back
    into nn.Linear. layers (--replay-fp8-layers) "frozen": the blocks' other frozen linears
    (frozen_block_linears) as well, each in FP8 only on calls of FP8_FROZEN_MIN_ROWS rows or more.
    fast_accum (--fp8-fast-accum): their forward GEMMs with fast accumulation (core.fp8.fp8_linear).
    Class swaps only (parameters, names, sharding unchanged), so it may be called before or after
    parallelize; a compiled block recompiles on the next call. Returns the layers now in FP8.
    Raises when an FP8 precision finds no eligible LoRA base layer (nothing would change)."""
    from trainer.core.fp8 import convert_frozen_to_fp8, restore_frozen_linears, set_fp8_fast_accum

    if precision not in REPLAY_PRECISIONS:
        raise ValueError(f"--replay-precision must be one of {REPLAY_PRECISIONS}, got {precision!r}")
    if layers not in REPLAY_FP8_LAYERS:
        raise ValueError(f"--replay-fp8-layers must be one of {REPLAY_FP8_LAYERS}, got {layers!r}")
    restore_frozen_linears(model)
    if precision == "default":
        return 0
    dgrad = precision == "fp8-dgrad"
    n = convert_frozen_to_fp8(lora_base_layers(model), fp8_dgrad=dgrad)
    if n and layers == "frozen":
        n += convert_frozen_to_fp8(frozen_block_linears(model), fp8_dgrad=dgrad, min_rows=FP8_FROZEN_MIN_ROWS)
    if fast_accum:
        set_fp8_fast_accum(model, True)
    if n == 0:
        raise ValueError(f"--replay-precision {precision} found no LoRA-wrapped linear layer in the transformer blocks "
                         "whose dimensions are multiples of 16: check --lora-target-modules, or use "
                         "--replay-precision default")
    return n


def share_engine_fp8_weights(model: nn.Module, engine: Any, name_map: Callable[[str], str],
                             compute_dtype: torch.dtype | None = None) -> tuple[int, int]:
    """The actor's FP8 replay layers read the FP8 copies an FP8 engine in the same process already
    holds of the same frozen base (core.fp8.share_fp8_weights) instead of quantizing the weight at
    every forward. Only for an engine whose base can no longer change (it holds LoRA adapters and
    freed its bf16 block weights: `fp8_weights_dropped`) on the actor's device; the caller keeps
    the engine's modules on the device through the update (not --offload-rollout). Names match
    as a sync matches them (strip_wrapper_segments, then the family's weight_name_map);
    compute_dtype: the actor's FSDP2 param dtype (None: its storage dtype). Returns (linked,
    mismatched); (0, 0) when the engine is not such an engine."""
    from trainer.core.fp8 import FP8FrozenLinear, FP8Linear, share_fp8_weights
    from trainer.core.names import strip_wrapper_segments

    transformer = getattr(engine, "transformer", None)
    if transformer is None or getattr(engine, "precision", "default") != "fp8" or \
            not getattr(engine, "fp8_weights_dropped", 0):
        return 0, 0
    layers = {name_map(strip_wrapper_segments(f"{n}.weight")): m for n, m in model.named_modules()
              if isinstance(m, FP8FrozenLinear)}
    device = next((p.device for p in model.parameters()), None)
    engine_layers = {strip_wrapper_segments(f"{n}.weight"): m for n, m in transformer.named_modules()
                     if isinstance(m, FP8Linear) and m.weight_fp8.device == device}
    return share_fp8_weights(layers, engine_layers, compute_dtype)


def replicates_frozen(setting: str, world_size: int, cpu_offload: bool = False) -> bool:
    """Whether --fsdp-frozen-params `setting` keeps the frozen parameters whole on every rank,
    outside FSDP2: 'replicate' always, 'shard' never, 'auto' on one rank without
    --fsdp-cpu-offload (there a shard is the whole tensor, and FSDP2 would only copy it into and
    out of its all-gather buffers at every block's forward and backward)."""
    if setting not in ("auto", "shard", "replicate"):
        raise ValueError(f"--fsdp-frozen-params must be 'auto', 'shard' or 'replicate', got {setting!r}")
    return setting == "replicate" or (setting == "auto" and world_size == 1 and not cpu_offload)


def _replicate_frozen(model: nn.Module, device: torch.device, dtype: torch.dtype | None) -> set[nn.Parameter]:
    """The frozen parameters of `model`, moved to `device` and cast to `dtype` (the compute dtype
    FSDP2 would have gathered them in; None: kept), in place, for fully_shard's ignored_params.
    Each gets storage of its own, as FSDP2's copy would be: a loaded tensor's may be a file
    mapping, which the actor's offload (storage resizing) cannot free."""
    frozen = {p for p in model.parameters() if not p.requires_grad}
    for p in frozen:
        cast = dtype if dtype is not None and p.is_floating_point() else p.dtype
        p.data = p.data.to(device=device, dtype=cast, copy=True)
    return frozen


def parallelize(model: nn.Module, mesh: Any, *, param_dtype: torch.dtype | None = None,
                reduce_dtype: torch.dtype | None = torch.float32, reshard_after_forward: bool = True,
                activation_checkpointing: bool = False, cpu_offload: bool = False,
                activation_checkpointing_every: int = 1, compile_blocks: bool = False,
                replicate_frozen: bool = False) -> nn.Module:
    """Apply activation checkpointing (optional), regional compilation (optional) and FSDP2 to
    `model` in place: fully_shard on every transformer block, then on the root, all over `mesh`.

    param_dtype: the all-gathered compute dtype (None: the storage dtype);
    reduce_dtype: gradient reduce-scatter dtype. LoRA and frozen parameters must be set up before.
    activation_checkpointing_every: with activation_checkpointing, checkpoint only the blocks whose
    index is a multiple of k (k = 1: every block; k = 2: blocks 0, 2, 4, ...): fewer recomputed
    forwards for more stored activations.
    compile_blocks: torch.compile each block (outside its checkpoint wrapper, inside FSDP2, as
    torchtitan orders them), so the recomputation in backward runs the compiled forward too;
    the added `_orig_mod` name segment is a wrapper segment (core.names).
    replicate_frozen: the parameters that do not require grad stay plain tensors, whole on every
    rank, on the mesh's device in param_dtype (replicates_frozen says when): FSDP2 gathers,
    reduces and offloads only the trainable ones.
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    if activation_checkpointing_every < 1:
        raise ValueError(f"activation_checkpointing_every must be >= 1, got {activation_checkpointing_every}")
    # (list, index) of every block, all lists in module order: a FLUX DiT's double-stream blocks,
    # then its single-stream ones; "every k-th block" counts along the whole sequence
    slots = [(blocks, i) for blocks in repeated_block_lists(model) for i in range(len(blocks))]
    if activation_checkpointing:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        for blocks, i in slots[::activation_checkpointing_every]:
            # non-reentrant checkpointing: works with keyword arguments and FSDP2 hooks
            blocks[i] = checkpoint_wrapper(blocks[i])
    if compile_blocks:
        raise_recompile_limit()
        for blocks, i in slots:
            blocks[i] = torch.compile(blocks[i], **REGIONAL_COMPILE_KWARGS)
    # inputs pass as the adapter and the model give them, as in the engine's DiT: casting them to
    # param_dtype would round, in the replay only, an fp32 timestep (SD3 pipelines pass one: 857.7
    # -> 856 in bf16) at the root and the fp32 rope tables (FLUX) at every block, and move the
    # replayed log-prob off the sampler's. The compute still runs in param_dtype: the weights are
    # gathered in it
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype, cast_forward_inputs=False)
    kwargs: dict[str, Any] = {"mesh": mesh, "mp_policy": mp}
    if cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    if replicate_frozen:
        if cpu_offload:
            raise ValueError("--fsdp-frozen-params replicate keeps the frozen weights on the device, which "
                             "--fsdp-cpu-offload would move to the host: use --fsdp-frozen-params shard")
        device = torch.device(mesh.device_type, torch.cuda.current_device()) if mesh.device_type == "cuda" \
            else torch.device(mesh.device_type)
        kwargs["ignored_params"] = _replicate_frozen(model, device, param_dtype)
    for blocks, i in slots:
        fully_shard(blocks[i], reshard_after_forward=reshard_after_forward, **kwargs)
    fully_shard(model, reshard_after_forward=reshard_after_forward, **kwargs)
    return model


def _assert_trainable_boundary(model: nn.Module, mode: str, never_trained: Iterable[str]) -> None:
    """Raise unless exactly the intended parameters are trainable.

    full: every parameter trains except `never_trained` (which must be frozen);
    lora: LoRA tensors present and all train except those on never-trained modules; the base is frozen.
    """
    dead = set(never_trained)
    wrong: list[str] = []
    n_train = 0
    n_lora = 0
    for name, p in model.named_parameters():
        mname = model_name(name)
        is_lora = is_lora_name(mname)
        n_lora += int(is_lora)
        n_train += int(p.requires_grad)
        if mode == "full":
            want = mname not in dead
        elif mode == "lora":
            want = is_lora and mname not in dead
        else:
            raise ValueError(f"--fsdp-trainable-mode must be 'full' or 'lora', got {mode!r}")
        if p.requires_grad != want:
            wrong.append(f"{mname} (requires_grad={p.requires_grad}, expected {want})")
    if mode == "lora" and n_lora == 0:
        wrong.append("no LoRA tensors in the model")
    if n_train == 0:
        wrong.append("nothing is trainable")
    if wrong:
        shown = "; ".join(wrong[:8]) + (f"; ... {len(wrong) - 8} more" if len(wrong) > 8 else "")
        raise RuntimeError(f"trainable boundary violated under --fsdp-trainable-mode {mode}: {shown}")


def build_train_model(model: nn.Module, mesh: Any, fsdp: FsdpConfig, lora: LoraConfig | None = None, *,
                      adapter: Any | None = None) -> tuple[nn.Module, dict | None, list[str]]:
    """Steps 1-6 of the module docstring. Returns (sharded model, lora_config or None, never-trained names).

    fsdp / lora: the run's typed cfg.fsdp / cfg.lora sections.
    adapter: the model family's adapter (models/base.py): its lora_target_modules are the LoRA
    targets when --lora-target-modules is unset, and its never_trained_param_names(model) are the
    parameters frozen in step 2. None: no default targets, nothing family-specific frozen.
    """
    mode = fsdp.fsdp_trainable_mode
    lora_config = None
    if mode == "lora":
        if fsdp.fsdp_cpu_offload:
            raise ValueError("--fsdp-cpu-offload is rejected with --fsdp-trainable-mode lora: gradient clipping "
                             "over CPU-offloaded adapter DTensors has no collective backend")
        targets = lora.lora_target_modules or list(getattr(adapter, "lora_target_modules", ()))
        lora_config = apply_lora(model, targets, lora.lora_rank, lora.lora_alpha, lora.lora_dropout)
        n_fp8 = set_replay_precision(model, fsdp.replay_precision, fsdp.replay_fp8_layers,
                                     fast_accum=fsdp.fp8_fast_accum)
        if n_fp8:
            log.info("--replay-precision %s --replay-fp8-layers %s: %d frozen block linears run their GEMM in FP8%s%s",
                     fsdp.replay_precision, fsdp.replay_fp8_layers, n_fp8,
                     ", their input gradient too" if fsdp.replay_precision == "fp8-dgrad" else "",
                     ", with fast accumulation forward" if fsdp.fp8_fast_accum else "")
    elif mode == "full":
        if fsdp.replay_precision != "default":
            raise ValueError(f"--replay-precision {fsdp.replay_precision} applies to the frozen base of LoRA layers; "
                             "--fsdp-trainable-mode full trains every weight: use --replay-precision default")
        for p in model.parameters():
            p.requires_grad_(True)
    else:
        raise ValueError(f"--fsdp-trainable-mode must be 'full' or 'lora', got {mode!r}")
    dead = list(adapter.never_trained_param_names(model)) if adapter is not None else []
    dead_set = set(dead)  # module-prefix based: covers base_layer and LoRA tensors of those modules
    for name, p in model.named_parameters():
        if model_name(name) in dead_set:
            p.requires_grad_(False)
    master = resolve_dtype(fsdp.fsdp_master_dtype)
    if master is not None:
        for p in model.parameters():
            if p.requires_grad and p.dtype != master:
                p.data = p.data.to(master)
    prepare_family = getattr(adapter, "prepare_block_compile", None)
    if fsdp.fsdp_compile and prepare_family is not None:
        prepare_family()  # the family's process-wide set-up for compiled blocks
    parallelize(model, mesh, param_dtype=resolve_dtype(fsdp.fsdp_param_dtype),
                reduce_dtype=resolve_dtype(fsdp.fsdp_reduce_dtype),
                reshard_after_forward=not fsdp.no_fsdp_reshard_after_forward,
                activation_checkpointing=fsdp.fsdp_activation_checkpointing,
                cpu_offload=fsdp.fsdp_cpu_offload,
                activation_checkpointing_every=fsdp.fsdp_activation_checkpointing_every,
                compile_blocks=bool(fsdp.fsdp_compile),
                replicate_frozen=replicates_frozen(fsdp.fsdp_frozen_params, mesh.size(), fsdp.fsdp_cpu_offload))
    _assert_trainable_boundary(model, mode, dead)
    return model, lora_config, dead


def load_in_waves(load: Callable[[], nn.Module], wave_size: int,
                  timings: list[float] | None = None) -> nn.Module:
    """Call `load()` on at most `wave_size` ranks at a time (0: all at once), barrier between waves.

    Bounds host RAM and model-directory contention at launch (every rank materialises the full base
    before sharding). Every rank must call it. `timings`, when given, receives each wave's wall
    time in seconds (one entry when all ranks load at once), the same on every rank.
    """
    if wave_size < 0:
        raise ValueError(f"--fsdp-load-wave-size must be >= 0, got {wave_size}")
    if not dist.is_initialized() or wave_size == 0 or wave_size >= dist.get_world_size():
        t0 = time.perf_counter()
        model = load()
        if timings is not None:
            timings.append(time.perf_counter() - t0)
        return model
    rank, world = dist.get_rank(), dist.get_world_size()
    model = None
    for wave in range(math.ceil(world / wave_size)):
        t0 = time.perf_counter()
        if rank // wave_size == wave:
            model = load()
        barrier()
        if timings is not None:
            timings.append(time.perf_counter() - t0)
    assert model is not None
    return model


# ----------------------------------------------------------------------------------------------
# the update plan

def reshard_all(model: nn.Module) -> None:
    """Put every FSDP2 unit of `model` back to its sharded parameters (a no-op for sharded ones)."""
    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole value of a parameter or gradient, detached: a DTensor's full_tensor() (a
    collective: every rank calls it), any other tensor (a frozen parameter that
    --fsdp-frozen-params keeps whole) as it is."""
    from torch.distributed.tensor import DTensor

    t = t.detach()
    return t.full_tensor() if isinstance(t, DTensor) else t


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (an FSDP2 parameter); any other tensor as it is."""
    from torch.distributed.tensor import DTensor

    return t._local_tensor if isinstance(t, DTensor) else t

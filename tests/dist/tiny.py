"""Shared pieces of the actor tests: the tiny Qwen-Image transformer, a synthetic trajectory batch,
a replay function over it, a config namespace, a minimal in-process engine (receiver), the
gathered parameters of a sharded model and a one-rank process group for in-process tests.

Used by tests/test_actor_unit.py (one process) and by the torchrun workers in this folder.
"""

from __future__ import annotations

import copy
import os
from typing import Any, Iterator

import torch
import torch.nn as nn

from trainer.config import (ColocateConfig, FsdpConfig, GrpoConfig, LoraConfig, OptimConfig, RunConfig,
                            SyncConfig)
from trainer.core.checksum import weights_checksum
from trainer.core.manifest import WeightManifest, WeightSyncError, verify_manifest
from trainer.core.modules import model_has_lora
from trainer.core.names import model_name
from trainer.flow_grpo import replay_transition_logp
from trainer.models.qwen_image import QwenImageAdapter
from trainer.trajectory import Geometry, SamplerSettings, Trajectory
from trainer.train_model import full_tensor

#: the 8 attention projections LoRA targets on Qwen-Image
LORA_TARGETS = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
                "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out")

#: the family the tiny transformer belongs to: the actor asks it for LoRA targets and the
#: parameters it must freeze
ADAPTER = QwenImageAdapter()

LATENT_HW = 4      # packed latent grid (4 x 4 tokens of 2x2 patches of a 8x8x4 latent)
TEXT_LEN = 6
SDE_STEPS = 2      # trained steps per candidate (columns of logp)


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """model name -> a gathered copy of every parameter of an FSDP2-sharded model (collective)."""
    return {model_name(n): full_tensor(p).clone() for n, p in model.named_parameters()}


def one_rank_mesh() -> Iterator[Any]:
    """Body of a module-scoped pytest fixture: a 1-rank gloo group and its mesh, one torch thread
    (the tiny model gains nothing from threads on a shared 2-core box); afterwards the group it
    created is destroyed and the torchrun variables and thread count are put back."""
    import torch.distributed as dist

    from trainer.distributed import build_mesh, init_distributed

    saved = {k: os.environ.get(k) for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    created = not dist.is_initialized()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    init_distributed("cpu")
    yield build_mesh("cpu")
    torch.set_num_threads(threads)
    if created:
        dist.destroy_process_group()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def tiny_transformer(seed: int = 0, dtype: torch.dtype = torch.float32) -> nn.Module:
    """The diffusers test config of QwenImageTransformer2DModel (diffusers' own unit tests use it), random weights."""
    from diffusers import QwenImageTransformer2DModel

    torch.manual_seed(seed)
    m = QwenImageTransformer2DModel(patch_size=2, in_channels=16, out_channels=4, num_layers=2,
                                    attention_head_dim=16, num_attention_heads=3, joint_attention_dim=16,
                                    axes_dims_rope=(8, 4, 4))
    return m.to(dtype)


def make_batch(n: int, seed: int = 0, device: str | torch.device = "cpu") -> Trajectory:
    """A synthetic trajectory of n candidates with SDE_STEPS trained steps each."""
    g = torch.Generator().manual_seed(seed)
    seq = LATENT_HW * LATENT_HW
    lat = torch.randn(n, SDE_STEPS, seq, 16, generator=g)
    sig = torch.tensor([0.9, 0.7]).expand(n, SDE_STEPS).clone()
    sig_next = torch.tensor([0.8, 0.6]).expand(n, SDE_STEPS).clone()
    nxt = lat * 0.95 + 0.1 * torch.randn(n, SDE_STEPS, seq, 16, generator=g)
    emb = torch.randn(n, TEXT_LEN, 16, generator=g)
    mask = torch.ones(n, TEXT_LEN, dtype=torch.long)
    i64 = torch.int64
    return Trajectory(
        prompts=["p"] * n, sample_ids=[f"s{i}" for i in range(n)], group_indices=torch.arange(n, dtype=i64),
        slots=torch.zeros(n, dtype=i64), generation_seeds=[seed] * n, policy_versions=torch.zeros(n, dtype=i64),
        metadata=[{} for _ in range(n)], latents=lat, next_latents=nxt, timesteps=sig * 1000, sigmas=sig,
        sigmas_next=sig_next, log_probs=torch.zeros(n, SDE_STEPS),
        conditions={"prompt_embeds": emb, "prompt_embeds_mask": mask}, sde_indices=list(range(1, SDE_STEPS + 1)),
        geometry=Geometry(8 * LATENT_HW, 8 * LATENT_HW, 4),
        sampler=SamplerSettings(num_inference_steps=SDE_STEPS + 2, eta=0.7)).validate().to(device)


def replay(model: nn.Module, b: Trajectory, eta: float = 0.7) -> torch.Tensor:
    """logp [b, S] of each recorded transition, recomputed through `model`."""
    from trainer.models.base import module_device_dtype

    _, dt = module_device_dtype(model)  # the actor passes inputs uncast: cast them to its compute dtype
    cols = []
    rows = len(b)
    for s in range(b.num_steps):
        x = b.latents[:, s]
        v = model(hidden_states=x.to(dt), encoder_hidden_states=b.prompt_embeds.to(dt),
                  encoder_hidden_states_mask=b.prompt_embeds_mask, timestep=b.sigmas[:, s].to(dt),
                  img_shapes=[(1, LATENT_HW, LATENT_HW)] * rows, return_dict=False)[0]
        cols.append(replay_transition_logp(x, b.next_latents[:, s], v, b.sigmas[:, s], b.sigmas_next[:, s], eta))
    return torch.stack(cols, dim=1)


def replay_moments(model: nn.Module, b: Trajectory, eta: float = 0.7):
    """TransitionMoments of each recorded transition through `model` (what a Replay's .moments
    returns): replay's log-probs with the transition means [b, S, ...] and stds [b, S]."""
    from trainer.flow_grpo import TransitionMoments, flow_sde_transition_moments
    from trainer.models.base import module_device_dtype

    _, dt = module_device_dtype(model)
    means, stds = [], []
    for s in range(b.num_steps):
        x = b.latents[:, s]
        v = model(hidden_states=x.to(dt), encoder_hidden_states=b.prompt_embeds.to(dt),
                  encoder_hidden_states_mask=b.prompt_embeds_mask, timestep=b.sigmas[:, s].to(dt),
                  img_shapes=[(1, LATENT_HW, LATENT_HW)] * len(b), return_dict=False)[0]
        mean, std = flow_sde_transition_moments(x, v, b.sigmas[:, s], b.sigmas_next[:, s], eta)
        means.append(mean)
        stds.append(std.reshape(-1).expand(len(b)))
    return TransitionMoments(replay(model, b, eta), torch.stack(means, 1), torch.stack(stds, 1))


def make_cfg(mode: str = "full", **over: Any) -> RunConfig:
    """A RunConfig whose actor and sync sections are set for the tiny model; `over` sets
    section__field (an unknown one raises)."""
    cfg = RunConfig(
        fsdp=FsdpConfig(fsdp_trainable_mode=mode, fsdp_trainable_attr="transformer", fsdp_param_dtype="fp32",
                        fsdp_reduce_dtype="fp32", fsdp_master_dtype=None, no_fsdp_reshard_after_forward=False,
                        fsdp_activation_checkpointing=False, fsdp_cpu_offload=False, fsdp_load_wave_size=0,
                        fsdp_lr_scheduler="constant", fsdp_debug_fingerprint=False),
        lora=LoraConfig(lora_rank=4 if mode == "lora" else 0, lora_alpha=8, lora_dropout=0.0,
                        lora_target_modules=None, lora_adapter_mode=False, lora_merge_mode=False),
        optim=OptimConfig(lr=1e-2, min_lr=0.0, lr_warmup_iters=0, lr_decay_iters=None, weight_decay=0.0,
                          adam_beta1=0.9, adam_beta2=0.999, adam_eps=1e-8, clip_grad=1.0),
        grpo=GrpoConfig(eps_clip=1e-4, eps_clip_high=None, num_updates_per_batch=2, micro_batch_size=1),
        sync=SyncConfig(weight_sync_mode="full", weight_sync_wire_dtype="fp32", weight_sync_bucket_size_mb=1),
        colocate=ColocateConfig(offload_train=True, offload_rollout=False))
    for key, value in over.items():
        sec, name = key.split("__")
        if not hasattr(getattr(cfg, sec), name):
            raise AttributeError(f"make_cfg: config section {sec} has no field {name}")
        setattr(getattr(cfg, sec), name, value)
    return cfg


class ReceiverEngine:
    """The engine protocol's weight surface over a plain (unsharded) transformer, strict like an engine:
    unknown names, shape mismatches and manifest mismatches raise; a full sync into LoRA layers raises."""

    def __init__(self, transformer: nn.Module, *, drop_one: bool = False) -> None:
        self.transformer = transformer
        self.policy_version = 0
        self.drop_one = drop_one  # test hook: silently lose one tensor, like a lenient loader would
        self.calls: list[str] = []  # memory calls, in order

    def release_memory(self, tags=None) -> None:
        self.calls.append(f"release:{','.join(tags) if tags else 'all'}")

    def resume_memory(self, tags=None) -> None:
        self.calls.append(f"resume:{','.join(tags) if tags else 'all'}")

    def holds_lora(self) -> bool:
        return model_has_lora(self.transformer)

    def update_weights_from_tensors(self, named_tensors, manifest: WeightManifest) -> None:
        self.calls.append("update")
        if self.holds_lora():
            raise WeightSyncError("engine transformer holds LoRA layers: full sync refused")
        verify_manifest(named_tensors, manifest)
        params = dict(self.transformer.named_parameters())
        for i, (name, t) in enumerate(named_tensors):
            if name not in params:
                raise WeightSyncError(f"unknown weight {name}")
            if params[name].shape != t.shape:
                raise WeightSyncError(f"shape mismatch for {name}")
            if self.drop_one and i == 0:
                continue
            with torch.no_grad():
                params[name].copy_(t)

    def set_lora_tensors(self, named_tensors, manifest: WeightManifest, lora_config: dict) -> None:
        from peft import LoraConfig, inject_adapter_in_model

        verify_manifest(named_tensors, manifest)
        if not self.holds_lora():
            inject_adapter_in_model(LoraConfig(r=lora_config["rank"], lora_alpha=lora_config["alpha"],
                                               target_modules=list(lora_config["target_modules"])), self.transformer)
        params = {n.replace(".default.", "."): p for n, p in self.transformer.named_parameters() if ".lora_" in n}
        if set(params) != {n for n, _ in named_tensors}:
            raise WeightSyncError("adapter tensor names differ from the engine's LoRA layers")
        with torch.no_grad():
            for name, t in named_tensors:
                params[name].copy_(t)

    def get_weights_checksum(self) -> str:
        return weights_checksum(self.transformer.named_parameters())

    def commit_weight_version(self, version: int) -> None:
        self.calls.append(f"commit:{version}")
        self.policy_version = version


def merged_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """A plain copy of an unsharded peft-LoRA model's weights with the adapter folded in (reference for merge)."""
    m = copy.deepcopy(model)
    from peft.tuners.lora import LoraLayer

    for mod in m.modules():
        if isinstance(mod, LoraLayer):
            mod.merge()
    out = {}
    for n, p in m.named_parameters():
        if ".lora_" in n:
            continue
        out[n.replace(".base_layer.", ".")] = p.detach().clone()
    return out

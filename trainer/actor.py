"""The actor: the trainable transformer sharded with FSDP2, its optimizer, the FlowGRPO update and
the colocate offload.

Build order (`parallelize`), each step before the next:
  1. LoRA (peft) injected on the target modules, base frozen        (--fsdp-trainable-mode lora)
  2. parameters that can never receive a gradient frozen            (the adapter's never_trained_param_names)
  3. trainable parameters cast to the master dtype                  (--fsdp-master-dtype)
  4. activation checkpointing around each transformer block         (--fsdp-activation-checkpointing)
  5. fully_shard per block, then the root, on the job's mesh        (MixedPrecisionPolicy from
                                                                      --fsdp-param-dtype / --fsdp-reduce-dtype)
  6. _assert_trainable_boundary

The update (`Actor.train_step`) is model-family independent: the caller supplies
`replay_fn(model, batch_slice) -> logp [b, S]` (in production, the adapter's replay_transition over
the trained-step columns) and the batch as a dict of per-candidate tensors / lists.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from trainer.core.dtypes import resolve_dtype
from trainer.core.names import is_lora_name, model_name
from trainer.distributed import all_reduce_max, all_reduce_sum, barrier, collective_device
from trainer.flow_grpo import grpo_clip_loss
from trainer.host_arena import HostArena
from trainer.lr_schedule import lr_at_step

log = logging.getLogger(__name__)

#: |advantage| at or below this everywhere (all ranks) makes an update degenerate: skipped and counted
ZERO_ADVANTAGE = 1e-8
ReplayFn = Callable[[nn.Module, dict], torch.Tensor]


class OffloadError(RuntimeError):
    """Releasing or restoring the actor's device storage failed (fatal: the run must stop)."""


class MicroBatchMismatchError(RuntimeError):
    """Ranks disagree on the micro-batch plan; running on would deadlock an FSDP collective."""


# ----------------------------------------------------------------------------------------------
# small helpers

def find_blocks(model: nn.Module) -> nn.ModuleList:
    """The ModuleList of repeated transformer blocks (diffusers: `transformer_blocks`, whose class
    is named in `_no_split_modules` / `_repeated_blocks`)."""
    names = set(getattr(model, "_repeated_blocks", None) or []) | set(getattr(model, "_no_split_modules", None) or [])
    for _, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) > 0:
            inner = [getattr(b, "_checkpoint_wrapped_module", b) for b in module]
            if names and all(type(b).__name__ in names for b in inner):
                return module
    blocks = getattr(model, "transformer_blocks", None)
    if isinstance(blocks, nn.ModuleList):
        return blocks
    raise ValueError(f"cannot find the transformer blocks of {type(model).__name__}: expected a ModuleList "
                     "`transformer_blocks` or one whose class is listed in _no_split_modules")


# ----------------------------------------------------------------------------------------------
# model construction

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


def parallelize(model: nn.Module, mesh: Any, *, param_dtype: torch.dtype | None = None,
                reduce_dtype: torch.dtype | None = torch.float32, reshard_after_forward: bool = True,
                activation_checkpointing: bool = False, cpu_offload: bool = False,
                activation_checkpointing_every: int = 1) -> nn.Module:
    """Apply activation checkpointing (optional) and FSDP2 to `model` in place: fully_shard on
    every transformer block, then on the root, all over `mesh`.

    param_dtype: the all-gathered compute dtype (None: the storage dtype);
    reduce_dtype: gradient reduce-scatter dtype. LoRA and frozen parameters must be set up before.
    activation_checkpointing_every: with activation_checkpointing, checkpoint only the blocks whose
    index is a multiple of k (k = 1: every block; k = 2: blocks 0, 2, 4, ...): fewer recomputed
    forwards for more stored activations.
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    if activation_checkpointing_every < 1:
        raise ValueError(f"activation_checkpointing_every must be >= 1, got {activation_checkpointing_every}")
    blocks = find_blocks(model)
    if activation_checkpointing:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        for i in range(0, len(blocks), activation_checkpointing_every):
            # non-reentrant checkpointing: works with keyword arguments and FSDP2 hooks
            blocks[i] = checkpoint_wrapper(blocks[i])
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    kwargs: dict[str, Any] = {"mesh": mesh, "mp_policy": mp}
    if cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    for block in blocks:
        fully_shard(block, reshard_after_forward=reshard_after_forward, **kwargs)
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


def build_train_model(model: nn.Module, mesh: Any, fsdp: Any, lora: Any | None = None, *,
                      adapter: Any | None = None,
                      activation_checkpointing_every: int = 1) -> tuple[nn.Module, dict | None, list[str]]:
    """Steps 1-6 of the module docstring. Returns (sharded model, lora_config or None, never-trained names).

    fsdp / lora: the cfg.fsdp / cfg.lora sections (duck-typed).
    adapter: the model family's adapter (models/base.py): its lora_target_modules are the LoRA
    targets when --lora-target-modules is unset, and its never_trained_param_names(model) are the
    parameters frozen in step 2. None: no default targets, nothing family-specific frozen.
    activation_checkpointing_every: see parallelize (not a trainer flag; tools/bench.py times it).
    """
    mode = fsdp.fsdp_trainable_mode
    lora_config = None
    if mode == "lora":
        if fsdp.fsdp_cpu_offload:
            raise ValueError("--fsdp-cpu-offload is rejected with --fsdp-trainable-mode lora: gradient clipping "
                             "over CPU-offloaded adapter DTensors has no collective backend")
        targets = lora.lora_target_modules or list(getattr(adapter, "lora_target_modules", ()))
        lora_config = apply_lora(model, targets, lora.lora_rank, lora.lora_alpha, lora.lora_dropout)
    elif mode == "full":
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
    parallelize(model, mesh, param_dtype=resolve_dtype(fsdp.fsdp_param_dtype),
                reduce_dtype=resolve_dtype(fsdp.fsdp_reduce_dtype),
                reshard_after_forward=not fsdp.no_fsdp_reshard_after_forward,
                activation_checkpointing=fsdp.fsdp_activation_checkpointing,
                cpu_offload=fsdp.fsdp_cpu_offload, activation_checkpointing_every=activation_checkpointing_every)
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

def plan_updates(n_local: int, num_updates: int, micro_batch_size: int) -> list[list[tuple[int, int]]]:
    """Split n_local candidates into `num_updates` disjoint equal parts of micro-batches.

    Returns, per update, the [start, end) ranges of its micro-batches. Every candidate is in exactly
    one micro-batch of exactly one update; no micro-batch straddles an update boundary.
    Raises ValueError when num_updates does not divide n_local or micro_batch_size does not divide
    a part (unequal parts/chunks would silently reweight the mean).
    """
    if num_updates < 1 or micro_batch_size < 1:
        raise ValueError(f"--num-updates-per-batch ({num_updates}) and --micro-batch-size ({micro_batch_size}) must be >= 1")
    if n_local < 1 or n_local % num_updates:
        raise ValueError(f"--num-updates-per-batch {num_updates} must divide this rank's {n_local} candidates")
    part = n_local // num_updates
    if part % micro_batch_size:
        raise ValueError(f"--micro-batch-size {micro_batch_size} must divide each update's {part} candidates "
                         f"({n_local} local / {num_updates} updates)")
    return [[(u * part + s, u * part + s + micro_batch_size) for s in range(0, part, micro_batch_size)]
            for u in range(num_updates)]


#: batch entries shared by all candidates even when their leading size happens to equal n
SHARED_BATCH_KEYS = ("sde_indices",)


def slice_batch(batch: dict[str, Any], start: int, end: int, n: int) -> dict[str, Any]:
    """Rows [start, end) of every per-candidate entry of `batch` (tensor or list whose leading size is n);
    other entries (scalars, shared tensors, SHARED_BATCH_KEYS) are passed through unchanged.
    A family whose batch has other shared [n]-sized entries passes its own slice_fn to train_step."""
    out = {}
    for k, v in batch.items():
        if k in SHARED_BATCH_KEYS:
            out[k] = v
        elif isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == n:
            out[k] = v[start:end]
        elif isinstance(v, (list, tuple)) and len(v) == n:
            out[k] = v[start:end]
        else:
            out[k] = v
    return out


def reshard_all(model: nn.Module) -> None:
    """Put every FSDP2 unit of `model` back to its sharded parameters (a no-op for sharded ones)."""
    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t._local_tensor if isinstance(t, DTensor) else t


# ----------------------------------------------------------------------------------------------
# offload

class _StorageOffload:
    """Frees device storages for real (resize to 0) and keeps a (pinned) host copy; restores bit-exactly.

    Why storage resizing: under fully_shard a parameter is a DTensor whose local shard is a view of
    FSDP's own padded buffer; reassigning `param.data` would leave that buffer alive and free nothing.
    """

    def __init__(self) -> None:
        self._saved: list[tuple[torch.UntypedStorage, int, torch.Tensor]] = []
        #: the host copies live in one exactly-sized buffer, kept across offloads (trainer.host_arena)
        self._arena: HostArena | None = None

    @property
    def active(self) -> bool:
        return bool(self._saved)

    @property
    def host_bytes(self) -> int:
        return self._arena.nbytes if self._arena is not None else 0

    def release(self, tensors: Iterable[torch.Tensor], pin: bool) -> int:
        if self._saved:
            raise OffloadError("release called twice without resume")
        storages: dict[int, tuple[torch.UntypedStorage, torch.device]] = {}
        for t in tensors:
            st = t.untyped_storage()
            if st.nbytes() and st.data_ptr() not in storages:
                storages[st.data_ptr()] = (st, t.device)
        if self._arena is None or self._arena.pin != pin:
            self._arena = HostArena(pin)
        freed = 0
        try:
            hosts = self._arena.slices([st.nbytes() for st, _ in storages.values()])
            for (st, device), host in zip(storages.values(), hosts):
                nbytes = st.nbytes()
                view = torch.empty(0, dtype=torch.uint8, device=device).set_(st)
                host.copy_(view, non_blocking=False)
                st.resize_(0)
                self._saved.append((st, nbytes, host))
                freed += nbytes
        except Exception as exc:
            self.resume()  # give back what was already released, then fail loudly
            raise OffloadError(f"releasing actor storage failed after {freed} bytes: {exc!r}") from exc
        return freed

    def resume(self) -> int:
        restored = 0
        try:
            while self._saved:
                st, nbytes, host = self._saved[-1]
                st.resize_(nbytes)
                view = torch.empty(0, dtype=torch.uint8, device=st.device).set_(st)
                view.copy_(host, non_blocking=False)
                self._saved.pop()
                restored += nbytes
        except Exception as exc:
            raise OffloadError(f"restoring actor storage failed with {len(self._saved)} storages left "
                               f"({restored} bytes restored): {exc!r}") from exc
        return restored


# ----------------------------------------------------------------------------------------------
# the actor

def _sec(cfg: Any, name: str) -> Any:
    sec = getattr(cfg, name, None)
    if sec is None:
        raise ValueError(f"config has no section {name!r}")
    return sec


class Actor:
    """The FSDP2-sharded trainable transformer, its AdamW, the FlowGRPO update and offload.

    model: the sharded module (already built by build_train_model, or built here from `model`).
    cfg: needs sections fsdp, lora, optim, grpo (duck-typed).
    adapter: the model family's adapter, asked for LoRA targets and never-trained parameters
      (build_train_model).
    total_optimizer_steps: the decay length when --lr-decay-iters is unset.
    """

    def __init__(self, model: nn.Module, mesh: Any, cfg: Any, *, device: torch.device,
                 adapter: Any | None = None, total_optimizer_steps: int | None = None,
                 built: bool = False, lora_config: dict | None = None, never_trained: Sequence[str] = ()) -> None:
        self.cfg = cfg
        self.fsdp, self.lora, self.optim, self.grpo = (_sec(cfg, n) for n in ("fsdp", "lora", "optim", "grpo"))
        self.mesh = mesh
        self.device = torch.device(device)
        if built:
            self.model, self.lora_config, self.never_trained = model, lora_config, list(never_trained)
        else:
            self.model, self.lora_config, self.never_trained = build_train_model(
                model, mesh, self.fsdp, self.lora, adapter=adapter)
        self.mode = self.fsdp.fsdp_trainable_mode
        self.trainable = [p for p in self.model.parameters() if p.requires_grad]
        o = self.optim
        self.optimizer = torch.optim.AdamW(self.trainable, lr=o.lr, betas=(o.adam_beta1, o.adam_beta2),
                                           eps=o.adam_eps, weight_decay=o.weight_decay)
        self.decay_iters = o.lr_decay_iters if o.lr_decay_iters else total_optimizer_steps
        #: optimizer steps taken so far (the lr schedule position; checkpointed as lr_scheduler_steps)
        self.optimizer_steps = 0
        #: rounds dropped entirely because every advantage was ~0
        self.skipped_rounds = 0
        self.last_update_stats: list[dict[str, Any]] = []
        #: the first executed update's own forward is its pi_old anchor (True), or every micro-batch
        #: gets a separate no_grad anchor pass (False: the slower, numerically identical reference)
        self.anchor_from_first_update = True
        #: no_grad anchor passes (micro-batches) of the last train_step
        self.last_anchor_passes = 0
        self._params_off = _StorageOffload()
        self._optim_off = _StorageOffload()

    # -- construction from the model adapter --------------------------------------------------
    @classmethod
    def from_adapter(cls, adapter: Any, model_path: str, mesh: Any, cfg: Any, *, device: torch.device,
                     total_optimizer_steps: int | None = None, revision: str | None = None,
                     load_timings: list[float] | None = None) -> "Actor":
        """Load the adapter's train model in --fsdp-param-dtype (in waves), build and shard it.

        The adapter returns the trainable module itself (--fsdp-trainable-attr names it in the
        model bundle; the frozen text encoder / VAE are the engine's). `load_timings` receives
        the load's per-wave wall times (load_in_waves)."""
        fsdp = _sec(cfg, "fsdp")
        load_dtype = resolve_dtype(fsdp.fsdp_param_dtype)
        model = load_in_waves(lambda: adapter.load_train_model(model_path, dtype=load_dtype, revision=revision),
                              int(fsdp.fsdp_load_wave_size or 0), load_timings)
        return cls(model, mesh, cfg, device=device, adapter=adapter,
                   total_optimizer_steps=total_optimizer_steps)

    # -- learning rate ------------------------------------------------------------------------
    def lr_at(self, step: int) -> float:
        o = self.optim
        return lr_at_step(step, lr=o.lr, min_lr=o.min_lr, warmup_iters=o.lr_warmup_iters,
                          decay_iters=self.decay_iters, schedule=self.fsdp.fsdp_lr_scheduler)

    def state_dict(self) -> dict[str, int]:
        """Scalar training state that rides along with the DCP checkpoint."""
        return {"lr_scheduler_steps": self.optimizer_steps, "skipped_rounds": self.skipped_rounds}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.optimizer_steps = int(state["lr_scheduler_steps"])
        self.skipped_rounds = int(state.get("skipped_rounds", 0))

    # -- the FlowGRPO update ------------------------------------------------------------------
    def train_step(self, batch: dict[str, Any], advantages: torch.Tensor, replay_fn: ReplayFn,
                   valid: torch.Tensor | None = None,
                   slice_fn: Callable[[dict[str, Any], int, int], dict[str, Any]] | None = None,
                   progress: Callable[[], None] | None = None) -> dict[str, float]:
        """One rollout's update over this rank's candidates. Collective: every rank calls it.

        batch: per-candidate entries with leading size n (what replay_fn consumes);
        advantages: [n]; valid: [n] bool (False = candidate of a failed reward group: replayed so
        every rank runs the same collectives, but excluded from the loss); replay_fn(model, rows)
        -> logp [b, S] (fp32 preferred); slice_fn(batch, start, end) -> rows [start, end) (default
        slice_batch, which is what the training loop uses for Qwen-Image's batch: views, no copy);
        progress() is called after every replayed micro-batch, anchor passes included (a progress bar).

        1. plan: n split into num_updates_per_batch disjoint equal parts of micro-batches; ranks
           MAX-check they agree on the micro-batch count (raise, never deadlock).
        2. skip: an update whose valid advantages are all ~0 on every rank is skipped (counted).
        3. anchor: pi_old log-probs through the live model with the same replay_fn, before any
           optimizer step. The first executed update runs before any step, so its own forward
           (with grad) is the anchor: old = logp.detach(), ratio exactly 1 by construction. Only
           the micro-batches of later updates get a separate no_grad anchor pass, all of them
           before the first step (`anchor_from_first_update=False`: every micro-batch gets one).
        4. per update: loss over micro-batches (per-(sample, step) clipped objective), scaled so
           the FSDP mean-reduced gradient is the mean over all valid (sample, step) of all ranks;
           clip_grad; lr from the schedule; AdamW step.
        Returns the train/* and perf/* series (ratio_min/max MAX-reduced, the rest averaged).
        """
        t_start = time.perf_counter()
        g = self.grpo
        n = int(advantages.shape[0])
        cut = slice_fn or (lambda b, s, e: slice_batch(b, s, e, n))
        plan = plan_updates(n, int(g.num_updates_per_batch), int(g.micro_batch_size))
        n_mb = sum(len(p) for p in plan)
        cdev = collective_device()
        adv = advantages.detach().float().to(self.device)
        ok = torch.ones(n, dtype=torch.bool, device=self.device) if valid is None else valid.to(self.device).bool()
        if ok.shape != adv.shape:
            raise ValueError(f"valid mask shape {tuple(ok.shape)} != advantages shape {tuple(adv.shape)}")
        world = dist.get_world_size() if dist.is_initialized() else 1

        # 1-2: one MAX reduce carries the plan check and the per-update max |A|; one SUM the valid counts
        bad_adv = (~torch.isfinite(adv) & ok).any().float().reshape(1).to(cdev)
        masked_abs = torch.where(ok, adv.abs(), torch.zeros_like(adv)).to(cdev)
        ok_c = ok.to(cdev)
        part_max = torch.stack([masked_abs[p[0][0]:p[-1][1]].max() for p in plan])
        part_cnt = torch.stack([ok_c[p[0][0]:p[-1][1]].sum().float() for p in plan])
        mx = all_reduce_max(torch.cat([torch.tensor([n_mb, -n_mb], dtype=torch.float32, device=cdev), bad_adv,
                                       part_max]))
        mx = mx.tolist()  # the plan's only host syncs: two tiny reduces before any forward
        if int(mx[0]) != n_mb or int(-mx[1]) != n_mb:
            raise MicroBatchMismatchError(
                f"rank {dist.get_rank() if dist.is_initialized() else 0} plans {n_mb} micro-batches but ranks range "
                f"{int(-mx[1])}..{int(mx[0])}: every rank needs the same local candidate count, "
                "--num-updates-per-batch and --micro-batch-size")
        if mx[2] > 0:
            raise ValueError("non-finite advantage for a valid candidate on some rank: the reward/advantage stage must "
                             "mark failed groups invalid instead of passing NaN/inf")
        global_cnt = all_reduce_sum(part_cnt.clone()).tolist()
        run = [mx[3 + u] > ZERO_ADVANTAGE and global_cnt[u] > 0 for u in range(len(plan))]
        ok_host = ok.cpu()

        metrics: dict[str, float] = {"train/num_microbatches": float(n_mb)}
        skips = sum(len(p) for u, p in enumerate(plan) if not run[u])
        if not any(run):
            self.skipped_rounds += 1
            metrics.update({"train/optimizer_steps": 0.0, "train/optimizer_skips": float(skips),
                            "train/skipped_rounds": float(self.skipped_rounds),
                            "train/lr": self.lr_at(self.optimizer_steps),
                            "train/lr_scheduler_steps": float(self.optimizer_steps)})
            return metrics

        # partially valid micro-batches: their row indices on the device, copied before any forward
        # is queued (boolean masking on the device, or a copy per micro-batch, syncs the host each time)
        part_idx = {(s, e): torch.nonzero(ok_host[s:e]).flatten().to(self.device)
                    for u, part in enumerate(plan) if run[u] for (s, e) in part
                    if 0 < int(ok_host[s:e].sum()) < e - s}

        self.model.train()
        # 3: the anchor, frozen before any optimizer step. The first executed update's forward IS
        # its anchor (no step precedes it), so only the later updates need a no_grad pass here.
        first = run.index(True)
        fused = {first} if self.anchor_from_first_update else set()
        old: dict[tuple[int, int], torch.Tensor] = {}
        with torch.no_grad():
            for u, part in enumerate(plan):
                if run[u] and u not in fused:
                    for (s, e) in part:
                        old[(s, e)] = replay_fn(self.model, cut(batch, s, e)).detach().float()
                        if progress is not None:
                            progress()
        self.last_anchor_passes = len(old)

        # 4: the updates
        acc = torch.zeros(8, dtype=torch.float64, device=self.device)  # weighted stat sums, see below
        rmax = torch.full((2,), -math.inf, dtype=torch.float64, device=self.device)  # ratio_max, -ratio_min
        grad_norms: list[torch.Tensor] = []
        steps = 0
        transitions = 0
        elems = 0.0  # valid (sample, step) elements behind acc[:5]; host-side, no device traffic
        lr = self.lr_at(self.optimizer_steps)
        #: per executed update, this rank's ratio range (detached tensors; for diagnostics and tests)
        self.last_update_stats = []
        for u, part in enumerate(plan):
            if not run[u]:
                continue
            self.optimizer.zero_grad(set_to_none=True)
            upd = torch.full((2,), -math.inf, dtype=torch.float64, device=self.device)
            for (s, e) in part:
                logp = replay_fn(self.model, cut(batch, s, e))
                if logp.dim() == 1:
                    logp = logp[:, None]
                rows_host = ok_host[s:e]
                n_rows = int(rows_host.sum())
                transitions += logp.shape[0] * logp.shape[1]
                if n_rows:
                    # the first executed update: this very forward is pi_old (ratio exactly 1)
                    anchor = old[(s, e)] if u not in fused else logp.detach().float()
                    if n_rows == e - s:
                        lp, op, ad = logp, anchor, adv[s:e]
                    else:
                        idx = part_idx[(s, e)].to(logp.device)
                        lp, op, ad = logp.index_select(0, idx), anchor.index_select(0, idx), adv[s:e].index_select(0, idx)
                    loss, st = grpo_clip_loss(lp, op, ad, g.eps_clip, getattr(g, "eps_clip_high", None))
                    scale = n_rows * world / global_cnt[u]
                    (loss * scale).backward()
                    k = float(n_rows * logp.shape[1])  # elements behind these stats
                    rm, rs = st["ratio_mean"].double(), st["ratio_std"].double()
                    # k enters as a Python scalar: a torch.tensor(k, device=cuda) would be a blocking
                    # host-to-device copy, i.e. a host sync per micro-batch
                    acc[:5] += torch.stack([loss.detach().double(), st["clip_fraction"].double(),
                                            st["approx_kl"].double(), rm, rs * rs + rm * rm]).to(acc.device) * k
                    elems += k
                    r_range = torch.stack([st["ratio_max"].double(), -st["ratio_min"].double()])
                    rmax = torch.maximum(rmax, r_range)
                    upd = torch.maximum(upd, r_range)
                else:
                    # no valid row here, but FSDP's reduce-scatter must still run on every rank
                    (logp.sum() * 0.0).backward()
                if progress is not None:
                    progress()
            self.last_update_stats.append({"update": u, "ratio_max": upd[0], "ratio_min": -upd[1]})
            gn = self._clip_grad()
            if torch.isfinite(gn):
                lr = self.lr_at(self.optimizer_steps)
                for group in self.optimizer.param_groups:
                    group["lr"] = lr
                self.optimizer.step()
                self.optimizer_steps += 1
                steps += 1
                grad_norms.append(gn.detach().double().reshape(()))
            else:
                log.warning("non-finite grad norm %s in update %d: optimizer step skipped", gn.item(), u)
                skips += len(part)
            self.optimizer.zero_grad(set_to_none=True)

        # metrics: one SUM and one MAX reduce, one host transfer
        acc[5] = elems
        acc[6] = torch.stack(grad_norms).sum() if grad_norms else 0.0
        acc[7] = float(len(grad_norms))
        dt = time.perf_counter() - t_start
        sums = all_reduce_sum(torch.cat([acc, torch.tensor([transitions, n, 1.0], dtype=torch.float64,
                                                           device=acc.device)]).to(cdev))
        maxes = all_reduce_max(torch.cat([rmax, torch.tensor([dt], dtype=torch.float64, device=rmax.device)]).to(cdev))
        sv, mv = sums.tolist(), maxes.tolist()
        k = max(sv[5], 1.0)
        mean_r = sv[3] / k
        metrics.update({
            "train/loss": sv[0] / k,
            "train/clip_fraction": sv[1] / k,
            "train/approx_kl": sv[2] / k,
            "train/ratio_mean": mean_r,
            "train/ratio_std": math.sqrt(max(sv[4] / k - mean_r * mean_r, 0.0)),
            "train/ratio_max": mv[0],
            "train/ratio_min": -mv[1],
            "train/grad_norm": sv[6] / max(sv[7], 1.0),
            "train/lr": lr,
            "train/optimizer_steps": float(steps),
            "train/optimizer_skips": float(skips),
            "train/skipped_rounds": float(self.skipped_rounds),
            "train/lr_scheduler_steps": float(self.optimizer_steps),
            "perf/train_time": mv[2],
            "perf/train_transitions_per_s": sv[8] / max(mv[2], 1e-9),
            "perf/train_samples_per_s": sv[9] / max(mv[2], 1e-9),
        })
        metrics.update(self.memory_metrics())
        return metrics

    def _clip_grad(self) -> torch.Tensor:
        """Total grad norm over all ranks (clipped to --clip-grad when > 0); a 0-d local tensor."""
        from torch.distributed.tensor import DTensor

        with_grad = [p for p in self.trainable if p.grad is not None]
        if not with_grad:
            return torch.zeros((), device=self.device)
        max_norm = float(self.optim.clip_grad) if self.optim.clip_grad and self.optim.clip_grad > 0 else math.inf
        gn = torch.nn.utils.clip_grad_norm_(with_grad, max_norm)
        if isinstance(gn, DTensor):
            gn = gn.full_tensor()
        return gn

    def memory_metrics(self) -> dict[str, float]:
        """perf/mem_{allocated,reserved,peak}_gb, MAX over ranks (CUDA only; {} on CPU)."""
        if self.device.type != "cuda":
            return {}
        v = torch.tensor([torch.cuda.memory_allocated(self.device), torch.cuda.memory_reserved(self.device),
                          torch.cuda.max_memory_allocated(self.device)], dtype=torch.float64, device=self.device)
        a, r, p = (x / 1e9 for x in all_reduce_max(v).tolist())
        return {"perf/mem_allocated_gb": a, "perf/mem_reserved_gb": r, "perf/mem_peak_gb": p}

    # -- colocate offload ---------------------------------------------------------------------
    @property
    def offloaded(self) -> bool:
        return self._params_off.active or self._optim_off.active

    def _param_tensors(self) -> list[torch.Tensor]:
        out = [_local(p) for p in self.model.parameters()]
        out += [b for b in self.model.buffers()]
        return [t for t in out if t.device.type == self.device.type]

    def _optim_tensors(self) -> list[torch.Tensor]:
        out = []
        for state in self.optimizer.state.values():
            for v in state.values():
                if isinstance(v, torch.Tensor):
                    lt = _local(v)
                    # AdamW keeps `step` as a CPU scalar on GPU runs: nothing to free there
                    if lt.device.type == self.device.type:
                        out.append(lt)
        return out

    def offload(self) -> dict[str, float]:
        """Release the parameter/buffer shards and AdamW state from the device into (pinned) host memory.

        Fatal on failure (OffloadError). Gradients must be None (they are after train_step).
        """
        if self.offloaded:
            raise OffloadError("actor is already offloaded: call onload() first")
        if any(p.grad is not None for p in self.model.parameters()):
            raise OffloadError("actor still holds gradients; offload after optimizer.zero_grad(set_to_none=True)")
        reshard_all(self.model)
        t0 = time.perf_counter()
        pin = self.device.type == "cuda"
        freed = self._params_off.release(self._param_tensors(), pin)
        freed += self._optim_off.release(self._optim_tensors(), pin)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
        return {"perf/actor_offload_gb": freed / 1e9, "perf/actor_offload_time": time.perf_counter() - t0,
                "perf/actor_offload_host_gb": (self._params_off.host_bytes + self._optim_off.host_bytes) / 1e9}

    def onload(self) -> dict[str, float]:
        """Bring back what offload() released, bit-exactly. Fatal on failure (OffloadError)."""
        if not self.offloaded:
            raise OffloadError("actor is not offloaded: onload() without offload()")
        t0 = time.perf_counter()
        restored = self._params_off.resume() + self._optim_off.resume()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return {"perf/actor_onload_gb": restored / 1e9, "perf/actor_onload_time": time.perf_counter() - t0}

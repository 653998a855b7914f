"""The actor: the trainable transformer sharded with FSDP2 (built by trainer/train_model.py), its
optimizer, the FlowGRPO update and the colocate offload.

The update (`Actor.train_step`) is model-family independent: the caller supplies a `ReplayFn`
(in production models.base.Replay: the adapter's replay_transitions over the trained-step
columns) and the batch, a trainer.trajectory.Trajectory (anything whose
`batch[start:end]` is those candidates' rows will do). `Actor.nft_train_step` is the DiffusionNFT
update (--algorithm nft) beside it, with its own numbered plan over the same micro-batch plan,
optimizer step and EMA, and an old policy kept like the EMA.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Protocol, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from trainer.config import FsdpConfig, GrpoConfig, LoraConfig, OptimConfig
from trainer.core.dtypes import resolve_dtype
from trainer.distributed import all_reduce_max, all_reduce_sum, collective_device
from trainer.ema import ParamEMA
from trainer.flow_grpo import (TransitionMoments, grpo_clip_loss, grpo_guard_clip_loss, guard_step_weight,
                               transition_kl)
from trainer.host_arena import HostArena
from trainer.lr_schedule import lr_at_step
# the model building lives in trainer.train_model; these names stay importable from here
from trainer.train_model import (apply_lora, build_train_model, load_in_waves, local_shard,  # noqa: F401
                                 parallelize, reshard_all)

_local = local_shard  # the older private name

log = logging.getLogger(__name__)

#: |advantage| at or below this everywhere (all ranks) makes an update degenerate: skipped and counted
ZERO_ADVANTAGE = 1e-8


class ReplayFn(Protocol):
    """replay_fn(model, rows) -> logp [b, S] fp32 of every trained-step column of the rows;
    replay_fn.moments(model, rows) -> flow_grpo.TransitionMoments of the same forward, needed only
    with the KL to the reference (--use-kl-loss). A plain function is a ReplayFn without the KL."""

    def __call__(self, model: nn.Module, rows: Any) -> torch.Tensor: ...

    def moments(self, model: nn.Module, rows: Any) -> TransitionMoments: ...


#: velocity_fn(model, rows, x_t [b, ...], sigma [b]) -> the DiT's velocity [b, ...] (the nft update)
VelocityFn = Callable[[nn.Module, Any, torch.Tensor, torch.Tensor], torch.Tensor]


class OffloadError(RuntimeError):
    """Releasing or restoring the actor's device storage failed (fatal: the run must stop)."""


class MicroBatchMismatchError(RuntimeError):
    """Ranks disagree on the micro-batch plan; running on would deadlock an FSDP collective."""


# ----------------------------------------------------------------------------------------------
# the update's plan

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


def global_update_order(ids: Sequence[int], num_updates: int) -> list[int]:
    """The local rows in update order: row i (global candidate id ids[i], group-major over the
    whole rollout) belongs to update ids[i] mod num_updates, and the rows of one update keep their
    global order. Update u is therefore the same set of candidates on any world size (slots u,
    u + U, ... of every group when U divides the group size), and each rank holds its equal share
    of it: a contiguous block of n rows, with U dividing n, holds n / U of every residue.

    Returns the permutation of range(len(ids)) that puts update 0's rows first, then update 1's;
    raises ValueError when this rank's rows are not an equal share of every update."""
    n = len(ids)
    if num_updates < 1:
        raise ValueError(f"--num-updates-per-batch must be >= 1, got {num_updates}")
    counts = [0] * num_updates
    for i in ids:
        counts[int(i) % num_updates] += 1
    if len(set(counts)) > 1:
        raise ValueError(f"--num-updates-per-batch {num_updates}: this rank's {n} candidates hold {counts} of the "
                         "updates (candidate id mod the update count); every rank needs an equal share of every "
                         "update: make the update count divide the candidates per rank")
    return sorted(range(n), key=lambda i: (int(ids[i]) % num_updates, int(ids[i])))


@dataclass
class UpdatePlan:
    """What `Actor._plan` decided for one train_step, the same on every rank."""

    n: int
    #: per update, the [start, end) ranges of its micro-batches (plan_updates)
    parts: list[list[tuple[int, int]]]
    #: per update: runs (False: all its valid advantages are ~0 on every rank)
    run: list[bool]
    #: per update, the valid candidates over all ranks (the loss scale's denominator)
    global_valid: list[float]
    #: [n] bool on the host: which candidates enter the loss
    valid_host: torch.Tensor
    #: [n] int64 on the host: each row's global candidate id (global_update_order's key)
    ids: torch.Tensor
    #: (start, end) -> device row indices of a partially valid micro-batch
    partial_rows: dict[tuple[int, int], torch.Tensor]
    world: int
    skipped_microbatches: int

    @property
    def num_microbatches(self) -> int:
        return sum(len(p) for p in self.parts)


class UpdateStats:
    """A train_step's statistics, accumulated on the device without host syncs and reduced once.

    Each micro-batch adds its loss, clip fraction, approx KL, ratio mean and ratio second moment
    weighted by its valid (sample, step) element count k (so the result is the mean over all
    valid elements of all ranks), and widens the ratio range; each optimizer step adds its grad
    norm."""

    _SUMS = ("loss", "clip_fraction", "approx_kl", "ratio_mean", "ratio_sq")

    def __init__(self, device: torch.device, kl: bool = False) -> None:
        self.device = device
        self.sums = torch.zeros(len(self._SUMS), dtype=torch.float64, device=device)
        #: (ratio_max, -ratio_min) over the whole step, and over the current update
        self.ratio_range = torch.full((2,), -math.inf, dtype=torch.float64, device=device)
        self._update_range = self.ratio_range.clone()
        self._update_start = (self.sums[3].clone(), 0.0)
        self.elements = 0.0  # valid (sample, step) elements behind `sums`; host-side, no device traffic
        self.grad_norms: list[torch.Tensor] = []
        #: KL to the reference (--use-kl-loss): its element-weighted sum, over the step and the update
        self.kl_sum = torch.zeros((), dtype=torch.float64, device=device) if kl else None
        self._update_kl: torch.Tensor | None = None
        self.transitions = 0
        self.steps = 0

    def begin_update(self) -> None:
        self._update_range = torch.full((2,), -math.inf, dtype=torch.float64, device=self.device)
        self._update_kl = None
        # where this update's share of the ratio sum starts (a device copy: no host sync)
        self._update_start = (self.sums[3].clone(), self.elements)

    def add(self, loss: torch.Tensor, st: dict[str, torch.Tensor], k: float) -> None:
        rm, rs = st["ratio_mean"].double(), st["ratio_std"].double()
        # k enters as a Python scalar: a torch.tensor(k, device=cuda) would be a blocking
        # host-to-device copy, i.e. a host sync per micro-batch
        self.sums += torch.stack([loss.detach().double(), st["clip_fraction"].double(), st["approx_kl"].double(),
                                  rm, rs * rs + rm * rm]).to(self.device) * k
        self.elements += k
        if "kl_ref" in st:
            part = st["kl_ref"].double().to(self.device) * k
            self.kl_sum = self.kl_sum + part
            self._update_kl = part / k if self._update_kl is None else torch.maximum(self._update_kl, part / k)
        r_range = torch.stack([st["ratio_max"].double(), -st["ratio_min"].double()])
        self.ratio_range = torch.maximum(self.ratio_range, r_range)
        self._update_range = torch.maximum(self._update_range, r_range)

    def update_ratio_range(self) -> dict[str, torch.Tensor]:
        """This update's ratio range and element-weighted mean ratio (and, with the KL term, its
        largest micro-batch mean KL)."""
        out = {"ratio_max": self._update_range[0], "ratio_min": -self._update_range[1]}
        start_sum, start_elements = self._update_start
        out["ratio_mean"] = (self.sums[3] - start_sum) / max(self.elements - start_elements, 1.0)
        if self._update_kl is not None:
            out["kl_ref_max"] = self._update_kl
        return out

    def add_step(self, grad_norm: torch.Tensor) -> None:
        self.grad_norms.append(grad_norm.detach().double().reshape(()))
        self.steps += 1

    def reduce(self, n: int, seconds: float) -> dict[str, float]:
        """The train/* and perf/* means over all ranks: one SUM and one MAX reduce."""
        cdev = collective_device()
        gn_sum = torch.stack(self.grad_norms).sum() if self.grad_norms else torch.zeros((), dtype=torch.float64,
                                                                                        device=self.device)
        local = torch.cat([self.sums, torch.stack([torch.tensor(self.elements, dtype=torch.float64,
                                                                device=self.device),
                                                   gn_sum.to(self.device),
                                                   torch.tensor(float(len(self.grad_norms)), dtype=torch.float64,
                                                                device=self.device)]),
                           torch.tensor([self.transitions, n, 1.0], dtype=torch.float64, device=self.device)])
        sums = all_reduce_sum(local.to(cdev)).tolist()
        maxes = all_reduce_max(torch.cat([self.ratio_range, torch.tensor([seconds], dtype=torch.float64,
                                                                         device=self.device)]).to(cdev)).tolist()
        loss, clip, kl, ratio, ratio_sq, elems, gn, n_gn, transitions, samples, _ = sums
        k = max(elems, 1.0)
        mean_r = ratio / k
        extra = {}
        if self.kl_sum is not None:
            extra["train/kl_ref"] = float(all_reduce_sum(self.kl_sum.reshape(1).to(cdev))[0]) / k
        return {
            **extra,
            "train/loss": loss / k,
            "train/clip_fraction": clip / k,
            "train/approx_kl": kl / k,
            "train/ratio_mean": mean_r,
            "train/ratio_std": math.sqrt(max(ratio_sq / k - mean_r * mean_r, 0.0)),
            "train/ratio_max": maxes[0],
            "train/ratio_min": -maxes[1],
            "train/grad_norm": gn / max(n_gn, 1.0),
            "perf/train_time": maxes[2],
            "perf/train_transitions_per_s": transitions / max(maxes[2], 1e-9),
            "perf/train_samples_per_s": samples / max(maxes[2], 1e-9),
        }


class _NftStats:
    """nft_train_step's statistics: element-weighted sums on the device (no host sync per
    micro-batch), reduced once; the optimizer steps' grad norms as UpdateStats keeps them."""

    _SUMS = ("loss", "positive_loss", "negative_loss", "old_deviation", "r_mean")

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.sums = torch.zeros(len(self._SUMS), dtype=torch.float64, device=device)
        self.elements = 0.0
        self.grad_norms: list[torch.Tensor] = []
        self.transitions = 0
        self.steps = 0

    def add(self, loss: torch.Tensor, st: dict[str, torch.Tensor], k: float) -> None:
        vals = [loss.detach()] + [st[n] for n in self._SUMS[1:]]
        self.sums += torch.stack([v.double() for v in vals]).to(self.device) * k
        self.elements += k

    def add_step(self, grad_norm: torch.Tensor) -> None:
        self.grad_norms.append(grad_norm.detach().double().reshape(()))
        self.steps += 1

    def reduce(self, n: int, seconds: float) -> dict[str, float]:
        cdev = collective_device()
        gn = torch.stack(self.grad_norms).sum().to(self.device) if self.grad_norms else \
            torch.zeros((), dtype=torch.float64, device=self.device)
        extra = torch.tensor([self.elements, float(len(self.grad_norms)), self.transitions, n],
                             dtype=torch.float64, device=self.device)
        sums = all_reduce_sum(torch.cat([self.sums, gn.reshape(1), extra]).to(cdev)).tolist()
        secs = float(all_reduce_max(torch.tensor([seconds], dtype=torch.float64, device=cdev))[0])
        k = max(sums[6], 1.0)  # the valid (sample, sigma) elements
        out = {f"train/{name}": sums[i] / k for i, name in enumerate(self._SUMS)}
        out.update({"train/grad_norm": sums[5] / max(sums[7], 1.0), "perf/train_time": secs,
                    "perf/train_transitions_per_s": sums[8] / max(secs, 1e-9),
                    "perf/train_samples_per_s": sums[9] / max(secs, 1e-9)})
        return out


def _gap_max(gap: torch.Tensor, logp: torch.Tensor, recorded: torch.Tensor, plan: "UpdatePlan",
             s: int, e: int) -> torch.Tensor:
    """max(gap, max |logp - recorded| over the valid rows of micro-batch [s, e)), on the device:
    the row indices are the plan's (already there), so this adds no host sync."""
    n_ok = int(plan.valid_host[s:e].sum())
    if not n_ok:
        return gap
    d = (logp.detach().double().reshape(recorded.shape) - recorded.double()).abs()
    if n_ok < e - s:
        d = d.index_select(0, plan.partial_rows[(s, e)].to(d.device))
    return torch.maximum(gap, d.max().to(gap.device))


def _clean_latents(rows: Any) -> torch.Tensor:
    """x0 [b, ...] of an nft rollout: the last recorded column's next latents, the output of the
    sampler's final (deterministic) step."""
    return rows.next_latents[:, -1].float()


class lora_disabled:
    """Context manager: every peft LoRA layer of `model` computes the base output only (the
    reference policy of the KL term), restored on exit. A model without LoRA is unchanged."""

    def __init__(self, model: nn.Module) -> None:
        from peft.tuners.tuners_utils import BaseTunerLayer

        self.layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]

    # the forward's own switch; peft's enable_adapters() would also reset requires_grad, which
    # would unfreeze the LoRA tensors the actor froze as never trained
    def __enter__(self) -> "lora_disabled":
        self.saved = [layer._disable_adapters for layer in self.layers]
        for layer in self.layers:
            layer._disable_adapters = True
        return self

    def __exit__(self, *exc) -> None:
        for layer, was in zip(self.layers, self.saved):
            layer._disable_adapters = was


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

class ActorConfig(Protocol):
    """The config sections the actor reads (a RunConfig has them; tools/bench.py builds just these)."""

    fsdp: FsdpConfig
    lora: LoraConfig
    optim: OptimConfig
    grpo: GrpoConfig


def _nft_chunks(k: int, per_forward: int) -> list[range]:
    """The noise-level indices 0..k-1 in forwards of `per_forward` levels (0: all k in one)."""
    step = k if per_forward <= 0 else per_forward
    return [range(j, min(j + step, k)) for j in range(0, k, step)]


def _nft_velocities(velocity_fn: VelocityFn, model: nn.Module, rows: Any, x0: torch.Tensor, noise: torch.Tensor,
                    sig: torch.Tensor, js: range) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(x_t, v) [b, ...] of `rows` at each noise level of `js` (sig [b, K], noise [K, b, ...]),
    x_t = forward_noise(x0, noise[j], sig[:, j]) and v its velocity: one DiT forward of len(js) x b
    rows (level js[i]'s rows at block i, the conditions tiled alike), split back per level."""
    from trainer.nft import forward_noise

    x_ts = [forward_noise(x0, noise[j], sig[:, j]) for j in js]
    if len(js) == 1:
        return [(x_ts[0], velocity_fn(model, rows, x_ts[0], sig[:, js.start]))]
    b = int(x0.shape[0])
    v = velocity_fn(model, rows[list(range(b)) * len(js)], torch.cat(x_ts), torch.cat([sig[:, j] for j in js]))
    return list(zip(x_ts, v.split(b)))


class Actor:
    """The FSDP2-sharded trainable transformer, its AdamW, the FlowGRPO update and offload.

    model: the sharded module (already built by build_train_model, or built here from `model`).
    cfg: its typed sections fsdp, lora, optim, grpo (ActorConfig; a RunConfig).
    adapter: the model family's adapter, asked for LoRA targets and never-trained parameters
      (build_train_model).
    total_optimizer_steps: the decay length when --lr-decay-iters is unset.
    """

    def __init__(self, model: nn.Module, mesh: Any, cfg: ActorConfig, *, device: torch.device,
                 adapter: Any | None = None, total_optimizer_steps: int | None = None,
                 built: bool = False, lora_config: dict | None = None, never_trained: Sequence[str] = ()) -> None:
        self.cfg = cfg
        self.fsdp, self.lora, self.optim, self.grpo = cfg.fsdp, cfg.lora, cfg.optim, cfg.grpo
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
                                           eps=o.adam_eps, weight_decay=o.weight_decay,
                                           **({"fused": True} if o.adam_fused else {}))
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
        #: the EMA of the trainable parameters (--ema-decay > 0), or None; starts equal to them
        self.ema: ParamEMA | None = None
        if o.ema_decay > 0:
            self.ema = ParamEMA(((n, p) for n, p in self.model.named_parameters() if p.requires_grad),
                                float(o.ema_decay), int(o.ema_update_interval))
        #: --algorithm nft's old policy: a soft copy of the trainable parameters, kept like the EMA
        #: (sharded fp32, offloaded with AdamW's state) but moved once per rollout on its own
        #: decay schedule (trainer.nft.old_policy_decay); None under FlowGRPO
        self.nft_old: ParamEMA | None = None
        if self.grpo.algorithm == "nft":
            self.nft_old = ParamEMA(((n, p) for n, p in self.model.named_parameters() if p.requires_grad), 0.0)

    # -- construction from the model adapter --------------------------------------------------
    @classmethod
    def from_adapter(cls, adapter: Any, model_path: str, mesh: Any, cfg: ActorConfig, *, device: torch.device,
                     total_optimizer_steps: int | None = None, revision: str | None = None,
                     load_timings: list[float] | None = None) -> "Actor":
        """Load the adapter's train model in --fsdp-param-dtype (in waves), build and shard it.

        The adapter returns the trainable module itself (--fsdp-trainable-attr names it in the
        model bundle; the frozen text encoder / VAE are the engine's). `load_timings` receives
        the load's per-wave wall times (load_in_waves)."""
        fsdp = cfg.fsdp
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

    def state_dict(self) -> dict[str, Any]:
        """Scalar training state that rides along with the DCP checkpoint (the EMA's settings only
        when it is on, so an EMA-off trainer_state.json is unchanged)."""
        state: dict[str, Any] = {"lr_scheduler_steps": self.optimizer_steps, "skipped_rounds": self.skipped_rounds}
        if self.ema is not None:
            state.update({"ema_decay": self.ema.decay, "ema_update_interval": self.ema.interval})
        if self.nft_old is not None:
            state["nft_old_updates"] = self.nft_old.updates
        return state

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.optimizer_steps = int(state["lr_scheduler_steps"])
        self.skipped_rounds = int(state.get("skipped_rounds", 0))
        if self.nft_old is not None:
            self.nft_old.updates = int(state.get("nft_old_updates", 0))

    # -- the FlowGRPO update ------------------------------------------------------------------
    def train_step(self, batch: Any, advantages: torch.Tensor, replay_fn: ReplayFn,
                   valid: torch.Tensor | None = None,
                   progress: Callable[[], None] | None = None,
                   ids: Sequence[int] | torch.Tensor | None = None) -> dict[str, float]:
        """One rollout's update over this rank's candidates. Collective: every rank calls it.

        batch: n candidates' Trajectory (what replay_fn consumes; `batch[s:e]` is a micro-batch);
        advantages: [n]; valid: [n] bool (False = candidate of a failed reward group: replayed so
        every rank runs the same collectives, but excluded from the loss);
        replay_fn(model, rows) -> logp [b, S] (fp32 preferred); progress() is called after every
        replayed micro-batch, anchor passes included (a progress bar); ids: [n] the rows' global
        candidate ids over the whole rollout (None: 0..n-1, one process holding everything).

        1. plan (`_open_round`, `_plan`): the rows put in update order (global_update_order:
           candidate id mod num_updates_per_batch, so an update is the same candidates on any
           world size and each rank holds its share), each update's share cut into micro-batches
           of --micro-batch-size (gradient accumulation); ranks MAX-check they agree on the
           micro-batch count (raise, never deadlock); an update whose valid advantages are all
           ~0 on every rank is skipped (counted).
        2. anchor (`_anchor`): pi_old log-probs through the live model with the same replay_fn,
           before any optimizer step. The first executed update runs before any step, so its own
           forward (with grad) is the anchor: old = logp.detach(), ratio exactly 1 by
           construction. Only the micro-batches of later updates get a separate no_grad anchor
           pass, all of them before the first step (`anchor_from_first_update=False`: every
           micro-batch gets one). --old-logprob-source rollout (`_recorded_old`): the sampler's
           recorded log-probs are pi_old and no anchor pass runs; the first executed update's own
           forward then measures train/rollout_logprob_gap_max (0 where the sampler is the replay
           to the bit, and then the same weights as the anchor path).
        3. per update (`_backward_microbatch`, `_optimizer_step`): loss over micro-batches
           (per-(sample, step) clipped objective), scaled so the FSDP mean-reduced gradient is the
           mean over all valid (sample, step) of the whole update, every rank's share summed: the
           gradient one process holding the whole update would get; clip_grad on the global norm;
           lr from the schedule; AdamW.
        4. metrics (`UpdateStats.reduce`): one SUM and one MAX reduce, one host transfer
           (ratio_min/max MAX-reduced, the rest averaged over valid (sample, step) elements).
        """
        t_start = time.perf_counter()
        batch, adv, plan, metrics = self._open_round(batch, advantages, valid, ids)
        if not any(plan.run):
            return metrics

        self.model.train()
        from_rollout = self.grpo.old_logprob_source == "rollout"
        if from_rollout and self.guard:
            raise ValueError("--old-logprob-source rollout with --grpo-guard: GRPO-Guard needs pi_old's transition "
                             "means, which only the anchor replay computes; use --old-logprob-source replay")
        first = plan.run.index(True)
        if from_rollout:
            fused: set[int] = set()
            old = self._recorded_old(batch, plan)
            old_means: dict = {}
            # the first executed update replays on the rollout's weights: its own forward measures
            # the rollout-to-replay gap for free (max |replayed - recorded|, valid rows)
            gap = torch.zeros((), dtype=torch.float64, device=self.device)
        else:
            fused = {first} if self.anchor_from_first_update else set()
            old = self._anchor(batch, plan, replay_fn, fused, progress)
            old_means = self._last_anchor_means

        stats = UpdateStats(self.device, kl=bool(self.kl_coef))
        lr = self.lr_at(self.optimizer_steps)
        skips = plan.skipped_microbatches
        #: per executed update, this rank's ratio range and mean (detached tensors; for diagnostics,
        #: tests and the bench's on-policy figures)
        self.last_update_stats = []
        for u, part in enumerate(plan.parts):
            if not plan.run[u]:
                continue
            self.optimizer.zero_grad(set_to_none=True)
            stats.begin_update()
            for (s, e) in part:
                rows = batch[s:e]
                guard = None
                if self.kl_coef or self.guard:
                    ref_mean = self._reference_means(rows, replay_fn) if self.kl_coef else None
                    logp, mean, std = replay_fn.moments(self.model, rows)
                    kl = None if ref_mean is None else transition_kl(
                        mean.flatten(0, 1), ref_mean.flatten(0, 1),
                        std.reshape(-1, *([1] * (mean.dim() - 2)))).view(logp.shape)
                    if self.guard:
                        old_mean = mean.detach() if u in fused else old_means[(s, e)]
                        guard = (mean, old_mean, std, guard_step_weight(rows.sigmas, rows.sigmas_next))
                else:
                    logp, kl = replay_fn(self.model, rows), None
                anchor = None if u in fused else old[(s, e)]
                if from_rollout and u == first:
                    gap = _gap_max(gap, logp, anchor, plan, s, e)
                self._backward_microbatch(logp, anchor, adv, plan, u, s, e, stats, kl, guard)
                if progress is not None:
                    progress()
            self.last_update_stats.append({"update": u, **stats.update_ratio_range()})
            lr, skips = self._close_update(u, stats, len(part), lr, skips)

        metrics.update(stats.reduce(plan.n, time.perf_counter() - t_start))
        if from_rollout:
            metrics["train/rollout_logprob_gap_max"] = float(all_reduce_max(gap.reshape(1).to(collective_device()))[0])
        metrics.update(self._round_metrics(lr, stats, skips))
        metrics.update(self.memory_metrics())
        return metrics

    # -- the DiffusionNFT update (--algorithm nft) -------------------------------------------------
    def nft_train_step(self, batch: Any, advantages: torch.Tensor, velocity_fn: VelocityFn, schedule: torch.Tensor,
                       seed: int, valid: torch.Tensor | None = None,
                       progress: Callable[[], None] | None = None,
                       ids: Sequence[int] | torch.Tensor | None = None) -> dict[str, float]:
        """One DiffusionNFT round on this rank's `batch` (a Trajectory whose last column's
        next_latents are the clean final latents x0 of an ODE rollout) with advantages [n].
        velocity_fn(model, rows, x_t, sigma) -> v [b, ...] is the DiT call the replay makes
        (the adapter's velocity); schedule [N] the rollout's step sigmas; seed fixes this
        round's draws (the caller derives it from the run seed and the rollout id, so a resumed
        run draws the same); ids: the rows' global candidate ids, as train_step's.

        1. plan (`_open_round`, as FlowGRPO's): update order, micro-batches, rank agreement,
           all-~0 rounds skipped; r = optimality_probability(A, --adv-clip-max) per candidate.
        2. draw (`_nft_draws`): per candidate K = floor(N x --nft-timestep-fraction) sigmas
           (draw_train_sigmas) and a standard-normal noise per sigma, from its own generator
           seeded by (`seed`, its global id): the same draws whichever rank holds it.
        3. old (`_nft_old_velocities`): v_old at every (micro-batch, sigma) with the old policy's
           weights swapped in, all before any optimizer step (one swap, no_grad).
        4. per update: for each micro-batch and sigma, x_t = forward_noise(x0, eps, sigma), v_theta
           with grad, nft_loss over the valid rows, scaled so the FSDP-mean gradient is the mean
           over all valid (sample, sigma) of all ranks; clip_grad; lr; AdamW (`_optimizer_step`).
        5. old policy (`_nft_move_old`): old <- d x old + (1 - d) x theta,
           d = old_policy_decay(optimizer steps, --nft-old-decay-flat/-rate/-max).
        6. metrics: one SUM and one MAX reduce.
        """
        from trainer.nft import optimality_probability

        t_start = time.perf_counter()
        g = self.grpo
        if self.nft_old is None:
            raise RuntimeError("nft_train_step needs the old policy: build the actor with --algorithm nft")
        batch, adv, plan, metrics = self._open_round(batch, advantages, valid, ids)
        if not any(plan.run):
            return metrics
        r = optimality_probability(adv.nan_to_num(0.0), float(g.adv_clip_max))
        self.model.train()
        draws = self._nft_draws(batch, plan, schedule, seed)
        v_old = self._nft_old_velocities(batch, plan, draws, velocity_fn, progress)

        stats = _NftStats(self.device)
        lr = self.lr_at(self.optimizer_steps)
        skips = plan.skipped_microbatches
        for u, part in enumerate(plan.parts):
            if not plan.run[u]:
                continue
            self.optimizer.zero_grad(set_to_none=True)
            for (s, e) in part:
                self._nft_backward_microbatch(batch[s:e], plan, u, s, e, draws[(s, e)], v_old[(s, e)], r,
                                              velocity_fn, stats)
                if progress is not None:
                    progress()
            lr, skips = self._close_update(u, stats, len(part), lr, skips)
        decay = self._nft_move_old()

        metrics.update(stats.reduce(plan.n, time.perf_counter() - t_start))
        metrics.update({**self._round_metrics(lr, stats, skips), "train/nft_old_decay": decay})
        metrics.update(self.memory_metrics())
        return metrics

    def _nft_draws(self, batch: Any, plan: "UpdatePlan", schedule: torch.Tensor,
                   seed: int) -> dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]]:
        """Step 2: per micro-batch (sigmas [b, K] fp32, noise [K, b, ...] fp32), on the device.
        Each candidate's K sigmas and noises come from its own CPU generator seeded with
        nft_candidate_seed(`seed`, its global id): a function of the candidate, not of the rank
        or the micro-batch that holds it."""
        from trainer.nft import draw_train_sigmas, nft_candidate_seed, num_train_timesteps

        g = self.grpo
        k = num_train_timesteps(int(schedule.numel()), float(g.nft_timestep_fraction))
        out = {}
        for u, part in enumerate(plan.parts):
            for (s, e) in part:
                if not plan.run[u]:
                    continue
                x0 = _clean_latents(batch[s:e])
                sigs, noises = [], []
                for row in range(s, e):
                    gen = torch.Generator().manual_seed(nft_candidate_seed(seed, int(plan.ids[row])))
                    sigs.append(draw_train_sigmas(schedule, 1, k, gen, str(g.nft_timestep_distribution)))
                    noises.append(torch.randn((k, 1, *x0.shape[1:]), generator=gen, dtype=torch.float32))
                out[(s, e)] = (torch.cat(sigs).to(self.device), torch.cat(noises, dim=1).to(self.device))
        return out

    @torch.no_grad()
    def _nft_old_velocities(self, batch: Any, plan: "UpdatePlan", draws: dict, velocity_fn: VelocityFn,
                            progress: Callable[[], None] | None) -> dict[tuple[int, int], list[torch.Tensor]]:
        """Step 3: v_old [b, ...] fp32 per (micro-batch, sigma), the old policy's weights swapped
        into the live model once for all of them (restored bit-exactly after)."""
        out: dict[tuple[int, int], list[torch.Tensor]] = {}
        # the swap writes the sharded parameters: a unit still holding gathered weights (no
        # reshard after forward) would compute with the live ones, so every unit is resharded
        # on the way in and out
        reshard_all(self.model)
        with self.nft_old.swapped_in():
            for (s, e), (sig, noise) in draws.items():
                rows = batch[s:e]
                x0 = _clean_latents(rows).to(self.device)
                out[(s, e)] = []
                for js in _nft_chunks(sig.shape[1], int(self.grpo.nft_sigmas_per_forward)):
                    out[(s, e)] += [v.detach().float()
                                    for _, v in _nft_velocities(velocity_fn, self.model, rows, x0, noise, sig, js)]
                if progress is not None:
                    progress()
            reshard_all(self.model)
        return out

    def _nft_backward_microbatch(self, rows: Any, plan: "UpdatePlan", u: int, s: int, e: int,
                                 draw: tuple[torch.Tensor, torch.Tensor], v_old: list[torch.Tensor],
                                 r: torch.Tensor, velocity_fn: VelocityFn, stats: "_NftStats") -> None:
        """Step 4, one micro-batch: for each of its K sigmas one forward with grad and the NFT
        loss over the valid rows, each backward scaled by 1 / K and the global valid share."""
        from trainer.nft import nft_loss

        g = self.grpo
        sig, noise = draw
        x0 = _clean_latents(rows).to(self.device)
        n_rows = int(plan.valid_host[s:e].sum())
        k = sig.shape[1]
        idx = plan.partial_rows.get((s, e))
        for js in _nft_chunks(k, int(g.nft_sigmas_per_forward)):
            levels = _nft_velocities(velocity_fn, self.model, rows, x0, noise, sig, js)
            stats.transitions += (e - s) * len(js)
            if not n_rows:
                # FSDP's reduce-scatter must still run on every rank
                (sum(v.float().sum() for _, v in levels) * 0.0).backward()
                continue
            total = 0.0
            for j, (x_t, v) in zip(js, levels):
                vo, xt, xz, sj, rr = v_old[j], x_t, x0, sig[:, j], r[s:e]
                if idx is not None:
                    v, vo, xt, xz, sj, rr = (t.index_select(0, idx) for t in (v, vo, xt, xz, sj, rr))
                loss, st = nft_loss(v, vo, xt, xz, sj, rr, float(g.nft_beta), float(g.adv_clip_max))
                total = total + loss * (n_rows * plan.world / plan.global_valid[u] / k)
                stats.add(loss, st, float(n_rows))
            total.backward()

    @torch.no_grad()
    def _nft_move_old(self) -> float:
        """Step 5: the old policy's soft update at the decay the schedule gives for the optimizer
        steps taken so far; returns that decay."""
        from trainer.nft import old_policy_decay

        g = self.grpo
        decay = old_policy_decay(self.optimizer_steps, int(g.nft_old_decay_flat), float(g.nft_old_decay_rate),
                                 float(g.nft_old_decay_max))
        self.nft_old.decay = decay
        self.nft_old.update()
        return decay

    def _open_round(self, batch: Any, advantages: torch.Tensor, valid: torch.Tensor | None,
                    ids: Sequence[int] | torch.Tensor | None):
        """(the batch in update order, its advantages on the device, the round's micro-batch plan,
        its first metrics), shared by both algorithms' steps; a round in which no micro-batch runs
        is counted as skipped and its metrics are complete (the caller returns them)."""
        n = int(advantages.shape[0])
        ids_host = torch.arange(n) if ids is None else torch.as_tensor(ids, dtype=torch.long).reshape(-1).cpu()
        if ids_host.shape != (n,):
            raise ValueError(f"ids shape {tuple(ids_host.shape)} != advantages shape {(n,)}")
        order = global_update_order(ids_host.tolist(), int(self.grpo.num_updates_per_batch))
        if order != list(range(n)):
            # one copy of this rank's rows (the replay reads every one of them anyway), so that each
            # update's share is contiguous and a micro-batch stays a view
            perm = torch.tensor(order, dtype=torch.long)
            batch = batch[order] if batch is not None else None
            advantages, ids_host = advantages[perm.to(advantages.device)], ids_host[perm]
            valid = None if valid is None else valid[perm.to(valid.device)]
        adv = advantages.detach().float().to(self.device)
        ok = torch.ones(adv.shape[0], dtype=torch.bool, device=self.device) if valid is None \
            else valid.to(self.device).bool()
        if ok.shape != adv.shape:
            raise ValueError(f"valid mask shape {tuple(ok.shape)} != advantages shape {tuple(adv.shape)}")
        plan = self._plan(adv, ok, ids_host)
        metrics: dict[str, float] = {"train/num_microbatches": float(plan.num_microbatches)}
        if not any(plan.run):
            self.skipped_rounds += 1
            metrics.update({"train/optimizer_steps": 0.0, "train/optimizer_skips": float(plan.skipped_microbatches),
                            "train/skipped_rounds": float(self.skipped_rounds),
                            "train/lr": self.lr_at(self.optimizer_steps),
                            "train/lr_scheduler_steps": float(self.optimizer_steps)})
        return batch, adv, plan, metrics

    def _plan(self, adv: torch.Tensor, ok: torch.Tensor, ids: torch.Tensor | None = None) -> "UpdatePlan":
        """Step 1: the micro-batch plan, agreed by every rank, and which updates run. Two tiny
        reduces (one MAX carries the plan check and the per-update max |A|, one SUM the valid
        counts) are the plan's only host syncs, before any forward."""
        g = self.grpo
        n = int(adv.shape[0])
        ids = torch.arange(n) if ids is None else ids
        parts = plan_updates(n, int(g.num_updates_per_batch), int(g.micro_batch_size))
        n_mb = sum(len(p) for p in parts)
        cdev = collective_device()
        bad_adv = (~torch.isfinite(adv) & ok).any().float().reshape(1).to(cdev)
        masked_abs = torch.where(ok, adv.abs(), torch.zeros_like(adv)).to(cdev)
        ok_c = ok.to(cdev)
        part_max = torch.stack([masked_abs[p[0][0]:p[-1][1]].max() for p in parts])
        part_cnt = torch.stack([ok_c[p[0][0]:p[-1][1]].sum().float() for p in parts])
        mx = all_reduce_max(torch.cat([torch.tensor([n_mb, -n_mb], dtype=torch.float32, device=cdev), bad_adv,
                                       part_max])).tolist()
        if int(mx[0]) != n_mb or int(-mx[1]) != n_mb:
            raise MicroBatchMismatchError(
                f"rank {dist.get_rank() if dist.is_initialized() else 0} plans {n_mb} micro-batches but ranks range "
                f"{int(-mx[1])}..{int(mx[0])}: every rank needs the same local candidate count, "
                "--num-updates-per-batch and --micro-batch-size")
        if mx[2] > 0:
            raise ValueError("non-finite advantage for a valid candidate on some rank: the reward/advantage stage must "
                             "mark failed groups invalid instead of passing NaN/inf")
        global_cnt = all_reduce_sum(part_cnt.clone()).tolist()
        run = [mx[3 + u] > ZERO_ADVANTAGE and global_cnt[u] > 0 for u in range(len(parts))]
        ok_host = ok.cpu()
        # partially valid micro-batches: their row indices on the device, copied before any forward
        # is queued (boolean masking on the device, or a copy per micro-batch, syncs the host each time)
        part_idx = {(s, e): torch.nonzero(ok_host[s:e]).flatten().to(self.device)
                    for u, part in enumerate(parts) if run[u] for (s, e) in part
                    if 0 < int(ok_host[s:e].sum()) < e - s}
        return UpdatePlan(n=n, parts=parts, run=run, global_valid=global_cnt, valid_host=ok_host, ids=ids,
                          partial_rows=part_idx, world=dist.get_world_size() if dist.is_initialized() else 1,
                          skipped_microbatches=sum(len(p) for u, p in enumerate(parts) if not run[u]))

    @torch.no_grad()
    def _anchor(self, batch: Any, plan: "UpdatePlan", replay_fn: ReplayFn, fused: set[int],
                progress: Callable[[], None] | None) -> dict[tuple[int, int], torch.Tensor]:
        """Step 2: pi_old of every micro-batch of the executed updates not in `fused` (whose own
        first forward is the anchor), frozen before any optimizer step."""
        old: dict[tuple[int, int], torch.Tensor] = {}
        #: GRPO-Guard's pi_old transition means, [b, S, ...] per micro-batch (only with --grpo-guard)
        self._last_anchor_means = {}
        for u, part in enumerate(plan.parts):
            if plan.run[u] and u not in fused:
                for (s, e) in part:
                    if self.guard:
                        logp, mean, _ = replay_fn.moments(self.model, batch[s:e])
                        self._last_anchor_means[(s, e)] = mean.detach()
                    else:
                        logp = replay_fn(self.model, batch[s:e])
                    old[(s, e)] = logp.detach().float()
                    if progress is not None:
                        progress()
        self.last_anchor_passes = len(old)
        return old

    def _recorded_old(self, batch: Any, plan: "UpdatePlan") -> dict[tuple[int, int], torch.Tensor]:
        """Step 2 under --old-logprob-source rollout: pi_old of every executed micro-batch is the
        sampler's recorded log-prob (no forward; exact only where the sampler is the replay to the bit)."""
        old = {(s, e): batch[s:e].log_probs.to(self.device, non_blocking=True).float()
               for u, part in enumerate(plan.parts) if plan.run[u] for (s, e) in part}
        self._last_anchor_means = {}
        self.last_anchor_passes = 0
        return old

    @property
    def guard(self) -> bool:
        """--grpo-guard: the FlowGRPO loss on GRPO-Guard's normalised, step-weighted ratio."""
        return bool(self.grpo.grpo_guard)

    @property
    def kl_coef(self) -> float:
        """The KL-to-reference weight in the loss (0: no KL term, no reference forward)."""
        g = self.grpo
        return float(g.kl_coef or 0.0) if g.use_kl_loss else 0.0

    @torch.no_grad()
    def _reference_means(self, rows: Any, replay_fn: ReplayFn) -> torch.Tensor:
        """Transition means [b, S, ...] of the reference policy: the same model with its LoRA
        adapter disabled (the base weights; no extra memory, one more no_grad forward)."""
        with lora_disabled(self.model):
            return replay_fn.moments(self.model, rows).mean

    def _backward_microbatch(self, logp: torch.Tensor, anchor: torch.Tensor | None, adv: torch.Tensor,
                             plan: "UpdatePlan", u: int, s: int, e: int, stats: "UpdateStats",
                             kl: torch.Tensor | None = None, guard: tuple | None = None) -> None:
        """Step 3, one micro-batch: the clipped loss over its valid rows (anchor None: this very
        forward is pi_old, ratio exactly 1), plus --kl-coef x the mean KL to the reference when
        `kl` [b, S] is given, scaled to the global valid mean, backward, stats. `guard`
        (--grpo-guard): (mean, old_mean [b, S, ...], std [b, S], step weight [b, S]), the loss
        then taken on GRPO-Guard's normalised ratio (flow_grpo.grpo_guard_clip_loss)."""
        g = self.grpo
        if logp.dim() == 1:
            logp = logp[:, None]
        n_rows = int(plan.valid_host[s:e].sum())
        stats.transitions += logp.shape[0] * logp.shape[1]
        if not n_rows:
            # no valid row here, but FSDP's reduce-scatter must still run on every rank
            (logp.sum() * 0.0).backward()
            return
        anchor = logp.detach().float() if anchor is None else anchor
        if n_rows == e - s:
            lp, op, ad = logp, anchor, adv[s:e]
        else:
            idx = plan.partial_rows[(s, e)].to(logp.device)
            lp, op, ad = logp.index_select(0, idx), anchor.index_select(0, idx), adv[s:e].index_select(0, idx)
            kl = None if kl is None else kl.index_select(0, idx)
            if guard is not None:
                guard = tuple(t.index_select(0, idx.to(t.device)) for t in guard)
        if guard is not None:
            mean, old_mean, std, weight = guard
            loss, st = grpo_guard_clip_loss(lp, op, mean, old_mean, std, ad, g.eps_clip, g.eps_clip_high,
                                            step_weight=weight.to(lp.device))
        else:
            loss, st = grpo_clip_loss(lp, op, ad, g.eps_clip, g.eps_clip_high)
        if kl is not None:
            st["kl_ref"] = kl.detach().mean()
            loss = loss + self.kl_coef * kl.mean()
        (loss * (n_rows * plan.world / plan.global_valid[u])).backward()
        stats.add(loss, st, float(n_rows * logp.shape[1]))

    def _close_update(self, u: int, stats: "UpdateStats", n_microbatches: int, lr: float,
                      skips: int) -> tuple[float, int]:
        """End of one update of either algorithm: the optimizer step, then the gradients cleared.
        Returns (the lr the round reports, its skipped micro-batches): a skipped step keeps the
        last lr and counts the update's micro-batches as skipped."""
        stepped, lr_used = self._optimizer_step(u, stats)
        self.optimizer.zero_grad(set_to_none=True)
        return (lr_used, skips) if stepped else (lr, skips + n_microbatches)

    def _round_metrics(self, lr: float, stats: "UpdateStats", skips: int) -> dict[str, float]:
        """The optimizer's figures of a round that ran, for either algorithm."""
        return {"train/lr": lr, "train/optimizer_steps": float(stats.steps), "train/optimizer_skips": float(skips),
                "train/skipped_rounds": float(self.skipped_rounds),
                "train/lr_scheduler_steps": float(self.optimizer_steps)}

    def _optimizer_step(self, u: int, stats: "UpdateStats") -> tuple[bool, float]:
        """Step 3, end of an update: clip, set the scheduled lr, step. A non-finite grad norm skips
        the step (logged). Returns (stepped, lr)."""
        gn = self._clip_grad()
        if not torch.isfinite(gn):
            log.warning("non-finite grad norm %s in update %d: optimizer step skipped", gn.item(), u)
            return False, 0.0
        lr = self.lr_at(self.optimizer_steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.optimizer_steps += 1
        if self.ema is not None and self.ema.due(self.optimizer_steps):
            self.ema.update()
        stats.add_step(gn)
        return True, lr

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
        out = [local_shard(p) for p in self.model.parameters()]
        out += [b for b in self.model.buffers()]
        return [t for t in out if t.device.type == self.device.type]

    def _optim_tensors(self) -> list[torch.Tensor]:
        out = []
        for state in self.optimizer.state.values():
            for v in state.values():
                if isinstance(v, torch.Tensor):
                    lt = local_shard(v)
                    # AdamW keeps `step` as a CPU scalar on GPU runs: nothing to free there
                    if lt.device.type == self.device.type:
                        out.append(lt)
        # the EMA is optimizer-like state: it leaves the device with AdamW's moments
        if self.ema is not None:
            out += [t for t in self.ema.local_tensors() if t.device.type == self.device.type]
        if self.nft_old is not None:
            out += [t for t in self.nft_old.local_tensors() if t.device.type == self.device.type]
        return out

    def offload(self) -> dict[str, float]:
        """Release the parameter/buffer shards, AdamW state and the EMA from the device into (pinned) host memory.

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

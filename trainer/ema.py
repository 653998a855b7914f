"""An exponential moving average of the trainable parameters, kept sharded beside them.

One fp32 tensor per trainable parameter, with the parameter's own placement: under FSDP2 a
DTensor whose local shard lives on the same rank as the parameter's shard, so an update is a
purely local `torch._foreach_lerp_` over the shards (no collective). The average starts equal
to the parameters it is built from (at build time, or as loaded from a checkpoint) and after
every optimizer step whose count is a multiple of the update interval becomes

    ema <- decay * ema + (1 - decay) * param        (fp32; lerp with weight 1 - decay)

The names are the parameters' names without wrapper segments (trainer.core.names.model_name),
i.e. the names the DCP model state dict uses, so a checkpoint stores them as "ema.<name>"
beside "model.<name>".
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterable, Iterator

import torch
import torch.nn as nn

from trainer.core.names import model_name

#: DCP key prefix of the EMA tensors (the model lives under "model.", the optimizer under "optim.")
EMA_PREFIX = "ema."


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t._local_tensor if isinstance(t, DTensor) else t


class ParamEMA:
    """The EMA of `params` ((name, parameter) pairs, the trainable ones).

    decay: in [0, 1); 0 would copy the parameters at every update (the flag's 0 means "no EMA"
    and never builds one). interval: update after every `interval`-th optimizer step (>= 1).
    """

    def __init__(self, params: Iterable[tuple[str, nn.Parameter]], decay: float, interval: int = 1) -> None:
        if not (0.0 <= decay < 1.0):
            raise ValueError(f"--ema-decay must be in [0, 1), got {decay}")
        if interval < 1:
            raise ValueError(f"--ema-update-interval must be >= 1, got {interval}")
        self.decay = float(decay)
        self.interval = int(interval)
        self.names: list[str] = []
        self.params: list[nn.Parameter] = []
        self.shadow: dict[str, torch.Tensor] = {}
        for name, p in params:
            key = model_name(name)
            if key in self.shadow:
                raise ValueError(f"two trainable parameters share the name {key!r}")
            self.names.append(key)
            self.params.append(p)
            # a DTensor stays a DTensor of the same mesh and placement; clone: never aliases p
            self.shadow[key] = p.detach().to(torch.float32).clone()
        #: EMA updates applied since build (not checkpointed: the optimizer step count decides)
        self.updates = 0

    def due(self, optimizer_steps: int) -> bool:
        """Whether the optimizer step that brought the count to `optimizer_steps` updates the EMA."""
        return optimizer_steps > 0 and optimizer_steps % self.interval == 0

    @torch.no_grad()
    def update(self) -> None:
        """ema <- lerp(ema, param, 1 - decay) on every local shard, in fp32 (a bf16 parameter
        is upcast first: averaging in bf16 would lose the small steps the EMA exists to sum)."""
        shadows = [_local(self.shadow[n]) for n in self.names]
        live = [_local(p.detach()) for p in self.params]
        live = [t if t.dtype == torch.float32 else t.float() for t in live]
        torch._foreach_lerp_(shadows, live, 1.0 - self.decay)
        self.updates += 1

    def local_tensors(self) -> list[torch.Tensor]:
        """This rank's shards (what the actor's offload releases and restores)."""
        return [_local(t) for t in self.shadow.values()]

    def state_dict(self) -> dict[str, torch.Tensor]:
        """name -> the (sharded) fp32 tensor itself; DCP saves and loads it in place."""
        return dict(self.shadow)

    @torch.no_grad()
    def reset_to_params(self) -> None:
        """ema <- param (fp32), e.g. after the parameters were replaced by a load."""
        for n, p in zip(self.names, self.params):
            _local(self.shadow[n]).copy_(_local(p.detach()))

    @contextmanager
    def swapped_in(self) -> Iterator[None]:
        """Inside the block the parameters hold the EMA values (cast to their dtype); the live
        values are kept in a copy and put back, bit-exactly, on exit (also on an exception)."""
        live = [_local(p.detach()).clone() for p in self.params]
        try:
            with torch.no_grad():
                for n, p in zip(self.names, self.params):
                    _local(p.detach()).copy_(_local(self.shadow[n]))
            yield
        finally:
            with torch.no_grad():
                for p, saved in zip(self.params, live):
                    _local(p.detach()).copy_(saved)

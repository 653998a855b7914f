"""FP8 (e4m3) linear layers: weights quantized with one scale per output channel, activations
quantized per row (token) at every call, one `torch._scaled_mm` per layer (Hopper's FP8 tensor
cores on CUDA; the same math on CPU).

The rollout DiT (`--rollout-precision fp8`, `FP8Linear`): weights quantized once per weight
version; the bf16 (or fp32) weight stays the module's parameter -- what a sync writes, a checksum
reads and a LoRA wraps -- and the FP8 copy is a buffer derived from it (`requantize_fp8` after a
weight change). Where the weight can no longer change (an engine that holds LoRA adapters takes
no full or merged sync), `drop_weight` frees it and the layer keeps only its FP8 copy. An FP8
rollout against a replay in the actor's dtype is off-policy by the FP8 rounding, which
docs/PERFORMANCE.md measures.

The actor's LoRA replay (`--replay-precision fp8`, `FP8FrozenLinear`): the frozen base layer of a
LoRA-wrapped linear, whose weight FSDP2 gathers for each forward; it is quantized from the
gathered weight at every call (no persistent copy, so sharding keeps its memory), and the
gradient w.r.t. the input goes through the unquantized weight (`frozen_fp8_linear`), or, with
`--replay-precision fp8-dgrad` (`FP8DgradFrozenLinear`), through an FP8 GEMM as well over the
forward's FP8 weight (`fp8_input_grad`). A layer linked to an FP8 engine's copy of its weight
(`share_fp8_weights`) reads that copy in both directions instead of quantizing its weight, on
every call, and under fp8-dgrad no longer reads its own weight at all: `release_linked_weights`
frees it (the actor's largest share of memory on one GPU).

The activation quantization (`quantize_rowwise`) is torch ops, which inductor fuses into the
compiled blocks with the elementwise work before it (docs/PERFORMANCE.md, "Where the FP8 rollout's
time goes", measures it against a standalone one-pass kernel, which lost that fusion).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

#: the largest finite float8_e4m3fn value
E4M3_MAX = 448.0
#: _scaled_mm needs both GEMM dimensions of the weight to be multiples of 16
_ALIGN = 16


def quantize_rowwise(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row absmax quantization of a 2-D tensor to float8_e4m3fn.

    t [R, K] (any float dtype) -> (q [R, K] float8_e4m3fn, scale [R, 1] fp32) with
    q = t / scale, scale = max(|t_r|) / 448, so t ~= q.float() * scale. Computed in fp32 (the
    scale must not round in bf16); an all-zero row gets scale 1 (its q is exactly 0).
    """
    t32 = t.float()
    amax = t32.abs().amax(dim=1, keepdim=True)
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    return (t32 / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scale


def fp8_linear(x: torch.Tensor, weight_fp8: torch.Tensor, weight_scale: torch.Tensor,
               bias: torch.Tensor | None, fast_accum: bool = False) -> torch.Tensor:
    """y = x @ W^T + b with x quantized per row and W per output channel.

    x [..., K] (bf16/fp32); weight_fp8 [N, K] float8_e4m3fn; weight_scale [1, N] fp32; bias [N]
    or None. Returns [..., N] in x's dtype. The GEMM accumulates in fp32 and applies
    scale_x[m] * scale_w[n] to each output element (rowwise scaling). fast_accum (--fp8-fast-accum):
    Hopper's FP8 tensor cores keep their own, narrower accumulator over the whole K instead of
    adding it into fp32 registers every few K-blocks; faster, with a larger rounding error of the
    sum (docs/PERFORMANCE.md measures both). CPU ignores it.
    """
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    xq, xs = quantize_rowwise(x2)
    y = torch._scaled_mm(xq, weight_fp8.t(), scale_a=xs, scale_b=weight_scale,
                         bias=None if bias is None else bias.to(x.dtype), out_dtype=x.dtype,
                         use_fast_accum=fast_accum)
    return y.reshape(*shape[:-1], weight_fp8.shape[0])


class FP8Linear(nn.Linear):
    """An nn.Linear whose forward runs `fp8_linear` on an FP8 copy of its weight (buffers
    `weight_fp8`, `weight_scale`). Still an nn.Linear, so peft's LoRA wraps it as a base layer
    (the adapter branch stays in the compute dtype) and a sync into `.weight` works unchanged;
    call `requantize()` after the weight changed."""

    weight_fp8: torch.Tensor
    weight_scale: torch.Tensor
    #: the forward GEMM's fast accumulation (fp8_linear; set_fp8_fast_accum)
    fp8_fast_accum = False

    def requantize(self) -> None:
        if self.weight is None:
            raise RuntimeError("this FP8 layer's weight was dropped (drop_weight: its engine holds LoRA adapters, "
                               "so its base weights are frozen); build a new engine to change them")
        with torch.no_grad():
            q, s = quantize_rowwise(self.weight)
        self.register_buffer("weight_fp8", q, persistent=False)
        self.register_buffer("weight_scale", s.reshape(1, -1).contiguous(), persistent=False)

    def drop_weight(self) -> None:
        """Free the weight parameter (`weight` becomes None), keeping the FP8 copy the forward
        uses: for a base that will not change again. Nothing can be re-quantized afterwards."""
        self.weight = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.weight_fp8, self.weight_scale, self.bias, self.fp8_fast_accum)


def fp8_eligible(module: nn.Module) -> bool:
    """A plain nn.Linear whose in / out features are multiples of 16 (what _scaled_mm takes)."""
    return (type(module) is nn.Linear and module.in_features % _ALIGN == 0
            and module.out_features % _ALIGN == 0)


def convert_to_fp8(blocks: nn.Module) -> int:
    """Turn every eligible nn.Linear under `blocks` into an FP8Linear in place (class swap; the
    parameters and their names stay), quantizing its current weight, its GEMM accumulating in full
    (set_fp8_fast_accum changes that). Returns how many. Call it on the repeated transformer blocks
    only: the embedders and the final projection stay in the compute dtype, as FP8 inference
    recipes keep them."""
    n = 0
    for module in blocks.modules():
        if fp8_eligible(module):
            module.__class__ = FP8Linear
            module.requantize()
            n += 1
    return n


def set_fp8_fast_accum(model: nn.Module, on: bool) -> int:
    """Every FP8 forward GEMM under `model` (FP8Linear, FP8FrozenLinear) with fast accumulation
    (fp8_linear) or without: an attribute per layer, so a compiled block recompiles on its next
    call. The FP8 input gradient (fp8_input_grad) always accumulates in full. Returns how many
    layers."""
    n = 0
    for m in model.modules():
        if isinstance(m, (FP8Linear, FP8FrozenLinear)):
            m.__dict__.pop("fp8_fast_accum", None)
            if on:
                m.fp8_fast_accum = True
            n += 1
    return n


def requantize_fp8(model: nn.Module) -> int:
    """Re-derive every FP8Linear's FP8 copy from its current weight (after a weight sync).
    Returns how many layers."""
    layers = [m for m in model.modules() if isinstance(m, FP8Linear)]
    for m in layers:
        m.requantize()
    return len(layers)


class _FrozenFP8Gemm(torch.autograd.Function):
    """y = fp8_linear(x, q(W), s(W), b) forward; dL/dx = dL/dy @ W backward, with W as given (in
    the compute dtype FSDP2 gathered it in: a straight-through estimate of the quantized GEMM's
    input gradient), or as fp8_input_grad's FP8 GEMM over the forward's q(W), s(W). W and b are
    frozen: no gradient is returned for them."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                fp8_dgrad: bool, weight_fp8: torch.Tensor | None = None,
                weight_scale: torch.Tensor | None = None, weight_dtype: torch.dtype | None = None,
                fast_accum: bool = False) -> torch.Tensor:
        shared = weight_fp8 is not None
        if not shared:
            weight_fp8, weight_scale = quantize_rowwise(weight.detach())
        weight_scale = weight_scale.reshape(1, -1)
        # saved: the weight itself, not a derived copy (FSDP2 frees and re-gathers its storage
        # around backward exactly as for F.linear's saved weight), or the FP8 copy a linked
        # layer shares (persistent, the engine's); fp8_dgrad re-quantizes the weight otherwise
        ctx.shared = shared and fp8_dgrad
        ctx.save_for_backward(*((weight_fp8, weight_scale) if ctx.shared else (weight,)))
        # a released weight (release_linked_weights) leaves its dtype behind: the gradient's cast
        ctx.x_dtype, ctx.w_dtype = x.dtype, weight.dtype if weight is not None else weight_dtype
        ctx.fp8_dgrad = fp8_dgrad
        return fp8_linear(x, weight_fp8, weight_scale, bias, fast_accum)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.to(ctx.w_dtype)
        if not ctx.fp8_dgrad:
            (weight,) = ctx.saved_tensors
            gx = grad @ weight
        elif ctx.shared:
            gx = fp8_input_grad(grad, *ctx.saved_tensors)
        else:
            (weight,) = ctx.saved_tensors
            gx = fp8_input_grad(grad, *quantize_rowwise(weight.detach()))
        return gx.to(ctx.x_dtype), None, None, None, None, None, None, None


def fp8_input_grad(grad: torch.Tensor, weight_fp8: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """dL/dx = dL/dy @ W as one FP8 GEMM over the forward's own FP8 weight, W ~= diag(s) Wq:
    dL/dy @ W ~= (dL/dy * s) @ Wq, so the weight's per-output-channel scales s multiply the
    incoming gradient's columns, which is then quantized per row (one scale per token), and the
    rowwise-scaled _scaled_mm takes Wq transposed (its input channels as the rows of the GEMM's
    weight) with unit column scales. Nothing of the weight is quantized again: the backward
    transposes the FP8 copy (1 byte a weight).

    grad [..., N] in the compute dtype; weight_fp8 [N, K] float8_e4m3fn and weight_scale [N]
    (any shape of N elements) as quantize_rowwise(W) gives them -> [..., K] in grad's dtype.
    """
    shape = grad.shape
    n, k = weight_fp8.shape
    g = grad.reshape(-1, n).float() * weight_scale.reshape(1, n)
    gq, gs = quantize_rowwise(g)
    ones = torch.ones(1, k, dtype=torch.float32, device=grad.device)
    gx = torch._scaled_mm(gq, weight_fp8.t().contiguous().t(), scale_a=gs, scale_b=ones, out_dtype=grad.dtype)
    return gx.reshape(*shape[:-1], k)


def frozen_fp8_linear(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, *,
                      fp8_dgrad: bool = False, min_rows: int = 0, quantized: Any = None,
                      weight_dtype: torch.dtype | None = None, fast_accum: bool = False) -> torch.Tensor:
    """The frozen base GEMM of a LoRA-wrapped linear in FP8, differentiable w.r.t. x only.

    x [..., K] (bf16/fp32); weight [N, K], bias [N] or None, both frozen. Forward:
    fp8_linear(x, quantize_rowwise(W)) -- W quantized per output channel at this call, x per row
    -- so equal inputs give bit-equal outputs (the anchor and the replay agree: the first ratio is
    exactly 1). Backward: dL/dx = dL/dy @ W with W in its own (compute) dtype, not the FP8 copy;
    with fp8_dgrad, that GEMM in FP8 too over the forward's FP8 weight (fp8_input_grad), which
    adds its rounding to the gradient. min_rows: a call with fewer rows (x's leading dims
    together) runs F.linear in the compute dtype instead: quantizing the whole weight at every
    call costs more than an FP8 GEMM of a few rows saves (a modulation linear sees one row a
    sample). quantized: an object whose `weight_fp8` / `weight_scale` already hold
    quantize_rowwise(W) (an FP8 engine's FP8Linear of the same frozen weight, share_fp8_weights),
    read instead of quantizing W again, in the forward and in fp8_dgrad's backward alike, on
    calls of any number of rows (min_rows prices the quantization such a copy saves: the few rows
    of a modulation linear run the engine's own FP8 GEMM). weight None: released
    (release_linked_weights), only with `quantized` and fp8_dgrad, which never read it;
    weight_dtype then names the dtype it had (the incoming gradient's cast). fast_accum: the
    forward GEMM's (fp8_linear; the input gradient's accumulates in full). Returns [..., N] in
    x's dtype.
    """
    if weight is None:
        if quantized is None or not fp8_dgrad or weight_dtype is None:
            raise RuntimeError("this frozen layer's weight was released (release_linked_weights): only an FP8 input "
                               "gradient over its linked FP8 copy can run it, with the dtype the weight had")
    elif weight.requires_grad or (bias is not None and bias.requires_grad):
        raise RuntimeError("frozen_fp8_linear is for frozen weights (the LoRA base): this weight trains")
    if quantized is not None:
        return _FrozenFP8Gemm.apply(x, weight, bias, fp8_dgrad, quantized.weight_fp8, quantized.weight_scale,
                                    weight_dtype, fast_accum)
    if min_rows and x.numel() // x.shape[-1] < min_rows:
        return F.linear(x, weight, bias)
    return _FrozenFP8Gemm.apply(x, weight, bias, fp8_dgrad, None, None, None, fast_accum)


class FP8FrozenLinear(nn.Linear):
    """A frozen nn.Linear (a LoRA layer's base_layer) whose forward is `frozen_fp8_linear`, its
    input gradient through the unquantized weight. Still an nn.Linear with the same parameters and
    names, so FSDP2, the sync, the checksum and the checkpoint see no difference;
    `restore_frozen_linears` turns it back."""

    fp8_dgrad = False
    #: calls with fewer rows run the compute dtype's GEMM (frozen_fp8_linear's min_rows), unless
    #: linked (fp8_source); set per layer by convert_frozen_to_fp8
    fp8_min_rows = 0
    #: an FP8 engine's FP8Linear holding this frozen weight's FP8 copy (share_fp8_weights), or
    #: None: the weight is quantized at each call. Kept in the instance dict, not as a submodule
    fp8_source = None
    #: the dtype of a weight release_linked_weights freed (`weight` is then None); None: not released
    fp8_released_dtype = None
    #: the forward GEMM's fast accumulation (fp8_linear; set_fp8_fast_accum)
    fp8_fast_accum = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return frozen_fp8_linear(x, self.weight, self.bias, fp8_dgrad=self.fp8_dgrad, min_rows=self.fp8_min_rows,
                                 quantized=self.fp8_source, weight_dtype=self.fp8_released_dtype,
                                 fast_accum=self.fp8_fast_accum)


class FP8DgradFrozenLinear(FP8FrozenLinear):
    """FP8FrozenLinear whose input gradient is an FP8 GEMM as well (fp8_input_grad):
    --replay-precision fp8-dgrad."""

    fp8_dgrad = True


def convert_frozen_to_fp8(layers: list[nn.Module], *, fp8_dgrad: bool = False, min_rows: int = 0) -> int:
    """Turn each eligible (fp8_eligible) frozen nn.Linear of `layers` into an FP8FrozenLinear (an
    FP8DgradFrozenLinear with fp8_dgrad) in place (class swap: parameters and names stay), whose
    calls of fewer than `min_rows` rows keep the compute dtype (frozen_fp8_linear) and whose
    forward GEMM accumulates in full (set_fp8_fast_accum changes that). Returns how many were
    converted."""
    n = 0
    for m in layers:
        if fp8_eligible(m):
            if m.weight.requires_grad or (m.bias is not None and m.bias.requires_grad):
                raise ValueError(f"an FP8 base GEMM needs a frozen layer; {type(m).__name__} "
                                 f"{tuple(m.weight.shape)} trains")
            m.__class__ = FP8DgradFrozenLinear if fp8_dgrad else FP8FrozenLinear
            if min_rows:
                m.fp8_min_rows = min_rows
            n += 1
    return n


def restore_frozen_linears(model: nn.Module) -> int:
    """Every FP8FrozenLinear (or FP8DgradFrozenLinear) under `model` back to a plain nn.Linear (the
    bf16 / fp32 GEMM). Returns how many. Raises, changing nothing, when a layer's weight was
    released (release_linked_weights): there is no weight to go back to."""
    layers = [m for m in model.modules() if isinstance(m, FP8FrozenLinear)]
    released = sum(m.fp8_released_dtype is not None for m in layers)
    if released:
        raise RuntimeError(f"{released} of the model's FP8 layers released their weights (release_linked_weights: "
                           "they read only an FP8 engine's copies): they cannot change precision again; build the "
                           "actor anew from the model's weights")
    for m in layers:
        m.__class__ = nn.Linear
        for attr in ("fp8_min_rows", "fp8_source", "fp8_fast_accum"):
            m.__dict__.pop(attr, None)
    return len(layers)


def share_fp8_weights(layers: dict[str, nn.Module], engine_layers: dict[str, nn.Module],
                      compute_dtype: torch.dtype | None = None) -> tuple[int, int]:
    """Point each FP8FrozenLinear of `layers` (by name) at the FP8Linear of `engine_layers` with the
    same name, whose FP8 copy is then read instead of quantizing the frozen weight at every call:
    an actor and an FP8 engine in one process hold the same frozen base, quantized the same way.
    A pair is linked only where the engine's copy equals quantize_rowwise of the layer's weight
    byte for byte (checked here, once; a DTensor weight is gathered for it, and cast to
    `compute_dtype`, the dtype its forward sees it in: FSDP2's param_dtype, None for the stored
    one), so every output of its FP8 GEMM stays what the layer computed before; a call under the
    layer's fp8_min_rows, which ran the compute dtype's GEMM, now runs the engine's FP8 one (what
    the sampler ran). A layer whose weight was released since (release_linked_weights) keeps its
    link and counts as linked; against another engine's layer it raises, nothing left to check.
    Every rank of a sharded actor must call it with the same names. Returns (linked, mismatched)."""
    linked = mismatched = 0
    for name, layer in layers.items():
        if not isinstance(layer, FP8FrozenLinear):
            continue
        source = engine_layers.get(name)
        if layer.weight is None:  # released after an earlier link, which stays: its weight equalled that copy
            if source is not layer.fp8_source:
                raise RuntimeError(f"{name}: this layer released its weight after linking to another engine's FP8 "
                                   "copy, so nothing can check it against this one: build the actor anew")
            linked += 1
            continue
        weight = layer.weight.detach()
        if hasattr(weight, "full_tensor"):  # a collective: gathered before any skip, on every rank alike
            weight = weight.full_tensor()
        if source is None or getattr(source, "weight_fp8", None) is None:
            continue
        q, scale = quantize_rowwise(weight.to(device=source.weight_fp8.device, dtype=compute_dtype or weight.dtype))
        same = (q.shape == source.weight_fp8.shape
                and torch.equal(q.view(torch.uint8), source.weight_fp8.view(torch.uint8))
                and torch.equal(scale.reshape(1, -1), source.weight_scale))
        if same:
            layer.__dict__["fp8_source"] = source  # not a submodule: the engine's layer stays the engine's
            linked += 1
        else:
            mismatched += 1
    return linked, mismatched


def release_linked_weights(model: nn.Module) -> tuple[int, int]:
    """Free the weight of every FP8DgradFrozenLinear under `model` that is linked to an FP8
    engine's copy of it (share_fp8_weights): its forward reads that copy on every call and its
    input gradient is an FP8 GEMM over the same copy, so the weight itself is never read again.
    `weight` becomes None (the layer keeps its bias, and its dtype in `fp8_released_dtype`), and
    a storage the weight alone holds is freed at once, whatever else still references the tensor
    (a sync plan's record of the module tree). Only a plain tensor -- the frozen base kept whole
    outside FSDP2 (--fsdp-frozen-params) -- is released: a DTensor's shard lives in FSDP2's
    buffers. Nothing can change the layer's precision afterwards (restore_frozen_linears raises).
    Returns (layers released, their weights' bytes)."""
    from torch.distributed.tensor import DTensor

    n = freed = 0
    for m in model.modules():
        if not (isinstance(m, FP8DgradFrozenLinear) and m.fp8_source is not None and m.weight is not None
                and not isinstance(m.weight, DTensor)):
            continue
        w = m.weight
        m.__dict__["fp8_released_dtype"] = w.dtype
        m.weight = None
        nbytes = w.numel() * w.element_size()
        st = w.untyped_storage()
        if st.nbytes() == nbytes and st.resizable():
            st.resize_(0)
        freed += nbytes
        n += 1
    return n, freed

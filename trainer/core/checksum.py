"""An order-independent checksum of named tensors' bits, computed the same way by the sender of a
sync (over what it sent) and by every engine (over what it holds), so equal bits give equal
digests."""

from __future__ import annotations

import hashlib
from typing import Callable, Iterable

import torch


#: the checksum folds a tensor's 32-bit words into this many column sums (position mod CHECKSUM_PERIOD);
#: a prime, so no power-of-two row length of a weight lines up with it
CHECKSUM_PERIOD = 1021


def _mix_weights(device: torch.device) -> torch.Tensor:
    """int64 [2, CHECKSUM_PERIOD]: row 0 = 1..P (position), row 1 = fixed pseudo-random values in [1, 2^20).

    Small enough that sum_j colsum_j * w_j (|colsum_j| < 2^31) stays below 2^62: no overflow."""
    p = CHECKSUM_PERIOD
    pseudo = [(j * 2654435761 + 97) % ((1 << 20) - 3) + 1 for j in range(p)]
    return torch.tensor([list(range(1, p + 1)), pseudo], dtype=torch.int64, device=device)


def tensor_words(tensor: torch.Tensor) -> torch.Tensor:
    """The raw bits of `tensor` as a flat int32 tensor (a view when possible, no copy).

    A byte count divisible by 4 is read as int32 words (a bf16 pair is one word); otherwise the
    16-bit (or 8-bit) words are widened to int32 (a copy; only odd-sized small tensors). A tensor
    whose storage offset does not allow the int32 view is copied first: the words depend only on
    (dtype, shape, bits), never on where the tensor lives.
    """
    flat = tensor.detach().reshape(-1)
    nbytes = flat.numel() * flat.element_size()
    if nbytes == 0:
        return torch.zeros(0, dtype=torch.int32, device=flat.device)
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    if nbytes % 4 == 0:
        try:
            return flat.view(torch.int32)
        except RuntimeError:  # a 1- or 2-byte dtype whose storage offset is not 4-byte aligned
            return flat.clone().view(torch.int32)
    if nbytes % 2 == 0 and flat.element_size() <= 2:
        try:
            return flat.view(torch.int16).to(torch.int32)
        except RuntimeError:
            return flat.clone().view(torch.int16).to(torch.int32)
    return flat.view(torch.uint8).to(torch.int32)


def column_sums(words: torch.Tensor) -> torch.Tensor:
    """int32 [CHECKSUM_PERIOD]: cs[j] = sum of words[i] over i % P == j, modulo 2^32 (wrapping).

    One read of the words (a reduction over a [n // P, P] view) plus the < P tail; exact and
    reduction-order independent, since integer addition modulo 2^32 is associative."""
    p = CHECKSUM_PERIOD
    n = words.numel()
    m = n - n % p
    if m == 0:
        return torch.nn.functional.pad(words, (0, p - n))
    cs = words[:m].view(-1, p).sum(0, dtype=torch.int32)
    if n > m:
        cs[: n - m] += words[m:]
    return cs


class WeightsChecksum:
    """Order-independent checksum of named tensors' BITS (dtype, shape and every bit of every value).

    Per tensor, on its own device: the raw bits are read once as int32 words and folded into
    CHECKSUM_PERIOD column sums (column_sums); no float conversion, no position tensor. hexdigest()
    stacks the column sums of all tensors, mixes each row into three int64 values (sum; sum
    weighted by position 1..P; sum weighted by fixed pseudo-random values), moves them to the host
    in one transfer per device, and hashes the lines "name:dtype:shape:<three ints>" sorted by name
    with sha256.

    What it catches: any single changed element (it changes one column sum by a non-zero amount
    modulo 2^32, hence the plain sum), a swapped pair of named tensors (the values move to other
    names), any permutation inside a tensor that moves an element to a position of another residue
    mod P, a dtype or shape change. What it cannot see: a permutation moving elements only by
    multiples of P words, or changes whose effects cancel in all three mixes (adversarial).
    Engines compute get_weights_checksum() with this same class over their parameters, so equal
    bits in equal dtypes give equal checksums: the sender checksums what the engine will store
    (see `update`'s as_dtype).
    """

    def __init__(self, column_sums_fn: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        #: column_sums or an implementation with the same output bits (tools/bench.py times another)
        self._column_sums = column_sums_fn or column_sums
        self._names: list[tuple[str, str, tuple[int, ...]]] = []
        self._sums: list[torch.Tensor] = []

    def update(self, name: str, tensor: torch.Tensor, as_dtype: torch.dtype | None = None) -> None:
        """Add one tensor. as_dtype: checksum the tensor as the receiver stores it (a cast copy,
        only when it differs from the tensor's dtype)."""
        t = tensor.detach()
        if as_dtype is not None and t.dtype != as_dtype:
            t = t.to(as_dtype)
        self._names.append((name, str(t.dtype).replace("torch.", ""), tuple(t.shape)))
        self._sums.append(self._column_sums(tensor_words(t)))

    def hexdigest(self) -> str:
        by_device: dict[torch.device, list[int]] = {}
        for i, s in enumerate(self._sums):
            by_device.setdefault(s.device, []).append(i)
        values: list[list[int]] = [[] for _ in self._sums]
        for device, idx in by_device.items():  # one host transfer per device
            cs = torch.stack([self._sums[i] for i in idx]).to(torch.int64)        # [N, P]
            # no integer matmul on CUDA: broadcast multiply [N, 1, P] * [2, P], then reduce
            mixed = torch.cat([cs.sum(1, keepdim=True), (cs[:, None, :] * _mix_weights(device)).sum(2)], 1)  # [N, 3]
            for i, row in zip(idx, mixed.cpu().tolist()):
                values[i] = row
        rows = sorted(zip(self._names, values), key=lambda r: r[0][0])
        h = hashlib.sha256()
        for (name, dtype, shape), stats in rows:
            h.update(f"{name}:{dtype}:{','.join(map(str, shape))}:{':'.join(map(str, stats))}\n".encode())
        return h.hexdigest()


def weights_checksum(named_tensors: Iterable[tuple[str, torch.Tensor]],
                     column_sums_fn: Callable[[torch.Tensor], torch.Tensor] | None = None) -> str:
    """WeightsChecksum over `named_tensors` (see the class); column_sums_fn: as the class takes it."""
    acc = WeightsChecksum(column_sums_fn)
    with torch.no_grad():  # autograd bookkeeping would double the per-tensor host cost
        for name, tensor in named_tensors:
            acc.update(name, tensor)
        return acc.hexdigest()

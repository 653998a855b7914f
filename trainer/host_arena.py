"""One exactly-sized, reusable host buffer for a set of tensors that leaves the device together.

Why not `torch.empty(..., pin_memory=True)` per tensor: torch's pinned allocations go through a
caching host allocator that rounds every request up to the next power of two, and keeps the
rounded blocks. A 3072 x 3072 bf16 weight (18.9 MB) then holds 32 MB, a 3072 x 12288 one (75.5 MB)
128 MB; at Qwen-Image width the offloaded actor and engine held 103 GB of host memory for 59 GB of
tensors. An arena is plain host memory of the summed sizes (each slice aligned), page-locked once
with cudaHostRegister when `pin`, and reused by every later offload of the same set (the sizes do
not change between steps), so the host cost is the tensors' own bytes.

Slices are uint8 views; `typed_view` reinterprets one as a tensor of a given dtype and shape.
"""

from __future__ import annotations

from typing import Sequence

import torch

#: slice alignment in bytes: a multiple of every dtype's size, and of the DMA engine's preference
ALIGN = 512


def layout(sizes: Sequence[int], align: int = ALIGN) -> tuple[list[int], int]:
    """(offset of each slice, total bytes) when `sizes` are packed in order, each slice starting
    at a multiple of `align`."""
    offsets, total = [], 0
    for n in sizes:
        if n < 0:
            raise ValueError(f"a slice size must be >= 0, got {n}")
        total = -(-total // align) * align
        offsets.append(total)
        total += int(n)
    return offsets, total


def typed_view(raw: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`raw` (a uint8 slice of exactly like's byte size) as a tensor of like's dtype and shape."""
    return raw.view(like.dtype).view(like.shape)


class HostArena:
    """Host buffers that hold the largest set they were asked for and are kept between uses.

    The memory is a list of chunks, filled in order; a set that does not fit gets one more chunk
    for what is left over, so growing (a LoRA adapter injected into a released module, optimizer
    state created by the first step) costs the extra bytes only, and never re-registers the
    chunks already locked. `pin`: page-lock each chunk (cudaHostRegister) so device copies to and
    from it are DMA-fast; needs CUDA. `free()`, or the arena's collection, gives the memory back.
    """

    def __init__(self, pin: bool) -> None:
        self.pin = bool(pin)
        self._chunks: list[torch.Tensor] = []

    @property
    def nbytes(self) -> int:
        """Bytes held now (0 before the first use and after free())."""
        return sum(int(c.numel()) for c in self._chunks)

    def slices(self, sizes: Sequence[int]) -> list[torch.Tensor]:
        """One uint8 slice per size, in order, disjoint and aligned. The same sizes give the same
        memory every time; slices handed out before are overwritten by later calls."""
        out: list[torch.Tensor] = []
        chunk, offset = 0, 0
        for i, n in enumerate(sizes):
            if n < 0:
                raise ValueError(f"a slice size must be >= 0, got {n}")
            offset = -(-offset // ALIGN) * ALIGN
            while chunk < len(self._chunks) and offset + n > self._chunks[chunk].numel():
                chunk, offset = chunk + 1, 0
            if chunk == len(self._chunks):
                self._chunks.append(self._new_chunk(layout(sizes[i:])[1]))
            out.append(self._chunks[chunk][offset:offset + n])
            offset += n
        return out

    def _new_chunk(self, nbytes: int) -> torch.Tensor:
        buf = torch.empty(max(nbytes, 1), dtype=torch.uint8)
        if self.pin:
            _register(buf)
        return buf

    def free(self) -> None:
        while self._chunks:
            buf = self._chunks.pop()
            if self.pin:
                _unregister(buf)

    def __del__(self) -> None:  # an arena dropped with its owner gives its page lock back
        try:
            self.free()
        except Exception:  # noqa: BLE001 - interpreter shutdown may have torn CUDA down already
            pass


def _register(buf: torch.Tensor) -> None:
    if not torch.cuda.is_available():
        raise RuntimeError("HostArena(pin=True) needs CUDA: page-locking host memory is a CUDA call")
    err = torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), buf.numel() * buf.element_size(), 0)
    if int(getattr(err, "value", err)) != 0:
        raise RuntimeError(f"cudaHostRegister of {buf.numel() / 1e9:.2f} GB of host memory failed (cuda error "
                           f"{err}); is the host short of memory, or is the locked-memory limit (ulimit -l) low?")


def _unregister(buf: torch.Tensor) -> None:
    torch.cuda.cudart().cudaHostUnregister(buf.data_ptr())

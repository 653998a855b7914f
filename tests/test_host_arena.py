"""The exactly-sized host buffer offloads copy into (trainer/host_arena.py), and the engine's
module move into it."""

import pytest
import torch

from trainer.engine.native import move_module_to_host
from trainer.host_arena import ALIGN, HostArena, layout, typed_view


def test_layout_aligns_every_slice_and_adds_no_rounding():
    offsets, total = layout([10, 0, 1000, 3])
    assert offsets == [0, ALIGN, ALIGN, 2 * ALIGN + ALIGN]
    assert total == 3 * ALIGN + 3  # not the next power of two of anything
    assert layout([]) == ([], 0)
    with pytest.raises(ValueError):
        layout([-1])


def test_arena_reuses_its_memory_and_grows_by_the_extra_only():
    arena = HostArena(pin=False)
    a = arena.slices([100, 200])
    b = arena.slices([100, 200])
    assert [s.data_ptr() for s in a] == [s.data_ptr() for s in b]
    first = layout([100, 200])[1]
    assert arena.nbytes == first
    arena.slices([50])  # smaller: the same memory serves
    assert arena.nbytes == first
    c = arena.slices([100, 200, 4000])  # larger: the first chunk stays, one chunk for the rest
    assert [s.data_ptr() for s in c[:2]] == [s.data_ptr() for s in a]
    assert arena.nbytes == first + 4000 and len(arena._chunks) == 2
    d = arena.slices([100, 200, 4000])  # and that layout is kept from then on
    assert [s.data_ptr() for s in d] == [s.data_ptr() for s in c]
    ends = sorted((s.data_ptr(), s.data_ptr() + s.numel()) for s in d)
    assert all(e <= s for (_, e), (s, _) in zip(ends, ends[1:]))  # disjoint
    arena.free()
    assert arena.nbytes == 0


def test_typed_views_round_trip_every_dtype():
    tensors = [torch.randn(3, 5), torch.randn(7).to(torch.bfloat16), torch.arange(6).reshape(2, 3),
               torch.tensor([True, False, True])]
    arena = HostArena(pin=False)
    raws = arena.slices([t.numel() * t.element_size() for t in tensors])
    for t, raw in zip(tensors, raws):
        v = typed_view(raw, t)
        v.copy_(t)
        assert v.dtype == t.dtype and v.shape == t.shape
    for t, raw in zip(tensors, raws):  # slices are disjoint: no copy clobbered another
        assert torch.equal(typed_view(raw, t), t)


def test_move_module_to_host_keeps_parameters_and_shares_once():
    torch.manual_seed(0)
    shared = torch.nn.Linear(4, 4)
    model = torch.nn.Sequential(shared, torch.nn.BatchNorm1d(4), shared)
    params = list(model.parameters())
    want = {n: t.clone() for n, t in model.state_dict().items()}
    arena = HostArena(pin=False)
    move_module_to_host(model, arena)
    assert list(model.parameters()) == params  # the same Parameter objects (held by the weight index)
    got = model.state_dict()
    assert all(torch.equal(want[n], got[n]) for n in want)
    unique = [p.data for p in params] + list(model[1].buffers())
    assert arena.nbytes == layout([t.numel() * t.element_size() for t in unique])[1]
    base = arena._chunks[0].data_ptr()
    assert len(arena._chunks) == 1 and all(base <= t.data_ptr() < base + arena.nbytes for t in unique)
    ptrs = [p.data_ptr() for p in model.parameters()]
    move_module_to_host(model, arena)  # a second release: the same memory
    assert [p.data_ptr() for p in model.parameters()] == ptrs


def test_pinning_needs_cuda():
    arena = HostArena(pin=True)
    if torch.cuda.is_available():
        assert arena.slices([10])[0].is_pinned()
    else:
        with pytest.raises(RuntimeError, match="needs CUDA"):
            arena.slices([10])

"""Module-tree facts both sides of a sync need: which modules hold LoRA layers, and whether a
tree is still made of the same module and parameter objects (ModuleTreeSnapshot)."""

from __future__ import annotations

import itertools
import operator
import weakref

import torch.nn as nn


def lora_modules(model: nn.Module) -> dict[str, nn.Module]:
    """name -> peft LoraLayer for every LoRA-wrapped module of `model` (empty when none)."""
    try:
        from peft.tuners.lora import LoraLayer
    except ImportError:  # peft missing: then there cannot be LoRA layers either
        return {}
    return {name: m for name, m in model.named_modules() if isinstance(m, LoraLayer)}


def model_has_lora(model: nn.Module) -> bool:
    return bool(lora_modules(model))


_MODULES_OF, _PARAMETERS_OF = operator.attrgetter("_modules"), operator.attrgetter("_parameters")


class ModuleTreeSnapshot:
    """Which module and parameter objects make up a module tree, recorded once, so that
    `unchanged(root)` can tell whether the tree still is what it was without a named walk.

    It records the tree's modules (each once, modules() order) and, over them, their classes, the
    sizes, keys and object ids of their _modules and _parameters dicts. `unchanged` re-reads exactly
    that from the recorded modules in a few C-level passes (no recursion, no name strings, no
    isinstance): any module or parameter added, removed, renamed or replaced anywhere below the root
    changes some recorded module's dicts, whatever route did it (setattr, register_parameter, a
    direct dict write as FSDP2 does, peft's LoRA injection, fully_shard, which also swaps classes,
    load_state_dict(assign=True)). What it does not see, by design: new values in the same objects
    (optimizer steps, `param.data = ...`, the actor's offload / onload, the engine's release /
    resume), which a plan reads at sync time anyway. The recorded objects are kept alive by the
    snapshot, so their ids cannot be taken by new objects while it exists (the cost: a replaced
    model's parameters live until the plan holding the snapshot is rebuilt or dropped).
    Cost of a check: about as much as one bare modules() walk (~3 ms on the test CPU at 7,100
    modules, the real DiT's module count with LoRA), a third to a half of a named_parameters walk,
    and none of the per-name work that came with the walks it replaces.
    """

    __slots__ = ("_root", "_modules", "_token", "_keep")

    def __init__(self, root: nn.Module) -> None:
        self._root = weakref.ref(root)
        self._modules = list(root.modules())
        self._token = self._read()
        self._keep = [list(d.values()) for d in map(_MODULES_OF, self._modules)] + \
                     [list(d.values()) for d in map(_PARAMETERS_OF, self._modules)]

    def _read(self) -> tuple:
        ms = self._modules
        mods, params = list(map(_MODULES_OF, ms)), list(map(_PARAMETERS_OF, ms))
        flat = itertools.chain.from_iterable
        return (list(map(type, ms)), list(map(len, mods)), list(map(len, params)),
                list(flat(map(dict.keys, mods))), list(map(id, flat(map(dict.values, mods)))),
                list(flat(map(dict.keys, params))), list(map(id, flat(map(dict.values, params)))))

    def unchanged(self, root: nn.Module) -> bool:
        return self._root() is root and self._read() == self._token

    def modules(self) -> list[nn.Module]:
        return list(self._modules)

    def __len__(self) -> int:
        return len(self._modules)


def _unwrapped(block: nn.Module) -> nn.Module:
    """`block` without the wrappers put around it (torch.compile's OptimizedModule, the
    checkpoint wrapper)."""
    while True:
        inner = getattr(block, "_orig_mod", None) or getattr(block, "_checkpoint_wrapped_module", None)
        if not isinstance(inner, nn.Module):
            return block
        block = inner


def _is_block(block: nn.Module, names: set[str]) -> bool:
    """Whether `block`'s class (or a base class: fully_shard swaps in a subclass) is named in `names`."""
    return any(k.__name__ in names for k in type(_unwrapped(block)).__mro__)


def repeated_block_lists(model: nn.Module) -> list[nn.ModuleList]:
    """Every ModuleList of repeated transformer blocks, in module order: each one whose blocks'
    classes are named in diffusers' `_repeated_blocks` / `_no_split_modules` (FLUX has two such
    lists, `transformer_blocks` and `single_transformer_blocks`), else `transformer_blocks`. Found
    also once the blocks are wrapped (compiled, checkpointed, sharded)."""
    names = set(getattr(model, "_repeated_blocks", None) or []) | set(getattr(model, "_no_split_modules", None) or [])
    if names:
        found = [m for _, m in model.named_modules()
                 if isinstance(m, nn.ModuleList) and len(m) > 0 and all(_is_block(b, names) for b in m)]
        if found:
            return found
    blocks = getattr(model, "transformer_blocks", None)
    if isinstance(blocks, nn.ModuleList) and len(blocks) > 0:
        return [blocks]
    raise ValueError(f"cannot find the repeated blocks of {type(model).__name__}: expected a ModuleList "
                     "`transformer_blocks` or one whose class is listed in _repeated_blocks / _no_split_modules")


def repeated_blocks(model: nn.Module) -> list[nn.Module]:
    """The blocks of every repeated_block_lists list, in module order (as they stand: wrapped
    ones wrapped). What regional compilation, FP8 conversion, activation checkpointing and
    FSDP2's per-block units act on."""
    return [block for blocks in repeated_block_lists(model) for block in blocks]


#: torch.compile keyword arguments of regional compilation (the engine's and the actor's repeated
#: blocks). Tests add backend="eager" to check the wiring without inductor's codegen time.
#:
#: dynamic=None: dynamo's automatic dynamic shapes. A block is first compiled for the exact shapes
#: it sees; when a later call differs in a dimension (the text length, the batch), dynamo compiles
#: it once more with that dimension symbolic, and that graph then serves every later length. The
#: text length does vary: qwen_image.text_conditioning trims each micro-batch to its longest
#: prompt and drops an all-ones mask (in eager mode that saves attention work and lets SDPA take
#: its flash kernel), and the engine's rollouts and evals differ in batch size. With fixed shapes
#: (dynamic=False) every new length was a new graph per variant, past dynamo's limit within a few
#: steps, after which the blocks ran eagerly. The alternatives weighed:
#: - torch._dynamo.mark_dynamic on the text dimension only: it must mark the very tensors that
#:   enter a compiled block (the text stream, its mask, the text RoPE table are all made inside
#:   the DiT's forward), which takes a hook outside the compiled region and family-specific
#:   knowledge of the block's arguments; automatic dynamic finds the varying dimensions itself,
#:   for every family, at the cost of one static graph per variant before the dynamic one.
#: - bucketing the text length (pad to a multiple, with the mask): bounded but needs the mask
#:   always, so it gives up the mask-free flash path of one-prompt micro-batches, and pays
#:   attention over the padding.
#: Fixed-length inputs (SD3 and FLUX pad every prompt to max_sequence_length, with no mask)
#: never trigger it and keep their static graphs.
REGIONAL_COMPILE_KWARGS: dict = {"dynamic": None}

#: graphs one compiled block may keep before dynamo stops compiling it and runs it eagerly (with a
#: warning only; the loop's perf/actor_new_graphs and perf/rollout_new_graphs show it). The blocks
#: of a model share one code object, so the count is over all of them. A LoRA training step runs
#: the compiled actor blocks in 4 variants (grad replay vs no-grad anchor pass; the last block's
#: never-trained LoRA parameters are a guard of their own), each with and without a text mask, and
#: each of those 8 compiles at most twice: static for the first length it sees, then once with the
#: text length (and batch) dynamic; at most 16. Counted on CPU (tests/test_rollout_speed.py),
#: micro-batches of varying text length: 6 + 4 + 2 graphs in the first three steps, then none
#: (with fixed shapes: 6 in every step, 32 after six and the limit hit). The engine: 7 over four
#: warm-up rollouts of varying prompt lengths and batch sizes (1 among them, which dynamo always
#: specializes), then none (fixed shapes: one more per new length); LoRA arriving is a variant
#: of its own, so about twice that once it has. The engine's blocks and any actor block not
#: wrapped for checkpointing run the same block class's forward, so in one process they share
#: the count: about 16 + 14, hence 64 (the limit is only a ceiling: graphs are compiled as the
#: inputs need them, never to fill it).
COMPILED_BLOCK_GRAPH_LIMIT = 64


def compiled_graphs() -> int:
    """Graphs torch.compile has produced in this process so far (dynamo's own counter)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def recompile_limit_hits() -> int:
    """How often dynamo gave up compiling a function in this process because it reached its
    recompile limit (after which that function runs eagerly). Read from dynamo's counters, where
    the hit is recorded as an unsupported construct ("Dynamo recompile limit exceeded"; older
    releases say "cache_size_limit")."""
    from torch._dynamo.utils import counters

    return sum(int(n) for reason, n in counters["unimplemented"].items()
               if "recompile limit" in reason.lower() or "cache_size_limit" in reason.lower())


#: dynamo's own timers (torch._dynamo.utils.compilation_time_metrics, seconds per call) that
#: compile_seconds sums: a frame's whole compile (tracing, then the backend), and the tracing part
_COMPILE_TIMERS = {"total": "_compile.compile_inner", "trace": "bytecode_tracing"}


def compile_seconds() -> dict[str, float]:
    """Seconds torch.compile has spent in this process so far, by _COMPILE_TIMERS: "total" (every
    compiled frame, end to end) and "trace" (dynamo's bytecode tracing within it; the rest is the
    backend: AOTAutograd and inductor, or loading their output from the compile cache). Timers a
    torch release does not keep read 0."""
    from torch._dynamo import utils

    times = getattr(utils, "compilation_time_metrics", {})
    return {name: float(sum(times.get(key, ()))) for name, key in _COMPILE_TIMERS.items()}


class CompileWatch:
    """Graphs compiled, the seconds spent compiling them and recompile-limit hits between two
    points of a run, for the loop's per-step metrics and its warning: a block that hit dynamo's
    limit silently runs eagerly, and the step gets slower with no other sign."""

    def __init__(self) -> None:
        self.graphs, self.hits, self.seconds = compiled_graphs(), recompile_limit_hits(), compile_seconds()

    def new_graphs(self) -> int:
        """Graphs compiled since the last call (or construction); moves the mark."""
        now = compiled_graphs()
        new, self.graphs = now - self.graphs, now
        return new

    def new_seconds(self) -> dict[str, float]:
        """compile_seconds spent since the last call (or construction); moves the mark."""
        now = compile_seconds()
        new = {name: now[name] - self.seconds.get(name, 0.0) for name in now}
        self.seconds = now
        return new

    def limit_warning(self) -> str | None:
        """A message when dynamo hit its recompile limit since the last call, else None; moves
        the mark."""
        now = recompile_limit_hits()
        new, self.hits = now - self.hits, now
        if new <= 0:
            return None
        import torch._dynamo

        cfg = torch._dynamo.config
        limit = getattr(cfg, "recompile_limit", None) or getattr(cfg, "cache_size_limit", None)
        return (f"torch.compile hit its recompile limit ({limit}) {new} time(s): the compiled blocks now run "
                "eagerly (slower, results unchanged). Run with TORCH_LOGS=recompiles to see which input "
                "keeps changing, or turn off --rollout-compile / --fsdp-compile")


def raise_recompile_limit(limit: int = COMPILED_BLOCK_GRAPH_LIMIT) -> int:
    """Raise dynamo's per-function graph limit to at least `limit` (never lowers it); returns it."""
    import torch._dynamo

    cfg = torch._dynamo.config
    name = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"
    setattr(cfg, name, max(int(getattr(cfg, name)), int(limit)))
    return int(getattr(cfg, name))

"""Export a committed training checkpoint as a diffusers pipeline or as a PEFT adapter.

    python tools/export_checkpoint.py --form merged \\
        --save-dir runs/ckpt --task t2i --iteration 100 --output-dir out/merged --verify
    python tools/export_checkpoint.py --form adapter \\
        --save-dir runs/ckpt --task t2i --iteration 100 --output-dir out/adapter --verify

It reads the DCP shards of `<save-dir>/<task>/iter_<7 digits>/fsdp/` offline, in one process
(no torchrun), and trusts only an iteration with a COMMITTED marker.

--form merged   a directly loadable diffusers pipeline directory. Every base component except
                transformer/ comes from the base model (--base-model-path, else the one the
                checkpoint records; copied by default, see --components);
                transformer/ is written with the base's own file layout (same shard files, same
                tensor names, same dtypes unless --dtype) holding the trained weights:
                  full fine-tune: the checkpoint's tensors (a weight the checkpoint lacks, e.g. a
                                  frozen never-trained one, is the base's, and is listed in
                                  export_info.json);
                  LoRA:           W' = W + (B @ A) * (alpha / rank) for every adapted module,
                                  computed in fp32 and cast to W's dtype; every other weight is
                                  the base's, bit for bit.
--form adapter  a HF-PEFT adapter directory (LoRA checkpoints only): adapter_config.json plus
                adapter_model.safetensors with the names peft's save_pretrained writes
                ("base_model.model.<module>.lora_A.weight"), so that
                PeftModel.from_pretrained(base_transformer, DIR) loads it; the safetensors header
                also carries diffusers' "lora_adapter_metadata" so that
                transformer.load_lora_adapter(DIR, weight_name="adapter_model.safetensors",
                prefix="base_model.model") gets the right alpha; and the same tensors as a
                diffusers pipeline LoRA, pytorch_lora_weights.safetensors ("transformer.<module>
                .lora_A.weight", the file the pipelines' save_lora_weights writes), so that
                pipe.load_lora_weights(DIR) of the family's diffusers pipeline loads it.

--ema           export the checkpoint's EMA of the trainable weights (written by runs with
                --ema-decay > 0, under "ema.*", in fp32) instead of the live ones, in either
                form; the weights the EMA does not cover (frozen ones) are the checkpoint's or
                the base's as above. A checkpoint without EMA state is refused.
--old-policy    export the old policy of an --algorithm nft run ("nft_old.*", fp32) instead of
                the live weights, in either form, as --ema does; a checkpoint without one is
                refused. --ema and --old-policy exclude each other.

The output is written into a hidden staging directory next to --output-dir, verified there
(--verify), fsynced and renamed into place only when complete: an interrupted export never
leaves a half-written --output-dir, and an existing non-empty --output-dir is refused. Written
files follow the umask, like every other output of the project.

A checkpoint directory is trusted input (DCP's .metadata is a pickle); its JSON files still
never choose code: a recorded model adapter is used only when it is a registered family adapter.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shutil
import sys
import tempfile
import warnings
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

import torch

if __package__ in (None, ""):  # run as a script: make `trainer` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer.cli import existing_dir, run_tool, tool_parser  # noqa: E402
from trainer.checkpoint import COMMITTED, CONTRACT, TRAINER_STATE, committed_iterations, iteration_dir  # noqa: E402
from trainer.core.dtypes import DTYPES  # noqa: E402
from trainer.core.files import dir_mode, file_mode, fsync_dir, fsync_tree  # noqa: E402
from trainer.core.adapter_config import lora_config_problems  # noqa: E402
from trainer.core.names import is_lora_name, strip_wrapper_segments  # noqa: E402
from trainer.weight_sync import merge_lora  # noqa: E402

log = logging.getLogger("export_checkpoint")

from trainer.config import DEFAULT_MODEL_ADAPTER as DEFAULT_ADAPTER  # noqa: E402
FORMS = ("merged", "adapter")
COMPONENT_MODES = ("copy", "hardlink", "symlink")
#: the key prefix PeftModel.save_pretrained puts in front of every module name of the wrapped model
PEFT_PREFIX = "base_model.model."
ADAPTER_WEIGHTS = "adapter_model.safetensors"
#: the pipeline-level LoRA file (diffusers' default weight name of load_lora_weights) and the
#: component prefix its names and metadata keys carry
PIPELINE_LORA_WEIGHTS = "pytorch_lora_weights.safetensors"
PIPELINE_LORA_PREFIX = "transformer."
EXPORT_INFO = "export_info.json"
#: safetensors header key diffusers' load_lora_adapter reads the LoraConfig kwargs from
DIFFUSERS_LORA_METADATA_KEY = "lora_adapter_metadata"
#: DCP key prefix of the model state (the optimizer lives under "optim.")
MODEL_PREFIX = "model."
#: DCP key prefix of the EMA of the trainable weights (trainer.ema)
EMA_PREFIX = "ema."
#: DCP key prefix of --algorithm nft's old policy (trainer.checkpoint)
OLD_POLICY_PREFIX = "nft_old."


class ExportError(RuntimeError):
    """The checkpoint, the base model or the output directory cannot be used; the message says
    which file / flag and what to do."""


# ---------------------------------------------------------------------------------------------
# reading the checkpoint


class CheckpointTensors(Mapping):
    """The model tensors of one checkpoint by diffusers name, read from the DCP shards on demand.

    Reading is lazy so that a full fine-tune of a 20 B model is exported one base shard at a
    time instead of all at once; `load(names)` reads several entries in one DCP pass, `preload()`
    reads and keeps everything (a LoRA checkpoint: small). Tensors come back at their global
    shape, in the dtype they were saved in (the master dtype), on CPU.
    """

    def __init__(self, fsdp_dir: Path, raw_key: dict[str, str], metadata: dict[str, Any]) -> None:
        self.fsdp_dir = fsdp_dir
        self._raw_key = raw_key  # diffusers name -> DCP key
        self._meta = metadata  # DCP key -> TensorStorageMetadata
        self._cache: dict[str, torch.Tensor] = {}

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.load([name])[name]

    def __iter__(self):
        return iter(self._raw_key)

    def __len__(self) -> int:
        return len(self._raw_key)

    def __contains__(self, name: object) -> bool:  # Mapping's default would read the tensor
        return name in self._raw_key

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._meta[self._raw_key[name]].size)

    def load(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        names = list(names)
        todo = [n for n in names if n not in self._cache]
        raw = read_dcp_tensors(self.fsdp_dir, [self._raw_key[n] for n in todo], self._meta)
        got = {n: raw[self._raw_key[n]] for n in todo}
        got.update({n: self._cache[n] for n in names if n in self._cache})
        return got

    def preload(self) -> "CheckpointTensors":
        self._cache = self.load(list(self._raw_key))
        return self


@dataclass
class Checkpoint:
    """One committed iteration, read offline.

    tensors: the model tensors under their diffusers names (wrapper segments and peft's adapter
    name removed: "transformer_blocks.0.attn.to_q.lora_A.weight"). For a LoRA run these are only
    the trained adapter tensors (preloaded); for a full fine-tune they are read on demand.
    """

    path: Path
    iteration: int
    contract: dict[str, Any]
    trainer_state: dict[str, Any]
    mode: str
    tensors: CheckpointTensors = field(repr=False)


#: the transformers of a two-expert model (Wan2.2 A14B): the trainer holds both in one module, so
#: a checkpoint names their tensors "transformer.<name>" and "transformer_2.<name>"
EXPERT_COMPONENTS = ("transformer", "transformer_2")


def expert_components(ckpt: Checkpoint) -> tuple[str, ...] | None:
    """EXPERT_COMPONENTS when every tensor of the checkpoint belongs to one of them and the second
    one is there (a two-expert run), else None (one transformer, names without a component)."""
    heads = {n.split(".", 1)[0] for n in ckpt.tensors}
    return EXPERT_COMPONENTS if heads == set(EXPERT_COMPONENTS) else None


def expert_checkpoint(ckpt: Checkpoint, component: str) -> Checkpoint:
    """The view of a two-expert checkpoint that holds one expert's tensors under the names of its
    own transformer ("transformer_2.blocks.0..." -> "blocks.0..."), so every one-transformer step
    (merge, adapter, verification) runs on it unchanged; read tensors are shared."""
    prefix = component + "."
    src = ckpt.tensors
    view = CheckpointTensors(src.fsdp_dir, {n[len(prefix):]: k for n, k in src._raw_key.items() if n.startswith(prefix)},
                             src._meta)
    view._cache = {n[len(prefix):]: t for n, t in src._cache.items() if n.startswith(prefix)}
    return dataclasses.replace(ckpt, tensors=view)


def find_checkpoint(save_dir: str | os.PathLike, task: str, iteration: int | None) -> tuple[Path, int]:
    """The directory of a COMMITTED iteration (the newest when `iteration` is None).

    Raises ExportError naming the directory when it is missing, uncommitted or lacks its DCP
    metadata, listing the committed iterations that do exist."""
    save = Path(save_dir)
    if not (save / task).is_dir():
        raise ExportError(f"--save-dir {str(save)!r} has no {task}/ directory: no checkpoints of task {task!r} "
                          f"there (expected {save / task / 'iter_0000000'}/...)")
    committed = committed_iterations(save, task)
    if iteration is None:
        if not committed:
            raise ExportError(f"{save / task} holds no COMMITTED iteration; nothing can be exported")
        iteration = committed[-1]
    d = iteration_dir(save, task, iteration)
    if not d.is_dir():
        raise ExportError(f"{d} does not exist; committed iterations under {save / task}: {committed or 'none'}")
    if not (d / COMMITTED).is_file():
        raise ExportError(f"{d} has no {COMMITTED} marker: the save never completed (or was interrupted), so "
                          f"its shards cannot be trusted; pick a committed --iteration from {committed or 'none'}")
    if not (d / "fsdp" / ".metadata").is_file():
        raise ExportError(f"{d / 'fsdp'} has no DCP .metadata file although {d.name} is COMMITTED: the "
                          "checkpoint is damaged; export an earlier iteration")
    return d, iteration


#: what a missing / unreadable JSON file of a COMMITTED checkpoint means
_DAMAGED_CHECKPOINT = "the checkpoint is damaged although its directory is COMMITTED; export an earlier iteration"


def _not_a_pipeline(base: Path) -> str:
    return f"--base-model-path {str(base)!r} is not a complete diffusers pipeline directory"


def _read_json(path: Path, fix: str) -> dict[str, Any]:
    """The JSON in `path`; ExportError naming it and saying `fix` when it is missing or not JSON.
    The file may belong to the checkpoint, the base model or the export, hence the caller's fix."""
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ExportError(f"{path} is missing: {fix}") from None
    except json.JSONDecodeError as e:
        raise ExportError(f"{path} is not valid JSON ({e}): {fix}") from None


def dcp_model_metadata(fsdp_dir: Path, prefix: str = MODEL_PREFIX) -> dict[str, Any]:
    """DCP key -> TensorStorageMetadata of every "<prefix>*" entry ("model." or "ema.") of the
    checkpoint in `fsdp_dir`; raises when there is none."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    try:
        md = FileSystemReader(str(fsdp_dir)).read_metadata()
    except Exception as e:  # noqa: BLE001 - any unreadable metadata is a damaged checkpoint
        raise ExportError(f"{fsdp_dir}: cannot read the DCP metadata ({e!r}); the checkpoint is damaged") from None
    out = {}
    for key, meta in md.state_dict_metadata.items():
        if not key.startswith(prefix):
            continue
        if not isinstance(meta, TensorStorageMetadata):
            raise ExportError(f"{fsdp_dir}: model entry {key!r} is not a tensor; not a checkpoint of a transformer")
        out[key] = meta
    if not out and prefix == EMA_PREFIX:
        raise ExportError(f"{fsdp_dir} holds no EMA weights ('{EMA_PREFIX}*'): the run was trained without "
                          "--ema-decay; export the live weights (drop --ema)")
    if not out and prefix == OLD_POLICY_PREFIX:
        raise ExportError(f"{fsdp_dir} holds no old policy ('{OLD_POLICY_PREFIX}*'): the run was not trained with "
                          "--algorithm nft; export the live weights (drop --old-policy)")
    if not out:
        raise ExportError(f"{fsdp_dir} holds no '{prefix}*' tensors: not a checkpoint written by "
                          "trainer.checkpoint.save_checkpoint")
    return out


def read_dcp_tensors(fsdp_dir: Path, keys: Iterable[str], metadata: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Load the DCP entries `keys` (full, unsharded tensors on CPU) in this one process.

    DCP reshards on load: every tensor is materialised at its global shape whatever the world
    size that saved it. Only the requested entries are read from disk."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    state = {k: torch.empty(tuple(metadata[k].size), dtype=metadata[k].properties.dtype) for k in keys}
    if not state:
        return {}
    try:
        with warnings.catch_warnings():  # single-process loading is the intent here
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, storage_reader=FileSystemReader(str(fsdp_dir)), no_dist=True)
    except BaseException as e:  # CheckpointException derives from BaseException
        if isinstance(e, KeyboardInterrupt):
            raise
        raise ExportError(f"reading the DCP shards in {fsdp_dir} failed ({type(e).__name__}: {e}); the "
                          "checkpoint is damaged or incomplete: export an earlier iteration") from None
    return state


def contract_mode(contract: dict[str, Any]) -> str | None:
    """'full' | 'lora' | None (absent) from adapter_contract.json ("mode", or "fsdp_trainable_mode")."""
    mode = contract.get("mode", contract.get("fsdp_trainable_mode"))
    return None if mode is None else str(mode)


def load_checkpoint(save_dir: str | os.PathLike, task: str, iteration: int | None, *,
                    name_map: Callable[[str], str] | None = None, ema: bool = False,
                    old_policy: bool = False) -> Checkpoint:
    """Read a committed iteration's sidecars and every model tensor (see Checkpoint).

    ema: the trainable tensors are the checkpoint's EMA ("ema.*", fp32) instead of the live ones;
    the rest stays the model's. Raises when the checkpoint has no EMA. old_policy: the same with
    an nft run's old policy ("nft_old.*").

    name_map: the model adapter's training-name -> diffusers-name map, applied after the
    wrapper segments are stripped. The mode comes from adapter_contract.json and must agree
    with the tensors (a LoRA checkpoint holds lora_A/lora_B tensors, a full one none)."""
    d, iteration = find_checkpoint(save_dir, task, iteration)
    contract = _read_json(d / CONTRACT, _DAMAGED_CHECKPOINT)
    state = _read_json(d / TRAINER_STATE, _DAMAGED_CHECKPOINT)
    meta = dcp_model_metadata(d / "fsdp")
    name_map = name_map or (lambda n: n)
    raw_key: dict[str, str] = {}
    for key in meta:
        name = name_map(strip_wrapper_segments(key[len(MODEL_PREFIX):]))
        if name in raw_key:
            raise ExportError(f"{d / 'fsdp'}: {raw_key[name]!r} and {key!r} map to the same name {name!r}")
        raw_key[name] = key
    if ema and old_policy:
        raise ExportError("--ema and --old-policy exclude each other: export one set of weights at a time")
    if ema or old_policy:
        prefix = EMA_PREFIX if ema else OLD_POLICY_PREFIX
        ema_meta = dcp_model_metadata(d / "fsdp", prefix)
        for key in ema_meta:
            name = name_map(strip_wrapper_segments(key[len(prefix):]))
            if name not in raw_key:
                raise ExportError(f"{d / 'fsdp'}: the EMA entry {key!r} has no model tensor {name!r}: the "
                                  "checkpoint is inconsistent")
            raw_key[name] = key
        meta = {**meta, **ema_meta}
    tensors = CheckpointTensors(d / "fsdp", raw_key, meta)
    has_lora = any(is_lora_name(n) for n in tensors)
    mode = contract_mode(contract)
    if mode is None:
        mode = "lora" if has_lora else "full"
        log.warning("%s records no mode; the tensors say %r", d / CONTRACT, mode)
    if mode not in ("full", "lora"):
        raise ExportError(f"{d / CONTRACT}: mode {mode!r} is neither 'full' nor 'lora'")
    if mode == "lora" and not has_lora:
        raise ExportError(f"{d / CONTRACT} says mode 'lora' but {d / 'fsdp'} holds no lora_A/lora_B tensors: "
                          "the checkpoint is inconsistent")
    if mode == "full" and has_lora:
        raise ExportError(f"{d / CONTRACT} says mode 'full' but {d / 'fsdp'} holds lora_A/lora_B tensors: "
                          "the checkpoint is inconsistent")
    if mode == "lora":
        tensors.preload()  # the adapter only: small, and every tensor is needed
    return Checkpoint(path=d, iteration=iteration, contract=contract, trainer_state=state, mode=mode, tensors=tensors)


# ---------------------------------------------------------------------------------------------
# LoRA


@dataclass(frozen=True)
class LoraSettings:
    """rank, alpha (scaling = alpha / rank, peft's default non-rsLoRA rule) and the training's
    target-module suffixes (for the record; the adapter lists the exact modules it holds)."""

    rank: int
    alpha: float
    target_modules: tuple[str, ...]

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


def lora_pairs(tensors: Mapping[str, torch.Tensor], where: Path | str) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """module name -> (A [r, in], B [out, r]) from "<module>.lora_A.weight" / "<module>.lora_B.weight".

    Raises ExportError for a half pair, a LoRA tensor of another kind (DoRA magnitude, bias,
    embedding LoRA: training never makes them) or mismatched ranks within a pair."""
    a_of: dict[str, torch.Tensor] = {}
    b_of: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if not is_lora_name(name):
            continue
        for kind, box in (("lora_A", a_of), ("lora_B", b_of)):
            suffix = f".{kind}.weight"
            if name.endswith(suffix):
                box[name[: -len(suffix)]] = t
                break
        else:
            raise ExportError(f"{where}: unsupported LoRA tensor {name!r} (only lora_A.weight / lora_B.weight "
                              "of linear layers are exported)")
    if set(a_of) != set(b_of):
        odd = sorted(set(a_of) ^ set(b_of))
        raise ExportError(f"{where}: LoRA tensors without their partner for modules {odd[:5]}; damaged checkpoint")
    pairs = {}
    for module in sorted(a_of):
        a, b = a_of[module], b_of[module]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
            raise ExportError(f"{where}: {module} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}, "
                              "which do not form B @ A")
        pairs[module] = (a, b)
    return pairs


def lora_settings(ckpt: Checkpoint, default_targets: Iterable[str] = ()) -> LoraSettings:
    """Rank (from the tensors, checked against the contract), alpha (from the contract: it cannot
    be recovered from the weights) and target modules (contract, else the model adapter's)."""
    where = ckpt.path / CONTRACT
    pairs = lora_pairs(ckpt.tensors, ckpt.path / "fsdp")
    ranks = {int(a.shape[0]) for a, _ in pairs.values()}
    if len(ranks) != 1:
        raise ExportError(f"{ckpt.path / 'fsdp'}: LoRA ranks differ between modules ({sorted(ranks)}); "
                          "per-module ranks are not supported")
    rank = ranks.pop()
    saved_rank = ckpt.contract.get("lora_rank")
    if saved_rank is not None and saved_rank != rank:
        raise ExportError(f"{where} records lora_rank {saved_rank!r} but the tensors have rank {rank}; "
                          "the checkpoint is inconsistent")
    alpha = ckpt.contract.get("lora_alpha")
    if alpha is None:
        raise ExportError(f"{where} records no lora_alpha: the merge scale alpha / rank cannot be recovered from "
                          "the weights, and a guessed one silently rescales the policy")
    targets = ckpt.contract.get("lora_target_modules") or list(default_targets)
    # the values written into adapter_config.json and used as the merge scale: a NaN or infinite
    # alpha would export NaN weights with exit 0
    problems = lora_config_problems(rank, alpha, list(targets) if isinstance(targets, (list, tuple)) else targets)
    if problems:
        raise ExportError(f"{where} (lora_alpha, lora_target_modules; r from the tensors): {'; '.join(problems)}; "
                          "the checkpoint cannot be exported as it is")
    return LoraSettings(rank=rank, alpha=float(alpha), target_modules=tuple(str(t) for t in targets))


def merge_lora_weight(weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                      scaling: float) -> torch.Tensor:
    """W' = W + (B @ A) * scaling, computed in fp32 and returned in W's dtype.

    weight [out, in], lora_a [r, in], lora_b [out, r]: the merged weight sync's
    weight_sync.merge_lora, after checking that the shapes fit.
    """
    if tuple(weight.shape) != (lora_b.shape[0], lora_a.shape[1]):
        raise ValueError(f"base weight {tuple(weight.shape)} does not match B @ A = "
                         f"{(lora_b.shape[0], lora_a.shape[1])}")
    return merge_lora(weight, lora_a, lora_b, scaling, None)


# ---------------------------------------------------------------------------------------------
# the base model's transformer files


def base_transformer_layout(base: Path, component: str = "transformer") -> tuple[list[str], dict[str, str], str | None]:
    """(safetensors file names, tensor name -> file name, index file name or None) of
    <base>/<component>/ (transformer/, or a two-expert model's transformer_2/), read from the
    safetensors headers (no tensor data)."""
    from safetensors import safe_open

    tdir = base / component
    if not (tdir / "config.json").is_file():
        raise ExportError(f"--base-model-path {str(base)!r} has no {component}/config.json: not a diffusers "
                          "pipeline directory of the model this run trained")
    index_files = sorted(tdir.glob("*.safetensors.index.json"))
    if len(index_files) > 1:
        raise ExportError(f"{tdir} holds several safetensors index files {[p.name for p in index_files]}; "
                          "keep exactly one")
    if index_files:
        weight_map = _read_json(index_files[0], _not_a_pipeline(base)).get("weight_map") or {}
        files = sorted(set(weight_map.values()))
        index = index_files[0].name
    else:
        files = sorted(p.name for p in tdir.glob("*.safetensors"))
        index = None
        weight_map = {}
    if not files:
        raise ExportError(f"{tdir} holds no *.safetensors weights (a .bin transformer is not supported: "
                          "re-save the base with safe_serialization=True)")
    located: dict[str, str] = {}
    for fname in files:
        if not (tdir / fname).is_file():
            raise ExportError(f"{tdir / fname} is listed by the index but missing")
        with safe_open(str(tdir / fname), "pt") as f:
            for key in f.keys():
                located[key] = fname
    if index and set(located) != set(weight_map):
        raise ExportError(f"{tdir / index} does not match the tensors of its shard files")
    return files, located, index


def _resolve_dtype(name: str | None) -> torch.dtype | None:
    if name is None:
        return None
    if name not in DTYPES:
        raise ExportError(f"--dtype must be one of {tuple(DTYPES)}, got {name!r}")
    return DTYPES[name]


def _save_safetensors(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str] | None = None) -> None:
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata=metadata or {"format": "pt"})
    path.chmod(file_mode())  # safetensors creates its files 0600; an export follows the umask (docs/export.md)


def missing_from_full_checkpoint(ckpt: Checkpoint, base: Path, located: dict[str, str],
                                 adapter: Any = None, component: str = "transformer") -> list[str]:
    """Base transformer weights a full fine-tune checkpoint lacks, checked to be exactly ones the
    trainer freezes as never trained (the model adapter's never_trained_param_names on the base's
    architecture): those equal the base. Any other gap means a damaged checkpoint or the wrong base."""
    missing = sorted(n for n in located if n not in ckpt.tensors)
    if not missing:
        return []
    adapter = adapter or load_model_adapter(DEFAULT_ADAPTER)
    frozen = set(adapter.never_trained_param_names(_meta_transformer(base / component, _not_a_pipeline(base))))
    unexplained = [n for n in missing if n not in frozen]
    if unexplained:
        raise ExportError(f"{ckpt.path / 'fsdp'} lacks {len(unexplained)} trained transformer weights of the base at "
                          f"{base}, e.g. {unexplained[:3]}: the checkpoint is incomplete or --base-model-path is "
                          "not the model this run trained")
    return missing


class Progress:
    """One log line per finished unit of a long phase (a 40 GB export takes minutes): how far,
    how fast, how long still. Sizes are the files' bytes on disk."""

    def __init__(self, phase: str, sizes: list[int]):
        import time

        self.phase, self.total, self.n = phase, max(sum(sizes), 1), len(sizes)
        self.done, self.count, self._clock, self.t0 = 0, 0, time.perf_counter, time.perf_counter()

    def step(self, what: str, size: int) -> None:
        self.done += size
        self.count += 1
        elapsed = self._clock() - self.t0
        rate = self.done / elapsed if elapsed > 0 else 0.0
        eta = (self.total - self.done) / rate if rate > 0 else 0.0
        log.info("%s %d/%d %s: %.2f / %.2f GB (%.0f%%), %.0f MB/s, about %.0f s left", self.phase, self.count, self.n,
                 what, self.done / 1e9, self.total / 1e9, 100.0 * self.done / self.total, rate / 1e6, eta)


def _size_on_disk(path: Path) -> int:
    if path.is_dir():
        return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    return path.stat().st_size if path.exists() else 0


def write_merged_transformer(ckpt: Checkpoint, base: Path, out_tdir: Path, *, lora: LoraSettings | None,
                             dtype: torch.dtype | None, adapter: Any = None,
                             component: str = "transformer") -> dict[str, Any]:
    """Write <out>/transformer/ with the base's file layout and the trained weights (module docstring);
    `component`: the base's subfolder it is made from (transformer_2 for a two-expert model's
    second DiT, with `ckpt` that expert's view, expert_checkpoint).

    Works one base file at a time: memory stays at about one base shard plus that shard's
    checkpoint tensors (full fine-tune) or the adapter (LoRA). Returns a summary for export_info.json."""
    from safetensors import safe_open

    files, located, index = base_transformer_layout(base, component)
    tdir = base / component
    pairs = lora_pairs(ckpt.tensors, ckpt.path / "fsdp") if lora else {}
    unknown = sorted(n for n in ckpt.tensors if not is_lora_name(n) and n not in located)
    unknown += sorted(f"{m}.weight" for m in pairs if f"{m}.weight" not in located)
    if unknown:
        raise ExportError(f"the checkpoint has {len(unknown)} weights the base transformer at {tdir} does not, e.g. "
                          f"{unknown[:3]}: --base-model-path is not the model this run trained")
    from_base = missing_from_full_checkpoint(ckpt, base, located, adapter, component) if ckpt.mode == "full" else []
    out_tdir.mkdir(parents=True)
    for extra in sorted(tdir.iterdir()):  # config.json and anything else that is not weights
        if extra.is_file() and not extra.name.endswith(".safetensors") and extra.name != index:
            shutil.copy2(extra, out_tdir / extra.name)
    total = 0
    progress = Progress("transformer shard", [_size_on_disk(tdir / f) for f in files])
    for fname in files:
        out: dict[str, torch.Tensor] = {}
        with safe_open(str(tdir / fname), "pt") as f:
            keys = list(f.keys())
            trained = ckpt.tensors.load([k for k in keys if k in ckpt.tensors]) if ckpt.mode == "full" else {}
            for key in keys:
                w = f.get_tensor(key)
                target = dtype or w.dtype
                module = key[: -len(".weight")] if key.endswith(".weight") else None
                if key in trained:
                    if trained[key].shape != w.shape:
                        raise ExportError(f"{key}: checkpoint shape {tuple(trained[key].shape)} != base shape "
                                          f"{tuple(w.shape)} in {tdir / fname}: wrong --base-model-path")
                    w = trained[key]
                elif module in pairs:
                    try:
                        w = merge_lora_weight(w, *pairs[module], lora.scaling)
                    except ValueError as e:
                        raise ExportError(f"{key} in {tdir / fname}: {e}: wrong --base-model-path") from None
                out[key] = w.to(target)
                total += out[key].numel() * out[key].element_size()
        _save_safetensors(out, out_tdir / fname)
        del out, trained
        progress.step(fname, _size_on_disk(tdir / fname))
    if index:
        idx = _read_json(tdir / index, _not_a_pipeline(base))
        idx["metadata"] = {**idx.get("metadata", {}), "total_size": total}
        (out_tdir / index).write_text(json.dumps(idx, indent=2, sort_keys=True) + "\n")
    if from_base:
        log.info("%d transformer weights are not in the checkpoint (frozen, never trained) and come from the "
                 "base: %s%s", len(from_base), from_base[:4], " ..." if len(from_base) > 4 else "")
    return {"files": files, "tensors": len(located), "bytes": total, "weights_from_base": from_base,
            "lora_modules_merged": len(pairs)}


def place_components(base: Path, out: Path, how: str, skip: tuple[str, ...] = ("transformer",)) -> list[str]:
    """Put every entry of the base pipeline directory except `skip` (the transformers written) into `out`:
    copy (default; a self-contained export), hardlink (no extra space, same filesystem only;
    the files are shared, so editing one edits the other) or symlink (absolute links: the export
    breaks when the base moves). Returns the entry names."""
    if how not in COMPONENT_MODES:
        raise ExportError(f"--components must be one of {COMPONENT_MODES}, got {how!r}")
    if not (base / "model_index.json").is_file():
        raise ExportError(f"--base-model-path {str(base)!r} has no model_index.json: not a diffusers pipeline "
                          "directory")
    names = []
    entries = [e for e in sorted(base.iterdir()) if e.name not in skip]
    # links cost no bytes: count entries then, not gigabytes
    progress = Progress(f"component ({how})", [1 if how != "copy" else _size_on_disk(e) for e in entries])
    for entry in entries:
        dest = out / entry.name
        try:
            if how == "symlink":
                dest.symlink_to(entry.resolve(), target_is_directory=entry.is_dir())
            elif entry.is_dir():
                shutil.copytree(entry, dest, copy_function=os.link if how == "hardlink" else shutil.copy2)
            elif how == "hardlink":
                os.link(entry, dest)
            else:
                shutil.copy2(entry, dest)
        except OSError as e:
            hint = " (hard links need the same filesystem: use --components copy)" if how == "hardlink" else ""
            raise ExportError(f"placing {entry} into {out} by {how} failed: {e}{hint}") from None
        names.append(entry.name)
        progress.step(entry.name, 1 if how != "copy" else _size_on_disk(entry))
    return names


# ---------------------------------------------------------------------------------------------
# the adapter form


def peft_adapter_state(ckpt: Checkpoint, dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """The LoRA tensors under the names PeftModel.save_pretrained writes for the transformer:
    "base_model.model.<module>.lora_{A,B}.weight"."""
    out = {}
    for module, (a, b) in lora_pairs(ckpt.tensors, ckpt.path / "fsdp").items():
        out[f"{PEFT_PREFIX}{module}.lora_A.weight"] = a.to(dtype or a.dtype)
        out[f"{PEFT_PREFIX}{module}.lora_B.weight"] = b.to(dtype or b.dtype)
    return out


def peft_lora_config(modules: list[str], lora: LoraSettings, base_model_name_or_path: str | None):
    """peft LoraConfig of the exported adapter.

    target_modules lists the exact module names the checkpoint holds LoRA tensors for, not the
    training's suffixes: modules that can never receive a gradient (the last block's text-output
    path) are frozen in training and not checkpointed, and a suffix list would make a loader
    create adapter layers that have no weights (NativeEngine.load_lora_dir refuses such an
    adapter as incomplete). Their LoRA delta in training was B @ A = 0 (B starts at 0 and never
    moved), so leaving them out changes nothing."""
    from peft import LoraConfig

    return LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=0.0, target_modules=sorted(modules),
                      bias="none", init_lora_weights=True, base_model_name_or_path=base_model_name_or_path,
                      inference_mode=True)


def write_adapter(ckpt: Checkpoint, out: Path, lora: LoraSettings, *, dtype: torch.dtype | None,
                  base_model_name_or_path: str | None) -> dict[str, Any]:
    """adapter_config.json + adapter_model.safetensors + pytorch_lora_weights.safetensors (module
    docstring) into `out`."""
    state = peft_adapter_state(ckpt, dtype)
    modules = sorted({k[len(PEFT_PREFIX):].rsplit(".lora_", 1)[0] for k in state})
    config = peft_lora_config(modules, lora, base_model_name_or_path)
    out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(str(out))
    kwargs = config.to_dict()
    for k, v in kwargs.items():
        if isinstance(v, set):
            kwargs[k] = sorted(v)
    # diffusers strips the load prefix from the metadata keys too, so they carry the same prefix
    # as the tensor names (diffusers' own pipeline-level save does this with "transformer.")
    for weights, prefix in ((ADAPTER_WEIGHTS, PEFT_PREFIX), (PIPELINE_LORA_WEIGHTS, PIPELINE_LORA_PREFIX)):
        meta = {prefix + k: v for k, v in kwargs.items()}
        _save_safetensors({prefix + k[len(PEFT_PREFIX):]: t for k, t in state.items()}, out / weights,
                          {"format": "pt", DIFFUSERS_LORA_METADATA_KEY: json.dumps(meta, sort_keys=True, default=str)})
    return {"modules": len(modules), "tensors": len(state),
            "bytes": sum(t.numel() * t.element_size() for t in state.values())}


# ---------------------------------------------------------------------------------------------
# verification


def _meta_transformer(config_dir: Path, fix: str):
    """The transformer class named in <config_dir>/config.json, built on the meta device (no memory).
    fix: what to say when that file is missing or unreadable (see _read_json)."""
    import diffusers

    cfg = _read_json(config_dir / "config.json", fix)
    cls_name = cfg.get("_class_name")
    cls = getattr(diffusers, str(cls_name), None)
    if cls is None:
        raise ExportError(f"{config_dir / 'config.json'} names class {cls_name!r}, which diffusers does not have")
    with torch.device("meta"):
        return cls.from_config(cls.load_config(str(config_dir)))


def _close(got: torch.Tensor, want: torch.Tensor, magnitude: float) -> bool:
    """got (stored in some dtype) equals want (fp64) up to that dtype's rounding of a computation
    whose operands are at most `magnitude`: |got - want| <= eps * (|want| + 4 * magnitude).
    The magnitude term matters where W and the LoRA delta nearly cancel."""
    eps = torch.finfo(got.dtype).eps if got.dtype.is_floating_point else 0.0
    return bool(((got.double() - want).abs() <= eps * (want.abs() + 4.0 * magnitude)).all())


def verify_merged(out: Path, ckpt: Checkpoint, base: Path, lora: LoraSettings | None,
                  component: str = "transformer") -> dict[str, Any]:
    """Reload the written transformer, file by file, and check it against the checkpoint and the base.

    - no lora_A / lora_B / base_layer tensor is present (a "transformer" of adapter tensors is
      non-empty and finite, so it would pass a naive check);
    - the names and shapes equal both the base's and those of the transformer class built from
      the written config (what from_pretrained will ask for);
    - full: every checkpoint tensor is written exactly (after the dtype cast), the others are the
      base's; LoRA: every adapted weight equals W + (B @ A) * alpha / rank recomputed in fp64 up to
      the stored dtype's rounding and differs from W wherever that dtype can show the difference;
      every other weight is the base's bit for bit;
    - every component of model_index.json is present.
    Raises ExportError listing the first problems; returns counts."""
    from safetensors import safe_open

    problems: list[str] = []
    _, base_located, _ = base_transformer_layout(base, component)
    try:
        _, written_located, _ = base_transformer_layout(out, component)
    except ExportError as e:
        raise ExportError(f"--verify failed for the merged export in {out}: {e}") from None
    bad_names = [n for n in written_located if is_lora_name(n) or "base_layer" in n.split(".")]
    if bad_names:
        problems.append(f"adapter tensors in a merged export: {bad_names[:3]}")
    if set(written_located) != set(base_located):
        problems.append(f"names differ from the base: missing {sorted(set(base_located) - set(written_located))[:3]}, "
                        f"extra {sorted(set(written_located) - set(base_located))[:3]}")
    model = _meta_transformer(out / component, "the merged export is incomplete")
    expected_shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    del model
    pairs = lora_pairs(ckpt.tensors, ckpt.path / "fsdp") if lora else {}
    changed = 0
    shape_bad: list[str] = sorted(set(expected_shapes) - set(written_located))
    written_files = sorted(set(written_located.values()))
    progress = Progress("--verify shard", [_size_on_disk(out / component / f) for f in written_files])
    for fname in written_files:
        progress_size = _size_on_disk(out / component / fname)
        with contextlib.ExitStack() as files:
            fw = files.enter_context(safe_open(str(out / component / fname), "pt"))
            base_files: dict[str, Any] = {}  # each base shard opened once, not once per tensor
            keys = list(fw.keys())
            trained = ckpt.tensors.load([k for k in keys if k in ckpt.tensors]) if ckpt.mode == "full" else {}
            for name in keys:
                w = fw.get_tensor(name)
                if tuple(w.shape) != expected_shapes.get(name):
                    shape_bad.append(name)
                if name not in base_located:
                    continue
                bname = base_located[name]
                if bname not in base_files:
                    base_files[bname] = files.enter_context(safe_open(str(base / component / bname), "pt"))
                base_w = base_files[bname].get_tensor(name)
                module = name[: -len(".weight")] if name.endswith(".weight") else None
                if ckpt.mode == "full":
                    want = trained.get(name, base_w)
                    if w.shape != want.shape or not torch.equal(w, want.to(w.dtype)):
                        problems.append(f"{name}: value differs from the checkpoint")
                elif module in pairs:
                    a, b = pairs[module]
                    delta = (b.double() @ a.double()) * lora.scaling
                    magnitude = max(base_w.abs().max().item(), delta.abs().max().item())
                    if w.shape != base_w.shape or not _close(w, base_w.double() + delta, magnitude):
                        problems.append(f"{name}: value differs from W + (B @ A) * {lora.scaling:g}")
                        continue
                    # a delta too small for the stored dtype may round away (bf16); only a
                    # representable one must show
                    if not torch.equal((base_w.double() + delta).to(w.dtype), base_w.to(w.dtype)):
                        changed += 1
                        if torch.equal(w, base_w.to(w.dtype)):
                            problems.append(f"{name}: equals the base although B @ A != 0 (not folded in)")
                elif w.shape != base_w.shape or not torch.equal(w, base_w.to(w.dtype)):
                    problems.append(f"{name}: not adapted, but differs from the base")
        progress.step(fname, progress_size)
    if shape_bad:
        problems.append(f"{len(shape_bad)} tensors do not fit the transformer class built from the written "
                        f"config, e.g. {shape_bad[:3]}")
    index = _read_json(out / "model_index.json", "the merged export is incomplete")
    for comp, spec in index.items():
        if not comp.startswith("_") and isinstance(spec, list) and spec[0] is not None and not (out / comp).exists():
            problems.append(f"component {comp}/ named in model_index.json is missing")
    if problems:
        raise ExportError(f"--verify failed for the merged export in {out}: " + "; ".join(problems[:8])
                          + (f"; ... {len(problems) - 8} more" if len(problems) > 8 else ""))
    return {"tensors": len(written_located), "lora_modules_checked": len(pairs), "lora_modules_changed": changed}


def verify_adapter(out: Path, ckpt: Checkpoint, lora: LoraSettings, base: Path | None,
                   component: str = "transformer") -> dict[str, Any]:
    """Reload the written adapter and check it against the checkpoint.

    - adapter_config.json loads as a peft LoraConfig with the checkpoint's rank and alpha;
    - adapter_model.safetensors holds exactly the checkpoint's LoRA tensors under peft's names,
      equal in value (after the dtype cast);
    - with a base model (--base-model-path or the contract's), peft injects this config into the
      base transformer (built on the meta device: no weights are read) and the LoRA parameters
      it creates are exactly the file's names and shapes: PeftModel.from_pretrained will load it
      with no missing or unexpected key.
    Raises ExportError listing the problems; returns counts."""
    from peft import LoraConfig
    from safetensors.torch import load_file

    problems: list[str] = []
    config = LoraConfig.from_pretrained(str(out))
    if int(config.r) != lora.rank or float(config.lora_alpha) != lora.alpha:
        problems.append(f"adapter_config.json has r={config.r}, lora_alpha={config.lora_alpha}; the checkpoint "
                        f"has rank {lora.rank}, alpha {lora.alpha}")
    written = load_file(str(out / ADAPTER_WEIGHTS))
    pipeline_file = {PEFT_PREFIX + k[len(PIPELINE_LORA_PREFIX):]: t
                     for k, t in load_file(str(out / PIPELINE_LORA_WEIGHTS)).items()}
    if set(pipeline_file) != set(written) or any(not torch.equal(pipeline_file[k], written[k]) for k in written):
        problems.append(f"{PIPELINE_LORA_WEIGHTS} does not hold exactly the tensors of {ADAPTER_WEIGHTS}")
    # the LoRA tensors only: a LoRA checkpoint also holds the DiT's persistent buffers (SD3's
    # position table), which are the base's and no part of an adapter
    want = {PEFT_PREFIX + n: t for n, t in ckpt.tensors.items() if is_lora_name(n)}
    if set(written) != set(want):
        problems.append(f"tensor names differ from the checkpoint: missing {sorted(set(want) - set(written))[:3]}, "
                        f"extra {sorted(set(written) - set(want))[:3]}")
    for name in sorted(set(written) & set(want)):
        got, exp = written[name], want[name]
        if got.shape != exp.shape or not torch.equal(got, exp.to(got.dtype)):
            problems.append(f"{name}: shape or value differs from the checkpoint")
    peft_checked = False
    if base is not None:
        from peft import inject_adapter_in_model

        model = _meta_transformer(base / component, _not_a_pipeline(base))
        inject_adapter_in_model(config, model, adapter_name="default")
        injected = {PEFT_PREFIX + strip_wrapper_segments(n): tuple(p.shape)
                    for n, p in model.named_parameters() if is_lora_name(n)}
        got = {k: tuple(v.shape) for k, v in written.items()}
        if injected != got:
            diff = sorted(set(injected.items()) ^ set(got.items()))
            problems.append(f"peft's injection into the base at {base} does not match the file: {diff[:3]}")
        peft_checked = True
    if problems:
        raise ExportError(f"--verify failed for the adapter export in {out}: " + "; ".join(problems[:8]))
    return {"tensors": len(written), "peft_injection_checked": peft_checked}


# ---------------------------------------------------------------------------------------------
# the export


def load_model_adapter(dotpath: str):
    """Instantiate the model adapter class at `dotpath` ("package.module.Class")."""
    from trainer.dotpath import import_dotpath

    try:
        cls = import_dotpath(dotpath, "--model-adapter-path")
    except ValueError as e:
        raise ExportError(f"--model-adapter-path {dotpath!r} cannot be imported ({e}); expected e.g. "
                          f"{DEFAULT_ADAPTER}") from None
    return cls()


def resolve_adapter_path(save_dir, task: str, iteration: int | None, base_model_path=None) -> str:
    """The model adapter of a checkpoint when --model-adapter-path is not given: the one its run
    recorded (adapter_contract.json "model_adapter_path") when that is a registered family
    adapter (config.PIPELINE_ADAPTERS), else the family that the base's model_index.json names
    (the given base, else the recorded one), else the default family's.

    A data file never chooses code to import: a recorded dotpath outside the registry is refused,
    and only an explicit --model-adapter-path imports it."""
    from trainer.config import PIPELINE_ADAPTERS, adapter_for_model_dir

    ckpt = load_checkpoint(save_dir, task, iteration)
    recorded = ckpt.contract.get("model_adapter_path")
    if recorded:
        families = sorted(set(PIPELINE_ADAPTERS.values()))
        if recorded not in families:
            raise ExportError(
                f"{ckpt.path / CONTRACT} records the model adapter {str(recorded)[:200]!r}, which is not one of the "
                f"registered family adapters ({', '.join(families)}); a checkpoint's files never choose code to "
                "import. Pass --model-adapter-path explicitly (the module it names is imported: give it only for "
                "code you trust)")
        return str(recorded)
    base = base_model_path or recorded_base_path(ckpt)
    return adapter_for_model_dir(base) if base else DEFAULT_ADAPTER


def recorded_base(ckpt: Checkpoint) -> tuple[str | None, Path | None]:
    """(the base model directory the run trained on, the file that records it): its
    trainer_state.json, else (checkpoints of older runs) its adapter_contract.json."""
    for record, name in ((ckpt.trainer_state, TRAINER_STATE), (ckpt.contract, CONTRACT)):
        for key in ("base_model_path", "model_path"):
            if record.get(key):
                return str(record[key]), ckpt.path / name
    return None, None


def recorded_base_path(ckpt: Checkpoint) -> str | None:
    """The base model directory the run trained on, as its checkpoint records it (recorded_base)."""
    return recorded_base(ckpt)[0]


def _check_output_dir(output_dir: Path) -> None:
    if output_dir.exists() and (not output_dir.is_dir() or any(output_dir.iterdir())):
        raise ExportError(f"--output-dir {str(output_dir)!r} exists and is not an empty directory; refusing to "
                          "overwrite it: choose a new directory or remove it yourself")


def export_checkpoint(save_dir: str | os.PathLike, task: str, iteration: int | None, output_dir: str | os.PathLike,
                      *, form: str, model_adapter_path: str | None = None,
                      base_model_path: str | os.PathLike | None = None, verify: bool = False,
                      dtype: str | None = None, components: str = "copy", ema: bool = False,
                      old_policy: bool = False) -> dict[str, Any]:
    """Export one committed iteration (see the module docstring). Returns the export_info dict,
    which is also written to <output_dir>/export_info.json.

    base_model_path: the base pipeline (--form merged needs one); None takes the path the
    checkpoint records (trainer_state.json, else adapter_contract.json), and export_info.json's
    "base_model_path_from" says which. dtype: None keeps the base's dtype per tensor (merged) or
    the checkpoint's (adapter). model_adapter_path: None takes the registered family adapter the
    run recorded in adapter_contract.json, else the family of the base's model_index.json
    (resolve_adapter_path)."""
    if form not in FORMS:
        raise ExportError(f"--form must be one of {FORMS}, got {form!r}")
    out = Path(output_dir)
    _check_output_dir(out)
    tdtype = _resolve_dtype(dtype)
    adapter = load_model_adapter(model_adapter_path or resolve_adapter_path(save_dir, task, iteration, base_model_path))
    name_map = getattr(adapter, "weight_name_map", None)
    ckpt = load_checkpoint(save_dir, task, iteration, name_map=name_map, ema=ema, old_policy=old_policy)
    lora = lora_settings(ckpt, getattr(adapter, "lora_target_modules", ())) if ckpt.mode == "lora" else None

    base: Path | None = Path(base_model_path) if base_model_path else None
    base_source = "--base-model-path" if base is not None else None
    if form == "merged" and base is None:
        why = ("a LoRA checkpoint holds only the adapter (lora_A/lora_B), so without the base weights there is "
               "nothing to fold it into" if ckpt.mode == "lora" else
               "the pipeline's other components and the transformer config come from it")
        recorded, record = recorded_base(ckpt)
        if recorded is None:
            raise ExportError(f"--form merged of {ckpt.path} needs --base-model-path: {why}, and neither "
                              f"{ckpt.path / TRAINER_STATE} nor {ckpt.path / CONTRACT} records base_model_path. Pass "
                              "the base model directory the run trained on (its --model-path)"
                              + (", or use --form adapter." if ckpt.mode == "lora" else "."))
        if not Path(recorded).is_dir():
            raise ExportError(f"--form merged of {ckpt.path} needs --base-model-path: {why}, and the base model "
                              f"{recorded} that {record} records is not a directory (moved?). Pass the base model "
                              "directory the run trained on")
        base, base_source = Path(recorded), str(record)
        log.info("using the base model recorded in %s: %s", record, base)
    if form == "adapter" and ckpt.mode != "lora":
        raise ExportError(f"--form adapter needs a LoRA checkpoint, but {ckpt.path} is a full fine-tune: "
                          "use --form merged")
    if base is not None and not base.is_dir():
        raise ExportError(f"--base-model-path {str(base)!r} is not a directory")
    if form == "adapter" and base is None and recorded_base_path(ckpt):
        recorded, record = recorded_base(ckpt)
        if Path(recorded).is_dir():
            base, base_source = Path(recorded), str(record)

    out.parent.mkdir(parents=True, exist_ok=True)
    # a fresh, unpredictable name: nothing planted beside --output-dir is followed or deleted
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    staging.chmod(dir_mode())  # mkdtemp makes it 0700; the export follows the umask like every other output
    info: dict[str, Any] = {
        "form": form,
        "source": str(ckpt.path),
        "iteration": ckpt.iteration,
        "task": task,
        "mode": ckpt.mode,
        "policy_version": ckpt.trainer_state.get("policy_version"),
        "rollout_id": ckpt.trainer_state.get("rollout_id"),
        "adapter_contract": ckpt.contract,
        "base_model_path": None if base is None else str(base.resolve()),
        "base_model_path_from": base_source,
        "dtype": dtype or ("base" if form == "merged" else "checkpoint"),
    }
    if ema:
        info["weights"] = "ema"
        info["ema_decay"] = ckpt.trainer_state.get("ema_decay")
    if old_policy:
        info["weights"] = "nft_old_policy"
    if lora:
        info["lora"] = {"rank": lora.rank, "alpha": lora.alpha, "scaling": lora.scaling,
                        "training_target_modules": list(lora.target_modules)}
    try:
        experts = expert_components(ckpt)
        # a two-expert model: each expert exported on its own, as its transformer of the pipeline
        parts = [(c, expert_checkpoint(ckpt, c)) for c in experts] if experts else [("transformer", ckpt)]
        if experts:
            info["experts"] = list(experts)
        if form == "merged":
            info["components"] = {"mode": components, "entries": place_components(
                base, staging, components, skip=tuple(c for c, _ in parts))}
        for c, part in parts if form == "merged" else ():
            key = "" if c == "transformer" else c[len("transformer"):]  # "", "_2": export_info keys
            info["transformer" + key] = write_merged_transformer(part, base, staging / c, lora=lora, dtype=tdtype,
                                                                 adapter=adapter, component=c)
        for c, part in parts:
            key = "" if c == "transformer" else c[len("transformer"):]
            if form == "merged":
                if verify:  # once every transformer is written: it checks model_index.json's components too
                    info["verify" + key] = verify_merged(staging, part, base, lora, component=c)
                continue
            # two experts: one adapter directory per expert (<out>/transformer/, <out>/transformer_2/)
            where = staging / c if experts else staging
            info["adapter" + key] = write_adapter(part, where, lora, dtype=tdtype,
                                                  base_model_name_or_path=None if base is None else str(base.resolve()))
            if verify:
                info["verify" + key] = verify_adapter(where, part, lora, base, component=c)
                if not info["verify" + key]["peft_injection_checked"]:
                    log.warning("--verify: no base model (pass --base-model-path), so the peft injection check "
                                "was skipped; the file was checked against the checkpoint")
        (staging / EXPORT_INFO).write_text(json.dumps(info, indent=2, sort_keys=True, default=str) + "\n")
        # the rename publishes the directory: its files must be on disk first, or a crash right
        # after it could leave a complete-looking export with empty or partial files
        fsync_tree(staging)
        _check_output_dir(out)  # nothing appeared there meanwhile
        if out.exists():
            out.rmdir()
        os.rename(staging, out)
        fsync_dir(out.parent)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return info


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = tool_parser("export_checkpoint", __doc__)
    p.add_argument("--save-dir", "--save", dest="save_dir", required=True, type=existing_dir,
                   help="the run's --save directory (holds <task>/iter_*/)")
    p.add_argument("--task", "--generation-task", dest="task", default="t2i", help="generation task subdirectory")
    p.add_argument("--iteration", type=int, default=None,
                   help="iteration to export; must be COMMITTED (unset: the newest committed one)")
    p.add_argument("--output-dir", required=True, help="where to write the export; must not exist or be empty")
    p.add_argument("--form", choices=FORMS, default="merged",
                   help="merged: a diffusers pipeline directory; adapter: a HF-PEFT adapter (LoRA checkpoints only)")
    p.add_argument("--model-adapter-path", default=None,
                   help="dotted path of the model adapter class; names code that is imported, so trusted input "
                        "(unset: the family adapter the run recorded in adapter_contract.json, which must be a "
                        "registered one, else the family of the base's model_index.json)")
    p.add_argument("--base-model-path", default=None, type=existing_dir,
                   help="the local base pipeline directory the run trained on (unset: the path the checkpoint "
                        "records in trainer_state.json; --form merged needs one)")
    p.add_argument("--verify", action="store_true",
                   help="reload what was written and check names, shapes and values against the checkpoint")
    p.add_argument("--dtype", choices=tuple(DTYPES), default=None,
                   help="dtype of the written weights (unset: the base's per tensor for merged, the "
                        "checkpoint's for adapter)")
    p.add_argument("--components", choices=COMPONENT_MODES, default="copy",
                   help="how --form merged places the base's non-transformer components: copy (self-contained), "
                        "hardlink (same filesystem, no extra space), symlink (breaks if the base moves)")
    p.add_argument("--ema", action="store_true",
                   help="export the EMA of the trainable weights instead of the live ones; the checkpoint must "
                        "have been written with --ema-decay > 0")
    p.add_argument("--old-policy", action="store_true",
                   help="export the old policy of an --algorithm nft run instead of the live weights")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return run_tool("export_checkpoint", lambda: _export(args), (ExportError,))


def _export(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    info = export_checkpoint(args.save_dir, args.task, args.iteration, args.output_dir, form=args.form,
                             model_adapter_path=args.model_adapter_path, base_model_path=args.base_model_path,
                             verify=args.verify, dtype=args.dtype, components=args.components, ema=args.ema,
                             old_policy=args.old_policy)
    checked = " (verified)" if "verify" in info else ""
    print(f"exported {info['source']} ({info['mode']}) as {info['form']} to {args.output_dir}{checked}")
    if info.get("base_model_path") and info.get("base_model_path_from") != "--base-model-path":
        print(f"base model {info['base_model_path']}: as recorded in {info['base_model_path_from']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

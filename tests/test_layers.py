"""The package's import layering (docs/architecture.md): a module may import only from its own
layer or a lower one. Imports inside functions count too: a lazy import is still a dependency,
and an upward one is how a cycle comes back."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: lowest first; a module belongs to the first entry that names it or a package above it
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("core", ("trainer.core", "trainer.dotpath", "trainer.host_arena", "trainer.lr_schedule",
              "trainer.distributed", "trainer.checkpoint_index", "trainer.metrics", "trainer.ema")),
    ("vocabulary", ("trainer.config", "trainer.sampling", "trainer.flow_grpo", "trainer.nft", "trainer.trajectory",
                    "trainer.video")),
    ("contracts", ("trainer.models.base", "trainer.rewards.base", "trainer.data", "trainer.artifacts",
                   "trainer.artifact_writer", "trainer.video_artifacts")),
    ("families", ("trainer.models", "trainer.rewards")),
    # the engine protocol sits above the families: an adapter builds what an engine consumes
    # (trajectory.RolloutRequest) and never needs the engine's side
    ("engines", ("trainer.engine",)),
    ("actor", ("trainer.train_model", "trainer.actor", "trainer.rollout", "trainer.checkpoint")),
    ("sync", ("trainer.weight_sync",)),
    ("colocation", ("trainer.colocation",)),
    ("driver", ("trainer.preflight", "trainer.loop", "trainer.evaluation", "trainer.train", "trainer.cli", "trainer")),
)


def layer_of(module: str) -> int:
    """Index in LAYERS of the most specific entry naming `module` or a package above it."""
    best, best_len = None, -1
    for i, (_, names) in enumerate(LAYERS):
        for name in names:
            # the root package names only itself: a new module must be placed, not inherit "driver"
            below = name != "trainer" and module.startswith(name + ".")
            if (module == name or below) and len(name) > best_len:
                best, best_len = i, len(name)
    if best is None:
        raise KeyError(f"{module} is in no layer of tests/test_layers.py: add it where it belongs")
    return best


def imported_modules(source: str, package: str) -> set[str]:
    """The trainer modules `source` imports (relative imports resolved against `package`);
    `from trainer import x` names trainer.x when that is a module, else trainer."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.split(".")[0] == "trainer")
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            if base.split(".")[0] != "trainer":
                continue
            for a in node.names:
                sub = f"{base}.{a.name}"
                out.add(sub if _is_module(sub) else base)
    return out


def _is_module(dotted: str) -> bool:
    path = ROOT.joinpath(*dotted.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def package_sources() -> dict[str, tuple[str, str]]:
    """module name -> (its package, source) for every module of trainer/."""
    out = {}
    for path in sorted((ROOT / "trainer").rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        if is_pkg:
            parts.pop()
        name = ".".join(parts)
        out[name] = (name if is_pkg else ".".join(parts[:-1]), path.read_text())
    return out


def layer_violations(sources: dict[str, tuple[str, str]]) -> list[str]:
    """'a (layer) imports b (higher layer)' for every upward import among `sources`."""
    bad = []
    for module, (package, source) in sources.items():
        mine = layer_of(module)
        for dep in sorted(imported_modules(source, package)):
            if layer_of(dep) > mine:
                bad.append(f"{module} ({LAYERS[mine][0]}) imports {dep} ({LAYERS[layer_of(dep)][0]})")
    return bad


def test_no_module_imports_a_higher_layer():
    assert layer_violations(package_sources()) == []


def test_every_module_has_a_layer():
    for module in package_sources():
        layer_of(module)


@pytest.mark.parametrize("module, line", [
    ("trainer.core.names", "from trainer.weight_sync import WeightSyncer\n"),
    ("trainer.engine.native", "def f():\n    from trainer.actor import Actor\n"),  # a lazy import counts
    ("trainer.models.qwen_image", "from trainer import weight_sync\n"),
    ("trainer.models.flux", "from trainer.engine.base import RolloutRequest\n"),  # a family never imports the engine
    ("trainer.models.base", "def f():\n    from trainer.engine.base import check_request\n"),
    ("trainer.actor", "import trainer.colocation\n"),
])
def test_a_deliberate_upward_import_is_reported(module, line):
    sources = package_sources()
    package, source = sources[module]
    sources[module] = (package, source + "\n" + line)
    bad = layer_violations(sources)
    assert len(bad) == 1 and bad[0].startswith(module + " ")


def test_the_bottom_layer_needs_nothing_above_torch():
    """trainer.core imports no framework beyond torch (no diffusers, peft at import time,
    transformers), so any layer can import it cheaply."""
    heavy = ("diffusers", "transformers", "peft", "safetensors", "sglang")
    for module, (_, source) in package_sources().items():
        if not module.startswith("trainer.core"):
            continue
        top = [n for n in ast.parse(source).body if isinstance(n, (ast.Import, ast.ImportFrom))]
        names = {a.name for n in top if isinstance(n, ast.Import) for a in n.names}
        names |= {n.module or "" for n in top if isinstance(n, ast.ImportFrom)}
        assert not {n for n in names if n.split(".")[0] in heavy}, module

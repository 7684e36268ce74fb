"""The package layout: the public API stays importable, and imports only go downward.

Layers (each may import those listed for it, and itself):

    config, errors, files,     shared by all
    version
    engine                     the decode loop (never a drafter, the pipeline or a tool)
    drafters                   engine's protocol, sampler and cache helpers; never its decoder
    models                     loading only
    method_registry            engine, drafters, models (each method's drafter factory and options)
    defaults                   + method_registry (default models and the commands' measured defaults)
    pipeline                   engine, drafters, models, method_registry, defaults
    bench                      + pipeline
    search                     + pipeline, and bench's datasets only
    serve                      + pipeline, and bench's datasets only (the soak driver's prompts)
    cli, generate_command,     anything
    the package root
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

import specdecode

SRC = Path(specdecode.__file__).resolve().parent

# specdecode.__all__ before the package was split into subpackages: every name stays importable.
PUBLIC_API_BEFORE_SPLIT = (
    "OFFLINE_MODELS", "ChecksumMismatchError", "DatasetError", "Draft", "DraftControl", "DraftModelDrafter",
    "Drafter", "EarlyExitDrafter", "GenerationConfig", "GenerationResult", "GenerationStream",
    "InvalidArgumentError", "LayerSkipDrafter", "LoadedModel", "ModelNotFoundError", "NonFiniteLogitsError",
    "PromptLookupDrafter", "SkipSet", "SpecDecodeError", "SpecDecodingStats", "SpeculativeDecoder",
    "SpeculativeGenerator", "StorageError", "StudyMismatchError", "UnsupportedModelError",
    "VocabularyMismatchError", "draft_mode", "load_model",
)

BASE = {"config", "errors", "files", "version"}
ALLOWED = {
    "config": BASE,
    "errors": BASE,
    "files": BASE,
    "version": BASE,
    "engine": BASE,
    "drafters": BASE | {"engine"},
    "models": BASE,
    "method_registry": BASE | {"engine", "drafters", "models"},
    "defaults": BASE | {"engine", "drafters", "models", "method_registry"},
    "pipeline": BASE | {"engine", "drafters", "models", "method_registry", "defaults"},
    "bench": BASE | {"engine", "drafters", "models", "method_registry", "defaults", "pipeline"},
    "search": BASE | {"engine", "drafters", "models", "method_registry", "defaults", "pipeline", "bench"},
    "serve": BASE | {"engine", "drafters", "models", "method_registry", "defaults", "pipeline", "bench"},
}
# Finer rules inside an allowed layer: (importer layer, imported module prefix, allowed?) — first match wins.
FINER = (
    ("drafters", "specdecode.engine.decoder", False),  # drafters reach the engine through its protocol
    ("search", "specdecode.bench.datasets", True),
    ("search", "specdecode.bench", False),  # search shares bench's prompt sets, nothing else
    ("serve", "specdecode.bench.datasets", True),
    ("serve", "specdecode.bench", False),
)


def layer_of(module: str) -> str:
    """``specdecode.engine.decoder`` -> ``engine``; ``specdecode`` (the root) -> ``__init__``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def imported_modules(source: str, module: str, is_package: bool) -> list[str]:
    """Every ``specdecode`` module that ``source`` imports, at any depth (function-level imports too)."""
    out = []
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names if a.name.split(".")[0] == "specdecode"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            if name.split(".")[0] != "specdecode":
                continue
            if name == "specdecode":  # from specdecode import bench -> the submodule
                out += [f"specdecode.{a.name}" for a in node.names]
            else:
                out.append(name)
    return out


def violations(importer: str, imported: list[str]) -> list[str]:
    """The imports of module ``importer`` that go against the layering."""
    src_layer = layer_of(importer)
    if src_layer in ("cli", "generate_command", "__init__"):
        return []
    if src_layer not in ALLOWED:
        return [f"{importer} belongs to no layer; add it to ALLOWED in {Path(__file__).name}"]
    bad = []
    for name in imported:
        dst = layer_of(name)
        if dst == "__init__":
            ok = False  # the root imports every layer
        else:
            ok = dst == src_layer or dst in ALLOWED[src_layer]
        for layer, prefix, allowed in FINER:
            if layer == src_layer and (name == prefix or name.startswith(prefix + ".")):
                ok = ok and allowed
                break
        if not ok:
            bad.append(f"{importer} imports {name}")
    return bad


def all_modules() -> list[tuple[str, Path, bool]]:
    found = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC.parent).with_suffix("")
        is_package = path.name == "__init__.py"
        parts = rel.parts[:-1] if is_package else rel.parts
        found.append((".".join(parts), path, is_package))
    return found


def test_every_name_exported_before_the_split_is_importable():
    missing = [n for n in PUBLIC_API_BEFORE_SPLIT if n not in specdecode.__all__]
    assert missing == []
    fresh = importlib.import_module("specdecode")
    from specdecode import GenerationConfig, LayerSkipDrafter, SpeculativeDecoder, load_model  # as users write it

    assert all(getattr(fresh, n) is not None for n in PUBLIC_API_BEFORE_SPLIT)
    assert (GenerationConfig, LayerSkipDrafter, SpeculativeDecoder, load_model) == (
        fresh.GenerationConfig, fresh.LayerSkipDrafter, fresh.SpeculativeDecoder, fresh.load_model
    )


@pytest.mark.parametrize("package", ["engine", "drafters", "models", "bench", "search"])
def test_each_subpackage_names_what_it_offers(package):
    if package == "search":
        pytest.importorskip("optuna")
    mod = importlib.import_module(f"specdecode.{package}")
    assert mod.__doc__ and mod.__all__
    assert [n for n in mod.__all__ if not hasattr(mod, n)] == []


def test_the_checker_sees_upward_and_sideways_imports():
    """A negative control: the rules below would pass vacuously if the parser missed imports."""
    src = "import torch\nfrom specdecode.drafters.layer_skip import SkipSet\n\ndef f():\n    from ..bench import run\n"
    imported = imported_modules(src, "specdecode.engine.decoder", is_package=False)
    assert imported == ["specdecode.drafters.layer_skip", "specdecode.bench"]
    assert violations("specdecode.engine.decoder", imported) == [
        "specdecode.engine.decoder imports specdecode.drafters.layer_skip",
        "specdecode.engine.decoder imports specdecode.bench",
    ]
    assert violations("specdecode.drafters.base", ["specdecode.engine.decoder"]) != []
    assert violations("specdecode.drafters.base", ["specdecode.engine.protocol"]) == []
    assert violations("specdecode.search.objective", ["specdecode.bench.datasets"]) == []
    assert violations("specdecode.search.objective", ["specdecode.bench.report"]) != []
    assert violations("specdecode.bench.report", ["specdecode.search"]) != []
    assert violations("specdecode.models.loading", ["specdecode.pipeline"]) != []
    assert violations("specdecode.engine.decoder", ["specdecode"]) != []  # the root re-exports everything
    assert violations("specdecode.method_registry", ["specdecode.pipeline"]) != []  # factories get the generator
    assert violations("specdecode.drafters.base", ["specdecode.method_registry"]) != []


def test_imports_only_go_downward():
    modules = all_modules()
    assert {layer_of(m) for m, _, _ in modules} >= {"engine", "drafters", "models", "bench", "search", "cli"}
    bad = []
    for module, path, is_package in modules:
        bad += violations(module, imported_modules(path.read_text(encoding="utf-8"), module, is_package))
    assert bad == []


# Modules allowed past about 600 lines, with the reason (splitting them would cut one idea in half).
LONG_MODULES: dict[str, str] = {}  # module -> why it may pass 650 lines (none now)


def test_modules_stay_under_about_600_lines():
    long = {}
    for module, path, _ in all_modules():
        lines = len(path.read_text(encoding="utf-8").splitlines())
        if lines > 650 and module not in LONG_MODULES:
            long[module] = lines
    assert long == {}, f"split these modules or add them, with the reason, to LONG_MODULES: {long}"


def test_generate_command_does_not_import_bench():
    """``specdecode generate`` shares its flag checks with ``bench`` through a lower layer
    (``models.quantize``), never by importing the bench tool."""
    path = SRC / "generate_command.py"
    imported = imported_modules(path.read_text(encoding="utf-8"), "specdecode.generate_command", False)
    assert "specdecode.models.quantize" in imported  # the parser sees its imports (a negative control)
    assert [m for m in imported if layer_of(m) == "bench"] == []

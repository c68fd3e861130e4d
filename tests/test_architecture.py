"""The package's shape: layers import only downwards, no import cycles, no private names across modules.

Layers, lowest first (docs/architecture.md):
  library    model, checkpointing, amp, nvtx, cli_args, attention/, optim/, parallel/   (what users import)
  bench      the measurement core                                              (cs336_systems.bench)
  tools      profile, kernel summaries, memory, accounting, amp probes         (cs336_systems.tools)
  reporting  saved runs -> tables, plots, README block, gates, baselines       (cs336_systems.reporting)
  entry      the `python -m cs336_systems.<name>` CLI modules at the top level
A module may import its own layer and the layers below it.  Every import counts, including those deferred
into functions: a cycle through a deferred import is still a cycle.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import tomllib
from pathlib import Path

import pytest

import cs336_systems

PACKAGE = Path(cs336_systems.__file__).resolve().parent
ROOT = PACKAGE.parent
LAYERS = ("library", "bench", "tools", "reporting", "entry")
ENTRY_POINTS = ("report", "gates", "baseline", "profile", "memory", "accounting", "flash_autotune", "perf_isolated")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def layer(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 2 and parts[1] in ENTRY_POINTS:
        return "entry"
    if len(parts) > 1 and parts[1] in ("bench", "tools", "reporting"):
        return parts[1]
    return "library"


def imports(module: str) -> list[tuple[str, list[str], int]]:
    """(imported cs336_systems module, names taken from it, line) for every import in ``module``."""
    tree = ast.parse(MODULES[module].read_text())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(a.name, [], node.lineno) for a in node.names if a.name.startswith("cs336_systems")]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("cs336_systems"):
            names = [a.name for a in node.names]
            submodules = [n for n in names if f"{node.module}.{n}" in MODULES]
            found += [(f"{node.module}.{n}", [], node.lineno) for n in submodules]
            rest = [n for n in names if n not in submodules]
            if rest:
                found.append((node.module, rest, node.lineno))
    return found


GRAPH = {m: sorted({target for target, _, _ in imports(m) if target != m}) for m in MODULES}


def test_every_import_resolves_to_a_module_of_the_package():
    missing = [(m, t) for m, targets in GRAPH.items() for t in targets if t not in MODULES]
    assert not missing, missing


def test_layers_import_only_their_own_layer_or_lower():
    wrong = [
        f"{m} ({layer(m)}) imports {t} ({layer(t)})"
        for m, targets in GRAPH.items() for t in targets
        if t in MODULES and LAYERS.index(layer(t)) > LAYERS.index(layer(m))
    ]
    assert not wrong, "\n".join(wrong)


def test_no_import_cycles():
    # Tarjan's strongly connected components; any component with more than one module is a cycle.
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in GRAPH.get(v, ()):
            if w not in MODULES:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for module in MODULES:
        if module not in index:
            visit(module)
    assert not cycles, cycles


def test_no_module_takes_another_modules_private_names():
    taken = []
    for module in MODULES:
        tree = ast.parse(MODULES[module].read_text())
        aliases = {}  # local name -> cs336_systems module it is bound to
        for target, names, line in imports(module):
            taken += [f"{module}:{line} imports {target}.{n}" for n in names if n.startswith("_") and target != module]
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("cs336_systems"):
                for a in node.names:
                    if f"{node.module}.{a.name}" in MODULES:
                        aliases[a.asname or a.name] = f"{node.module}.{a.name}"
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                    and node.attr.startswith("_") and not node.attr.startswith("__")):
                taken.append(f"{module}:{node.lineno} uses {aliases[node.value.id]}.{node.attr}")
    assert not taken, "\n".join(taken)


def test_library_layers_do_not_import_tests_or_perf():
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                assert not any(n.split(".")[0] in ("tests", "perf", "conftest") for n in names), module


@pytest.mark.parametrize("name", ENTRY_POINTS)
def test_each_cli_is_a_module_and_a_console_script(name):
    assert importlib.util.find_spec(f"cs336_systems.{name}") is not None
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    script = "cs336-" + name.replace("_", "-")
    assert script in scripts, f"pyproject.toml [project.scripts] lacks {script}"
    target_module, _, function = scripts[script].partition(":")
    assert function == "main"
    entry = importlib.import_module(f"cs336_systems.{name}")
    assert getattr(importlib.import_module(target_module), "main") is entry.main


def test_public_names_are_where_users_look_for_them():
    from cs336_systems import attention, parallel
    from cs336_systems.model import build

    assert callable(build)
    for name in ("attention", "names", "available", "FlashAttentionPytorch", "FlashAttentionTriton"):
        assert getattr(attention, name) is not None, name
    for name in ("NaiveDDP", "FlatDDP", "DDPIndividualParameters", "DDPBucketed", "ShardedOptimizer", "FSDP"):
        assert isinstance(getattr(parallel, name), type), name


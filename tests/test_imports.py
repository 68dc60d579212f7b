"""Imports run one way (README.md's folder table), and no module imports itself back.

Every ``import`` and ``from ... import`` in every module counts, at module level or inside
a function: a lazy import is still a dependency.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = (
    "kernels", "vtoken", "policies", "workers", "controlplane", "serving", "bench", "sim"
)  # fmt: skip
# package -> the packages of ours it may import (besides itself)
ALLOWED = {
    "kernels": set(),
    "vtoken": {"kernels"},
    "policies": {"vtoken"},
    "workers": {"vtoken", "policies", "kernels"},
    "controlplane": set(),
    "serving": set(PACKAGES),
    "bench": set(PACKAGES) - {"sim"},
    "sim": set(PACKAGES) - {"serving"},
}
FORBIDDEN_THIRD_PARTY = {"controlplane": {"vllm", "torch"}}
ONLY_BENCH_IMPORTER = "serving.cli"  # of serving, the only importer of bench and sim


def _modules() -> dict[str, Path]:
    modules = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            modules[name] = path
    return modules


def _imports(module: str, path: Path) -> set[str]:
    """Absolute names of everything ``path`` imports (``from a import b`` yields ``a.b``
    when ``a.b`` is a module of ours, else ``a``)."""
    names: set[str] = set()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


MODULES = _modules()
GRAPH = {
    module: {name for name in _imports(module, path) if name in MODULES and name != module}
    for module, path in MODULES.items()
}
THIRD_PARTY = {
    module: {name.split(".")[0] for name in _imports(module, path)}
    for module, path in MODULES.items()
}


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_follow_the_folder_table(module: str) -> None:
    package = module.split(".")[0]
    ours = {name.split(".")[0] for name in GRAPH[module]} - {package}
    assert ours <= ALLOWED[package], f"{module} imports {sorted(ours - ALLOWED[package])}"
    for tool in ("bench", "sim"):
        if tool in ours and package == "serving":
            assert module == ONLY_BENCH_IMPORTER, f"only {ONLY_BENCH_IMPORTER} may import {tool}"
    if package == "bench":
        assert ONLY_BENCH_IMPORTER not in GRAPH[module], f"{module} imports the CLI"
    banned = THIRD_PARTY[module] & FORBIDDEN_THIRD_PARTY.get(package, set())
    assert not banned, f"{module} imports {sorted(banned)}"


def test_no_module_imports_itself_back() -> None:
    """No cycle among modules (package ``__init__`` re-exports count like any import)."""
    cycles = []
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for name in sorted(GRAPH[module]):
            if state.get(name) == 1:
                cycles.append([*path[path.index(name) :], name])
            elif name not in state:
                visit(name, [*path, name])
        state[module] = 2

    for module in sorted(MODULES):
        if module not in state:
            visit(module, [module])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_the_table_sees_every_package() -> None:
    assert {m.split(".")[0] for m in MODULES} == set(PACKAGES)
    assert len(MODULES) > 50

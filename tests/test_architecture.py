"""The package's shape (ARCHITECTURE.md): every import points down a floor or stays in its package,
and no modules import each other in a circle. Imports inside functions count too. Importing
`refusion` loads no torch; its top-level names load on first use."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).parents[1] / "src"
# a package may import from packages on lower floors and from its own
FLOORS = {"runtime": 0, "files": 0, "model": 1, "bundled": 2, "decoding": 2, "tasks": 2, "training": 3,
          "evaluation": 3, "serve": 4, "cli": 5}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports() -> dict[str, set[str]]:
    mods = {module_name(p): p for p in (SRC / "refusion").rglob("*.py")}
    graph = {}
    for name, path in mods.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                subs = [f"{node.module}.{a.name}" for a in node.names]
                # `from pkg import submodule` runs pkg/__init__ first, as any import of a submodule
                # does: the arrow that matters is to the submodule
                targets = subs if all(t in mods for t in subs) else [node.module] + subs
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            found |= {t for t in targets if t in mods and t != name}
        graph[name] = found
    return graph


def package(mod: str) -> str:
    return mod.split(".")[1] if mod.count(".") else ""


def test_every_import_points_down_or_stays_in_its_package():
    graph = imports()
    for mod in graph:
        if mod != "refusion":
            assert package(mod) in FLOORS, f"{mod} is in no floor of ARCHITECTURE.md; add its package to FLOORS"
    up = [f"{a} -> {b}" for a, bs in graph.items() for b in bs
          if a != "refusion" and package(a) != package(b) and FLOORS[package(b)] >= FLOORS[package(a)]]
    assert not up, "imports that do not point down:\n" + "\n".join(sorted(up))


def test_no_circle_of_imports():
    graph = imports()
    state: dict[str, int] = {}
    circles = []

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                circles.append(stack[stack.index(n):] + [n])
            elif n not in state:
                visit(n, stack + [n])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not circles, "circles of imports:\n" + "\n".join(" -> ".join(c) for c in circles)


def test_top_level_names_load_lazily_without_torch_at_import():
    code = ("import sys, refusion; assert 'torch' not in sys.modules; "
            "from refusion.model.checkpoint import load_model; assert refusion.load_model is load_model; "
            "from refusion.decoding import decode; assert refusion.decode is decode; print('ok')")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr


def test_unknown_top_level_name_is_an_attribute_error():
    import refusion

    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        refusion.nope

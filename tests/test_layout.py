"""The package's shape: modules of one concept each, imports running one way, notes that resolve.

CONTRIBUTING.md's module map states the layers; these tests hold the tree to them, reading
the source (every import, including those inside functions), never importing it.
"""

import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "poptorch_lite"
MAX_LINES = 450

# Layers, bottom up: a module imports only modules of its own layer or lower ones. Within
# a layer any import is allowed as long as no cycle forms (test below).
LAYERS = [
    {"errors"},                                               # the one error hierarchy
    {"enums", "strategies", "phases"},                        # PopTorch's vocabulary (no torch)
    {"options", "optim", "profiling"},                        # what a user configures; reports
    {"compiler"},                                             # module -> stage graphs
    {"runtime"},                                              # stage graphs -> a run
    {"distributed"},                                          # other processes (uses runtime)
]  # everything else (the wrapper, annotations, ops, data, the frontends, cli, ...) is a face


def modules() -> dict:
    """Dotted name (``poptorch_lite.runtime.executor``; a package by its own name) -> path."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


MODULES = modules()


def layer(name: str) -> int:
    parts = name.split(".")
    top = parts[1] if len(parts) > 1 else "__init__"
    return next((k for k, group in enumerate(LAYERS) if top in group), len(LAYERS))


def imports(name: str) -> set:
    """The package modules ``name`` imports, anywhere in its source: the module named and,
    for a module of another package, that package's ``__init__`` (which runs first)."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            named = [f"{target}.{a.name}" for a in node.names]  # submodules, or names in target
            targets = named if all(t in MODULES for t in named) else [target, *named]
        elif isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            continue
        for t in targets:
            if t in MODULES:
                found.add(t)
                parts = t.split(".")  # packages entered on the way, the root's excepted
                found |= {".".join(parts[:k]) for k in range(2, len(parts))
                          if not name.startswith(".".join(parts[:k]) + ".")
                          and name != ".".join(parts[:k])}
    found.discard(name)
    return found


GRAPH = {name: imports(name) for name in MODULES}


def test_the_reader_of_this_test_sees_the_real_package():
    for name in ("poptorch_lite.wrapper", "poptorch_lite.compiler.tracing",
                 "poptorch_lite.runtime.executor", "poptorch_lite.options"):
        assert name in MODULES
    assert "poptorch_lite.compiler.markers" in GRAPH["poptorch_lite.annotations"]
    assert "poptorch_lite.runtime.placement" in GRAPH["poptorch_lite.runtime.executor"]


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_module_is_longer_than_the_house_limit(name):
    lines = len(MODULES[name].read_text(encoding="utf-8").splitlines())
    assert lines <= MAX_LINES, (f"{MODULES[name].relative_to(ROOT)} has {lines} lines; split it "
                                f"by concept (CONTRIBUTING.md: at most {MAX_LINES} lines)")


def test_imports_run_down_the_layers():
    wrong = [f"{a} (layer {layer(a)}) imports {b} (layer {layer(b)})"
             for a, targets in GRAPH.items() for b in sorted(targets)
             if b != "poptorch_lite" and layer(b) > layer(a)]
    assert not wrong, "\n".join(wrong)


def test_no_module_imports_the_package_root_but_the_faces():
    # poptorch_lite/__init__.py imports every face; below the faces, importing it is a cycle
    wrong = [a for a, targets in GRAPH.items() if "poptorch_lite" in targets
             and layer(a) < len(LAYERS)]
    assert not wrong


NO_TORCH = ["poptorch_lite.errors", "poptorch_lite.enums", "poptorch_lite.strategies",
            "poptorch_lite.phases", "poptorch_lite.runtime.schedule",
            "poptorch_lite.runtime.schedule_kinds",
            *(name for name in MODULES if name.startswith("poptorch_lite.profiling"))]


@pytest.mark.parametrize("name", NO_TORCH)
def test_the_modules_of_plain_data_import_no_torch(name):
    """Schedules, strategies, enums and the profiling reports are data (CONTRIBUTING.md)."""
    tree = ast.parse(MODULES[name].read_text(encoding="utf-8"))
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
                 and n.level == 0}
    assert not {m for m in imported if m.split(".")[0] in ("torch", "numpy")}
    packages = {"poptorch_lite", "poptorch_lite.runtime", "poptorch_lite.profiling"}  # no code
    assert GRAPH[name] - packages <= set(NO_TORCH)  # and nothing they import does either


def test_no_import_cycles():
    """No chain of imports (module-level or inside functions) leads back to its start."""
    state, cycles = {}, []

    def visit(node, path):
        state[node] = "open"
        for nxt in sorted(GRAPH[node] - {"poptorch_lite"}):
            if state.get(nxt) == "open":
                cycles.append(" -> ".join(path[path.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = "done"

    for name in sorted(GRAPH):
        if name not in state:
            visit(name, [name])
    assert not cycles, "\n".join(cycles)


def _notes():
    """(definitions: note -> files, references: (file, line, note, where or None))."""
    files = [p for d in ("poptorch_lite", "tests", "benchmarks", "examples", "docs")
             for p in sorted((ROOT / d).rglob("*")) if p.suffix in (".py", ".md")
             and p != pathlib.Path(__file__).resolve()]
    files += [ROOT / "README.md", ROOT / "CONTRIBUTING.md"]
    definitions, references = {}, []
    ref = re.compile(r"\[Note:\s+([^\]]+?)\](?:\s+in\s+`*([\w/]+(?:\.py)?)`*)?")
    for path in files:
        text = path.read_text(encoding="utf-8")
        rel = str(path.relative_to(ROOT))
        for m in re.finditer(r"^\s*#?\s*\[Note: ([^\]]+)\]\s*$", text, re.M):
            definitions.setdefault(m.group(1), []).append(rel)
        for m in ref.finditer(text):
            name = " ".join(m.group(1).replace("#", " ").split())
            references.append((rel, text[:m.start()].count("\n") + 1, name, m.group(2)))
    return definitions, references


def test_every_note_is_defined_once_and_every_reference_finds_it():
    """``[Note: x]`` on a line of its own defines a note; ``[Note: x] in <module or path>``
    elsewhere must name the file that defines it (by path, or by module or package name)."""
    definitions, references = _notes()
    assert len(definitions) > 40 and len(references) > 250
    assert {n: f for n, f in definitions.items() if len(f) > 1} == {}
    wrong = []
    for rel, line, name, where in references:
        if name not in definitions:
            wrong.append(f"{rel}:{line}: [Note: {name}] is defined nowhere")
            continue
        home = definitions[name][0]
        if where and home.startswith("poptorch_lite/") and home not in _files_named(where):
            wrong.append(f"{rel}:{line}: [Note: {name}] in {where}, but it is in {home}")
    assert not wrong, "\n".join(wrong)


def _files_named(where: str) -> set:
    """The package files a reference's ``in ...`` can mean: a path (``runtime/weights.py``,
    ``poptorch_lite/runtime/executor``, a package's folder) or a module or package name."""
    where = where.removeprefix("poptorch_lite/").removesuffix(".py")
    paths = {str(p.relative_to(ROOT)) for p in MODULES.values()}
    if "/" in where:
        return {f"poptorch_lite/{where}.py", f"poptorch_lite/{where}/__init__.py"} & paths
    return {p for p in paths if p.endswith((f"/{where}.py", f"/{where}/__init__.py"))}

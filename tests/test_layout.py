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
def test_every_module_opens_with_the_one_concept_it_holds(name):
    """STYLE.md: one concept per module, named by the first line of its docstring (one
    sentence); its size follows the concept."""
    doc = ast.get_docstring(ast.parse(MODULES[name].read_text(encoding="utf-8")))
    assert doc, f"{MODULES[name].relative_to(ROOT)} has no docstring naming its concept"
    first = doc.splitlines()[0]
    assert first.endswith(".") and len(first) <= 100, (
        f"{MODULES[name].relative_to(ROOT)}: the first line of its docstring names its concept "
        f"in one sentence of at most 100 characters: {first!r}")


def classes() -> dict:
    """Class name -> its definitions in the package."""
    found: dict = {}
    for path in MODULES.values():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef):
                found.setdefault(node.name, []).append(node)
    return found


CLASSES = classes()


def _bases(node) -> list:
    return [b.id if isinstance(b, ast.Name) else b.attr if isinstance(b, ast.Attribute)
            else None for b in node.bases]


def _own(node) -> set:
    """The attributes a class defines or sets itself: methods, class attributes, slots, and
    ``self.x`` it assigns (``object.__setattr__(self, "x", ...)`` included)."""
    names = set()
    for item in node.body:
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(item.name)
        elif isinstance(item, (ast.Assign, ast.AnnAssign)):
            targets = item.targets if isinstance(item, ast.Assign) else [item.target]
            names |= {e.id for t in targets for e in ast.walk(t) if isinstance(e, ast.Name)}
            if "__slots__" in names:
                names |= {e.value for e in ast.walk(item.value)
                          if isinstance(e, ast.Constant) and isinstance(e.value, str)}
    for e in ast.walk(node):
        if isinstance(e, ast.Attribute) and isinstance(e.value, ast.Name) and (
                e.value.id == "self" and isinstance(e.ctx, ast.Store)):
            names.add(e.attr)
        if isinstance(e, ast.Call) and isinstance(e.func, ast.Attribute) and (
                e.func.attr == "__setattr__" and len(e.args) > 1
                and isinstance(e.args[1], ast.Constant)):
            names.add(e.args[1].value)
    return names


def _with_bases(name: str, node, seen=()) -> set:
    """What ``node`` defines with its bases in the package."""
    names = _own(node)
    for b in _bases(node):
        if b in CLASSES and b != name and b not in seen:
            for base in CLASSES[b]:
                names |= _with_bases(b, base, (*seen, name))
    return names


def _subclasses(name: str, seen=()) -> list:
    out = []
    for sub, nodes in CLASSES.items():
        for node in nodes:
            if sub != name and sub not in seen and name in _bases(node):
                out += [(sub, node), *_subclasses(sub, (*seen, name))]
    return out


def test_no_class_is_a_mixin():
    """One concept per module, never split with mixins (STYLE.md): no class reads attributes
    of ``self`` that only a class inheriting it defines. Such a class is half of a concept
    whose other half is elsewhere; merge it into the class it serves, or compose an object
    with what it needs (``runtime.update.Update``)."""
    mixins = []
    for name, nodes in CLASSES.items():
        for node in nodes:
            read = {e.attr for e in ast.walk(node) if isinstance(e, ast.Attribute)
                    and isinstance(e.value, ast.Name) and e.value.id == "self"
                    and isinstance(e.ctx, ast.Load)}
            missing = read - _with_bases(name, node)
            lent = sorted({m for sub, sub_node in _subclasses(name)
                           for m in missing & _with_bases(sub, sub_node)})
            if lent:
                mixins.append(f"{name} reads {', '.join(lent)}, defined by a class inheriting it")
    assert not mixins, "\n".join(mixins)


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

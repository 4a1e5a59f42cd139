"""glm5f's import graph, read from the source with `ast` (imports inside functions included): no module imports
itself back through others; each folder imports only the folders below it (FLOORS); nothing in glm5f imports
train.py or configs.py; no private name is imported across folders."""

import ast
import pathlib
from collections import deque

import glm5f

# The floors of glm5f, bottom first: a module of a floor imports only modules of its own floor and of floors below.
# A floor is a folder (glm5f/core/, ...) or a top module (glm5f/objectives.py: the objective table, above train/ and
# posttrain/, whose rows it names). A new folder is a line here.
FLOORS = ("core", "kernels", "parallel", "model", "data", "ckpt", "train", "posttrain", "objectives", "run")
OUTSIDE = ("train", "configs")  # the CLI's modules at the repository's top: glm5f never imports them


def modules(root: pathlib.Path) -> dict[str, pathlib.Path]:
    """{dotted name: file} of every module of the package at `root` and of its subpackages (a subpackage is its
    __init__.py). The top package itself is left out: importing any of its modules runs it first, so an import of
    it ties nothing to anything."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    found.pop(root.name, None)
    return found


def import_graph(root: pathlib.Path) -> dict[str, set[str]]:
    """{module: the package's modules it imports} over every import statement of its file, at any depth (inside
    functions, under TYPE_CHECKING). `from P import n` imports P, and P.n when that is a module; relative imports
    are resolved against the importing module's package. A module's own parent packages are no edge: Python loads
    them before the module itself, whatever it imports (a package's modules import each other through it)."""
    found = modules(root)
    graph = {}
    for name, path in found.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
                else:
                    base = node.module
                targets |= {base} | {f"{base}.{a.name}" for a in node.names}
        ancestors = {name.rsplit(".", k)[0] for k in range(1, name.count(".") + 1)}
        graph[name] = (targets & found.keys()) - {name} - ancestors
    return graph


def path_to(graph: dict[str, set[str]], start: str, goal) -> list[str] | None:
    """The shortest chain of imports from `start` to a module for which `goal(module)` holds (`start` itself only
    through an import back to it), or None."""
    came_from, todo = {start: None}, deque([start])
    while todo:
        m = todo.popleft()
        for n in sorted(graph[m]):
            if goal(n):
                chain = [n, m]
                while came_from[chain[-1]] is not None:
                    chain.append(came_from[chain[-1]])
                return chain[::-1]
            if n not in came_from:
                came_from[n] = m
                todo.append(n)
    return None


def cycles(graph: dict[str, set[str]]) -> dict[str, list[str]]:
    """{module: a chain of imports from it back to itself} of every module on an import cycle."""
    return {m: chain for m in graph if (chain := path_to(graph, m, lambda n, m=m: n == m)) is not None}


def floor(module: str) -> str:
    """The floor of a glm5f module: its first name under the package ("glm5f.model.moe" -> "model")."""
    return module.split(".")[1]


def upward(graph: dict[str, set[str]], floors: tuple[str, ...]) -> list[str]:
    """"a -> b" for every import of a module b on a floor above a's (a floor not in `floors` is above all)."""
    rank = {f: i for i, f in enumerate(floors)}
    return sorted(f"{a} -> {b}" for a, targets in graph.items() for b in targets
                  if rank.get(floor(b), len(floors)) > rank.get(floor(a), len(floors)))


def private_imports(root: pathlib.Path) -> list[str]:
    """"module: name from other" for every `from other import _name` of the package across two floors."""
    found = []
    for name, path in modules(root).items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").startswith(root.name + ".")
                    and floor(node.module) != floor(name)):
                found += [f"{name}: {a.name} from {node.module}" for a in node.names if a.name.startswith("_")]
    return found


def outside_imports(graph_root: pathlib.Path) -> list[str]:
    """"module -> name" for every import in the package of a top-level CLI module (OUTSIDE)."""
    found = []
    for name, path in modules(graph_root).items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module] if isinstance(node, ast.ImportFrom) and not node.level else [])
            found += [f"{name} -> {n}" for n in names if n and n.split(".")[0] in OUTSIDE]
    return found


ROOT = pathlib.Path(glm5f.__file__).parent
GRAPH = import_graph(ROOT)


def test_no_glm5f_module_imports_itself_back():
    assert cycles(GRAPH) == {}


def test_every_module_stands_on_a_floor_of_the_table():
    assert {floor(m) for m in GRAPH} == set(FLOORS)


def test_each_floor_imports_only_the_floors_below_it():
    assert upward(GRAPH, FLOORS) == []


def test_no_private_name_crosses_a_floor_and_nothing_imports_the_cli():
    assert private_imports(ROOT) == []
    assert outside_imports(ROOT) == []


def test_the_rule_table_catches_an_upward_import(tmp_path):
    """A copy of glm5f with one upward import added: the table names it (and only it)."""
    import shutil
    copy = tmp_path / "glm5f"
    shutil.copytree(ROOT, copy, ignore=shutil.ignore_patterns("__pycache__", "assets"))
    moe = copy / "model" / "moe.py"
    moe.write_text(moe.read_text() + "\n\ndef _late():\n    from glm5f.run import preempt\n")
    assert upward(import_graph(copy), FLOORS) == ["glm5f.model.moe -> glm5f.run", "glm5f.model.moe -> glm5f.run.preempt"]
    ops = copy / "core" / "ops.py"
    ops.write_text(ops.read_text() + "\nfrom glm5f.model.lora import _private  # noqa\nimport train  # noqa\n")
    assert private_imports(copy) == ["glm5f.core.ops: _private from glm5f.model.lora"]
    assert outside_imports(copy) == ["glm5f.core.ops -> train"]


def test_the_graph_holds_the_imports_of_the_source():
    """The reader sees glm5f's own imports: at module level, inside functions, under TYPE_CHECKING, `from glm5f
    import x`, and chains of them."""
    assert "glm5f.parallel.layout" in GRAPH["glm5f.model.attention"]  # from glm5f.parallel.layout import ...
    assert "glm5f.model.lora" in GRAPH["glm5f.ckpt.checkpoint"]  # only inside functions
    assert "glm5f.kernels.triton_dsa" in GRAPH["glm5f.kernels.dsa"]  # inside a function's try
    assert "glm5f.model.env" in GRAPH["glm5f.model.indexer_loss"]  # under TYPE_CHECKING
    assert "glm5f.run.preempt" in GRAPH["glm5f.run.launch"]  # from glm5f.run import preempt
    assert path_to(GRAPH, "glm5f.run.plan", lambda n: n == "glm5f.core.ops") is not None


def test_cycles_and_paths_in_a_package_of_their_own(tmp_path):
    """Relative and function-level imports, a subpackage's __init__, `import a.b`, and a module that imports
    nothing of the package."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    files = {"__init__.py": "from pkg import a\n",
             "a.py": "import os\nfrom . import b\n",
             "b.py": "def f():\n    from pkg.sub import c\n    return c\n",
             "sub/__init__.py": "from .c import g\n",
             "sub/c.py": "import pkg.a\ndef g(): pass\n",
             "d.py": "import json\nfrom pkg.a import os\n",
             "e.py": "import torch\n"}
    for name, text in files.items():
        (pkg / name).write_text(text)
    graph = import_graph(pkg)
    assert graph == {"pkg.a": {"pkg.b"}, "pkg.b": {"pkg.sub", "pkg.sub.c"}, "pkg.sub": {"pkg.sub.c"},
                     "pkg.sub.c": {"pkg.a"}, "pkg.d": {"pkg.a"}, "pkg.e": set()}
    assert cycles(graph) == {"pkg.a": ["pkg.a", "pkg.b", "pkg.sub.c", "pkg.a"],
                             "pkg.b": ["pkg.b", "pkg.sub.c", "pkg.a", "pkg.b"],
                             "pkg.sub": ["pkg.sub", "pkg.sub.c", "pkg.a", "pkg.b", "pkg.sub"],
                             "pkg.sub.c": ["pkg.sub.c", "pkg.a", "pkg.b", "pkg.sub.c"]}
    assert path_to(graph, "pkg.d", lambda n: n == "pkg.sub") == ["pkg.d", "pkg.a", "pkg.b", "pkg.sub"]
    assert path_to(graph, "pkg.e", lambda n: True) is None

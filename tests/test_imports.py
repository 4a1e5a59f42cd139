"""glm5f's import graph, read from the source with `ast` (imports inside functions included): no module imports
itself back through others, and the model (attention, model, KDA, MoE, loss) stands below processes, signals and
checkpoints."""

import ast
import pathlib
from collections import deque

import glm5f

# the model's modules (a name and every module under it; "glm5f.kernels.kda" also covers "glm5f.kda_*" and the like) and the
# modules that start processes, handle signals or write checkpoints, which the model never reaches
MODEL = ("glm5f.model.attention", "glm5f.model.decoder", "glm5f.kernels.kda", "glm5f.model.moe", "glm5f.train.loss")
ABOVE_THE_MODEL = ("glm5f.run.launch", "glm5f.ckpt.checkpoint", "glm5f.run.preempt")


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


def under(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


GRAPH = import_graph(pathlib.Path(glm5f.__file__).parent)


def test_no_glm5f_module_imports_itself_back():
    assert cycles(GRAPH) == {}


def test_the_model_reaches_no_process_signal_or_checkpoint_module():
    model = [m for m in GRAPH if under(m, MODEL) or m.startswith("glm5f.kernels.kda")]
    assert {"glm5f.model.attention", "glm5f.model.decoder", "glm5f.kernels.kda", "glm5f.model.moe", "glm5f.train.loss"} <= {
        "glm5f.kernels.kda" if m.startswith("glm5f.kernels.kda") else m for m in model}, "a module of MODEL is not found"
    reached = {m: path_to(GRAPH, m, lambda n: under(n, ABOVE_THE_MODEL)) for m in model}
    assert {m: " -> ".join(chain) for m, chain in reached.items() if chain} == {}


def test_the_graph_holds_the_imports_of_the_source():
    """The reader sees glm5f's own imports: at module level, inside functions, under TYPE_CHECKING, `from glm5f
    import x`, and chains of them."""
    assert "glm5f.parallel.layout" in GRAPH["glm5f.model.attention"]  # from glm5f.parallel.layout import cp_position_list
    assert "glm5f.model.lora" in GRAPH["glm5f.ckpt.checkpoint"]  # only inside functions: from glm5f.model.lora import merge
    assert "glm5f.kernels.triton_dsa" in GRAPH["glm5f.kernels.dsa"]  # inside a function's try: from glm5f import triton_dsa
    assert "glm5f.model.env" in GRAPH["glm5f.model.indexer_loss"]  # under TYPE_CHECKING
    assert "glm5f.run.preempt" in GRAPH["glm5f.run.launch"]  # from glm5f import preempt
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

"""No import circles in app/: a module never imports, even lazily inside a function, a module that
imports it back through any chain. Circles make the order of imports matter and hide which module is
the lower layer; a newcomer reads the folder tree as the architecture only if the arrows go one way."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def module_graph(package: str = "app") -> dict[str, set[str]]:
    """module -> the package's modules it imports (anywhere in its source)."""
    files = {}
    for path in (ROOT / package).rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path

    def known(name: str) -> str | None:
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for mod, path in files.items():
        here = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = ".".join(here[:len(here) - node.level + 1] + ([node.module] if node.module else [])) \
                    if node.level else node.module
                names = [base] + [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            targets |= {t for t in map(known, names) if t and t != mod}
        graph[mod] = targets
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_app_has_no_import_circles():
    assert circles(module_graph()) == []


def test_the_check_finds_a_circle():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    graph = module_graph()
    assert "app.llm.engine" in graph["app.llm.async_engine"]  # lazy and relative imports are followed
    assert "app.media.slicing" in graph["app.media.spec"]


# ---------------------------------------------------------------------------- the scripts' folders
SCRIPT_FOLDERS = ("benchmarks", "tests", "deployments")


def _top_level_names(path: Path) -> set[str]:
    """Names a module defines or imports at its top level (what `from it import name` can take)."""
    out = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            out.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                out |= {n.id for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, ast.Import | ast.ImportFrom):
            out |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, ast.If | ast.Try):  # `if triton is not None:` blocks, optional imports
            out |= _names_in(node)
    return out


def _names_in(block) -> set[str]:
    out = set()
    for node in ast.walk(block):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            out.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            out.add(node.id)
        elif isinstance(node, ast.alias):
            out.add((node.asname or node.name).split(".")[0])
    return out


def unresolved_app_imports() -> list[str]:
    """`from app.x import y` (or benchmarks.x) in the scripts and app/ whose y is neither a module of that
    package nor a name its module defines: a module moved or renamed under a script that still names it.
    Ruff cannot see it; the script fails only when it runs (2026-12-01: benchmarks/kernels.py still took
    `timing` from app.vision after it moved to app.gpu, and broke every serving run started from
    benchmarks/, below)."""
    bad = []
    for folder in (*SCRIPT_FOLDERS, "app"):
        for path in (ROOT / folder).rglob("*.py"):
            here = list(path.relative_to(ROOT).with_suffix("").parts)
            package = here if path.name == "__init__.py" else here[:-1]
            for node in ast.walk(ast.parse(path.read_text())):
                if not isinstance(node, ast.ImportFrom):
                    continue
                if node.level:  # relative: from the importing file's package, `level - 1` packages up
                    if folder not in ("app", "deployments"):
                        continue
                    parts = package[:len(package) - node.level + 1] + (node.module.split(".") if node.module else [])
                    module_name = ".".join(parts)
                elif node.module and node.module.split(".")[0] in ("app", "benchmarks", "deployments"):
                    module_name = node.module
                else:
                    continue
                node.module = module_name  # reported by its absolute name
                base = ROOT.joinpath(*module_name.split("."))
                module = base.with_suffix(".py") if base.with_suffix(".py").is_file() else base / "__init__.py"
                if not module.is_file():
                    bad.append(f"{path.relative_to(ROOT)}: no module {node.module}")
                    continue
                names = _top_level_names(module)
                for a in node.names:
                    if a.name != "*" and a.name not in names and not (base / f"{a.name}.py").is_file() \
                            and not (base / a.name / "__init__.py").is_file():
                        bad.append(f"{path.relative_to(ROOT)}: {node.module} has no {a.name}")
    return bad


def test_every_import_of_the_projects_modules_resolves():
    assert unresolved_app_imports() == []


def test_no_script_folder_shadows_a_package_that_transformers_probes():
    """Running `python benchmarks/x.py` puts benchmarks/ first on sys.path, and Ray gives its workers the
    driver's script folder too; transformers probes optional packages by importing them, so a module of
    ours with such a name is imported in their place (benchmarks/kernels.py was, as the `kernels` package,
    by every transformers model import of a serving run started from benchmarks/: renamed
    tower_kernels.py)."""
    import re

    import transformers

    source = (Path(transformers.__file__).parent / "utils" / "import_utils.py").read_text()
    probed = set(re.findall(r'_is_package_available\(\s*"([A-Za-z0-9_]+)"', source)) | {"kernels"}
    assert len(probed) > 20  # the pattern still finds transformers' probes
    ours = {p.stem for f in SCRIPT_FOLDERS for p in (ROOT / f).glob("*.py")}
    ours |= {p.name for f in SCRIPT_FOLDERS for p in (ROOT / f).iterdir() if p.is_dir()}
    assert ours & probed == set()

"""Architecture rules of ``easy_context/`` (issue #46), read off the source with ``ast`` / ``tokenize``: pure Python,
no import of the package, a fraction of a second.

(a) No import cycle between files of ``easy_context/``. Every ``import`` and ``from ... import`` counts, at module
    level or inside a function (a cycle through a function-level import is still two files that need each other).
    ``from .x import y`` depends on the file ``x`` (and on ``x/y`` when that is a module); ``from . import y`` on the
    package's ``__init__`` and on ``y``; ``import a.b`` on ``a.b``. Importing ``p.q`` from outside package ``p`` also
    runs ``p/__init__``, so it depends on that too (a solver behind a package ``__init__`` is not hidden by
    importing one of the package's small modules).
(b) No module under ``easy_context/`` imports ``easy_context_train`` (train.py's library: a package of its own on top
    of the library; train.py, the eval scripts, prepare_data.py, tests, bench and examples may import it).
    ``python -m easy_context``'s command table names two of its commands (``retrieval-data``, ``faults``) by module
    path and imports them only when chosen: the CLI's front door, not a library import.
(c) No file under ``easy_context/`` is over ``MAX_LINES`` (400) lines.
(d) No comment line under ``easy_context/`` carries a measurement: a ``#`` comment matching ``MEASURED``, i.e. a
    number followed by a time unit (``ms``, ``us``, ``s``, ``sec``, ``min``), a throughput (``tok/s``, ``tokens/s``,
    ``TFLOP/s``, ``TFLOPS``, ``GB/s``), a memory size (``KB``, ``MB``, ``GB``, ``KiB``, ``MiB``, ``GiB``, ``TiB``,
    also ``/token``), a ratio (``1.7x``, ``0.96×``, ``4.3%``, ``max/mean 1.06``), or the word "measured" (numbers
    may carry a K / M: ``1.2M tok/s``). Measurements live in docs/ (dated sections) and bench/results/; the code
    keeps the reasoning. Docstrings are documentation and not checked.
(e) ``easy_context/`` holds at most ``MAX_PACKAGE_LINES`` lines of Python (every line of every .py file, as
    ``find easy_context -name '*.py' | xargs cat | wc -l`` counts them), so the package cannot silently regrow: code
    only benchmarks or tests need lives in bench/ or tests/ (bench/dispatch_solvers.py, bench/offload_timeline.py).
    Lower the number when the package shrinks; raise it only with the reason in the commit.
(f) No import cycle between files of ``bench/`` (the check of (a) over that folder), nor of ``easy_context_train/``,
    whose files are also held to (c).

Each rule is a function over a package directory that returns the offences; each is also run on a tiny synthetic
package in ``tmp_path`` that breaks it, so a check that stopped seeing its offence would fail here.
"""
from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "easy_context"
TRAIN = ROOT / "easy_context_train"
BENCH = ROOT / "bench"
MAX_LINES = 400
MAX_PACKAGE_LINES = 17_100  # issue #46 set 15,000; raised on 2026-12-08 for four features without paired deletions (issue #61 open): #59 contract + census (+1,100), #63 vlm/ (+620), #62 RL scoring (+540), #64 held-out probes (+140)
_NUMBER = r"\d(?:[\d,]*\d)?(?:\.\d+)?(?:e[+-]?\d+)?"
MEASURED = re.compile(
    rf"{_NUMBER}[KM]?\s*(?:(?:ms|us|µs|s|sec|secs|seconds|min)\b"  # a time
    r"|tok(?:ens)?/s|TFLOP/s|TFLOPS|[GM]B/s|GiB/s"                 # a throughput
    r"|[KMGT]i?B(?:/tok(?:en)?)?\b)"                                # a memory size
    rf"|{_NUMBER}(?:[x×](?!\w)|%)"                                  # a ratio (no space: "2 x 3" is a shape)
    rf"|max/mean\s*[~=]?\s*{_NUMBER}"                              # a balance
    r"|\b(?i:measured)\b")                                          # the word


def _modules(package: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every .py under ``package`` (a package's ``__init__`` as the package)."""
    out = {}
    for f in sorted(package.rglob("*.py")):
        parts = f.relative_to(package.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = f
    return out


def _imported(name: str, path: Path, node: ast.AST, mods: dict) -> list[str]:
    """The modules of ``mods`` an import statement of module ``name`` (file ``path``) depends on."""
    if isinstance(node, ast.Import):
        found = [a.name for a in node.names]
    else:
        if node.level:
            base = name.split(".")
            base = base[:len(base) - node.level + (1 if path.name == "__init__.py" else 0)]
            prefix = ".".join(base + ([node.module] if node.module else []))
        else:
            prefix = node.module or ""
        found = [prefix] + [f"{prefix}.{a.name}" for a in node.names]
    return [m for m in found if m in mods and m != name]


def import_graph(package: Path, entered: bool = True) -> dict[str, set[str]]:
    """Module -> the modules of ``package`` it imports anywhere in its file (function-level imports included), and
    (``entered``) the ``__init__`` of every package it enters from outside."""
    mods = _modules(package)
    graph = {}
    for name, path in mods.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                deps.update(_imported(name, path, node, mods))
        for d in list(deps) if entered else ():
            parts = d.split(".")
            deps.update(p for p in (".".join(parts[:i]) for i in range(2, len(parts)))
                        if p in mods and p != name and not name.startswith(p + "."))
        graph[name] = deps
    return graph


def import_cycles(package: Path) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted; [] when imports run one way."""
    graph = import_graph(package)
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
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

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def training_imports(package: Path, training: str = "easy_context_train") -> list[str]:
    """``module -> imported module`` for every import of ``training`` (a package outside ``package``) by a module of
    ``package``, function-level imports included."""
    out = []
    for name, path in _modules(package).items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                found = [node.module or ""]
            else:
                continue
            out += [f"{name} -> {m}" for m in found if m == training or m.startswith(training + ".")]
    return sorted(out)


def long_files(package: Path, limit: int = MAX_LINES) -> list[str]:
    """``path: lines`` of every .py file under ``package`` longer than ``limit`` lines."""
    out = []
    for f in sorted(package.rglob("*.py")):
        n = len(f.read_text().splitlines())
        if n > limit:
            out.append(f"{f.relative_to(package.parent)}: {n}")
    return out


def package_lines(package: Path) -> int:
    """Lines of every .py file under ``package`` (``wc -l``: newline characters)."""
    return sum(f.read_text().count("\n") for f in package.rglob("*.py"))


def measured_comments(package: Path) -> list[str]:
    """``path:line: comment`` of every ``#`` comment under ``package`` that carries a measurement (``MEASURED``)."""
    out = []
    for f in sorted(package.rglob("*.py")):
        for tok in tokenize.generate_tokens(io.StringIO(f.read_text()).readline):
            if tok.type == tokenize.COMMENT and MEASURED.search(tok.string):
                out.append(f"{f.relative_to(package.parent)}:{tok.start[0]}: {tok.string.strip()}")
    return out


# ---------------------------------------------------------------------------------------------- the real tree
def test_no_import_cycle():
    cycles = import_cycles(PACKAGE)
    assert not cycles, "import cycles between files of easy_context/ (make the data flow one way):\n" + \
        "\n".join(" <-> ".join(c) for c in cycles)


def test_only_training_imports_training():
    found = training_imports(PACKAGE)
    assert not found, ("library modules importing easy_context_train, train.py's library (move what they need into "
                       "the library; easy_context_train may re-export it):\n" + "\n".join(found))


def test_no_file_over_the_limit():
    long = long_files(PACKAGE) + long_files(TRAIN)
    assert not long, f"files of easy_context/ over {MAX_LINES} lines (split them by concern):\n" + "\n".join(long)


def test_package_under_its_line_budget():
    n = package_lines(PACKAGE)
    assert n <= MAX_PACKAGE_LINES, (f"easy_context/ has {n} lines, over its budget of {MAX_PACKAGE_LINES} (issue #46): "
                                    "delete what is unused, move what only bench/ or tests/ need there")


def test_no_import_cycle_in_bench_or_train():
    cycles = import_cycles(BENCH) + import_cycles(TRAIN)
    assert not cycles, "import cycles between files of bench/ or easy_context_train/ (function-level imports included):\n" + \
        "\n".join(" <-> ".join(c) for c in cycles)


def test_no_measured_comment():
    found = measured_comments(PACKAGE)
    assert not found, ("comments carrying measurements (move the figures to docs/ or bench/results/, keep the "
                       "reasoning):\n" + "\n".join(found))


_TEST_HOOK = re.compile(r"EASY_CONTEXT_TEST|\bPYTEST_CURRENT_TEST\b")


def test_hooks(package: Path) -> list[str]:
    """Lines of library code that exist for tests (a mutation switched on by an environment variable, a branch on
    pytest): such hooks live in tests/ (monkeypatching the library), never in what users run (issue #61)."""
    out = []
    for f in sorted(package.rglob("*.py")):
        for i, line in enumerate(f.read_text().splitlines(), 1):
            if _TEST_HOOK.search(line):
                out.append(f"{f.relative_to(package.parent)}:{i}: {line.strip()}")
    return out


test_hooks.__test__ = False  # a check, not a test (pytest would collect it by name)


def test_no_test_hook_in_library_code():
    found = test_hooks(PACKAGE)
    assert not found, "test hooks in library code (move the mutation into tests/, e.g. monkeypatch):\n" + \
        "\n".join(found)


# ---------------------------------------------------------------------------------------------- the checks bite
def test_hook_check_sees_a_hook(tmp_path):
    pkg = _package(tmp_path, {"m.py": 'import os\nDROP = os.environ.get("EASY_CONTEXT_TEST_DROP")\nx = 1\n'})
    assert test_hooks(pkg) == ['easy_context/m.py:2: DROP = os.environ.get("EASY_CONTEXT_TEST_DROP")']
def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    pkg = tmp_path / "easy_context"
    for rel, text in {"__init__.py": "", **files}.items():
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
        (pkg / rel).write_text(text)
    return pkg


def test_cycle_check_sees_function_level_and_package_cycles(tmp_path):
    pkg = _package(tmp_path, {
        "a.py": "from .b import f\n",
        "b.py": "def f():\n    from .a import g  # a function-level import closes the cycle\n",
        "c.py": "import easy_context.d\n",
        "d.py": "from easy_context.c import x\n",
        "k/__init__.py": "from .m import h\n",
        "k/m.py": "def h():\n    from . import merge  # the package's __init__: a cycle\n",
        "s/__init__.py": "from .solve import plan\n",
        "s/solve.py": "from ..geometry import cut\n",
        "s/table.py": "",
        "geometry.py": "from .s.table import Table  # runs s/__init__, which imports the solver: a cycle\n",
        "ok.py": "from .a import f\nfrom . import c\n",
    })
    assert import_cycles(pkg) == [["easy_context.a", "easy_context.b"], ["easy_context.c", "easy_context.d"],
                                  ["easy_context.geometry", "easy_context.s", "easy_context.s.solve"],
                                  ["easy_context.k", "easy_context.k.m"]]
    (pkg / "b.py").write_text("def f():\n    pass\n")
    assert ["easy_context.a", "easy_context.b"] not in import_cycles(pkg)


def test_training_check_sees_library_imports_of_training(tmp_path):
    pkg = _package(tmp_path, {
        "loss.py": "def nll():\n    from easy_context_train.parallel import x  # function level\n",
        "tools/check.py": "import easy_context_train.data\nfrom easy_context_train import data\n",
        "ok.py": "from .loss import nll\nimport easy_context_trainer_other\n",
    })
    assert training_imports(pkg) == ["easy_context.loss -> easy_context_train.parallel",
                                     "easy_context.tools.check -> easy_context_train",
                                     "easy_context.tools.check -> easy_context_train.data"]


def test_length_check_sees_a_file_over_the_limit(tmp_path):
    pkg = _package(tmp_path, {"short.py": "x = 1\n" * MAX_LINES, "long.py": "x = 1\n" * (MAX_LINES + 1)})
    assert long_files(pkg) == [f"easy_context/long.py: {MAX_LINES + 1}"]


def test_line_budget_counts_every_python_line(tmp_path):
    pkg = _package(tmp_path, {"a.py": "x = 1\n\n# c\n", "k/b.py": '\"\"\"doc\"\"\"\n', "k/c.txt": "not python\n"})
    assert package_lines(pkg) == 4  # a.py 3, k/b.py 1, __init__.py 0; k/c.txt is no Python


@pytest.mark.parametrize("comment", [
    "# 0.95 ms per 16K tokens", "# took 8 s vs 4.6 s on 2 CPU cores", "# 632 TFLOP/s at 128K", "# 1.2M tok/s",
    "# 96.6 -> 56.6 KB/token", "# ~10 KB/token here", "# 12.5 GiB at 512K", "# 1.73x faster", "# 0.96× the speed",
    "# mean |error| 4.3%", "# max/mean 2.2 at 128K", "# measured on an H200", "# Measured picks"])
def test_comment_check_sees_measurements(tmp_path, comment):
    text = f'"""1.73x in a docstring is documentation."""\nx = "9 ms"  # a string is no comment\ny = 1  {comment}\n'
    pkg = _package(tmp_path, {"m.py": text})
    assert measured_comments(pkg) == [f"easy_context/m.py:3: {comment}"]


@pytest.mark.parametrize("comment", [
    "# (B, L, H, D) rows", "# 32 heads x 128", "# a 16x16 tile", "# 2 B x hidden per token", "# 0x1f mask",
    "# rank r holds chunks r and 2W-1-r", "# W x m chunks", "# the planner's cost model"])
def test_comment_check_leaves_plain_comments(tmp_path, comment):
    pkg = _package(tmp_path, {"m.py": f"x = 1  {comment}\n"})
    assert measured_comments(pkg) == []


def test_data_files_ship_in_the_wheel():
    """Every data file the package reads at run time is in pyproject's package-data (a non-editable install otherwise
    lacks it: `plan` and the cost model read tools/plan_constants.json). READMEs are documentation."""
    import fnmatch
    import tomllib
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    data = [f.relative_to(PACKAGE).as_posix() for f in PACKAGE.rglob("*") if f.is_file()
            and f.suffix not in (".py", ".pyc", ".md") and "__pycache__" not in f.parts]
    missing = [f for f in data if not any(fnmatch.fnmatch(f, pat) for pat in declared.get("easy_context", []))]
    assert data and not missing, f"data files of easy_context/ not in [tool.setuptools.package-data]: {missing}"

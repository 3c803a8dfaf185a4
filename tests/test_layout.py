"""House rules of the source tree (src/eagle3fn and cli), checked on the source text:

- no private name (``_x``) of one eagle3fn module used by another: a seam used elsewhere
  is public (and documented), or the code moves to where it is used;
- no benchmark figures in docstrings (GPU names, tokens/s, ratios, timings, pointers to
  the benchmark pages): figures go stale in code, they live in docs/benchmarks.md with
  their JSON;
- no environment variable read when a module is imported (the CLI reads its switches
  once, at start-up: ``eagle3fn.cli.main.ENVIRONMENT``);
- no source file above ``MAX_FILE_LINES`` lines and no function above
  ``MAX_FUNCTION_LINES`` lines (Triton kernels in src/eagle3fn/kernels excepted from
  the function rule): a longer one is split by concern.

Each check has a control: a synthetic source with the offence is caught.
"""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = {"eagle3fn": ROOT / "src" / "eagle3fn", "eagle3fn.cli": ROOT / "cli"}


def module_files() -> dict[str, pathlib.Path]:
    """Dotted module name -> file, for every module of src/eagle3fn and cli (installed as
    ``eagle3fn.cli``)."""
    out = {}
    for package, folder in PACKAGES.items():
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([package, *parts])] = path
    return out


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_uses(source: str, module: str, modules: set[str], is_package: bool = False) -> list[str]:
    """The private names of other modules in ``modules`` that ``source`` (the text of
    ``module``) uses: ``from m import _x`` (relative imports resolved) and ``m._x`` where
    ``m`` names a module of ``modules`` (``import a.b as m``, ``from a import m``)."""
    tree = ast.parse(source)
    here = module.split(".") if is_package else module.split(".")[:-1]
    aliases, found = {}, []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(here[:len(here) - node.level + 1] + ([base] if base else []))
            for a in node.names:
                if f"{base}.{a.name}" in modules:
                    aliases[a.asname or a.name] = f"{base}.{a.name}"
                elif base in modules and base != module and _private(a.name):
                    found.append(f"line {node.lineno}: from {base} import {a.name}")
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.asname and a.name in modules:
                    aliases[a.asname] = a.name
                elif not a.asname:
                    aliases[a.name.split(".")[0]] = a.name.split(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            chain, value = [], node.value
            while isinstance(value, ast.Attribute):
                chain.append(value.attr)
                value = value.value
            if isinstance(value, ast.Name) and value.id in aliases:
                target = ".".join([aliases[value.id], *reversed(chain)])
                if target in modules and target != module:
                    found.append(f"line {node.lineno}: {target}.{node.attr}")
    return found


def test_no_private_name_is_used_across_modules():
    files = module_files()
    found = [f"{path.relative_to(ROOT)} {use}" for module, path in files.items()
             for use in private_uses(path.read_text(), module, set(files), path.name == "__init__.py")]
    assert not found, "private names used from another module (make the seam public or move the code):\n" \
        + "\n".join(found)


@pytest.mark.parametrize("source", [
    "from eagle3fn.plan.saved import _swiglu_saved\n",
    "from .saved import (head_saved, _swiglu_saved)\n",
    "import eagle3fn.plan.saved as saved\nsaved._swiglu_saved(1, 2, 3)\n",
    "from eagle3fn.plan import saved\nx = saved._swiglu_saved\n",
    "import eagle3fn.plan.saved\neagle3fn.plan.saved._swiglu_saved(1)\n",
])
def test_control_a_private_import_is_caught(source):
    modules = set(module_files())
    assert private_uses(source, "eagle3fn.plan.memory", modules)
    # the module's own private names, and other libraries', are not this rule's business
    assert not private_uses(source, "eagle3fn.plan.saved", modules)
    assert not private_uses("import torch\ntorch._dynamo.reset()\nfrom torch import _C\n",
                            "eagle3fn.plan.memory", modules)


FIGURES = re.compile(
    r"\bH[12]00\b"                                  # a GPU named: a measurement on it
    r"|\d[\d.,]*\s*(tok|tokens)/s\b"                 # a throughput figure
    r"|\b\d+\.\d+(-\d+\.\d+)?x\b"                   # a measured ratio (1.07x, 0.93-0.94x)
    r"|\b\d+(\.\d+)?\s?ms\b"                        # a timing
    r"|benchmarks\.md|BENCH\.md",                   # a pointer to the benchmark pages
    re.IGNORECASE)


def docstring_figures(source: str) -> list[str]:
    """Lines of ``source``'s docstrings (every string statement: module, class,
    function and attribute docstrings) that cite a benchmark figure (``FIGURES``)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            for i, line in enumerate(node.value.value.splitlines()):
                if FIGURES.search(line):
                    found.append(f"line {node.lineno + i}: {line.strip()}")
    return found


def test_no_benchmark_figures_in_docstrings():
    found = [f"{path.relative_to(ROOT)} {line}" for path in module_files().values()
             for line in docstring_figures(path.read_text())]
    assert not found, "benchmark figures in docstrings (they belong in docs/benchmarks.md):\n" + "\n".join(found)


@pytest.mark.parametrize("doc", ["measured on an H200", "1450 tok/s", "12.5 tokens/s", "backbone was 1.07x none",
                                 "0.93-0.94x at 8192", "the step took 329 ms", "see docs/benchmarks.md"])
def test_control_a_figure_in_a_docstring_is_caught(doc):
    source = f'"""Module."""\n\n\ndef f():\n    """Does f ({doc})."""\n\n\nX = 1\n"""The x ({doc})."""\n'
    assert len(docstring_figures(source)) == 2
    # what a docstring may say: a format with placeholders, shapes, sizes
    assert not docstring_figures('"""Prints ``loss L acc0 A N tok/s``; ``[N, 2x H]``; 4096 rows; 256 MiB."""')


def import_time_environment_reads(source: str) -> list[str]:
    """``os.environ`` / ``os.getenv`` reads of ``source`` that run when it is imported:
    outside every function body (module level, class bodies, default arguments)."""
    tree = ast.parse(source)
    inside = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            for statement in (node.body if isinstance(node.body, list) else [node.body]):
                inside.update(id(n) for n in ast.walk(statement))
    found = []
    for node in ast.walk(tree):
        if id(node) in inside:
            continue
        if (isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv")
                and isinstance(node.value, ast.Name) and node.value.id == "os"):
            found.append(f"line {node.lineno}: os.{node.attr}")
    return found


def test_no_environment_read_at_import():
    found = [f"{path.relative_to(ROOT)} {line}" for path in module_files().values()
             for line in import_time_environment_reads(path.read_text())]
    assert not found, "environment read at import (read it in the CLI, once, and pass it down):\n" \
        + "\n".join(found)


def test_control_an_import_time_environment_read_is_caught():
    assert import_time_environment_reads('import os\nX = os.environ.get("A", "1") != "0"\n')
    assert import_time_environment_reads('import os\ndef f(x=os.getenv("A")):\n    return x\n')
    assert not import_time_environment_reads('import os\ndef f():\n    return os.environ.get("A")\n')


MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 80
KERNELS = ROOT / "src" / "eagle3fn" / "kernels"


def size_offences(source: str, functions: bool = True) -> list[str]:
    """What in ``source`` is too long: the file above ``MAX_FILE_LINES`` lines, and (with
    ``functions``) each function, method or nested function above ``MAX_FUNCTION_LINES``
    lines, counted from its ``def`` line to its last line (docstring included)."""
    lines = len(source.splitlines())
    found = [f"{lines} lines (at most {MAX_FILE_LINES})"] if lines > MAX_FILE_LINES else []
    if functions:
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    found.append(f"line {node.lineno}: {node.name} has {length} lines (at most {MAX_FUNCTION_LINES})")
    return found


def test_no_long_file_or_function():
    found = [f"{path.relative_to(ROOT)} {offence}" for path in module_files().values()
             for offence in size_offences(path.read_text(), functions=not path.is_relative_to(KERNELS))]
    assert not found, "too long (split the file by concern, or extract named helpers):\n" + "\n".join(found)


def _function(name: str, body_lines: int, indent: str = "") -> str:
    """A function named ``name`` of ``1 + body_lines`` lines."""
    return f"{indent}def {name}(x):\n" + f"{indent}    x = x + 1\n" * (body_lines - 1) + f"{indent}    return x\n"


def test_control_a_long_file_or_function_is_caught():
    assert size_offences("x = 1\n" * MAX_FILE_LINES) == []
    assert size_offences("x = 1\n" * (MAX_FILE_LINES + 1)) == [f"{MAX_FILE_LINES + 1} lines (at most 500)"]
    assert size_offences(_function("short", MAX_FUNCTION_LINES - 1)) == []
    long = _function("long", MAX_FUNCTION_LINES)
    assert size_offences(long) == ["line 1: long has 81 lines (at most 80)"]
    # methods, nested and async functions count too; a kernel file only by its length
    method = "class A:\n" + _function("method", MAX_FUNCTION_LINES, "    ")
    assert size_offences(method) == ["line 2: method has 81 lines (at most 80)"]
    nested = "def outer():\n" + _function("inner", MAX_FUNCTION_LINES, "    ") + "    return inner\n"
    assert [o.split(":")[1].split()[0] for o in size_offences(nested)] == ["outer", "inner"]
    assert size_offences("async " + long) == ["line 1: long has 81 lines (at most 80)"]
    assert size_offences(long, functions=False) == []

"""docs/reference/errors.md lists every exception class the package defines, with the exit
code the CLI gives it (``cli.main._exit_code``; ``io.stop.Stopped``: 128 + the signal) and
a fix. The classes are found in the source (any class deriving from an exception class),
so a new one fails this test until it is documented. Control: the same check on the page
without one row fails naming that class."""

import ast
import importlib
import signal
from pathlib import Path

from eagle3fn.errors import Eagle3fnError
from eagle3fn.io.stop import Stopped

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "reference" / "errors.md"
BUILTIN = {"Exception", "ValueError", "RuntimeError", "OSError", "TypeError", "KeyError"}


def defined_exceptions() -> dict[str, str]:
    """{class name: module} of every exception class under src/eagle3fn (a class whose
    base is a builtin exception or another class found here)."""
    classes = {}
    for path in sorted((ROOT / "src" / "eagle3fn").rglob("*.py")):
        module = ".".join(path.relative_to(ROOT / "src").with_suffix("").parts).removesuffix(".__init__")
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                bases = {b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases}
                classes[node.name] = (module, bases)
    found: dict[str, str] = {}
    while True:  # to a fixpoint: subclasses of classes found
        new = {n: m for n, (m, bases) in classes.items()
               if n not in found and bases & (BUILTIN | set(found))}
        if not new:
            return found
        found.update(new)


def expected_exit(cls) -> str:
    if issubclass(cls, Stopped):
        return str(128 + signal.SIGTERM)
    if issubclass(cls, Eagle3fnError):
        return str(cls.exit_code)
    return "2" if issubclass(cls, (ValueError, FileNotFoundError, NotADirectoryError)) else "1"


def class_rows(page: str) -> dict[str, list[str]]:
    """{class name: cells} of the page's "The error classes" table."""
    section = page.split("## The error classes", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and cells[0].startswith("`"):
            rows[cells[0].split("`")[1].split(".")[-1]] = cells
    return rows


def missing(page: str) -> list[str]:
    """Classes without a row, or whose row gives another exit code or no fix."""
    rows, problems = class_rows(page), []
    for name, module in defined_exceptions().items():
        cls = getattr(importlib.import_module(module), name)
        cells = rows.get(name)
        if cells is None:
            problems.append(f"{module}.{name}: no row")
        elif not cells[1].startswith(expected_exit(cls)) or not cells[3]:
            problems.append(f"{module}.{name}: exit {cells[1]!r}, expected {expected_exit(cls)}, fix {cells[3]!r}")
    return problems


def test_every_exception_class_is_listed_with_its_exit_code_and_fix():
    found = defined_exceptions()
    assert {"Eagle3fnError", "UsageError", "RunError", "Stopped", "DataError", "OutputMismatch"} <= set(found)
    assert missing(PAGE.read_text()) == []


def test_control_a_class_without_its_row_is_caught():
    page = PAGE.read_text()
    cut = "\n".join(line for line in page.splitlines() if not line.startswith("| `eagle3fn.io.stop.Stopped`"))
    assert cut != page and missing(cut) == ["eagle3fn.io.stop.Stopped: no row"]
    wrong = page.replace("| `eagle3fn.io.stop.Stopped` | 143", "| `eagle3fn.io.stop.Stopped` | 1")
    assert [p.split(":")[0] for p in missing(wrong)] == ["eagle3fn.io.stop.Stopped"]

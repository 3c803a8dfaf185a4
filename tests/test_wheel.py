"""The built wheel holds every module of the source tree, so a non-editable install works.

Each wheel is built from a copy of the packaging inputs (pyproject.toml, setup.py,
README.md, src/, cli/) in a temporary folder: neither a stale build/ folder nor the
editable install can hide a package that discovery missed. Three builds: straight from
the tree (`pip install .`), from the sdist (`python -m build`, a package index), and the
control: the same tree with the hand-written package list pyproject.toml had before
discovery (it left out eagle3fn.io.cache), which the check must catch.
"""

import pathlib
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGING_INPUTS = ("pyproject.toml", "setup.py", "README.md", "src", "cli")

# pyproject.toml's [tool.setuptools] packages up to 0.1.0, listed by hand (the control).
HAND_LIST = ["eagle3fn", "eagle3fn.kernels", "eagle3fn.io", "eagle3fn.parallel", "eagle3fn.train",
             "eagle3fn.demo", "eagle3fn.testing", "eagle3fn.unrolled", "eagle3fn.plan", "eagle3fn.cli"]


def expected_files() -> set[str]:
    """Every module under src/eagle3fn and cli/ (cli/ installs as eagle3fn.cli) and the demo
    conversations, as paths inside the wheel."""
    def modules(folder: pathlib.Path, prefix: str, pattern: str = "*.py") -> set[str]:
        return {f"{prefix}/{p.relative_to(folder).as_posix()}" for p in folder.rglob(pattern)
                if "__pycache__" not in p.parts}

    files = modules(ROOT / "src" / "eagle3fn", "eagle3fn") | modules(ROOT / "cli", "eagle3fn/cli")
    files |= modules(ROOT / "src" / "eagle3fn" / "demo", "eagle3fn/demo", "*.jsonl")
    assert "eagle3fn/io/cache/__init__.py" in files and "eagle3fn/demo/chat.jsonl" in files
    return files


def copy_inputs(dest: pathlib.Path) -> pathlib.Path:
    dest.mkdir()
    for name in PACKAGING_INPUTS:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            shutil.copy2(src, dest / name)
    return dest


def use_hand_list(tree: pathlib.Path) -> None:
    """Put the old hand-written list back into the copy's [tool.setuptools] (pyproject.toml
    wins over setup.py's discovery)."""
    path = tree / "pyproject.toml"
    text = path.read_text()
    listed = "packages = [" + ", ".join(f'"{p}"' for p in HAND_LIST) + "]\n"
    text, n = re.subn(r"^\[tool\.setuptools\]\n", lambda m: m.group(0) + listed, text, flags=re.M)
    assert n == 1
    path.write_text(text)


def run(*cmd: str, cwd: pathlib.Path) -> None:
    done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def build_wheel(source: pathlib.Path, out: pathlib.Path) -> pathlib.Path:
    """`pip wheel` of a folder or an sdist, with this environment's setuptools (offline)."""
    run(sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
        "--no-index", "--wheel-dir", str(out), str(source), cwd=out.parent)
    (wheel,) = out.glob("eagle3fn-*.whl")
    return wheel


def build_sdist(tree: pathlib.Path, out: pathlib.Path) -> pathlib.Path:
    """The sdist through setuptools' PEP 517 hook (what `python -m build --sdist` calls)."""
    run(sys.executable, "-c", f"from setuptools import build_meta; build_meta.build_sdist({str(out)!r})",
        cwd=tree)
    (sdist,) = out.glob("eagle3fn-*.tar.gz")
    return sdist


def check_wheel(wheel: pathlib.Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = sorted(expected_files() - names)
    assert not missing, f"{len(missing)} files missing from {wheel.name}: {missing}"
    stray = sorted(n for n in names if not n.startswith(("eagle3fn/", "eagle3fn-")))
    assert not stray, f"files outside the eagle3fn package in {wheel.name}: {stray}"
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert wheel.name.startswith(f"eagle3fn-{declared}-")
    with zipfile.ZipFile(wheel) as z:
        (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
        assert "eagle3fn = eagle3fn.cli.main:main" in z.read(entry_points).decode()


@pytest.mark.parametrize("route", ["tree", "sdist", "control-hand-list"])
def test_wheel_holds_every_module(tmp_path, route):
    tree = copy_inputs(tmp_path / "tree")
    out = tmp_path / "dist"
    out.mkdir()
    if route == "control-hand-list":
        use_hand_list(tree)
        with pytest.raises(AssertionError, match=r"missing from .*eagle3fn/io/cache/__init__\.py"):
            check_wheel(build_wheel(tree, out))
        return
    source = build_sdist(tree, out) if route == "sdist" else tree
    check_wheel(build_wheel(source, out))

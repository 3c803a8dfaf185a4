"""Package discovery, the one thing pyproject.toml cannot say (everything else lives there).

Every package under src/eagle3fn is found, not listed, so a new subpackage ships without an
edit here; the top-level cli/ folder installs as eagle3fn.cli (pyproject.toml's package-dir
maps it), and a find directive there cannot name a folder outside its search roots.
tests/test_wheel.py builds the wheel and fails on any module left out.
"""

from setuptools import find_namespace_packages, setup

setup(packages=[*find_namespace_packages("src", include=["eagle3fn", "eagle3fn.*"],
                                         exclude=["*.__pycache__"]),
                "eagle3fn.cli",
                *(f"eagle3fn.cli.{p}" for p in find_namespace_packages("cli", exclude=["*__pycache__"]))])

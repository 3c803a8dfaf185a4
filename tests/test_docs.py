"""Every fenced python block of the tutorials and the README runs, so docs cannot rot."""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = (sorted((ROOT / "docs" / "tutorials").glob("*.md")) + sorted((ROOT / "docs" / "how-to").glob("*.md"))
         + [ROOT / "README.md"])


def python_blocks(text):
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_page_code_runs(page):
    blocks = python_blocks(page.read_text())
    assert blocks, f"{page.name} has no python block"
    namespace = {}
    for i, block in enumerate(blocks):
        exec(compile(block, f"{page.name}[block {i}]", "exec"), namespace)


def test_a_broken_block_fails():
    """Negative control: an assertion inside a block surfaces as a failure."""
    (block,) = python_blocks("```python\nassert 1 == 2\n```\n")
    with pytest.raises(AssertionError):
        exec(block, {})


def test_tutorials_exist():
    assert (ROOT / "docs" / "tutorials" / "row-maps.md") in PAGES

"""docs/reference/config.md is generated from the configs and must be up to date."""

import pathlib
import re
import runpy

import pytest

from eagle3fn.cli.main import main

ROOT = pathlib.Path(__file__).resolve().parents[1]
GENERATOR = ROOT / "docs" / "reference" / "generate.py"


def test_config_reference_is_up_to_date():
    page = runpy.run_path(str(GENERATOR))["render"]()
    assert (ROOT / "docs" / "reference" / "config.md").read_text() == page, \
        "docs/reference/config.md is out of date: run python docs/reference/generate.py"


@pytest.mark.parametrize("command", ["train", "eval", "export", "synthesize"])
def test_config_reference_has_every_flag_with_its_help(capsys, command):
    with pytest.raises(SystemExit):
        main([command, "--help"])
    flags = set(re.findall(r"(--[a-z][a-z0-9.-]*[a-z0-9])", capsys.readouterr().out)) - {"--help"}
    section = (ROOT / "docs" / "reference" / "config.md").read_text().split(f"## `eagle3fn {command}`")[1]
    section = section.split("\n## ")[0]
    documented = set(re.findall(r"^\| `(--[^`]*)`", section, flags=re.M))
    documented = {f for cell in documented for f in cell.split(", ")}
    assert flags <= documented, flags - documented
    # Each field's docstring is in the page (what --help shows), e.g. the held-out split.
    generator = runpy.run_path(str(GENERATOR))
    from eagle3fn.cli.run import EvalArgs, ExportArgs
    from eagle3fn.cli.synth import SynthesizeArgs
    from eagle3fn.train.config import TrainConfig
    cls = {"train": TrainConfig, "eval": EvalArgs, "export": ExportArgs, "synthesize": SynthesizeArgs}[command]
    for doc in generator["field_docs"](cls).values():
        assert doc.replace("|", "\\|") in section

"""benchmarks/plot.py's reading of step.py JSON (the plot itself is checked by eye)."""

import importlib.util
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def load_plot():
    spec = importlib.util.spec_from_file_location("bench_plot", ROOT / "benchmarks" / "plot.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


def row(mode, density, ms, S=8192, pattern="tail"):
    return dict(S=S, pattern=pattern, mode=mode, density=density, median_ms=ms, peak_gib=1.0)


def test_later_file_wins_and_oom_rows_drop(tmp_path):
    """A point measured in two files is drawn once, from the later file; a NaN (out of
    memory) row is not drawn; distinct points all stay. Negative control: reading the
    files in the other order keeps the other value."""
    first, second = tmp_path / "a.json", tmp_path / "b.json"
    first.write_text(json.dumps({"results": [row("specforge", 0.1, 300.0), row("none", 0.1, 250.0),
                                             row("none", 0.3, float("nan"))]}))
    second.write_text(json.dumps({"results": [row("specforge", 0.1, 310.0), row("loss", 0.1, 200.0),
                                              row("none", 0.1, 260.0, pattern="scattered")]}))
    plot = load_plot()
    got = {(r["mode"], r["density"], r["pattern"]): r["median_ms"]
           for r in plot.load_rows((str(first), str(second)))}
    assert got == {("specforge", 0.1, "tail"): 310.0, ("none", 0.1, "tail"): 250.0,
                   ("loss", 0.1, "tail"): 200.0, ("none", 0.1, "scattered"): 260.0}
    swapped = {(r["mode"], r["density"]): r["median_ms"]
               for r in plot.load_rows((str(second), str(first))) if r["pattern"] == "tail"}
    assert swapped[("specforge", 0.1)] == 300.0

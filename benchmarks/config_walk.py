"""The training config's walk through the code: in which eagle3fn modules, in what
order, a run of ``eagle3fn.train.train`` reads its settings (CPU, tiny target, a minute).

A reader chasing one setting goes where the code reads it. This tool runs
``train(TrainConfig(...))`` on the tests' tiny target and chat (``tests/recorders.py``:
``save_tiny_target``, ``write_tiny_chat``; 2 optimizer steps, a held-out evaluation),
once per scenario (online with ``--pack`` off and on, and offline from a cache), while
every read of a field or property of the config objects (``CONFIG_CLASSES``:
``TrainConfig`` and its parts ``LossConfig``, ``TTTOptions``, ``ParallelConfig``, and
the run's ``TTTConfig`` made from them) is recorded with the eagle3fn module that
made it: the class's ``__getattribute__`` is replaced for the run and looks up the
first eagle3fn frame above it (``sys._getframe``), so a read made for eagle3fn by
``dataclasses.asdict`` or ``replace`` counts where that call is; reads made by the
config classes' own methods (a property's body, ``__post_init__``, ``__eq__``) do not
count, the property read itself does, where it is made.

The walk is the read sites ``(module, line, field)`` in the order each first ran (a
reader follows the code once, not once per step), and its visits are the runs of
consecutive sites in one module. Over the visits (``walk_metrics``):

- ``modules``: distinct modules read in;
- ``steps_up``: visits followed by one in a module above it in the layering: the
  later module imports the earlier (transitively, imports inside functions included;
  ``import_graph``) and not the other way round, i.e. the reader steps back up to a
  caller after a callee;
- ``returns``: visits to a module already left, and per module (``reentered``).

    python benchmarks/config_walk.py --out config-walk.json
"""

from __future__ import annotations

import ast
import collections
import contextlib
import dataclasses
import json
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import tyro

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "eagle3fn"
sys.path.insert(0, str(Path(__file__).parent))
from meta import run_metadata  # noqa: E402

SCENARIOS = ("online-unpacked", "online-packed", "offline-packed")


@dataclass(kw_only=True)
class Args:
    scenarios: tuple[str, ...] = SCENARIOS
    """Which runs to walk: ``online-unpacked`` (``pack=False``), ``online-packed``,
    ``offline-packed`` (from a cache ``eagle3fn prepare`` writes first)."""
    steps: int = 2
    """Optimizer steps per run."""
    out: str = "config-walk.json"


@dataclass(frozen=True)
class Read:
    """One read site: the module and function reading, the line, the config class and
    the field or property read."""

    module: str
    function: str
    line: int
    cls: str
    name: str


def config_classes() -> tuple[type, ...]:
    """The classes whose reads are recorded: the training config and its parts."""
    from eagle3fn.loss import LossConfig
    from eagle3fn.parallel.mesh import ParallelConfig
    from eagle3fn.train.config import TrainConfig, TTTOptions
    from eagle3fn.unrolled.config import TTTConfig

    return (TrainConfig, TTTOptions, LossConfig, ParallelConfig, TTTConfig)


def _own_code(classes) -> set:
    """Code objects of the classes' own methods and properties (their reads are internal)."""
    codes = set()
    for cls in classes:
        for value in vars(cls).values():
            for f in (value.fget, value.fset) if isinstance(value, property) else (value,):
                f = getattr(f, "__func__", f)
                if hasattr(f, "__code__"):
                    codes.add(f.__code__)
    return codes


@contextlib.contextmanager
def recording_reads(classes=None):
    """Within the block, every public attribute read on an instance of ``classes``
    (default ``config_classes()``) adds its site (``Read``) to the yielded dict, in the
    order sites first ran (the values count the reads)."""
    classes = config_classes() if classes is None else tuple(classes)
    own, sites = _own_code(classes), {}

    def getattribute(self, name, _get=object.__getattribute__):
        if not name.startswith("_"):
            frame = sys._getframe(1)
            while frame is not None and not _is_ours(frame.f_globals.get("__name__", "")):
                frame = frame.f_back
            if frame is not None and frame.f_code not in own:
                site = Read(frame.f_globals["__name__"], frame.f_code.co_name, frame.f_lineno,
                            type(self).__name__, name)
                sites[site] = sites.get(site, 0) + 1
        return _get(self, name)

    saved = {cls: vars(cls).get("__getattribute__") for cls in classes}
    for cls in classes:
        cls.__getattribute__ = getattribute
    try:
        yield sites
    finally:
        for cls, old in saved.items():
            if old is None:
                del cls.__getattribute__
            else:
                cls.__getattribute__ = old


def _is_ours(module: str) -> bool:
    return module == "eagle3fn" or module.startswith("eagle3fn.")


def module_name(path: Path, src: Path = SRC) -> str:
    """``src/eagle3fn/train/build.py`` -> ``eagle3fn.train.build`` (a package: its name)."""
    parts = list(path.relative_to(src.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(src: Path = SRC) -> dict[str, set[str]]:
    """Every eagle3fn module under ``src`` -> the eagle3fn modules it imports, anywhere in
    its source (at the top, inside functions, under TYPE_CHECKING); ``from package
    import name`` counts the package and, where ``name`` is a module, that module."""
    files = {module_name(p, src): p for p in sorted(src.rglob("*.py"))}
    graph = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                found.add(base)
                found.update(f"{base}.{a.name}" for a in node.names)
        graph[name] = {m for m in found if m in files and m != name}
    return graph


def reach(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Each module -> every module it imports, directly or through others."""
    out = {}
    for start in graph:
        seen, todo = set(), [start]
        while todo:
            for m in graph.get(todo.pop(), ()):
                if m not in seen:
                    seen.add(m)
                    todo.append(m)
        out[start] = seen - {start}
    return out


def visits_of(sites) -> list[str]:
    """The modules of the read sites in order, consecutive repeats merged."""
    out = []
    for s in sites:
        if not out or out[-1] != s.module:
            out.append(s.module)
    return out


def walk_metrics(visits: list[str], imports: dict[str, set[str]]) -> dict:
    """``modules``, ``steps_up`` (with the pairs), ``returns`` and ``reentered`` (module ->
    returns to it, most first) of a walk's visits (module docstring); ``imports`` maps
    a module to every module it imports transitively (``reach``)."""
    above = lambda hi, lo: lo in imports.get(hi, ()) and hi not in imports.get(lo, ())  # noqa: E731
    ups = [(a, b) for a, b in zip(visits, visits[1:]) if above(b, a)]
    counts = collections.Counter(visits)
    reentered = {m: c - 1 for m, c in counts.most_common() if c > 1}
    return {"visits": len(visits), "modules": len(counts), "steps_up": len(ups),
            "returns": sum(reentered.values()), "reentered": reentered, "up_pairs": [list(p) for p in ups]}


def short(module: str) -> str:
    return module.removeprefix("eagle3fn.")


def scenario_config(name: str, work: Path, steps: int):
    """The tiny run of scenario ``name`` in ``work`` (inputs made there once)."""
    from eagle3fn.train.config import TrainConfig

    if str(ROOT / "tests") not in sys.path:
        sys.path.insert(0, str(ROOT / "tests"))
    from recorders import prepare_cache, save_tiny_target, write_tiny_chat

    if not (work / "model").exists():
        save_tiny_target(work / "model")
        write_tiny_chat(work / "chat.jsonl", 8)
    base = dict(model=str(work / "model"), out_dir=str(work / f"out-{name}"), draft_vocab_size=64,
                batch_size=2, max_steps=steps, ttt_length=3, save_every=steps, eval_holdout=2,
                eval_every=steps, eval_accept_prompts=1, eval_accept_tokens=4, device="cpu")
    if name == "offline-packed":
        if not (work / "cache").exists():
            prepare_cache(work, work / "cache")
        return TrainConfig(**base, cache=str(work / "cache"), pack=True)
    if name not in SCENARIOS:
        raise ValueError(f"unknown scenario {name!r}; use some of {SCENARIOS}")
    return TrainConfig(**base, data=str(work / "chat.jsonl"), pack=name == "online-packed")


def walk(cfg, imports: dict[str, set[str]]) -> dict:
    """Run ``train(cfg)`` recording the config reads; the walk's sites, visits and metrics."""
    from eagle3fn.train import train

    with recording_reads() as sites:
        train(cfg, log=lambda s: None)
    visits = visits_of(sites)
    return {**walk_metrics(visits, imports), "walk": [short(m) for m in visits],
            "sites": [dict(dataclasses.asdict(s), reads=n) for s, n in sites.items()]}


def main(args: Args) -> dict:
    imports = reach(import_graph())
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.scenarios:
            results[name] = walk(scenario_config(name, Path(tmp), args.steps), imports)
            r = results[name]
            top = ", ".join(f"{short(m)} {n}" for m, n in list(r["reentered"].items())[:4])
            print(f"{name}: {r['modules']} modules, {r['steps_up']} steps back up, {r['returns']} returns "
                  f"({r['visits']} visits, {len(r['sites'])} read sites); most re-entered: {top}")
    record = dict(run_metadata(dataclasses.asdict(args)), results=results)
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    return record


if __name__ == "__main__":
    main(tyro.cli(Args))

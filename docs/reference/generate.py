"""Write ``docs/reference/config.md``: every field of the train, eval, export and synthesize configs
with its type, default and docstring (the text ``--help`` shows), and the presets.

    python docs/reference/generate.py

``tests/test_reference_docs.py`` fails when the page differs from what this writes.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
import types
import typing
from pathlib import Path

from eagle3fn.cli.main import ENVIRONMENT
from eagle3fn.cli.run import EvalArgs, ExportArgs
from eagle3fn.cli.synth import SynthesizeArgs
from eagle3fn.train.config import PRESETS, TrainConfig

PAGE = Path(__file__).with_name("config.md")


def field_docs(cls) -> dict[str, str]:
    """The docstring under each field of a dataclass (and of the dataclasses it derives
    from; the nearest wins), on one line."""
    docs = {}
    for base in reversed([b for b in cls.__mro__ if dataclasses.is_dataclass(b)]):
        body = ast.parse(textwrap.dedent(inspect.getsource(base))).body[0].body
        docs.update({node.target.id: " ".join(inspect.cleandoc(doc.value.value).split())
                     for node, doc in zip(body, body[1:])
                     if isinstance(node, ast.AnnAssign) and isinstance(doc, ast.Expr)
                     and isinstance(doc.value, ast.Constant) and isinstance(doc.value.value, str)})
    return docs


def type_name(tp) -> str:
    """``int``, ``str | None``, ``raise | skip`` (a Literal's choices), ``tuple[int, int, int]``."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Literal:
        return " | ".join(str(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in args)
    if origin is not None:
        return f"{origin.__name__}[{', '.join(type_name(a) for a in args)}]"
    if tp is Ellipsis:
        return "..."
    return "None" if tp is type(None) else tp.__name__


def _rows(cls, prefix: str = "") -> list[str]:
    docs, hints, rows = field_docs(cls), typing.get_type_hints(cls), []
    for f in dataclasses.fields(cls):
        if f.default is dataclasses.MISSING:  # a nested config: a heading row, then its fields
            rows.append(f"| `--{prefix}{f.name}.*` | `{hints[f.name].__name__}` | | {docs[f.name]} |")
            rows += _rows(hints[f.name], f"{prefix}{f.name}.")
            continue
        flag = f"--{prefix}{f.name}".replace("_", "-")
        if hints[f.name] is bool:
            flag += f", --{prefix}no-{f.name}".replace("_", "-")
        default = f'"{f.default}"' if isinstance(f.default, str) else str(f.default)
        cell = lambda s: s.replace("|", "\\|")  # noqa: E731
        rows.append(f"| `{flag}` | `{cell(type_name(hints[f.name]))}` | `{default}` | {cell(docs[f.name])} |")
    return rows


def _table(cls) -> str:
    return "\n".join(["| flag | type | default | meaning |", "|---|---|---|---|", *_rows(cls)])


def render() -> str:
    """The page's text."""
    presets = "\n".join(
        f"| `{name}` | {' '.join(f'`--{k}'.replace('_', '-') + f' {v}`' for k, v in fn().items())} | "
        f"{' '.join(inspect.getdoc(fn).split())} |" for name, fn in PRESETS.items())
    environment = "\n".join(f"| `{name}` | {text} |" for name, text in ENVIRONMENT.items())
    return f"""# Configuration reference

Generated from the config dataclasses by `python docs/reference/generate.py` (a test
fails when this page is out of date). Every field is a flag of its command; the text is
the field's docstring, which is also what `--help` prints.

## `eagle3fn train` (`eagle3fn.train.config.TrainConfig`)

{_table(TrainConfig)}

### Presets

`--preset NAME` gives these values to the fields whose flags are not given (a flag given
beside it wins, whatever its value; in Python, `TrainConfig.with_preset(NAME, **values)`
keeps the values given). The embedded default (no
`--model`, `--data` or `--cache`) applies `demo`. Each preset is a function in
`eagle3fn/train/config.py`.

| preset | values | what for |
|---|---|---|
{presets}

### The compiled step (`--compile-step`)

`--compile-step` runs each optimizer step (the teacher table, the k unrolled steps, the
loss, `torch.autograd.grad` of it, the gradient clip and AdamW) as one `torch.compile`
graph (`eagle3fn/train/onegraph.py`), instead of a few thousand operations issued one by
one from the host. The row map and the steps' index maths stay on the host; the row
count is a symbolic size of the graph, so a run compiles one graph per batch shape
whatever its row counts, and computes no padding rows (`DYNAMIC_ROWS` in `onegraph.py`;
off, the row counts are padded with zero-weight rows up to one of 8 sizes, multiples of
rows x `--pack-length` / 8, one static graph each); the log says when it compiles and
how long it took. The maths is the eager step's (tests/test_compiled_step.py:
equal parameters, optimizer state and metrics in fp64 on the CPU), and the optimizer
state keeps AdamW's names, so a run may resume with the flag on or off. Its backward
keeps the fused head's chunk logits instead of recomputing them (more memory than the
eager step; `REMAT` in `onegraph.py` says why). It needs packed
rows, one process and `--grad-accum 1`, and refuses anything else with the fix. Every
`--trim` mode runs in it: under `--trim backbone` (or `auto`'s choice of it, one graph
per path taken) every step's row lists and packed attention layouts are symbolic too, so
one graph serves every batch (tests: equal to the eager step in fp64, 0 recompilations
over the batches; with FlexAttention and the Triton loss at fp32 tolerance; CPU only, not
yet run on CUDA). Off by default: at 8B offline shapes on one H100 (b2b3cda) it
compiled **one graph** for the whole run (the row count changing every step, 0
recompilations) and ran a step in 206.5 ms against the eager step's 222.6 (+12% tokens/s,
GPU busy 90% against 89%), but its first step compiled for 115.5 s against 49.7 s and its
peak memory was 22.97 GiB against 19.85: it repays its compilation after about 4,000
steps, or at once from a warm compile cache
([benchmarks](../benchmarks.md#does-the-one-graph-step---compile-step-take-the-host-out)).
Its first GPU runs found three CUDA-only faults, all fixed: a second compile inside the
graph on the FlexAttention path (SmolLM2), a graph break in the diagonal merge's kernel
choice, and at 8B shapes inductor's "Unexpected fake buffer _tensor_constant0" after
those breaks ([record](../bench/train-8b-offline-compile-step-h200/logs.txt)). A resume reuses the run's
compile-cache.bin. Compare it with
`benchmarks/train.py --variants compile-step --modes loss --packs True`.

## `eagle3fn eval` (`eagle3fn.cli.run.EvalArgs`)

{_table(EvalArgs)}

## `eagle3fn export` (`eagle3fn.cli.run.ExportArgs`)

{_table(ExportArgs)}

## `eagle3fn synthesize` (`eagle3fn.cli.synth.SynthesizeArgs`)

Training data from the target itself (docs/how-to/make-training-data.md). `eagle3fn
regenerate` is `synthesize --prompts` under its old name, with its old flags.

{_table(SynthesizeArgs)}

## Environment variables

The CLI reads the first two once, at start-up, and passes their values down as
settings (`eagle3fn.cli.main.ENVIRONMENT`); no module reads the environment when it is
imported.

| variable | effect |
|---|---|
{environment}
"""


if __name__ == "__main__":
    PAGE.write_text(render())
    print(f"wrote {PAGE}")

"""Recording metrics: rows appended to ``metrics.jsonl``, optionally TensorBoard scalars.

A row is one JSON object per line. Training rows: ``step``, ``lr``, ``loss``,
``grad_norm``, per-step lists ``kl``/``acc``/``accept``, ``tau``, ``tokens_per_s`` (=
``tokens / elapsed_s``: the real tokens trained on by this process so far, all ranks,
over the seconds since its loop started, warm-up included; a resumed run starts both
again), ``input_wait_s`` (the step's wait on its batches), ``nonfinite_skipped``.
Held-out rows add ``"split": "eval"`` and carry ``step``, ``loss``, ``kl``, ``acc``,
``accept``, ``tau``. Rows without ``split`` are training rows.
"""

from __future__ import annotations

import json
import os
from pathlib import Path


def metrics_lines(path: str | os.PathLike) -> list[str]:
    """The complete lines of a metrics.jsonl (none if it does not exist). The text after
    the last newline is left out: it is empty, or a row cut short by a killed run."""
    path = Path(path)
    if not path.exists():
        return []
    return [line for line in path.read_text().split("\n")[:-1] if line.strip()]


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """The rows of a metrics.jsonl (``metrics_lines``, parsed)."""
    return [json.loads(line) for line in metrics_lines(path)]


class MetricsLog:
    """Appends rows to ``out_dir/metrics.jsonl`` and, with ``tensorboard``, writes each
    number of a row as a scalar ``{split}/{key}`` (lists as ``{key}_{j}``) to ``out_dir/tb``.

    ``resume_step``: the step of the checkpoint the run continues from; rows after it
    (written by a run that was stopped later) are dropped from the file and hidden from
    TensorBoard, so the rewritten steps appear once.
    """

    def __init__(self, out_dir: str | os.PathLike, *, resume_step: int, tensorboard: bool) -> None:
        self.path = Path(out_dir) / "metrics.jsonl"
        kept = [line for line in metrics_lines(self.path) if json.loads(line)["step"] <= resume_step]
        self.path.write_text("".join(line + "\n" for line in kept))
        self.writer = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(Path(out_dir) / "tb"),
                                        purge_step=resume_step + 1 if resume_step else None)

    def write(self, row: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        if self.writer is None:
            return
        split = row.get("split", "train")
        for key, value in row.items():
            if key in ("split", "step"):
                continue
            named = ([(f"{key}_{j}", v) for j, v in enumerate(value)] if isinstance(value, list)
                     else [(key, value)])
            for name, v in named:
                self.writer.add_scalar(f"{split}/{name}", v, row["step"])
        self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()

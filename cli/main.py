"""``eagle3fn`` subcommands. Each one parses a typed config with tyro and calls the
library; formatting of tables is the only thing done here."""

from __future__ import annotations

import functools
import os
import sys
from dataclasses import dataclass, field
from typing import Literal, Mapping

import torch
import tyro

import eagle3fn
from eagle3fn.cli import data, demo, run, synth
from eagle3fn.errors import Eagle3fnError
from eagle3fn.io.stop import Stopped
from eagle3fn.check import compare_ttt, compare_with_reference, random_case
from eagle3fn.loss import LossConfig
from eagle3fn.parallel import leave_distributed
from eagle3fn.plan import PlanArgs, plan
from eagle3fn.rowmap import build_rowmap
from eagle3fn.train.config import TrainConfig, given_fields


@dataclass(kw_only=True)
class RowmapArgs:
    """Print the row map of a mask: which rows each TTT step computes (SPEC 6)."""

    mask: tuple[str, ...] = ("0001101110",)
    """Supervised positions per sample as 0/1 strings of equal length, e.g.
    ``--mask 0001101110 0110000111`` for a batch of two."""
    ttt_length: int = 3
    """k, the number of TTT steps."""
    num_rows: int | None = None
    """C, own rows per sample (default: the mask length). Positions >= C are a
    sequence-parallel tail: they teach but never emit rows."""

    def __post_init__(self) -> None:
        bad = [m for m in self.mask if set(m) - {"0", "1"} or len(m) != len(self.mask[0])]
        if not self.mask or bad:
            raise ValueError(
                f"--mask takes 0/1 strings of one length, got {list(self.mask)}; "
                "e.g. --mask 0001101110"
            )


@dataclass(kw_only=True)
class VerifyArgs:
    """Check trimming on random batches: the trimmed loss end against the dense
    full-length oracle, and the whole TTT (a small random draft) with trim="loss"
    against trim="none": every per-step loss, metric and gradient, and the rows saved."""

    batch: int = 4
    """B, samples per batch (right-padded to random lengths)."""
    seq_len: int = 256
    """S, padded sequence length."""
    vocab: int = 2048
    """V, target vocab size."""
    draft_vocab: int = 512
    """Vd, draft vocab size."""
    ttt_length: int = 7
    """k, TTT steps."""
    density: float = 0.3
    """Fraction of positions in the chat loss mask."""
    pattern: Literal["tail", "scattered"] = "tail"
    """Where the supervision sits: a contiguous tail (prompt-heavy chat) or scattered."""
    seeds: int = 3
    """Number of random batches."""
    dtype: Literal["float64", "float32"] = "float64"
    """Precision of logits; fp64 is held to 1e-10, fp32 to SPEC section 8."""
    loss: LossConfig = field(default_factory=LossConfig)
    """The objective to check."""

    def __post_init__(self) -> None:
        for flag, value in (("--batch", self.batch), ("--seeds", self.seeds),
                            ("--ttt-length", self.ttt_length), ("--vocab", self.vocab)):
            if value < 1:
                raise ValueError(f"{flag} {value} must be >= 1; e.g. {flag} 2")
        if self.seq_len < 2:
            raise ValueError(f"--seq-len {self.seq_len} must be >= 2 (a supervised position needs "
                             "a next token); e.g. --seq-len 64")
        if not 0 < self.density <= 1:
            raise ValueError(f"--density {self.density} must be in (0, 1] (the fraction of "
                             "positions supervised); e.g. --density 0.3")
        if not 1 <= self.draft_vocab <= self.vocab:
            raise ValueError(f"--draft-vocab {self.draft_vocab} must be in 1..{self.vocab} (at most "
                             f"--vocab); e.g. --draft-vocab {max(1, self.vocab // 4)}")


def rowmap(args: RowmapArgs) -> None:
    mask = torch.tensor([[c == "1" for c in m] for m in args.mask])
    rm = build_rowmap(mask, args.ttt_length, num_rows=args.num_rows)
    print(f"B={rm.batch_size} T={rm.buffer_len} C={rm.num_rows} k={rm.ttt_length} "
          f"denominator={rm.denominator}")
    print(f"teacher positions U = {rm.teacher_positions.tolist()}")
    print(f"{'step':>4}  {'rows_j':<28} {'table_rows_j':<28} backbone_rows_j")
    for j in range(rm.ttt_length):
        backbone = "all" if j == 0 else str(rm.backbone_rows[j].tolist())
        dead = "  (dead)" if rm.dead_steps[j] else ""
        print(f"{j:>4}  {str(rm.rows[j].tolist()):<28} {str(rm.table_rows[j].tolist()):<28} "
              f"{backbone}{dead}")


def verify(args: VerifyArgs) -> None:
    import math

    from eagle3fn.errors import RunError

    dtype = getattr(torch, args.dtype)
    tol_loss, tol_grad = (1e-10, 1e-10) if dtype == torch.float64 else (1e-6, 1e-5)
    print(f"trimmed vs full length, {args.dtype}, B={args.batch} S={args.seq_len} V={args.vocab} "
          f"Vd={args.draft_vocab} k={args.ttt_length} {args.density:.0%} {args.pattern}, "
          f"objective={args.loss.objective} normalization={args.loss.normalization}")
    worst = 0.0
    print(f"{'seed':>4} {'check':>34} {'max rel err (loss/metrics)':>27} {'grad rel err':>13} "
          f"{'rows computed':>14}")
    for seed in range(args.seeds):
        case = random_case(batch=args.batch, seq_len=args.seq_len, vocab=args.vocab,
                           draft_vocab=args.draft_vocab, ttt_length=args.ttt_length,
                           density=args.density, seed=seed, dtype=dtype, pattern=args.pattern)
        loss_end = compare_with_reference(case, args.loss)
        rows_trimmed, rows_full = loss_end.pop("rows_trimmed"), loss_end.pop("rows_full")
        if rows_trimmed == 0:
            raise RunError(f"seed {seed} compared 0 rows: no position of its batch is supervised "
                           f"at --density {args.density} --seq-len {args.seq_len} --pattern "
                           f"{args.pattern}; raise --density or --seq-len")
        checks = [("loss end vs dense oracle", loss_end),
                  ("TTT trim=loss vs trim=none", compare_ttt(case, args.loss, seed=seed))]
        for name, err in checks:
            grad = err.pop("grad")
            # NaN compares false with everything, so max() could drop it and PASS
            loss = math.nan if any(map(math.isnan, err.values())) else max(err.values())
            ratios = (loss / tol_loss, grad / tol_grad)
            worst = max(worst, *ratios) if all(map(math.isfinite, ratios)) else math.inf
            print(f"{seed:>4} {name:>34} {loss:>27.2e} {grad:>13.2e} "
                  f"{rows_trimmed / rows_full:>13.1%}")
    verdict = "PASS" if worst <= 1 else "FAIL"
    print(f"{verdict}: worst error is {worst:.2g}x the tolerance "
          f"(loss/metrics {tol_loss:g}, gradients {tol_grad:g})")
    if worst > 1:
        sys.exit(1)


@dataclass(kw_only=True)
class VersionArgs:
    """Print the installed eagle3fn version."""


def version(args: VersionArgs) -> None:
    """Print pyproject.toml's version as installed (``eagle3fn.__version__``, read from the
    package metadata); ``eagle3fn --version`` prints the same."""
    print(eagle3fn.__version__)


def train(args: TrainConfig) -> None:
    from eagle3fn.train.loop import train as run_training

    args.refuse_ignored_flags()
    run_training(args)
    if args.embedded_default:  # the demo ends with a real speculative-decoding check
        # KV-cached decoding makes both drafts cheap enough for the same 64 tokens.
        demo.demo_report(args.out_dir, num_prompts=4, max_new_tokens=64, untrained_new_tokens=64)


COMMANDS = {"train": (TrainConfig, train), "rowmap": (RowmapArgs, rowmap), "verify": (VerifyArgs, verify),
            "vocab": (data.VocabArgs, data.vocab), "prepare": (data.PrepareArgs, data.prepare),
            "cache": (data.CacheArgs, data.cache),
            "synthesize": (synth.SynthesizeArgs, synth.synthesize),
            "regenerate": (data.RegenerateArgs, data.regenerate),
            "export": (run.ExportArgs, run.export), "eval": (run.EvalArgs, run.evaluate),
            "plan": (PlanArgs, plan),
            "version": (VersionArgs, version)}


ENVIRONMENT = {
    "EAGLE3FN_DEBUG": "``1``: a failed command shows its traceback (as ``--debug`` does).",
    "EAGLE3FN_COMPILE": "``0``: the draft's elementwise chains and the diagonal merge run eagerly: "
                        "``train`` runs with ``--ttt.no-compile-elementwise`` whatever the flag says, "
                        "``plan`` plans the eager chains.",
    "EAGLE3FN_CACHE": "Where the embedded default's converted SmolLM2 model is kept (default "
                      "``~/.cache/eagle3fn``; read by ``io.smollm2.cache_dir`` when it converts).",
}
"""The environment variables eagle3fn reads. The CLI reads ``EAGLE3FN_DEBUG`` and
``EAGLE3FN_COMPILE`` once, at start-up (``settings_from_environment``), and passes the
values down; no module reads the environment at import. docs/reference/config.md lists
them."""


@dataclass(frozen=True)
class EnvironmentSettings:
    """What ``ENVIRONMENT`` sets for one command line."""

    debug: bool = False
    """Show the traceback of a failed command."""
    compile_elementwise: bool = True
    """False under ``EAGLE3FN_COMPILE=0``: ``TTTConfig.compile_elementwise`` off."""


def settings_from_environment(environ: Mapping[str, str] | None = None) -> EnvironmentSettings:
    """``ENVIRONMENT`` read from ``environ`` (default: the process environment)."""
    environ = os.environ if environ is None else environ
    return EnvironmentSettings(debug=environ.get("EAGLE3FN_DEBUG", "0") not in ("", "0"),
                               compile_elementwise=environ.get("EAGLE3FN_COMPILE", "1") != "0")


def with_settings(args, settings: EnvironmentSettings):
    """``(args, run)``: the parsed config of one command with the environment's settings
    applied, and the function that runs it."""
    run_command = next(fn for config, fn in COMMANDS.values() if isinstance(args, config))
    if isinstance(args, TrainConfig):
        args.ttt.compile_elementwise = args.ttt.compile_elementwise and settings.compile_elementwise
    elif isinstance(args, PlanArgs):
        run_command = functools.partial(plan, compile_elementwise=settings.compile_elementwise)
    return args, run_command


# Errors shown as one line (no traceback): ours, and the standard ones our validation
# raises or that name a path the user gave (a full disk, a missing or unreadable file).
_USER_ERRORS = (Eagle3fnError, ValueError, OSError)


def _exit_code(error: BaseException) -> int:
    """2 for usage errors (bad flags, paths, inputs), 1 for faults found while running."""
    if isinstance(error, Eagle3fnError):
        return error.exit_code
    return 2 if isinstance(error, (ValueError, FileNotFoundError, NotADirectoryError)) else 1


def flag_fields(argv: list[str]) -> set[str]:
    """The config field names the flags of ``argv`` set: ``--max-length 512`` and
    ``--max_length=512`` -> ``max_length``, ``--no-pack`` -> ``pack`` (and ``no_pack``,
    harmless where no field has that name)."""
    names = set()
    for token in argv:
        if token.startswith("--"):
            name = token[2:].split("=", 1)[0].replace("-", "_")
            names.update((name, name.removeprefix("no_")))
    return names


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``eagle3fn`` console command.

    Errors after argument parsing print ``eagle3fn: error: <message>`` (one line) and
    exit 2 (usage) or 1 (runtime); ``--debug`` anywhere on the command line, or
    ``EAGLE3FN_DEBUG=1``, shows the traceback instead (``ENVIRONMENT``: what the
    environment switches, read here once). Parse-time errors (a bad flag
    value, a failed config check) are drawn by tyro and exit 2. A command stopped by
    SIGTERM / SIGINT after saving its work (``io.stop.Stopped``) prints ``stopped by
    SIGTERM at ...; rerun the same command to resume`` and exits 143 / 130.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    settings = settings_from_environment()
    debug = "--debug" in argv or settings.debug
    argv = [a for a in argv if a != "--debug"]
    if argv[:1] == ["--version"]:
        return version(VersionArgs())
    with given_fields(flag_fields(argv[1:])):  # explicit flags win over a --preset's values
        args = tyro.extras.subcommand_cli_from_dict(
            {name: config for name, (config, _) in COMMANDS.items()},
            prog="eagle3fn",
            description="EAGLE-3 draft training that computes only what is supervised "
                        "(eagle3fn --version prints the version).",
            args=argv,
        )
    args, command = with_settings(args, settings)
    try:
        try:
            command(args)
        finally:
            leave_distributed()  # the process group a train run joined, torchrun's or its own
    except Stopped as stopped:  # SIGTERM / SIGINT after a save: not an error, 128 + the signal
        print(stopped, file=sys.stderr)
        sys.exit(stopped.exit_code)
    except _USER_ERRORS as error:
        if debug:
            raise
        message = " ".join(str(error).split()) or type(error).__name__
        print(f"eagle3fn: error: {message} (rerun with --debug for the traceback)", file=sys.stderr)
        sys.exit(_exit_code(error))

"""Data subcommands: ``vocab``, ``prepare``, ``cache verify`` / ``cache info``, ``regenerate`` (typed configs +
library calls)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Literal

import torch
import tyro

from eagle3fn.errors import RunError, UsageError
from eagle3fn.io.device import default_dtype, resolve_device
from eagle3fn.io.paths import claim_dir
from eagle3fn.io.stop import graceful_stop
from eagle3fn.io.regenerate import GenerationConfig


@dataclass(kw_only=True)
class ModelSource:
    """A local HF model (or tokenizer) directory."""

    path: str
    """Directory with config.json / tokenizer files (no hub downloads)."""
    gguf_file: str | None = None
    """A GGUF file inside ``path`` to load from (e.g. SmolLM2-135M-Instruct.Q4_1.gguf)."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Weights dtype of the target (auto: bfloat16 on CUDA, float32 on the CPU)."""
    device: str = "auto"
    """Device to run the target on (auto: cuda when a GPU is visible, else cpu)."""

    def kwargs(self) -> dict:
        return {"gguf_file": self.gguf_file} if self.gguf_file else {}

    def torch_device(self) -> torch.device:
        """``device`` resolved (UsageError for cuda without a GPU)."""
        return resolve_device(self.device)

    def torch_dtype(self, device: torch.device) -> torch.dtype:
        """``dtype`` resolved for ``device``."""
        return default_dtype(device) if self.dtype == "auto" else getattr(torch, self.dtype)


@dataclass(kw_only=True)
class DataSource:
    """Chat data in JSONL (ShareGPT ``conversations`` or OpenAI ``messages`` lines)."""

    path: str
    """The JSONL file."""
    max_length: int = 2048
    """Tokens per conversation after the chat template (longer ones are cut)."""
    on_error: Literal["raise", "skip"] = "raise"
    """Bad lines: stop with file:line, or skip them and print the count."""


def _tokenizer(source: ModelSource):
    from transformers import AutoTokenizer

    from eagle3fn.io.model_dir import check_model_dir

    check_model_dir(source.path, source.gguf_file, weights=False, tokenizer=True)
    return AutoTokenizer.from_pretrained(source.path, **source.kwargs())


def _check_inputs(model: ModelSource, data: DataSource, *, weights: bool) -> None:
    """The model directory (config, tokenizer, weights when they will be loaded) and the
    data file, checked before anything loads."""
    from eagle3fn.io.data import check_data_file
    from eagle3fn.io.model_dir import check_model_dir

    check_model_dir(model.path, model.gguf_file, weights=weights, tokenizer=True)
    check_data_file(data.path)


@dataclass(kw_only=True)
class VocabArgs:
    """Build the draft vocab map (d2t / t2d, SPEC 2) from the supervised tokens of chat data."""

    model: ModelSource
    """Tokenizer (and config, for the target vocab size) directory."""
    data: DataSource
    """Chat data."""
    draft_vocab_size: int = 32000
    """Vd, the draft head's vocab."""
    vocab_size: int | None = None
    """V, the target's lm_head rows (default: the model config's vocab_size)."""
    out: str = "vocab.safetensors"
    """Where to write d2t / t2d (a file path)."""
    overwrite: bool = False
    """Replace --out even when it is not a vocab map (an existing map is replaced
    without it)."""


def _is_vocab_map(path) -> bool:
    from eagle3fn.io.vocab_io import load_vocab_map

    try:
        load_vocab_map(path)
    except (ValueError, OSError):
        return False
    return True


def vocab(args: VocabArgs) -> None:
    from transformers import AutoConfig

    from eagle3fn.io.data import tokenize_file
    from eagle3fn.io.vocab_io import save_vocab_map, vocab_map_from_examples

    from eagle3fn.io.paths import claim_file

    _check_inputs(args.model, args.data, weights=False)
    claim_file(args.out, "eagle3fn vocab", overwrite=args.overwrite, ours=_is_vocab_map,
               example="vocab.safetensors")
    tok = _tokenizer(args.model)
    V = args.vocab_size or AutoConfig.from_pretrained(args.model.path, **args.model.kwargs()).vocab_size
    examples = tokenize_file(args.data.path, tok, max_length=args.data.max_length,
                             on_error=args.data.on_error)
    d2t, t2d = vocab_map_from_examples(examples, V, args.draft_vocab_size)
    save_vocab_map(args.out, d2t, t2d)
    print(f"wrote {args.out}: {args.draft_vocab_size} of {V} target ids from {len(examples)} conversations")


@dataclass(kw_only=True)
class PrepareArgs:
    """Run the target once over chat data and write the offline feature cache
    (resumable: rerun the same command to finish an interrupted run)."""

    model: ModelSource
    """The target."""
    data: DataSource
    """Chat data."""
    out: str
    """Cache directory."""
    batch_size: int = 4
    """Conversations per shard."""
    aux_layer_ids: tuple[int, int, int] | None = None
    """Output-of-layer ids captured (default [1, N//2-1, N-4])."""
    storage: Literal["auto", "bfloat16", "float32"] = "auto"
    """dtype of the cached aux features, final hidden and head (auto: bfloat16 when the
    target runs on CUDA, float32 on the CPU)."""
    aux_dtype: Literal["storage", "float8_e4m3"] = "storage"
    """dtype of the cached aux features: as --storage, or float8_e4m3 with one fp32 scale
    per token and aux layer (about half the bytes of bfloat16; lossy, see docs/reference/what-the-cache-stores.md)."""
    compile_target: bool = True
    """On CUDA: compile the target's decoder layers with torch.compile to fuse their
    elementwise work (one graph for all of them, one extra compilation at the first
    shard; docs/explanation/what-each-stage-computes.md). The cache differs only by rounding and keeps its
    fingerprint (a cache may be resumed with either). The CPU runs eagerly."""
    overwrite: bool = False
    """Write the cache into --out even when it is a non-empty directory that holds no
    cache (it is refused otherwise); files of the same names are replaced, others are
    left. A cache of other settings there is refused either way."""

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise UsageError(f"--batch-size {self.batch_size}: a shard holds at least one "
                             "conversation; pass --batch-size 1 or more")


def prepare(args: PrepareArgs) -> None:
    """Check paths, that ``--out`` is new, empty or a cache, and a cache already there
    (by content fingerprint) before the target is loaded, then write or resume the
    cache. SIGTERM / SIGINT finish the shard in flight and stop (``io.stop.Stopped``);
    rerunning the command resumes."""
    from eagle3fn.io.cache import MANIFEST, check_resumable, prepare as write
    from eagle3fn.io.data import tokenize_file
    from eagle3fn.io.fingerprint import file_fingerprint, target_fingerprint
    from eagle3fn.io.target import compile_decoder_layers, load_target

    device = args.model.torch_device()
    dtype = args.model.torch_dtype(device)
    storage = default_dtype(device) if args.storage == "auto" else getattr(torch, args.storage)
    _check_inputs(args.model, args.data, weights=True)
    fingerprint = {"target": target_fingerprint(args.model.path, args.model.gguf_file),
                   "target_dtype": str(dtype).removeprefix("torch."),
                   "data": file_fingerprint(args.data.path), "max_length": args.data.max_length,
                   "on_error": args.data.on_error}
    given = {"batch_size": args.batch_size, "dtype": str(storage).removeprefix("torch."),
             "aux_dtype": args.aux_dtype}
    if args.aux_layer_ids is not None:
        given["aux_layer_ids"] = list(args.aux_layer_ids)
    claim_dir(args.out, "eagle3fn prepare", overwrite=args.overwrite, flag="--out", own_files=(MANIFEST,),
              mark=False, create=False)
    check_resumable(args.out, fingerprint | given)
    with graceful_stop(unit="shard") as stop:
        tok = _tokenizer(args.model)
        target = load_target(args.model.path, aux_layer_ids=args.aux_layer_ids, dtype=dtype, device=device,
                             **args.model.kwargs())
        if args.compile_target:
            target = compile_decoder_layers(target)
        examples = tokenize_file(args.data.path, tok, max_length=args.data.max_length,
                                 on_error=args.data.on_error)
        write(target, examples, args.out, batch_size=args.batch_size, pad_token_id=tok.pad_token_id or 0,
              fingerprint=fingerprint, dtype=storage, aux_dtype=args.aux_dtype, log=_stopping_log(stop))


def _stopping_log(stop):
    """``print``, and after a stop request ``Stopped`` at the line that reports a shard
    written (``write_cache`` logs it once the shard and the manifest listing it are on
    disk) or the estimate (the first line, before any shard), so the shard in flight
    finishes and nothing half-written is left; a rerun resumes after the last shard."""
    done = [0]

    def log(line: str) -> None:
        print(line)
        if line.startswith("wrote shard"):
            done[0] += 1
        if stop.requested and (line.startswith("wrote shard") or " shards, " in line and "estimated" in line):
            raise stop.stopped(f"{line.split()[1] if line.startswith('wrote') else 'the start'} "
                               f"({done[0]} shards written by this run)")
    return log


@dataclass(kw_only=True)
class CacheArgs:
    """Inspect an offline feature cache. ``eagle3fn cache verify DIR`` checks the
    manifest's digest (an edited manifest is broken), reads every shard (exists, size
    and sha256 as the manifest says, loads, dtypes and widths as the manifest says,
    consistent index, finite features), lists shard files the manifest does not list,
    prints a table and a summary, and exits 1 if any file is broken or the cache is
    unfinished. ``eagle3fn cache info DIR`` prints what the cache holds from its
    manifest (conversations, real and supervised tokens, bytes per real token by
    component, dtypes, fingerprints) without reading the shards."""

    action: tyro.conf.Positional[Literal["verify", "info"]]
    """verify: check every file of the cache; info: summarise it from the manifest."""
    dir: tyro.conf.Positional[Annotated[str, tyro.conf.arg(metavar="DIR")]]
    """The cache directory (the one eagle3fn prepare wrote)."""


def cache(args: CacheArgs) -> None:
    if args.action == "info":
        return _info(args.dir)
    from eagle3fn.io.cache import verify_cache
    from eagle3fn.io.fingerprint import short

    report = verify_cache(args.dir)
    m, fp = report.manifest, report.manifest["fingerprint"]
    print(f"feature cache {args.dir} (format {m['format']}, {'complete' if m['complete'] else 'UNFINISHED'})")
    print(f"{'file':<26} {'convs':>6} {'tokens':>9} {'bytes':>13}  status")
    for f in report.files:
        convs, tokens = (f.conversations, f.tokens) if f.name.startswith("shard") else ("-", "-")
        print(f"{f.name:<26} {convs:>6} {tokens:>9} {f.bytes:>13}  "
              f"{'BROKEN: ' + f.problem if f.problem else 'ok'}")
    shards = [f for f in report.files if f.name.startswith("shard")]
    bad = sum(1 for f in shards if f.problem)
    print(f"shards: {len(shards) - bad} ok, {bad} broken; conversations "
          f"{sum(f.conversations for f in shards)}; tokens {sum(f.tokens for f in shards)}; "
          f"dtype {m['dtype']}; aux layer ids {fp.get('aux_layer_ids')}")
    data = fp.get("data") or {}
    print(f"target {short(fp['target']) if 'target' in fp else '-'}; data "
          f"{data.get('sha256', '-')[:12]} ({data.get('bytes', '-')} bytes); max length "
          f"{fp.get('max_length')}, on_error {fp.get('on_error')}, batch size {fp.get('batch_size')}, "
          f"target dtype {fp.get('target_dtype')}")
    fix = f"rerun eagle3fn prepare with the same settings and --out {args.dir} to rewrite them"
    if report.broken:
        raise RunError(f"{len(report.broken)} of {len(report.files)} files of the feature cache "
                       f"{args.dir} are broken ({', '.join(f.name for f in report.broken)}); {fix}")
    if not m["complete"]:
        raise RunError(f"the feature cache {args.dir} is unfinished ({len(shards)} shards); rerun "
                       f"eagle3fn prepare with the same settings and --out {args.dir} to finish it")
    print("OK")


def _info(path: str) -> None:
    from eagle3fn.io.cache import cache_info
    from eagle3fn.io.fingerprint import short

    i = cache_info(path)
    fp = i["fingerprint"]
    print(f"feature cache {path} (format {fp['format']}, {'complete' if i['complete'] else 'UNFINISHED'}): "
          f"{i['shards']} shards")
    print(f"conversations {i['conversations']}; real tokens {i['tokens']}; supervised tokens "
          f"{i['supervised']} ({100 * i['supervised'] / max(i['tokens'], 1):.1f}%); teacher rows "
          f"{i['teacher_rows']}; padded tokens (format 2) {i['padded_tokens']}")
    per = i["per_token"]
    print(f"bytes {i['bytes']} ({i['bytes'] / 2**30:.3f} GiB); per real token {sum(per.values()):.1f}: "
          + ", ".join(f"{k} {v:.1f}" for k, v in per.items()))
    print(f"storage dtype {i['dtype']}; aux dtype {i['aux_dtype']}; hidden size {i['hidden_size']}; "
          f"vocab {i['vocab_size']}; aux layer ids {fp.get('aux_layer_ids')}")
    data = fp.get("data") or {}
    print(f"fingerprint {short(fp)}; target {short(fp['target']) if 'target' in fp else '-'}; data "
          f"{data.get('sha256', '-')[:12]} ({data.get('bytes', '-')} bytes); max length {fp.get('max_length')}, "
          f"batch size {fp.get('batch_size')}, target dtype {fp.get('target_dtype')}")


@dataclass(kw_only=True)
class RegenerateArgs:
    """Rewrite every assistant turn of chat data with the target (prompts kept), JSONL out:
    eagle3fn synthesize with given prompts, under its old name (resumable: rerun the same command)."""

    model: ModelSource
    """The target."""
    data: DataSource
    """Chat data."""
    out: str
    """Output JSONL (OpenAI ``messages`` form)."""
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    """Decoding settings."""


def regenerate(args: RegenerateArgs) -> None:
    """``eagle3fn synthesize --prompts`` under its old name (cli/synth.py): resumable, with
    the filter report; every answer kept."""
    from eagle3fn.cli.synth import regenerate as run

    run(args)

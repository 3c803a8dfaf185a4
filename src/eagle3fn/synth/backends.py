"""What writes the turns: one small interface, three implementations.

A backend is a callable ``backend(requests) -> iterator of (k, Completion)``: it takes a
list of ``Request`` (token-id prompts with their decoding settings) and yields the k-th
request's completion as soon as it is done, in any order, each exactly once.

- ``EngineBackend``: eagle3fn's batched static-cache generator (``eagle3fn.decoding``),
  continuous refill; the local path.
- ``GenerateBackend``: transformers' ``model.generate`` on left-padded batches (greedy),
  one request at a time when sampling (its seed then holds); the oracle in tests.
- ``eagle3fn.synth.server.ServerBackend``: an OpenAI-compatible HTTP server.

Completions are text: the new tokens up to (not including) the first stop token, decoded
with special tokens skipped and stripped of surrounding whitespace, as a chat message
holds them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence

import torch


@dataclasses.dataclass(frozen=True)
class Request:
    """One generation: continue ``prompt_ids`` for at most ``max_new_tokens`` tokens,
    stopping after any of ``stop_ids``; greedy when ``temperature`` is 0, else sampled
    at ``temperature`` with nucleus ``top_p`` from a generator seeded with ``seed``."""

    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    stop_ids: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class Completion:
    """A request's result: ``text`` (decoded, stripped), ``finished`` (True when a stop
    token ended it, False when ``max_new_tokens`` did) and ``new_tokens`` (tokens
    generated, the stop token included)."""

    text: str
    finished: bool
    new_tokens: int


Backend = Callable[[Sequence[Request]], Iterator[tuple[int, Completion]]]


def completion_from_ids(tokenizer, new_ids: Sequence[int], stop_ids: Sequence[int]) -> Completion:
    """The ``Completion`` of generated ids ``new_ids`` (anything after the first stop
    token, e.g. padding of a finished row, is ignored)."""
    ids = list(new_ids)
    stops = set(stop_ids)
    end = next((i for i, t in enumerate(ids) if t in stops), None)
    kept = ids if end is None else ids[:end]
    return Completion(text=tokenizer.decode(kept, skip_special_tokens=True).strip(),
                      finished=end is not None, new_tokens=len(ids) if end is None else end + 1)


class GenerateBackend:
    """``model.generate`` from transformers: greedy requests in left-padded batches of
    ``batch_size`` (dynamic cache; a batch waits for its longest row), sampled requests
    one at a time after ``torch.manual_seed(seed)``."""

    def __init__(self, model, tokenizer, *, batch_size: int = 8) -> None:
        self.model, self.tokenizer, self.batch_size = model, tokenizer, batch_size
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    @torch.no_grad()
    def _run(self, requests: Sequence[Request]) -> list[Completion]:
        r0 = requests[0]
        width = max(len(r.prompt_ids) for r in requests)
        ids = torch.full((len(requests), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for b, r in enumerate(requests):
            ids[b, width - len(r.prompt_ids):] = torch.tensor(r.prompt_ids)
            mask[b, width - len(r.prompt_ids):] = 1
        sample = r0.temperature > 0
        if sample:
            torch.manual_seed(r0.seed)
        dev = self.model.device
        out = self.model.generate(input_ids=ids.to(dev), attention_mask=mask.to(dev),
                                  max_new_tokens=r0.max_new_tokens, do_sample=sample,
                                  temperature=r0.temperature if sample else None,
                                  top_p=r0.top_p if sample else None, top_k=None if sample else None,
                                  eos_token_id=list(r0.stop_ids) or None, pad_token_id=self.pad_id)
        return [completion_from_ids(self.tokenizer, row[width:].tolist(), r0.stop_ids) for row in out]

    def __call__(self, requests: Sequence[Request]) -> Iterator[tuple[int, Completion]]:
        groups: dict[tuple, list[int]] = {}
        for k, r in enumerate(requests):
            key = (r.max_new_tokens, r.stop_ids) if r.temperature == 0 else ("sampled", k)
            groups.setdefault(key, []).append(k)
        for ks in groups.values():
            for start in range(0, len(ks), self.batch_size):
                chunk = ks[start:start + self.batch_size]
                yield from zip(chunk, self._run([requests[k] for k in chunk]))


class EngineBackend:
    """eagle3fn's batched static-cache generator (``eagle3fn.decoding.generate``):
    ``batch_size`` slots with continuous refill, CUDA graphs on the GPU (``compile``: the
    CPU's step compiled). Requests that
    share (temperature, top_p, stop ids) are decoded in one ``generate`` call with
    per-request token limits and seeds."""

    def __init__(self, model, tokenizer, *, batch_size: int = 64, compile: bool = False) -> None:
        self.model, self.tokenizer, self.batch_size, self.compile = model, tokenizer, batch_size, compile

    def __call__(self, requests: Sequence[Request]) -> Iterator[tuple[int, Completion]]:
        from eagle3fn.decoding import GenerateConfig, generate

        groups: dict[tuple, list[int]] = {}
        for k, r in enumerate(requests):
            groups.setdefault((r.temperature, r.top_p, r.stop_ids), []).append(k)
        for (temperature, top_p, stop_ids), ks in groups.items():
            cfg = GenerateConfig(batch_size=self.batch_size, temperature=temperature, top_p=top_p,
                                 eos_token_ids=stop_ids, compile=self.compile)
            for done in generate(self.model, [requests[k].prompt_ids for k in ks], cfg,
                                 max_new_tokens=[requests[k].max_new_tokens for k in ks],
                                 seeds=[requests[k].seed for k in ks]):
                yield ks[done.index], completion_from_ids(self.tokenizer, done.tokens, stop_ids)

"""The synthesis loop: conversations in chunks, turn by turn, filtered, written in order.

Conversation i (``i = 0, 1, ...``) is a function of the settings, its index and the
target alone: its system prompt is chosen by i, each request's seed is
``request_seed(seed, i, step)``, and it is judged against the earlier conversations only.
So a run may be cut anywhere and resumed, and its file equals an uninterrupted run's
(for greedy decoding, and for sampling on a backend whose draws follow the seed).

A chunk of ``commit_every`` conversations (fewer near the end) advances in rounds, one request per live
conversation each: synthesized conversations alternate user turns (Magpie: the
template's text up to a user turn, sampled to its end-of-turn token) and answers;
given prompts (``--prompts``) have every assistant turn rewritten, each conditioned on
the rewritten turns before it. After a chunk's last round its conversations are written
in index order (kept to ``out``, dropped with their reason to ``out.rejected.jsonl``)
until ``num_conversations`` are kept.
"""

from __future__ import annotations

import hashlib
import math
import sys
import time
from dataclasses import dataclass
from typing import Callable, Sequence

from eagle3fn.errors import RunError
from eagle3fn.io.stop import graceful_stop
from eagle3fn.synth.backends import Backend, Completion, Request
from eagle3fn.synth.config import DEFAULT_CONVERSATIONS, SynthConfig
from eagle3fn.synth.filters import PromptFilter, turn_reason
from eagle3fn.synth.report import build_report
from eagle3fn.synth.store import open_store
from eagle3fn.synth.template import answer_prompt, topic_system_prompt, user_turn_prefix

ATTEMPTS_PER_CONVERSATION = 4
"""Synthesis stops after trying this many conversations per one asked for (plus one
chunk), when the filters drop nearly everything (the report says so)."""


def request_seed(seed: int, index: int, step: int) -> int:
    """The seed of conversation ``index``'s request ``step`` (a 56-bit integer)."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{index}:{step}".encode()).digest()[:7], "big")


@dataclass
class Conv:
    """A conversation being made: its messages so far, the message positions of the
    answers to write (given prompts) or None (synthesized), and why it was dropped."""

    index: int
    messages: list[dict]
    tools: tuple | None = None
    slots: list[int] | None = None
    reason: str | None = None
    truncated: bool = False

    def steps(self, turns: int) -> int:
        return 2 * turns if self.slots is None else len(self.slots)


@dataclass(frozen=True)
class GivenPrompt:
    """A conversation of ``--prompts``: its messages and tools; every assistant turn is
    rewritten, and one is appended when the last turn is not the assistant's."""

    messages: tuple[dict, ...]
    tools: tuple | None = None


def new_conv(index: int, given: Sequence[GivenPrompt] | None, systems: Sequence[str]) -> Conv:
    """Conversation ``index`` before its first request."""
    if given is not None:
        g = given[index]
        messages = [dict(m) for m in g.messages]
        if messages[-1]["role"] != "assistant":
            messages.append({"role": "assistant", "content": ""})
        slots = [k for k, m in enumerate(messages) if m["role"] == "assistant"]
        return Conv(index, messages, g.tools, slots)
    messages = [{"role": "system", "content": systems[index % len(systems)]}] if systems else []
    return Conv(index, messages)


class Synthesizer:
    """One run: ``backend`` writes the turns, ``tokenizer`` renders and counts them."""

    def __init__(self, backend: Backend, tokenizer, cfg: SynthConfig, *, stop_ids: Sequence[int],
                 commit_every: int = 256, log: Callable[[str], None] = print) -> None:
        self.backend, self.tok, self.cfg, self.stop_ids = backend, tokenizer, cfg, tuple(stop_ids)
        self.commit_every, self.log = commit_every, log
        self.tokens = 0

    def request(self, c: Conv, step: int) -> Request:
        """Conversation ``c``'s request number ``step``."""
        cfg = self.cfg
        if c.slots is None and step % 2 == 0:
            text = user_turn_prefix(self.tok, c.messages, c.tools)
            limit, temperature, top_p = cfg.max_prompt_tokens, cfg.prompt_temperature, cfg.prompt_top_p
        else:
            upto = len(c.messages) if c.slots is None else c.slots[step]
            text = answer_prompt(self.tok, c.messages[:upto], c.tools)
            limit, temperature, top_p = cfg.max_new_tokens, cfg.temperature, cfg.top_p
        ids = self.tok(text, add_special_tokens=False)["input_ids"]
        return Request(tuple(ids), limit, temperature, top_p, request_seed(cfg.seed, c.index, step),
                       self.stop_ids)

    def apply(self, c: Conv, step: int, out: Completion, prompts: PromptFilter | None) -> None:
        """Put a completion into its conversation and judge it (``c.reason``)."""
        if c.slots is None and step % 2 == 0:
            c.messages.append({"role": "user", "content": out.text})
            c.reason = turn_reason("user", out.text, out.finished)
            if c.reason is None and step == 0 and prompts is not None:
                c.reason = prompts.check(out.text)
            return
        if c.slots is None:
            c.messages.append({"role": "assistant", "content": out.text})
        else:
            c.messages[c.slots[step]]["content"] = out.text
        c.reason = turn_reason("assistant", out.text, out.finished)
        if c.reason == "truncated_answer" and self.cfg.keep_truncated:
            c.reason, c.truncated = None, True

    def run_chunk(self, convs: list[Conv], prompts: PromptFilter | None, tick: Callable[[int], None]) -> None:
        """Advance every conversation of the chunk to its end (or its drop)."""
        for step in range(max(c.steps(self.cfg.turns) for c in convs)):
            live = [c for c in convs if c.reason is None and step < c.steps(self.cfg.turns)]
            if not live:
                break
            results: list[Completion | None] = [None] * len(live)
            for k, out in self.backend([self.request(c, step) for c in live]):
                if results[k] is not None:
                    raise RunError(f"the backend answered request {k} twice")
                results[k] = out
                self.tokens += out.new_tokens
                tick(out.new_tokens)
            missing = [live[k].index for k, r in enumerate(results) if r is None]
            if missing:
                raise RunError(f"the backend returned no answer for conversations {missing[:5]}")
            for c, out in zip(live, results):  # in index order: duplicates judged as written
                self.apply(c, step, out, prompts)

    def run(self, out: str, settings: dict, *, given: Sequence[GivenPrompt] | None = None,
            systems: Sequence[str] = (), live: bool | None = None) -> dict:
        """Write (or resume) ``out``; returns the report (also written to
        ``<out>.report.json``)."""
        cfg = self.cfg
        if given is not None:
            target = len(given) if cfg.num_conversations is None else min(cfg.num_conversations, len(given))
            limit = target
        else:
            target = cfg.num_conversations or DEFAULT_CONVERSATIONS
            limit = ATTEMPTS_PER_CONVERSATION * target + self.commit_every
        store = open_store(out, settings)
        prompts = None if given is not None else PromptFilter(
            requests_only=cfg.requests_only, near_threshold=cfg.near_duplicate_threshold)
        for i in sorted(store.done):
            row = store.done[i]
            if prompts is not None and row.get("reason") in (None, "empty_answer", "truncated_answer"):
                first = next(m["content"] for m in row["messages"] if m["role"] == "user")
                prompts.remember(first)
        kept, resumed = store.kept, len(store.done)
        start = kept
        if resumed:
            self.log(f"resuming {out}: {kept} of {target} conversations kept, {resumed - kept} dropped")
        todo = (i for i in range(limit) if i not in store.done)
        bar = _bar(target, kept, live)
        t0 = time.perf_counter()

        shown = [t0]

        def tick(n: int) -> None:
            now = time.perf_counter()
            if bar is not None and now - shown[0] > 0.5:  # tokens/s between writes too
                bar.set_postfix_str(f"{self.tokens / max(now - t0, 1e-9):.0f} tok/s")
                shown[0] = now

        with graceful_stop(unit="chunk of conversations") as stop:
            try:
                kept = self._write_chunks(store, prompts, given, systems, todo, tick, bar, t0,
                                          kept=kept, start=start, target=target, stop=stop)
            finally:
                if bar is not None:
                    bar.close()
        return build_report(out, target=target, tokens=self.tokens, seconds=time.perf_counter() - t0,
                            settings=settings, given=given is not None)

    def _write_chunks(self, store, prompts, given, systems, todo, tick, bar, t0, *, kept: int, start: int,
                      target: int, stop) -> int:
        """Generate and write chunks until ``target`` conversations are kept; after each
        chunk's lines are written, a SIGTERM / SIGINT raises ``io.stop.Stopped`` (the rerun
        resumes there). Returns the conversations kept."""
        while kept < target:
            # No more than the conversations still missing, over the share kept so
            # far (a half before any is known; all for given prompts), a tenth more:
            # chunking does not change any conversation's content.
            tried = len(store.done)
            share = 1.0 if given is not None else (max(kept / tried, 0.1) if tried else 0.5)
            size = min(self.commit_every, math.ceil(1.1 * (target - kept) / share))
            chunk = [i for _, i in zip(range(size), todo)]
            if not chunk:
                break
            convs = [new_conv(i, given, systems) for i in chunk]
            self.run_chunk(convs, prompts, tick)
            for c in convs:
                if kept == target:
                    break
                if c.reason is None:
                    store.keep(c.index, c.messages, c.tools, truncated=c.truncated)
                    store.done[c.index] = {}
                    kept += 1
                else:
                    store.reject(c.index, c.reason, c.messages)
                    store.done[c.index] = {"reason": c.reason}
            if bar is not None:
                rate = self.tokens / max(time.perf_counter() - t0, 1e-9)
                bar.set_postfix_str(f"{rate:.0f} tok/s", refresh=False)
                bar.update(kept - bar.n)
            else:
                spent = time.perf_counter() - t0
                eta = spent / max(kept - start, 1) * (target - kept)
                self.log(f"{kept}/{target} conversations kept, {len(store.done)} tried, "
                         f"{self.tokens / max(spent, 1e-9):.0f} tok/s, elapsed {spent:.0f} s, ETA {eta:.0f} s")
            if stop.requested and kept < target:
                raise stop.stopped(f"{kept} of {target} conversations kept")
        return kept


def _bar(total: int, start: int, live: bool | None):
    """A tqdm bar on stderr (None when not a terminal, unless ``live``)."""
    if live is False or (live is None and not sys.stderr.isatty()):
        return None
    from tqdm import tqdm

    from eagle3fn.train.progress import BAR_FORMAT

    return tqdm(total=total, initial=start, file=sys.stderr, bar_format=BAR_FORMAT, ascii="-#",
                dynamic_ncols=True, smoothing=0.3)

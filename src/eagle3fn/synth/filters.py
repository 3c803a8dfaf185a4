"""Filters of synthesized conversations, each one reason a conversation is dropped.

Reasons, in the order they are checked (a conversation counts under its first):

    empty_prompt       a user turn with no text (after stripping whitespace)
    truncated_prompt   a user turn cut by its token limit (no end-of-turn token came)
    not_request        the first user turn is neither a question nor a request (``is_request``)
    exact_duplicate    the first user turn equals an earlier one (case and spacing ignored)
    near_duplicate     ... or is near an earlier one (``NearDuplicates``: MinHash LSH)
    empty_answer       an assistant turn with no text
    truncated_answer   an assistant turn cut by ``--max-new-tokens`` (dropped unless
                       ``--keep-truncated``)

Duplicates are judged in conversation order against every earlier first user turn that
passed the checks before them (also those whose answer was dropped later), so the
result does not depend on batching or on where a run was resumed.
"""

from __future__ import annotations

import re

REASONS = ("empty_prompt", "truncated_prompt", "not_request", "exact_duplicate", "near_duplicate",
           "empty_answer", "truncated_answer")
"""Every reason a conversation is dropped, in the order they are checked."""

# Words a question or request starts with: interrogatives, auxiliaries and modals,
# imperative verbs, and first-person openers ("I need ...", "My code ..."), which are
# kept because a statement about oneself is usually the start of a request.
_REQUEST_START = frozenset("""
what whats how why when where which who whom whose whether is are am was were do does did
can could would will should shall may might must have has had
write explain describe list give tell show help create make generate provide summarize
summarise translate compare suggest recommend find calculate compute solve define design
draft plan outline rewrite edit fix convert classify analyze analyse identify name imagine
please let consider implement prove evaluate estimate discuss brainstorm compose correct
check review improve paraphrase simplify count sort predict choose pick
i im i'm ive i've id i'd my we our
""".split())
_STARTS = frozenset(w.replace("'", "") for w in _REQUEST_START)
_REQUEST_PHRASE = re.compile(r"\b(please|help me|i need|i want|i'd like|i would like|can you|"
                             r"could you|would you|how to|how do|how can)\b")
# An assistant's voice in the user turn (a Magpie failure: the target answers instead).
_ASSISTANT_OPENER = re.compile(r"^(sure|certainly|of course|absolutely|as an ai|i'm sorry|i am sorry|"
                               r"i apologi[sz]e|(hello|hi)[!,.]? how (can|may) i (help|assist))\b")
_WORD = re.compile(r"[\w']+")


def normalize(text: str) -> str:
    """Case-folded text with runs of whitespace as one space: the exact-duplicate key."""
    return " ".join(text.casefold().split())


def is_request(text: str) -> bool:
    """Whether ``text`` reads as a question or a request (conservative: only a text that
    clearly is neither is refused).

    False when it opens in an assistant's voice ("Sure, ...", "As an AI ...", "Hello! How
    can I help"); else True when it holds a "?", when one of its sentences starts with a
    question word, auxiliary, modal, imperative verb or first-person word (``_REQUEST_START``),
    or when it holds a request phrase ("please", "can you", "how to", ...); else False
    (a bare statement, a fragment, a list of words).
    """
    t = normalize(text)
    if _ASSISTANT_OPENER.match(t):
        return False
    if "?" in t or _REQUEST_PHRASE.search(t):
        return True
    for sentence in re.split(r"(?<=[.!:;\n])\s+", t):
        words = _WORD.findall(sentence)
        if words and words[0].replace("'", "") in _STARTS:
            return True
    return False


def shingles(text: str, n: int = 3) -> set[str]:
    """Word ``n``-grams of the normalized text (the whole word list when shorter)."""
    words = _WORD.findall(normalize(text))
    if len(words) < n:
        return {" ".join(words)}
    return {" ".join(words[i:i + n]) for i in range(len(words) - n + 1)}


class NearDuplicates:
    """Near-duplicate detection over a growing set of texts: MinHash of word 3-gram
    shingles with locality-sensitive hashing (``datasketch``); a text is a near duplicate
    when an earlier one's estimated Jaccard similarity of shingles is >= ``threshold``.

    ``seen(text)`` answers without adding; ``add(text)`` indexes a text.
    """

    def __init__(self, threshold: float = 0.7, num_perm: int = 128) -> None:
        try:
            from datasketch import MinHash, MinHashLSH
        except ImportError:
            raise ImportError("near-duplicate filtering needs datasketch: pip install datasketch") from None
        self._MinHash, self.threshold, self.num_perm = MinHash, threshold, num_perm
        # The index finds candidates (it cannot be built for thresholds near 1); each is
        # then held to ``threshold`` by its estimated similarity.
        self._lsh = MinHashLSH(threshold=min(threshold, 0.9), num_perm=num_perm)
        self._hashes: dict[str, object] = {}

    def _minhash(self, text: str):
        m = self._MinHash(num_perm=self.num_perm)
        m.update_batch(s.encode() for s in shingles(text))
        return m

    def seen(self, text: str) -> bool:
        """Whether an indexed text is near ``text``."""
        m = self._minhash(text)
        return any(self._hashes[k].jaccard(m) >= self.threshold for k in self._lsh.query(m))

    def add(self, text: str) -> None:
        """Index ``text``."""
        key = str(len(self._hashes))
        self._hashes[key] = m = self._minhash(text)
        self._lsh.insert(key, m)


class PromptFilter:
    """The first-user-turn checks with their memory of earlier prompts.

    ``check(text)`` returns the reason ``text`` is refused (``not_request``,
    ``exact_duplicate``, ``near_duplicate``) or None, and remembers an accepted text so a
    later copy is caught; ``remember(text)`` adds an accepted text from an earlier run
    (a resumed one).
    """

    def __init__(self, *, requests_only: bool = True, near_threshold: float = 0.7) -> None:
        self.requests_only = requests_only
        self._exact: set[str] = set()
        self._near = NearDuplicates(near_threshold)

    def check(self, text: str) -> str | None:
        if self.requests_only and not is_request(text):
            return "not_request"
        if normalize(text) in self._exact:
            return "exact_duplicate"
        if self._near.seen(text):
            return "near_duplicate"
        self.remember(text)
        return None

    def remember(self, text: str) -> None:
        self._exact.add(normalize(text))
        self._near.add(text)


def turn_reason(role: str, text: str, finished: bool) -> str | None:
    """The reason one generated turn drops its conversation, from its text alone:
    ``empty_*`` before ``truncated_*`` (``role`` is ``user`` -> ``*_prompt``, else
    ``*_answer``), or None."""
    kind = "prompt" if role == "user" else "answer"
    if not text.strip():
        return f"empty_{kind}"
    if not finished:
        return f"truncated_{kind}"
    return None

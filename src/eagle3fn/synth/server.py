"""A backend that sends the requests to an OpenAI-compatible server (SGLang, vLLM,
llama.cpp's server) instead of running the target here.

Endpoint: ``POST {url}/v1/completions`` (not chat completions). Magpie prompts need the
template's raw text *up to the start of a user turn*, which no chat endpoint can take
(it always appends its own assistant header); so every request, answers too, is the
chat template rendered here with the target's tokenizer and sent as **token ids**
(``"prompt": [ids]``, which all three servers accept). The server then sees exactly the
tokens the local path feeds the model (no second BOS added by its tokenizer, no
re-tokenization at the boundary of the template and the content).

Each request carries ``max_tokens``, ``temperature``, ``top_p``, ``seed`` and
``stop_token_ids`` (the template's end-of-turn ids; a vLLM/SGLang extension that
llama.cpp ignores, where the model's own EOS ends the turn); the completion's
``finish_reason`` tells a finished turn ("stop") from a cut one ("length").

At most ``concurrency`` requests are in flight (a thread pool over one ``httpx.Client``).
A request that fails by a dropped connection, a timeout, 408, 429 or a 5xx status is
retried after ``backoff * 2**attempt`` seconds (capped at 30 s), ``retries`` times; any
other status (a wrong model name, a prompt too long) stops the run with the server's
message. Results are keyed by request, so a retried request is never counted twice.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed

from eagle3fn.errors import RunError, UsageError
from eagle3fn.synth.backends import Completion, Request

_RETRY_STATUS = {408, 429, 500, 502, 503, 504}


def _httpx():
    try:
        import httpx
    except ImportError:
        raise UsageError("--server needs httpx: pip install httpx") from None
    return httpx


def api_base(url: str) -> str:
    """``url`` normalised to end with ``/v1`` (``http://host:8000`` and
    ``http://host:8000/v1/`` both give ``http://host:8000/v1``)."""
    if not url.startswith(("http://", "https://")):
        raise UsageError(f"--server {url}: give an http(s) URL, e.g. --server http://localhost:30000")
    base = url.rstrip("/")
    return base if base.endswith("/v1") else base + "/v1"


class ServerBackend:
    """Requests to ``{url}/v1/completions`` (module docstring). ``model``: the served
    model's name (None: the first of ``GET /v1/models``)."""

    def __init__(self, url: str, *, model: str | None = None, concurrency: int = 16, retries: int = 6,
                 backoff: float = 0.5, timeout: float = 600.0) -> None:
        if concurrency < 1 or retries < 0:
            raise UsageError(f"--concurrency {concurrency} must be >= 1 and retries {retries} >= 0")
        httpx = _httpx()
        self.base, self.concurrency, self.retries, self.backoff = api_base(url), concurrency, retries, backoff
        self.client = httpx.Client(timeout=timeout, limits=httpx.Limits(max_connections=concurrency,
                                                                          max_keepalive_connections=concurrency))
        self.model = model or self.served_model()

    def _post_or_get(self, method: str, path: str, json=None) -> dict:
        httpx = _httpx()
        last = ""
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(min(self.backoff * 2 ** (attempt - 1), 30.0))
            try:
                r = self.client.request(method, self.base + path, json=json)
            except httpx.TransportError as e:  # refused, dropped, timed out
                last = f"{type(e).__name__}: {e}"
                continue
            if r.status_code in _RETRY_STATUS:
                last = f"HTTP {r.status_code}: {r.text[:200]}"
                continue
            if r.status_code != 200:
                raise RunError(f"{self.base}{path} answered HTTP {r.status_code}: {' '.join(r.text.split())[:300]}")
            return r.json()
        raise RunError(f"{self.base}{path} failed {self.retries + 1} times (last: {' '.join(last.split())[:300]}); "
                       "check the server, then rerun the same command to resume")

    def served_model(self) -> str:
        """The first model id of ``GET /v1/models``."""
        data = self._post_or_get("GET", "/models").get("data") or []
        if not data:
            raise RunError(f"{self.base}/models lists no model; pass --server-model NAME")
        return data[0]["id"]

    def complete(self, request: Request) -> Completion:
        """One request, retried as the module docstring says."""
        body = {"model": self.model, "prompt": list(request.prompt_ids), "max_tokens": request.max_new_tokens,
                "temperature": request.temperature, "top_p": request.top_p, "seed": request.seed,
                "stop_token_ids": list(request.stop_ids)}
        data = self._post_or_get("POST", "/completions", body)
        try:
            choice = data["choices"][0]
            text, reason = choice["text"], choice.get("finish_reason")
        except (KeyError, IndexError, TypeError):
            raise RunError(f"{self.base}/completions answered without choices[0].text: {str(data)[:200]}") from None
        used = (data.get("usage") or {}).get("completion_tokens")
        return Completion(text=text.strip(), finished=reason == "stop",
                          new_tokens=int(used) if used is not None else 0)

    def __call__(self, requests: Sequence[Request]) -> Iterator[tuple[int, Completion]]:
        with ThreadPoolExecutor(self.concurrency) as pool:
            futures = {pool.submit(self.complete, r): k for k, r in enumerate(requests)}
            try:
                for f in as_completed(futures):
                    yield futures[f], f.result()
            finally:
                for f in futures:
                    f.cancel()

    def close(self) -> None:
        self.client.close()

"""eagle3fn synthesize --server: a real HTTP server in a thread serves a real tiny model's
completions (eagle3fn's engine, as a serving engine would); the output equals the local
path's, also when the server drops connections or answers 5xx, with no conversation lost
or duplicated."""

import json
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from eagle3fn.decoding import GenerateConfig, generate
from eagle3fn.errors import RunError
from eagle3fn.synth import EngineBackend, SynthConfig
from eagle3fn.synth.run import stop_ids_for, synthesize
from eagle3fn.synth.server import ServerBackend, api_base
from eagle3fn.testing import tiny_chat_tokenizer
from eagle3fn.testing.chat_model import tiny_chat_model

pytestmark = pytest.mark.usefixtures("one_thread")


class Served:
    """An OpenAI-compatible /v1/completions over ``model`` (token-id prompts), with
    faults: ``fault`` "drop" closes the connection without an answer, "error" answers
    503, "always" answers 503 to every request, "bad" answers 400; "drop"/"error" hit
    the first attempt of every distinct request."""

    def __init__(self, model, tok, fault=None):
        self.model, self.tok, self.fault = model, tok, fault
        self.attempts, self.lock, self.in_flight, self.most = Counter(), threading.Lock(), 0, 0
        served = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, code, obj):
                body = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                self._send(200, {"object": "list", "data": [{"id": "tiny", "object": "model"}]})

            def do_POST(self):
                raw = self.rfile.read(int(self.headers["Content-Length"]))
                with served.lock:
                    served.attempts[raw] += 1
                    first = served.attempts[raw] == 1
                    served.in_flight += 1
                    served.most = max(served.most, served.in_flight)
                try:  # the answer is made (or the fault chosen) while counted in flight
                    if served.fault == "bad":
                        code, answer = 400, {"error": {"message": "model 'x' not found"}}
                    elif served.fault == "always" or (served.fault == "error" and first):
                        code, answer = 503, {"error": "overloaded"}
                    elif served.fault == "drop" and first:
                        code, answer = None, None
                    else:
                        code, answer = 200, served.complete(json.loads(raw))
                finally:
                    with served.lock:
                        served.in_flight -= 1
                if code is None:
                    self.close_connection = True  # no answer at all
                    return
                self._send(code, answer)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def complete(self, body):
        stop = tuple(body["stop_token_ids"])
        cfg = GenerateConfig(batch_size=1, temperature=body["temperature"], top_p=body["top_p"],
                             eos_token_ids=stop)
        with self.lock:  # one model, one request at a time
            (done,) = generate(self.model, [body["prompt"]], cfg, max_new_tokens=[body["max_tokens"]],
                               seeds=[body["seed"]])
        tokens = done.tokens[:-1] if done.eos else done.tokens
        return {"object": "text_completion", "model": body["model"],
                "choices": [{"index": 0, "text": self.tok.decode(tokens, skip_special_tokens=True),
                             "finish_reason": "stop" if done.eos else "length"}],
                "usage": {"completion_tokens": len(done.tokens)}}

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def tok():
    return tiny_chat_tokenizer()


@pytest.fixture(scope="module")
def model(tok):
    return tiny_chat_model(tok)


CFG = SynthConfig(num_conversations=6, turns=2, max_new_tokens=10, max_prompt_tokens=16, requests_only=False,
                  keep_truncated=True)


def run(out, tok, backend, cfg=CFG):
    return synthesize(backend=backend, tokenizer=tok, cfg=cfg, out=str(out), identity={"backend": "test"},
                      stop_ids=stop_ids_for(tok), commit_every=4, live=False, log=lambda s: None)


def rows(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def local(tmp_path_factory, tok, model):
    out = tmp_path_factory.mktemp("local") / "local.jsonl"
    run(out, tok, EngineBackend(model, tok, batch_size=4))
    return rows(out)


@pytest.mark.parametrize("fault", [None, "drop", "error"])
def test_server_output_equals_local(tmp_path, tok, model, local, fault):
    """Sampled user turns (the seed travels with the request) and greedy answers: the
    file equals the local engine's, each conversation once, whatever the faults."""
    served = Served(model, tok, fault)
    try:
        backend = ServerBackend(served.url + "/v1/", concurrency=3, backoff=0.01)
        assert backend.model == "tiny"
        run(tmp_path / "s.jsonl", tok, backend)
        got = rows(tmp_path / "s.jsonl")
    finally:
        served.close()
    assert got == local and len({r["id"] for r in got}) == len(got) == 6
    assert 1 < served.most <= 3  # concurrent, and bounded
    if fault:  # every request failed once and was retried once
        assert set(served.attempts.values()) == {2}
    else:
        assert set(served.attempts.values()) == {1}


def test_server_control_other_model_differs(tmp_path, tok, local):
    served = Served(tiny_chat_model(tok, seed=1), tok)
    try:
        run(tmp_path / "s.jsonl", tok, ServerBackend(served.url, concurrency=2))
    finally:
        served.close()
    assert rows(tmp_path / "s.jsonl") != local


def test_server_failures_stop_with_one_line(tmp_path, tok, model):
    for fault, message in (("always", r"failed 3 times \(last: HTTP 503"), ("bad", "HTTP 400: .*not found")):
        served = Served(model, tok, fault)
        try:
            with pytest.raises(RunError, match=message):
                run(tmp_path / f"{fault}.jsonl", tok, ServerBackend(served.url, model="tiny", retries=2,
                                                                    backoff=0.01))
        finally:
            served.close()
    with pytest.raises(RunError, match="failed 2 times .*ConnectError"):  # nothing listens there
        ServerBackend(served.url, retries=1, backoff=0.01)
    assert api_base("http://h:1") == api_base("http://h:1/v1/") == "http://h:1/v1"


def test_cli_server_path(tmp_path, tok, model, local, capsys):
    """``eagle3fn synthesize --server URL``: the tokenizer read from --model.path (no
    weights there), the same conversations as the local path."""
    from eagle3fn.cli.main import main

    tok.save_pretrained(tmp_path / "tokenizer")
    (tmp_path / "tokenizer" / "config.json").write_text(json.dumps(model.config.to_dict()))
    served = Served(model, tok)
    try:
        main(["synthesize", "--model.path", str(tmp_path / "tokenizer"), "--server", served.url, "--out",
              str(tmp_path / "cli.jsonl"), "--num-conversations", "6", "--turns", "2", "--max-new-tokens", "10",
              "--max-prompt-tokens", "16", "--no-requests-only", "--keep-truncated", "--concurrency", "2"])
    finally:
        served.close()
    assert [r["messages"] for r in rows(tmp_path / "cli.jsonl")] == [r["messages"] for r in local]
    assert "wrote 6 of 6 conversations" in capsys.readouterr().out

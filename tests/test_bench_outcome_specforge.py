"""benchmarks/outcome_specforge.py on the CPU: SpecForge 0.2.0's loop on a tiny target for
2 steps end to end (JSON, the drafts it saves imported by io.import_draft with eagle3fn's
vocab map, the schedule eagle3fn's lr_at), and its fixed-shape batches giving the
gradients of SpecForge as shipped (padded to the batch's longest), with a control."""

import json
import shlex

import pytest
import torch
import tyro
from recorders import load_benchmark, save_tiny_target, write_tiny_chat

pytest.importorskip("specforge")
pytest.importorskip("specforge_oracle")  # sets TRITON_INTERPRET before SpecForge's loss kernel loads

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("outcome_specforge")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    work = tmp_path_factory.mktemp("outcome")
    save_tiny_target(work / "model")
    write_tiny_chat(work / "chat.jsonl", 11)
    return work


ARGS = dict(max_length=64, batch_size=2, max_steps=2, draft_vocab_size=64, ttt_length=3, eval_holdout=1,
            save_every=1, log_every=1, lr=1e-3, warmup_ratio=0.75, device="cpu")


@pytest.fixture(scope="module")
def smoke(bench, workdir):
    """The 2-step CPU run: ``(args, its JSON record)``."""
    args = bench.OutcomeArgs(model=str(workdir / "model"), data=str(workdir / "chat.jsonl"),
                             out_dir=str(workdir / "sf"), **ARGS)
    return args, bench.main(args)


def test_tiny_cpu_run_imports(bench, workdir, smoke):
    from eagle3fn.io.data import tokenize_file
    from eagle3fn.io.import_draft import as_run
    from eagle3fn.io.vocab_io import vocab_map_from_examples
    from eagle3fn.train.config import TrainConfig
    from eagle3fn.train.step import lr_at
    from transformers import AutoTokenizer

    args, record = smoke
    assert json.loads((workdir / "sf" / "outcome_specforge.json").read_text())["steps"] == 2
    assert record["args"]["max_steps"] == 2 and record["conversations"] == 10 and record["steps"] == 2
    assert "--no-pack" in record["eagle3fn_command"] and "--max-steps 2" in record["eagle3fn_command"]
    # the printed command is the eagle3fn train run it mirrors
    assert tyro.cli(TrainConfig, args=shlex.split(record["eagle3fn_command"])[2:]) == bench.train_config(args)
    assert [s["step"] for s in record["checkpoints"]] == [1, 2]
    assert 0 < record["startup_s"] and 0 < record["train_s"] <= record["total_s"]
    cfg = bench.train_config(args)
    # eagle3fn warms up over round(0.75 * 2) = 2 steps (SpecForge's own: int(1.5) = 1)
    assert [r["lr"] for r in record["log"]] == [lr_at(s, 2, cfg) for s in (0, 1)] == [5e-4, 1e-3]
    assert all(len(r["acc"]) == 3 for r in record["log"])

    tok = AutoTokenizer.from_pretrained(workdir / "model")
    examples = tokenize_file(workdir / "chat.jsonl", tok, max_length=64)[:-1]
    d2t, t2d = vocab_map_from_examples(examples, len(tok), 64)
    runs = [as_run(s["path"], workdir / "model", log=lambda _: None) for s in record["checkpoints"]]
    for run, saved in zip(runs, record["checkpoints"]):
        assert run["step"] == saved["step"] and run["aux_layer_ids"] == (1, 3, 4)
        assert torch.equal(run["d2t"], d2t) and torch.equal(run["t2d"], t2d)
        assert all(torch.isfinite(p).all() for p in run["params"].values())
    moved = [n for n in runs[0]["params"] if not torch.equal(runs[0]["params"][n], runs[1]["params"][n])]
    assert "lm_head.weight" in moved and "fc.weight" in moved  # step 2 trained


def test_eval_cli_takes_the_draft(workdir, smoke, capsys):
    """``eagle3fn eval --draft DIR --model TARGET`` (once cli/run.py has --draft)."""
    from eagle3fn.cli.main import main
    from eagle3fn.cli.run import EvalArgs

    if "draft" not in EvalArgs.__dataclass_fields__:
        pytest.skip("eagle3fn eval has no --draft yet")
    main(["eval", "--draft", smoke[1]["checkpoints"][-1]["path"], "--model", str(workdir / "model"),
          "--prompts", str(workdir / "chat.jsonl"), "--num-prompts", "2", "--max-new-tokens", "8",
          "--batch-size", "2", "--num-draft-tokens", "3"])
    out = capsys.readouterr().out
    assert "records no aux layer ids" in out and "trained draft (step 2), 2 prompts" in out
    assert "2/2 outputs identical" in out


def test_fixed_shape_is_specforge_as_shipped(bench, workdir):
    """One step's gradients at [batch_size, max_length] with the scale equal those of the
    same batch padded to its longest (SpecForge's collator); unscaled they do not."""
    from specforge.algorithms.eagle3.model import OnlineEagle3Model
    from specforge.utils import padding
    from train_specforge import capture, specforge_draft
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from eagle3fn.io.data import tokenize_file
    from eagle3fn.vocab import build_vocab_map

    tok = AutoTokenizer.from_pretrained(workdir / "model")
    target = AutoModelForCausalLM.from_pretrained(workdir / "model").eval().requires_grad_(False)
    group = tokenize_file(workdir / "chat.jsonl", tok, max_length=64)[:2]
    d2t, t2d = build_vocab_map(torch.arange(len(tok)), 48)

    def grads(batch, scale):
        torch.manual_seed(0)
        draft = specforge_draft(type("S", (), {"draft_vocab": 48}), workdir / "model", "cpu", d2t, t2d,
                                target.get_input_embeddings().weight)
        model = OnlineEagle3Model(draft_model=draft, length=3, attention_backend="sdpa")
        ids, am = batch["input_ids"], batch["attention_mask"]
        aux, out = capture(target, target.model.layers, [1, 3, 4], ids, am)
        with torch._dynamo.config.patch(disable=True):
            plosses, *_ = model(input_ids=padding(ids, left=False), attention_mask=am,
                                target=padding(out.logits, left=False),
                                loss_mask=batch["supervised"][..., None].int(), hidden_states=aux)
            (sum(0.8**j * p for j, p in enumerate(plosses)) * scale).backward()
        return {n: p.grad for n, p in draft.named_parameters() if p.requires_grad}

    fixed = bench.fixed_batch(group, tok.pad_token_id, 3, 64)  # one filler row too
    longest = max(len(e) for e in group)
    shipped = {k: v[:2, :longest] for k, v in fixed.items() if k in ("input_ids", "attention_mask", "supervised")}
    assert fixed["scale"] == 3 * 64 / (2 * longest) and fixed["input_ids"].shape == (3, 64)
    want = grads(shipped, 1.0)
    got = grads(fixed, fixed["scale"])
    for name, g in want.items():
        assert (got[name] - g).abs().max() <= 1e-5 * g.abs().max(), name
    unscaled = grads(fixed, 1.0)
    assert (unscaled["fc.weight"] - want["fc.weight"]).abs().max() > 1e-2 * want["fc.weight"].abs().max()

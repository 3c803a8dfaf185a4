"""Content fingerprints and the offline cache's guards: a cache is never mixed from two
settings, a broken shard is named with its fix, non-finite features never pass."""

import json
import shutil

import pytest
import torch
from recorders import save_tiny_target, write_tiny_chat
from safetensors.torch import load_file, save_file

from eagle3fn.cli.main import main
from eagle3fn.errors import RunError, UsageError
from eagle3fn.io.cache import (MANIFEST, FeatureCache, cache_fingerprint, check_cache_for_training,
                               verify_cache)
from eagle3fn.io.cache.store import sample_digest
from eagle3fn.io.fingerprint import diff, file_fingerprint, short, target_fingerprint

pytestmark = pytest.mark.usefixtures("no_gpu", "one_thread")  # one thread: tiny runs crawl with 2 on a busy CPU


def _weights(path, seed, **extra):
    torch.manual_seed(seed)
    save_file({"w": torch.randn(64, 64), "b": torch.randn(64), **extra}, str(path))


@pytest.fixture
def model_dir(tmp_path):
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"hidden_size": 64, "model_type": "llama"}, indent=2))
    (d / "tokenizer.json").write_text(json.dumps({"vocab": {"a": 0, "b": 1}}))
    _weights(d / "model.safetensors", 0)
    return d


def test_file_fingerprint_follows_content_not_spelling(tmp_path, monkeypatch):
    f = tmp_path / "chat.jsonl"
    f.write_text('{"a": 1}\n' * 150000)
    monkeypatch.chdir(tmp_path)
    spelled = f"./../{tmp_path.name}/chat.jsonl"
    assert file_fingerprint(f) == file_fingerprint("chat.jsonl") == file_fingerprint(spelled)
    assert file_fingerprint(f)["bytes"] == f.stat().st_size > (1 << 20)  # more than one chunk
    copy = tmp_path / "copy.jsonl"
    shutil.copy(f, copy)
    assert file_fingerprint(copy) == file_fingerprint(f)
    f.write_text('{"a": 2}\n' * 150000)  # same size, other content
    assert file_fingerprint(f)["bytes"] == file_fingerprint(copy)["bytes"]
    assert file_fingerprint(f) != file_fingerprint(copy)
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        file_fingerprint(tmp_path / "missing.jsonl")


def test_target_fingerprint_is_content_not_path(model_dir, monkeypatch):
    monkeypatch.chdir(model_dir.parent)
    fp = target_fingerprint(model_dir)
    assert fp == target_fingerprint("model") == target_fingerprint("./model/")
    assert set(fp) == {"config", "tokenizer", "weights"} and set(fp["weights"]) == {"model.safetensors"}
    moved = model_dir.parent / "elsewhere"
    shutil.copytree(model_dir, moved)
    assert target_fingerprint(moved) == fp
    # config.json is compared as JSON (key order, whitespace and who saved it do not count)
    (moved / "config.json").write_text(json.dumps(
        {"model_type": "llama", "transformers_version": "9.9", "hidden_size": 64}))
    assert target_fingerprint(moved) == fp


def test_new_weights_at_the_same_path_change_the_fingerprint(model_dir):
    fp = target_fingerprint(model_dir)
    _weights(model_dir / "model.safetensors", 1)  # retrained: same names, shapes, dtypes, size
    new = target_fingerprint(model_dir)
    assert new["weights"]["model.safetensors"]["bytes"] == fp["weights"]["model.safetensors"]["bytes"]
    assert new["weights"]["model.safetensors"]["header"] == fp["weights"]["model.safetensors"]["header"]
    assert new != fp and diff(fp, new) == [
        f"weights.model.safetensors.sample: {fp['weights']['model.safetensors']['sample'][:12]} -> "
        f"{new['weights']['model.safetensors']['sample'][:12]}"]
    _weights(model_dir / "model.safetensors", 1, extra=torch.zeros(3))  # another tensor set
    assert {line.split(":")[0] for line in diff(new, target_fingerprint(model_dir))} == {
        "weights.model.safetensors.bytes", "weights.model.safetensors.header",
        "weights.model.safetensors.sample"}


def test_large_weight_file_is_sampled_not_read_whole(model_dir):
    """A change in the last MiB of a large file is caught; one in the middle is not
    (documented: never hash whole weights)."""
    big = torch.zeros(3 << 20, dtype=torch.uint8)  # 3 MiB of data
    save_file({"w": big}, str(model_dir / "model.safetensors"))
    fp = target_fingerprint(model_dir)
    big[-1] = 1
    save_file({"w": big}, str(model_dir / "model.safetensors"))
    tail = target_fingerprint(model_dir)
    assert tail != fp
    big[len(big) // 2] = 1
    save_file({"w": big}, str(model_dir / "model.safetensors"))
    assert target_fingerprint(model_dir) == tail


def test_tokenizer_and_gguf_files_count(model_dir):
    fp = target_fingerprint(model_dir)
    (model_dir / "chat_template.jinja").write_text("{{ messages }}")
    with_template = target_fingerprint(model_dir)
    want = f"tokenizer: {fp['tokenizer'][:12]} -> {with_template['tokenizer'][:12]}"
    assert diff(fp, with_template) == [want]
    (model_dir / "m.Q4.gguf").write_bytes(b"GGUF" + bytes(100))
    g = target_fingerprint(model_dir, gguf_file="m.Q4.gguf")
    assert set(g["weights"]) == {"m.Q4.gguf"} and g["weights"]["m.Q4.gguf"]["bytes"] == 104
    (model_dir / "m.Q4.gguf").write_bytes(b"GGUF" + bytes(99) + b"\1")
    assert target_fingerprint(model_dir, gguf_file="m.Q4.gguf") != g
    with pytest.raises(FileNotFoundError, match="'other.gguf' is not in"):
        target_fingerprint(model_dir, gguf_file="other.gguf")
    with pytest.raises(FileNotFoundError, match="is not a directory"):
        target_fingerprint(model_dir / "nope")


def test_diff_lists_each_flattened_key():
    old = {"a": 1, "b": {"c": [1, 2, 3], "d": "x"}, "gone": 5, "sha": "0" * 64}
    new = {"a": 1, "b": {"c": [1, 2, 4], "d": "x"}, "added": None, "extra": {"k": True}, "sha": "f" * 64}
    assert diff(old, new) == ["b.c: [1, 2, 3] -> [1, 2, 4]", "extra.k: <none> -> True",
                              "gone: 5 -> <none>", f"sha: {'0' * 12} -> {'f' * 12}"]
    assert diff(old, old) == []
    assert short(old) == short(json.loads(json.dumps(old))) != short(new) and len(short(old)) == 12


# ---- the offline cache, prepared by the CLI on a tiny saved target ----

SHARD1 = "shard-000001.safetensors"


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, no_gpu):
    d = tmp_path_factory.mktemp("guard")
    save_tiny_target(d / "model")
    write_tiny_chat(d / "chat.jsonl", 6)
    prepare(d / "built", workdir=d)
    return d


def prepare(out, *extra, workdir, model=None, data=None):
    main(["prepare", "--model.path", str(model or workdir / "model"),
          "--data.path", str(data or workdir / "chat.jsonl"), "--out", str(out), "--batch-size", "2",
          *extra])


@pytest.fixture
def cache(workdir, tmp_path):
    """A fresh copy of the built cache (3 shards of 2 conversations) to break."""
    return shutil.copytree(workdir / "built", tmp_path / "cache")


def manifest(path):
    return json.loads((path / MANIFEST).read_text())


def reseal(path, m):
    """Write manifest ``m`` into ``path`` with a matching digest (as if prepare wrote it):
    the tests that break a shard behind a valid manifest."""
    from eagle3fn.io.cache.store import manifest_digest

    (path / MANIFEST).write_text(json.dumps({**m, "digest": manifest_digest(m)}))


def cli_error(capsys, argv, code):
    with pytest.raises(SystemExit) as e:
        main(argv)
    captured = capsys.readouterr()
    assert e.value.code == code, captured.err
    return captured.out, " ".join(captured.err.split())


def test_prepare_on_cpu_writes_float32_and_records_the_fingerprint(workdir):
    m = manifest(workdir / "built")
    assert m["complete"] and m["format"] == 3 and m["dtype"] == "float32" and m["aux_dtype"] == "storage"
    fp = m["fingerprint"]
    assert fp["target_dtype"] == "float32" and fp["dtype"] == "float32"
    assert set(fp) == {"target", "data", "target_dtype", "max_length", "on_error", "batch_size",
                       "aux_layer_ids", "dtype", "aux_dtype", "format"}
    assert fp["aux_layer_ids"] == [1, 3, 4] and fp["batch_size"] == 2 and fp["max_length"] == 2048
    assert fp["data"] == file_fingerprint(workdir / "chat.jsonl")
    assert fp["target"] == target_fingerprint(workdir / "model")
    assert str(workdir) not in json.dumps(fp)  # content, never spelled paths
    assert cache_fingerprint(workdir / "built") == fp
    assert [s["name"] for s in m["shards"]] == [f"shard-00000{i}.safetensors" for i in range(3)]
    for s in m["shards"]:
        assert file_fingerprint(workdir / "built" / s["name"]) == {"bytes": s["bytes"], "sha256": s["sha256"]}
        assert load_file(str(workdir / "built" / s["name"]))["aux"].dtype == torch.float32
    # ModelSource resolves auto per device (bf16 on CUDA) and keeps explicit choices.
    from eagle3fn.cli.data import ModelSource

    assert ModelSource(path="m").torch_dtype(torch.device("cuda")) == torch.bfloat16
    assert ModelSource(path="m").torch_dtype(torch.device("cpu")) == torch.float32
    assert ModelSource(path="m", dtype="float32").torch_dtype(torch.device("cuda")) == torch.float32
    assert ModelSource(path="m").torch_device() == torch.device("cpu")


def test_same_files_by_another_spelling_resume(workdir, cache, monkeypatch, capsys):
    monkeypatch.chdir(workdir)
    capsys.readouterr()
    prepare(cache, workdir=workdir, model="./model", data="../" + workdir.name + "/chat.jsonl")
    out = capsys.readouterr().out
    assert "wrote shard" not in out and manifest(cache) == manifest(workdir / "built")


def test_changed_data_at_the_same_path_is_refused_before_loading_the_target(workdir, cache, tmp_path,
                                                                            monkeypatch, capsys):
    model = shutil.copytree(workdir / "model", tmp_path / "model")
    data = tmp_path / "chat.jsonl"
    write_tiny_chat(data, 6)
    prepare(cache, workdir=workdir, model=model, data=data)  # a copy: same content, resumes
    write_tiny_chat(data, 7)
    import eagle3fn.io.target

    monkeypatch.setattr(eagle3fn.io.target, "load_target", lambda *a, **k: pytest.fail("target loaded"))
    _, err = cli_error(capsys, ["prepare", "--model.path", str(model), "--data.path", str(data), "--out",
                                str(cache), "--batch-size", "2"], 2)
    old, new = file_fingerprint(workdir / "chat.jsonl"), file_fingerprint(data)
    assert (f"eagle3fn: error: {cache} holds a cache written with other settings (old -> new: "
            f"data.bytes: {old['bytes']} -> {new['bytes']}; data.sha256: {old['sha256'][:12]} -> "
            f"{new['sha256'][:12]}); rerun with the settings it was written with") in err
    with pytest.raises(UsageError, match=r"\(old -> new: batch_size: 2 -> 3; dtype: float32 -> bfloat16\)"):
        main(["--debug", "prepare", "--model.path", str(workdir / "model"), "--data.path",
              str(workdir / "chat.jsonl"), "--out", str(cache), "--batch-size", "3", "--storage", "bfloat16"])


def test_truncated_shard_is_named_and_rewritten_by_a_rerun(workdir, cache, capsys):
    data = (cache / SHARD1).read_bytes()
    (cache / SHARD1).write_bytes(data[: len(data) // 2])
    with pytest.raises(RunError, match=f"feature cache {cache}: {SHARD1} has {len(data) // 2} bytes, the "
                       f"manifest says {len(data)}; run eagle3fn cache verify {cache}, then rerun eagle3fn "
                       "prepare with the same settings to rewrite the broken shards"):
        FeatureCache(cache)[1]
    capsys.readouterr()
    prepare(cache, workdir=workdir)
    out = capsys.readouterr().out
    assert f"{SHARD1}: {len(data) // 2} bytes, the manifest says {len(data)}; rewriting it" in out
    assert [line.split()[1] for line in out.splitlines() if line.startswith("wrote")] == [SHARD1]
    assert (cache / SHARD1).read_bytes() == data and manifest(cache) == manifest(workdir / "built")
    assert torch.equal(FeatureCache(cache)[1].features.aux, FeatureCache(workdir / "built")[1].features.aux)


def test_zeroed_shard_is_reported_by_verify_and_named_by_the_reader(workdir, cache, capsys):
    size = (cache / SHARD1).stat().st_size
    (cache / SHARD1).write_bytes(bytes(size))
    out, err = cli_error(capsys, ["cache", "verify", str(cache)], 1)
    assert f"{SHARD1}" in out and "BROKEN: checksum differs" in out
    assert "shards: 2 ok, 1 broken; conversations 6" in out
    assert err == (f"eagle3fn: error: 1 of 4 files of the feature cache {cache} are broken ({SHARD1}); "
                   f"rerun eagle3fn prepare with the same settings and --out {cache} to rewrite them "
                   "(rerun with --debug for the traceback)")
    with pytest.raises(RunError, match=f"{cache}: {SHARD1} is unreadable .*; run eagle3fn cache verify"):
        FeatureCache(cache)[1]
    # zeros after an intact header load as finite zeros: only the checksum sees them
    header = 8 + int.from_bytes((workdir / "built" / SHARD1).read_bytes()[:8], "little")
    (cache / SHARD1).write_bytes((workdir / "built" / SHARD1).read_bytes()[:header] + bytes(size - header))
    assert [(f.name, f.problem) for f in verify_cache(cache).broken] == [
        (SHARD1, "checksum differs from the manifest (corrupted or changed on disk)")]


def test_deleted_shard_and_head(workdir, cache, capsys):
    (cache / SHARD1).unlink()
    (cache / "head.safetensors").unlink()
    with pytest.raises(RunError, match=f"{SHARD1} is missing; run eagle3fn cache verify {cache}"):
        FeatureCache(cache)[1]
    with pytest.raises(RunError, match="head.safetensors is missing"):
        FeatureCache(cache)[0]
    out, _ = cli_error(capsys, ["cache", "verify", str(cache)], 1)
    assert "BROKEN: missing" in out and out.count("BROKEN") == 2
    prepare(cache, workdir=workdir)
    out = capsys.readouterr().out
    assert f"{SHARD1}: missing; rewriting it" in out and "head.safetensors: missing; rewriting it" in out
    assert manifest(cache) == manifest(workdir / "built")
    main(["cache", "verify", str(cache)])
    assert capsys.readouterr().out.strip().endswith("OK")


def test_bad_manifest_is_named_and_a_rerun_rewrites_the_cache(workdir, cache, capsys):
    (cache / MANIFEST).write_text('{"format": 2, "shards": [')
    with pytest.raises(RunError, match=f"{cache / MANIFEST} is unreadable .*rerun eagle3fn prepare with the "
                       f"same settings and --out {cache}"):
        FeatureCache(cache)
    _, err = cli_error(capsys, ["cache", "verify", str(cache)], 1)
    assert f"{cache / MANIFEST} is unreadable" in err
    prepare(cache, workdir=workdir)
    out = capsys.readouterr().out
    assert "is unreadable or was edited; rewriting every shard" in out and out.count("wrote shard") == 3
    assert manifest(cache) == manifest(workdir / "built")


def test_old_format_cache_is_refused_with_the_rebuild_command(workdir, cache, capsys):
    """A format-2 cache (padded shards) is refused by the reader, verify, train's checks
    and prepare, with the command that rebuilds it (its settings from its fingerprint)."""
    m = manifest(cache)
    fp = {k: v for k, v in m["fingerprint"].items() if k != "aux_dtype"} | {"format": 2}
    (cache / MANIFEST).write_text(json.dumps({"format": 2, "dtype": "float32", "fingerprint": fp,
                                              "shards": m["shards"], "head": m["head"], "complete": True}))
    want = (f"{cache} holds a feature cache of format 2, this eagle3fn reads format 3; rebuild it: delete "
            f"{cache} (or pick another --out) and run eagle3fn prepare --model.path <target dir> --data.path "
            f"<chat.jsonl> --out {cache} --batch-size 2 --storage float32 --data.max-length 2048 "
            "--data.on-error raise --model.dtype float32 --aux-layer-ids 1 3 4")
    with pytest.raises(UsageError) as e:
        FeatureCache(cache)
    assert str(e.value) == want
    with pytest.raises(UsageError, match="format 2, this eagle3fn reads format 3"):
        check_cache_for_training(cache, model_dir=workdir / "model")
    _, err = cli_error(capsys, ["prepare", "--model.path", str(workdir / "model"), "--data.path",
                                str(workdir / "chat.jsonl"), "--out", str(cache), "--batch-size", "2"], 2)
    assert want in err
    _, err = cli_error(capsys, ["cache", "verify", str(cache)], 2)
    assert want in err
    # The command it prints, with the paths filled in, rebuilds the cache.
    shutil.rmtree(cache)
    argv = want.split(" and run eagle3fn ")[1].replace("<target dir>", str(workdir / "model"))
    main(argv.replace("<chat.jsonl>", str(workdir / "chat.jsonl")).split())
    assert manifest(cache) == manifest(workdir / "built")


def test_non_finite_features_are_refused_when_written_and_when_read(workdir, cache, tmp_path, monkeypatch,
                                                                    capsys):
    import eagle3fn.io.target

    real = eagle3fn.io.target.target_features
    calls = []

    def poisoned(target, input_ids, attention_mask):
        f = real(target, input_ids, attention_mask)
        calls.append(1)
        if len(calls) == 2:
            f.final_hidden[1, :, 0] = float("nan")  # conversation 1 of shard 1, its teacher rows too
        return f
    monkeypatch.setattr(eagle3fn.io.target, "target_features", poisoned)
    _, err = cli_error(capsys, ["prepare", "--model.path", str(workdir / "model"), "--data.path",
                                str(workdir / "chat.jsonl"), "--out", str(tmp_path / "nan"),
                                "--batch-size", "2"], 1)
    assert (f"eagle3fn: error: the target gave non-finite final_hidden features for conversation "
            f"{workdir / 'chat.jsonl'}:4 (row 1 of {SHARD1}); nothing was written for it: run the target in "
            "float32 (--model.dtype float32) or drop that conversation from the data") in err
    assert not (tmp_path / "nan" / SHARD1).exists() and not manifest(tmp_path / "nan")["complete"]
    # A shard that holds a NaN (checksum updated to match) is refused by the reader and verify.
    t = load_file(str(cache / SHARD1))
    t["aux"][int(t["offsets"][1]) + 3, 5] = float("inf")  # conversation 1, position 3
    save_file(t, str(cache / SHARD1))
    m = manifest(cache)
    m["shards"][1].update(file_fingerprint(cache / SHARD1), sample=sample_digest(cache / SHARD1))
    reseal(cache, m)
    reader = FeatureCache(cache)
    with pytest.raises(RunError, match=f"feature cache {cache}: {SHARD1} holds non-finite aux at row 1; "
                       f"run eagle3fn cache verify {cache}"):
        reader[1]
    assert reader.read(1, (0, 3)).features.aux.shape[1] == 3  # the window before the inf is fine
    assert [(f.name, f.problem) for f in verify_cache(cache).broken] == [(SHARD1, "non-finite aux at row 1")]


def test_check_cache_for_training(workdir, tmp_path):
    built = workdir / "built"
    assert check_cache_for_training(built, model_dir=workdir / "model") == (1, 3, 4)
    same = shutil.copytree(workdir / "model", tmp_path / "same")
    assert check_cache_for_training(built, model_dir=same, aux_layer_ids=[1, 3, 4]) == (1, 3, 4)
    with pytest.raises(UsageError) as e:
        check_cache_for_training(built, model_dir=same, aux_layer_ids=(0, 2, 5))
    assert str(e.value) == (
        f"--cache {built} was prepared from another target or other aux layer ids (cache -> this run: "
        "aux_layer_ids: [1, 3, 4] -> [0, 2, 5]); train with the --model/--gguf-file it was prepared from "
        "and without --aux-layer-ids (the cache's are used), or prepare a cache for this target")
    t = load_file(str(same / "model.safetensors"))
    t["lm_head.weight"] = t["lm_head.weight"] + 1
    save_file(t, str(same / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(UsageError, match=r"cache -> this run: target.weights.model.safetensors.sample: "
                       r"\w{12} -> \w{12}\)"):
        check_cache_for_training(built, model_dir=same)


def test_verify_cli_summarizes_a_whole_cache(workdir, capsys):
    built = workdir / "built"
    capsys.readouterr()
    main(["cache", "verify", str(built)])
    out = capsys.readouterr().out
    fp = cache_fingerprint(built)
    assert out.splitlines()[0] == f"feature cache {built} (format 3, complete)"
    assert out.count(" ok\n") == 4 and "head.safetensors" in out
    assert "shards: 3 ok, 0 broken; conversations 6; tokens " in out
    assert "dtype float32; aux layer ids [1, 3, 4]" in out
    assert (f"target {short(fp['target'])}; data {fp['data']['sha256'][:12]} ({fp['data']['bytes']} bytes); "
            "max length 2048, on_error raise, batch size 2, target dtype float32") in out
    _, err = cli_error(capsys, ["cache", "verify", str(workdir / "nothing")], 2)
    assert f"no manifest.json in {workdir / 'nothing'}: not a feature cache" in err
    cli_error(capsys, ["cache", "check", str(built)], 2)


def test_bad_flags_and_paths_fail_before_the_target_loads(workdir, tmp_path, capsys):
    base = ["prepare", "--model.path", str(workdir / "model"), "--data.path", str(workdir / "chat.jsonl"),
            "--out", str(tmp_path / "c")]
    cli_error(capsys, base + ["--batch-size", "0"], 2)
    _, err = cli_error(capsys, base[:4] + [str(tmp_path / "no.jsonl")] + base[5:], 2)
    assert f"chat data file '{tmp_path / 'no.jsonl'}' not found; pass a JSONL file" in err
    _, err = cli_error(capsys, base[:2] + [str(tmp_path / "nomodel")] + base[3:], 2)
    assert f"target model path '{tmp_path / 'nomodel'}' does not exist" in err
    _, err = cli_error(capsys, base + ["--model.device", "cuda"], 2)
    assert "--device cuda but torch sees no GPU" in err
    assert not (tmp_path / "c").exists()


def test_verify_names_a_shard_whose_index_disagrees_with_its_tensors(workdir, cache):
    """A shard whose offsets no longer match its rows (checksum updated to match) loads
    fine but is reported by verify; the untouched shards are not."""
    t = load_file(str(cache / SHARD1))
    t["offsets"][-1] -= 1
    save_file(t, str(cache / SHARD1))
    m = manifest(cache)
    m["shards"][1].update(file_fingerprint(cache / SHARD1), sample=sample_digest(cache / SHARD1))
    reseal(cache, m)
    assert [(f.name, f.problem) for f in verify_cache(cache).broken] == [
        (SHARD1, "index does not match its tensors (offsets, ids, aux, teacher rows)")]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_fast_finite_check_agrees_with_isfinite(dtype):
    """``_all_finite`` (the reader's bit test) against ``torch.isfinite`` on every
    non-finite kind at rows in the first, a middle and the last chunk; a tensor
    with the largest finite values passes (the control that the bits test the
    exponent, not magnitude), and ``nonfinite_row`` names the row."""
    from eagle3fn.io.cache.store import _all_finite, nonfinite_row

    g = torch.Generator().manual_seed(0)
    big = torch.full((40, 9), torch.finfo(dtype).max, dtype=dtype)
    big[::2] = -big[::2]
    assert _all_finite(big, rows=16) and bool(torch.isfinite(big).all())
    for row in (0, 17, 39):
        for value in (float("nan"), float("inf"), -float("inf")):
            x = torch.randn(40, 3, 3, generator=g).to(dtype)
            x[row, 2, 1] = value
            assert _all_finite(x, rows=16) is False and not bool(torch.isfinite(x).all())
            assert nonfinite_row(x) == row
    assert _all_finite(torch.zeros(3, dtype=torch.int64)) is None  # not a float: the slow path decides

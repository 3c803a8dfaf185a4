"""Issue 37, deliverable 2: a feature cache that proves itself. The manifest carries a
digest of its own content and, per file, size, sha256 and a sample hash (first and last
MiB); ``train --cache`` refuses an edited manifest, shard files it does not list and a
shard whose header or index disagrees with it, with the command that fixes them;
``cache verify`` reports each. Manifests mutated at random (hypothesis) never pass
silently and never give a traceback.

Controls (today's code before these checks): a manifest listing 2 of 4 shards trained on
half the data with exit 0 and ``cache verify`` said OK; an edited ``aux_layer_ids``
trained; a wrong ``seq_len`` ended in a bare AssertionError."""

from __future__ import annotations

import copy
import json
import math
import shutil

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from recorders import save_tiny_target, write_tiny_chat

from eagle3fn.cli.main import main
from eagle3fn.errors import RunError
from eagle3fn.io.cache import MANIFEST, FeatureCache, check_cache_for_training, verify_cache
from eagle3fn.io.cache.store import manifest_digest

pytestmark = pytest.mark.usefixtures("no_gpu", "one_thread")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, no_gpu):
    d = tmp_path_factory.mktemp("hostile-cache")
    save_tiny_target(d / "model")
    write_tiny_chat(d / "chat.jsonl", 8)
    main(["prepare", "--model.path", str(d / "model"), "--data.path", str(d / "chat.jsonl"), "--out",
          str(d / "built"), "--batch-size", "2"])
    return d


@pytest.fixture
def cache(workdir, tmp_path):
    return shutil.copytree(workdir / "built", tmp_path / "cache")


def manifest(path):
    return json.loads((path / MANIFEST).read_text())


def write(path, m, *, seal):
    """Write manifest ``m``; ``seal``: with a digest matching it (as prepare would),
    else with the digest ``m`` holds (none if it holds none)."""
    if seal:
        m = {k: v for k, v in m.items() if k != "digest"}
        m = {**m, "digest": manifest_digest(m)}
    (path / MANIFEST).write_text(json.dumps(m))


def cli(capsys, argv):
    """``(exit code, stdout, stderr)`` of the real CLI entry, in process."""
    try:
        main(argv)
        code = 0
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


def refused(capsys, argv, code, *needles):
    got, out, err = cli(capsys, argv)
    assert got == code, (got, out, err)
    assert "Traceback" not in out + err
    lines = [line for line in err.splitlines() if line.startswith("eagle3fn: error:")]
    assert len(lines) == 1, err
    for needle in needles:
        assert needle in lines[0], lines[0]
    return out, lines[0]


def train_argv(workdir, cache, out):
    return ["train", "--model", str(workdir / "model"), "--cache", str(cache), "--out-dir", str(out),
            "--max-steps", "1", "--draft-vocab-size", "32", "--ttt-length", "2", "--no-pack", "--max-length", "256"]


def test_a_manifest_listing_half_the_shards_is_refused(workdir, cache, tmp_path, capsys):
    m = manifest(cache)
    assert len(m["shards"]) == 4 and m["digest"] == manifest_digest(m)
    half = {**m, "shards": m["shards"][:2]}
    write(cache, half, seal=False)  # edited by hand: the digest no longer matches
    refused(capsys, train_argv(workdir, cache, tmp_path / "a"), 1,
            f"{cache / MANIFEST} was edited after eagle3fn prepare wrote it",
            "restore it, or delete it and rerun eagle3fn prepare", "--aux-layer-ids 1 3 4")
    out, _ = refused(capsys, ["cache", "verify", str(cache)], 1, "are broken (manifest.json, shard-000002")
    assert "manifest.json" in out and "was edited after eagle3fn prepare" in out
    # The same list under a digest that matches (another tool, or an edit re-sealed):
    # the shards on disk it does not list are still found.
    write(cache, half, seal=True)
    refused(capsys, train_argv(workdir, cache, tmp_path / "b"), 1,
            f"feature cache {cache} holds shard files its manifest does not list "
            "(shard-000002.safetensors, shard-000003.safetensors; 2 of 4): training would skip them")
    out, _ = refused(capsys, ["cache", "verify", str(cache)], 1, "shard-000002.safetensors, shard-000003")
    assert out.count("on disk but not listed in the manifest") == 2
    with pytest.raises(RunError, match="holds shard files its manifest does not list"):
        FeatureCache(cache)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_edited_aux_layer_ids_are_refused(workdir, cache, tmp_path, capsys):
    m = manifest(cache)
    m["fingerprint"]["aux_layer_ids"] = [0, 2, 5]
    write(cache, m, seal=False)
    refused(capsys, train_argv(workdir, cache, tmp_path / "run"), 1, "was edited after eagle3fn prepare")
    with pytest.raises(RunError, match="was edited"):
        check_cache_for_training(cache, model_dir=workdir / "model")


def test_a_wrong_seq_len_or_width_is_one_line(workdir, cache, tmp_path, capsys):
    """Behind a digest that matches (so only the shard itself can tell)."""
    m = manifest(cache)
    good = copy.deepcopy(m)
    m["shards"][1]["seq_len"] -= 1
    write(cache, m, seal=True)
    with pytest.raises(RunError, match=r"shard-000001.safetensors holds 2 conversations of up to \d+ tokens, "
                       r"the manifest says batch 2, seq_len \d+; run eagle3fn cache verify"):
        FeatureCache(cache)[1]
    refused(capsys, train_argv(workdir, cache, tmp_path / "run"), 1, "shard-000001.safetensors holds 2 "
            "conversations of up to")
    good["hidden_size"] = 16
    write(cache, good, seal=True)
    with pytest.raises(RunError, match=r"shard-000000.safetensors holds aux F32 \[\d+, 96\], the manifest says "
                       r"F32 \[N, 48\] \(3 aux layers of hidden size 16\)"):
        FeatureCache(cache)[0]
    assert "holds aux F32" in [f.problem for f in verify_cache(cache).files][0]


def test_sample_hash_catches_a_zeroed_tail_at_the_start(workdir, cache, tmp_path, capsys):
    """Zeros after an intact header load as finite zeros; the sample (first and last
    MiB, here the whole file) is checked before training starts."""
    shard = cache / "shard-000003.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[:-64] + bytes(64))
    refused(capsys, train_argv(workdir, cache, tmp_path / "run"), 1,
            "1 broken file(s) (shard-000003.safetensors: its first or last MiB differs from the manifest")


def test_an_older_manifest_without_digest_is_sealed_by_prepare(workdir, cache, tmp_path, capsys):
    """An older format-3 manifest (no digest, no samples) is refused with the prepare
    command that seals it; that rerun hashes the shards and runs the target for none."""
    m = manifest(cache)
    for entry in [*m["shards"], m["head"]]:
        del entry["sample"]
    del m["digest"]
    write(cache, m, seal=False)
    _, line = refused(capsys, train_argv(workdir, cache, tmp_path / "run"), 1,
                      f"{cache / MANIFEST} has no digest (written by an eagle3fn before manifests carried one)",
                      "it checks every shard's sha256 and writes the digest")
    command = line.split("(eagle3fn prepare ")[1].split(")")[0]
    argv = ("prepare " + command).replace("<target dir>", str(workdir / "model"))
    argv = argv.replace("<chat.jsonl>", str(workdir / "chat.jsonl")).split()
    code, out, err = cli(capsys, argv)
    assert code == 0 and "wrote shard" not in out, out + err
    assert manifest(cache) == manifest(workdir / "built")


def test_a_whole_cache_trains(workdir, cache, tmp_path, capsys):
    """Control: the untouched cache passes the same checks and trains."""
    code, out, err = cli(capsys, train_argv(workdir, cache, tmp_path / "run"))
    assert code == 0, err
    code, out, _ = cli(capsys, ["cache", "verify", str(cache)])
    assert code == 0 and out.strip().endswith("OK")


# ---- manifests mutated at random ----------------------------------------------------

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.sampled_from([0, 1, -1, 2**63])
    | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=12)
    | st.sampled_from(["", "0" * 64, "shard-000009.safetensors", "../x.safetensors", "bfloat16", "float8_e4m3"]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6)


@st.composite
def mutations(draw, base):
    """A manifest with one to three random edits: a field dropped, added or replaced by
    another JSON value (at any depth), or an integer moved by a small amount."""
    m = copy.deepcopy(base)
    for _ in range(draw(st.integers(1, 3))):
        node, path = m, []
        while isinstance(node, (dict, list)) and node and draw(st.booleans()):
            key = draw(st.sampled_from(sorted(node) if isinstance(node, dict) else range(len(node))))
            if not isinstance(node[key], (dict, list)) or not node[key]:
                break
            node, path = node[key], [*path, key]
        if not isinstance(node, (dict, list)) or not node:
            continue
        keys = sorted(node) if isinstance(node, dict) else list(range(len(node)))
        key = draw(st.sampled_from(keys))
        action = draw(st.sampled_from(["drop", "add", "replace", "nudge"]))
        if action == "drop":
            del node[key]
        elif action == "add" and isinstance(node, dict):
            node[draw(st.text(min_size=1, max_size=8))] = draw(JSON_VALUES)
        elif action == "nudge" and isinstance(node[key], int) and not isinstance(node[key], bool):
            node[key] += draw(st.sampled_from([-1, 1, 7]))
        else:
            node[key] = draw(JSON_VALUES)
    return m


def _same(a, b) -> bool:
    """Equal as JSON (NaN equal to NaN)."""
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True) or (
        isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))


@pytest.mark.parametrize("seal", [False, True])
def test_mutated_manifests_never_pass_silently(workdir, tmp_path_factory, capsys, seal):
    """Every mutation, with the digest left as it was or re-sealed to match: ``cache
    verify`` and the training check refuse it in one line naming the cache (or, for a
    mutation that changes nothing, pass); never a traceback, never exit 0 on a changed
    manifest. Re-sealed mutations that touch only descriptive fields the shards cannot
    contradict (fingerprint values, counts of supervised tokens, ...) are the one thing
    a digest cannot see: those must at least keep the shards whole and be what verify
    reads back."""
    base = manifest(workdir / "built")
    root = tmp_path_factory.mktemp("mut")
    cache = shutil.copytree(workdir / "built", root / "cache")

    @settings(max_examples=30, suppress_health_check=list(HealthCheck))
    @given(mutations({k: v for k, v in base.items() if k != "digest"}))
    def check(m):
        m = m if seal else {**m, "digest": base["digest"]}
        write(cache, m, seal=seal)
        unchanged = _same({**m, "digest": base["digest"]}, base)
        for argv in (["cache", "verify", str(cache)], ["cache", "info", str(cache)]):
            code, out, err = cli(capsys, argv)
            assert "Traceback" not in out + err, (m, err)
            if unchanged:
                assert code == 0, (m, err)
                continue
            if code == 0:  # a re-sealed, descriptive-only edit
                assert seal, (argv, m, out)
                continue
            lines = [line for line in err.splitlines() if line.startswith("eagle3fn: error:")]
            assert code in (1, 2) and len(lines) == 1, (argv, m, code, err)
            assert str(cache) in lines[0], lines[0]
        if not seal and not unchanged:
            with pytest.raises((RunError, ValueError)):
                check_cache_for_training(cache, model_dir=workdir / "model")
    check()

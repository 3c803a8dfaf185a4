"""The eagle3fn command: flags frozen, output checked, editable and regular installs."""

import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

from eagle3fn.cli.main import main

ROOT = pathlib.Path(__file__).resolve().parents[1]

# Changing a flag is a user-visible change: update this set on purpose.
FLAGS = {
    "rowmap": {"--mask", "--ttt-length", "--num-rows"},
    "verify": {"--batch", "--seq-len", "--vocab", "--draft-vocab", "--ttt-length",
               "--density", "--pattern", "--seeds", "--dtype", "--loss.step-weight-decay",
               "--loss.normalization", "--loss.objective", "--loss.kl-scale",
               "--loss.kl-decay"},
    "vocab": {"--model.path", "--model.gguf-file", "--model.dtype", "--model.device", "--data.path",
              "--data.max-length", "--data.on-error", "--draft-vocab-size", "--vocab-size", "--out",
              "--overwrite", "--no-overwrite"},
    "prepare": {"--model.path", "--model.gguf-file", "--model.dtype", "--model.device", "--data.path",
                "--data.max-length", "--data.on-error", "--out", "--batch-size", "--aux-layer-ids",
                "--storage", "--aux-dtype", "--compile-target", "--no-compile-target", "--overwrite",
                "--no-overwrite"},
    "cache": set(),
    "regenerate": {"--model.path", "--model.gguf-file", "--model.dtype", "--model.device",
                   "--data.path", "--data.max-length", "--data.on-error", "--out",
                   "--generation.max-new-tokens", "--generation.temperature", "--generation.top-p",
                   "--generation.batch-size", "--generation.seed"},
    "train": {"--model", "--gguf-file", "--data", "--cache", "--out-dir", "--vocab-map",
              "--draft-vocab-size", "--aux-layer-ids", "--max-length", "--allow-long", "--no-allow-long",
              "--memory-check", "--no-memory-check", "--pack", "--no-pack", "--pack-length",
              "--pack-window", "--on-error",
              "--ttt-length",
              "--trim", "--trim-loss-positions", "--no-trim-loss-positions",
              "--loss.step-weight-decay", "--loss.normalization", "--loss.objective",
              "--loss.kl-scale", "--loss.kl-decay", "--lr", "--warmup-ratio", "--weight-decay",
              "--grad-clip", "--batch-size", "--grad-accum", "--epochs", "--max-steps", "--seed",
              "--save-every", "--log-every", "--device", "--parallel.ulysses", "--parallel.ring", "--parallel.timeout-s", "--eval-holdout", "--eval-every",
              "--eval-accept-prompts", "--eval-accept-tokens",
              "--tensorboard", "--no-tensorboard", "--preset",
              "--precision", "--compile-step", "--no-compile-step", "--compile-target", "--no-compile-target", "--on-nonfinite", "--ttt.attention", "--ttt.loss-impl", "--ttt.fused-head",
              "--ttt.no-fused-head", "--ttt.head-chunk-rows", "--ttt.teacher-chunk-size",
              "--ttt.auto-backbone-fraction", "--ttt.auto-loss-share", "--ttt.auto-min-rows",
              "--ttt.compile-elementwise", "--ttt.no-compile-elementwise", "--ttt.query-buckets",
              "--ttt.flex-kernel-options"},
    "export": {"--run", "--out", "--dtype", "--format", "--best", "--no-best", "--overwrite", "--no-overwrite"},
    "eval": {"--run", "--prompts", "--num-prompts", "--num-draft-tokens", "--max-new-tokens", "--temperature",
             "--batch-size", "--baseline", "--no-baseline", "--untrained", "--no-untrained", "--json", "--draft", "--model", "--aux-layer-ids", "--device", "--dtype", "--impl"},
    "plan": {"--attention", "--auto-backbone-fraction", "--auto-loss-share", "--auto-min-rows", "--batch",
             "--density", "--draft-vocab",
             "--dtype-bytes", "--gpu-memory-gib", "--head-chunk-rows", "--head-dim", "--heads",
             "--hidden", "--intermediate", "--kv-heads", "--loss-impl", "--no-optimizer", "--optimizer",
             "--pattern", "--seq-len", "--sp", "--target-hidden", "--teacher-chunk-size", "--trim",
             "--ttt-length", "--vocab", "--world"},
    "version": set(),
}


def help_flags(capsys, command):
    with pytest.raises(SystemExit):
        main([command, "--help"])
    text = capsys.readouterr().out
    return set(re.findall(r"(--[a-z][a-z0-9.-]*[a-z0-9])", text)) - {"--help"}


@pytest.mark.parametrize("command", sorted(FLAGS))
def test_flag_set_is_frozen(capsys, command):
    assert help_flags(capsys, command) == FLAGS[command]


def test_rowmap_prints_the_golden_table(capsys):
    main(["rowmap", "--mask", "0000111", "--ttt-length", "3", "--num-rows", "4"])
    out = capsys.readouterr().out
    assert "teacher positions U = [4, 5]" in out
    lines = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit()]
    assert lines[0][:2] == ["0", "[]"] and "(dead)" in lines[0]
    assert lines[2][:3] == ["2", "[2,", "3]"]


def test_bad_mask_is_a_clear_error(capsys):
    with pytest.raises(SystemExit):
        main(["rowmap", "--mask", "01", "012"])
    captured = capsys.readouterr()
    text = " ".join((captured.out + captured.err).split())
    assert "--mask takes 0/1 strings of one length, got ['01', '012']" in text


def test_verify_passes_and_reports(capsys):
    main(["verify", "--batch", "2", "--seq-len", "24", "--vocab", "64", "--draft-vocab", "16",
          "--seeds", "2", "--pattern", "scattered", "--loss.objective", "lambda"])
    out = capsys.readouterr().out
    assert out.strip().splitlines()[-1].startswith("PASS")


def _run(cmd, **kw):
    return subprocess.run(cmd, capture_output=True, text=True, check=True, **kw)


def test_console_script_in_this_install():
    exe = shutil.which("eagle3fn")
    assert exe, "the eagle3fn console script is not on PATH"
    import eagle3fn

    assert _run([exe, "version"]).stdout.strip() == eagle3fn.__version__
    assert _run([exe, "--version"]).stdout.strip() == eagle3fn.__version__
    assert _run([sys.executable, "-m", "eagle3fn.cli", "version"]).stdout.strip() == eagle3fn.__version__


def test_regular_install(tmp_path):
    """`pip install .` (not editable) into a fresh target: the CLI package comes along."""
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(
        ".venv", ".git", "build", "*.egg-info", "__pycache__", ".pytest_cache", ".hypothesis"))
    target = tmp_path / "site"
    _run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation",
          "--no-index", "--quiet", "--target", str(target), str(src)])
    env = {**os.environ, "PYTHONPATH": str(target)}
    # Every eagle3fn module must come from the regular install (a subpackage missing
    # from the wheel would otherwise be found through the editable install's finder).
    where = _run([sys.executable, "-c", "import sys, eagle3fn.cli.main, eagle3fn.loss; "
                  "print('\\n'.join(m.__file__ for n, m in sys.modules.items() "
                  "if n.startswith('eagle3fn') and getattr(m, '__file__', None)))"],
                 env=env, cwd=tmp_path).stdout.split()
    assert len(where) > 5 and all(w.startswith(str(target)) for w in where), where
    out = _run([sys.executable, str(target / "bin" / "eagle3fn"), "rowmap", "--mask", "0110"],
               env=env, cwd=tmp_path).stdout
    assert "teacher positions U = [1, 2]" in out


def test_version_comes_from_the_package_metadata():
    """One source of truth: pyproject.toml's version is what eagle3fn reports."""
    import tomllib

    import eagle3fn

    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert eagle3fn.__version__ == declared != "0+unknown"


def test_public_api_names_the_stages():
    """``eagle3fn.ttt`` is the function (not a module); every exported name is documented."""
    import inspect

    import eagle3fn
    from eagle3fn.unrolled import ttt

    assert eagle3fn.ttt is ttt and callable(eagle3fn.ttt) and not inspect.ismodule(eagle3fn.ttt)
    undocumented = [n for n in eagle3fn.__all__ if not inspect.getdoc(getattr(eagle3fn, n))]
    assert not undocumented, undocumented


def test_eagle3fn_compile_0_reaches_train_and_plan(monkeypatch, capsys):
    """``EAGLE3FN_COMPILE=0``, read once by the CLI (nothing reads it at import), turns
    ``TTTConfig.compile_elementwise`` off for ``train`` (even beside the flag) and makes
    ``plan`` plan the eager chains; unset, both keep the config's value (control)."""
    from eagle3fn.cli.main import settings_from_environment, with_settings
    from eagle3fn.train.config import TrainConfig, TTTOptions

    off, unset = settings_from_environment({"EAGLE3FN_COMPILE": "0"}), settings_from_environment({})
    assert with_settings(TrainConfig(), off)[0].ttt.compile_elementwise is False
    assert with_settings(TrainConfig(ttt=TTTOptions(compile_elementwise=True)), off)[0].ttt.compile_elementwise is False
    assert with_settings(TrainConfig(), unset)[0].ttt.compile_elementwise is True
    assert with_settings(TrainConfig(ttt=TTTOptions(compile_elementwise=False)), unset)[0].ttt.compile_elementwise \
        is False
    lines = []
    for value in ("0", "1"):
        monkeypatch.setenv("EAGLE3FN_COMPILE", value)
        main(["plan", "--seq-len", "512"])
        lines.append(capsys.readouterr().out.splitlines()[0])
    assert "eager elementwise" in lines[0] and "eager elementwise" not in lines[1], lines


def test_a_flag_given_beside_a_preset_wins_even_at_the_class_default(monkeypatch, tmp_path):
    """``--preset demo --epochs 1`` trains one epoch (1 is the class default, which the
    preset would otherwise replace by its 3); a flag not given takes the preset's value
    (control), and ``--pack`` (class default True) beats the demo's ``pack`` False."""
    from eagle3fn.cli import main as cli
    from eagle3fn.train.config import TrainConfig

    seen = []
    monkeypatch.setitem(cli.COMMANDS, "train", (TrainConfig, seen.append))
    out = ["--out-dir", str(tmp_path)]
    for argv in (["--epochs", "1"], ["--epochs=1", "--pack"], [], ["--preset", "demo", "--max-length", "1024"]):
        main(["train", *argv, *out])
    given, given_eq, control, other = seen
    assert given.preset == "demo" and given.epochs == 1 and given.pack is False
    assert given_eq.epochs == 1 and given_eq.pack is True
    assert control.epochs == 3 and control.pack is False and control.max_length == 512
    assert other.max_length == 1024 and other.epochs == 3
    assert cli.flag_fields(["--no-pack", "--max_length=4", "1", "--ttt.attention", "eager"]) >= {"pack", "max_length"}
    assert TrainConfig.with_preset("demo", out_dir=str(tmp_path), epochs=1).epochs == 1
    assert TrainConfig(preset="demo", out_dir=str(tmp_path), epochs=1).epochs == 3  # no names given: preset's

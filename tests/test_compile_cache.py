"""The run's compile cache (``train.compile_cache``): what one process compiled, saved
beside the run, makes a process with empty compile caches hit instead of compiling.

Each side runs in its own interpreter with its own empty ``TORCHINDUCTOR_CACHE_DIR``
(what a new machine has), compiling one small function with inductor on the CPU.
The writer (what the training loop calls after a checkpoint) writes only when graphs
were compiled since its last write. Control: in the fresh process, a graph compiled
before the file is loaded misses.
"""

import json
import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    import torch
    from torch._dynamo.utils import counters
    from eagle3fn.train.compile_cache import CompileCacheWriter, load_compile_cache

    mode, out = sys.argv[1], Path(sys.argv[2])
    x = torch.arange(48, dtype=torch.float32).reshape(6, 8) / 10

    def f(x):
        return torch.nn.functional.silu(x) * x.square().mean(-1, keepdim=True).rsqrt()

    def g(x):  # another graph: the control of an empty local cache
        return torch.nn.functional.gelu(x) * x.abs().amax(-1, keepdim=True)

    result = {}
    if mode == "load":
        torch.compile(g, backend="inductor", dynamic=False)(x)
        result["control"] = dict(counters["inductor"])
        result["loaded"] = load_compile_cache(out, print)
    writer = CompileCacheWriter(out, print)
    assert writer.update() == 0  # nothing compiled since the writer started: nothing written
    y = torch.compile(f, backend="inductor", dynamic=False)(x)
    assert torch.allclose(y, f(x))
    if mode == "save":
        result["saved"] = writer.update()
        assert writer.update() == 0  # no graph compiled since: not written again
    result.update(hit=counters["inductor"]["fxgraph_cache_hit"], miss=counters["inductor"]["fxgraph_cache_miss"])
    print(json.dumps(result))
""")


def _run(mode: str, out, cache_dir) -> dict:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache_dir), "OMP_NUM_THREADS": "1"}
    env.pop("TORCHINDUCTOR_FX_GRAPH_CACHE", None)
    proc = subprocess.run([sys.executable, "-c", SCRIPT, mode, str(out)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_saved_compile_cache_makes_a_fresh_machine_hit(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    first = _run("save", out, tmp_path / "cache-a")
    assert first["saved"] > 0 and first["miss"] >= 1 and first["hit"] == 0
    assert (out / "compile-cache.bin").stat().st_size > 0
    fresh = _run("load", out, tmp_path / "cache-b")  # an empty local cache, then the file loaded
    assert fresh["control"].get("fxgraph_cache_miss", 0) >= 1 and not fresh["control"].get("fxgraph_cache_hit")
    assert fresh["loaded"] > 0 and fresh["hit"] >= 1 and fresh["miss"] == fresh["control"]["fxgraph_cache_miss"]


def test_an_unreadable_compile_cache_is_reported_and_ignored(tmp_path):
    from eagle3fn.train.compile_cache import COMPILE_CACHE, load_compile_cache

    (tmp_path / COMPILE_CACHE).write_bytes(b"not a cache")
    lines = []
    assert load_compile_cache(tmp_path, lines.append) == 0
    assert len(lines) == 1 and "could not load" in lines[0] and COMPILE_CACHE in lines[0]
    assert load_compile_cache(tmp_path / "absent", lines.append) == 0 and len(lines) == 1

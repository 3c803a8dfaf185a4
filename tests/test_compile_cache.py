"""The run's compile cache (``train.compile_cache``): what one run compiled, saved beside
it, makes a run with empty compile caches hit instead of compiling.

One interpreter (inductor on the CPU, one small function) runs three phases, each in a
new empty local cache (``torch._inductor.utils.fresh_cache``, what a new machine has,
dynamo reset): compile and save through the writer the training loop calls after a
checkpoint (which writes only when graphs were compiled since its last write), then the
control (nothing loaded: a miss), then load and compile (a hit, no miss).
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest
from test_train import workdir  # noqa: F401 - the tiny target + data fixture

from eagle3fn.train.compile_cache import COMPILE_CACHE

SCRIPT = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    import torch
    from torch._dynamo.utils import counters
    from torch._inductor.utils import fresh_cache
    from eagle3fn.train.compile_cache import CompileCacheWriter, load_compile_cache

    out = Path(sys.argv[1])
    x = torch.arange(48, dtype=torch.float32).reshape(6, 8) / 10

    def f(x):
        return torch.nn.functional.silu(x) * x.square().mean(-1, keepdim=True).rsqrt()

    def phase(mode):
        torch._dynamo.reset()
        counters.clear()
        with fresh_cache():
            loaded = load_compile_cache(out, print) if mode == "load" else 0
            writer = CompileCacheWriter(out, print)
            assert writer.update() == 0  # nothing compiled since the writer started: nothing written
            y = torch.compile(f, backend="inductor", dynamic=False)(x)
            assert torch.allclose(y, f(x))
            saved = writer.update() if mode == "save" else 0
            assert writer.update() == 0 or mode != "save"  # no graph compiled since: not written again
            return {"loaded": loaded, "saved": saved, "hit": counters["inductor"]["fxgraph_cache_hit"],
                    "miss": counters["inductor"]["fxgraph_cache_miss"]}

    print(json.dumps({mode: phase(mode) for mode in ("save", "control", "load")}))
""")


def test_saved_compile_cache_makes_an_empty_cache_hit(tmp_path):
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"), "OMP_NUM_THREADS": "1"}
    env.pop("TORCHINDUCTOR_FX_GRAPH_CACHE", None)
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["save"]["saved"] > 0 and got["save"]["miss"] >= 1 and got["save"]["hit"] == 0
    assert (tmp_path / "compile-cache.bin").stat().st_size > 0
    assert got["control"]["hit"] == 0 and got["control"]["miss"] >= 1  # an empty cache, nothing loaded
    assert got["load"]["loaded"] > 0 and got["load"]["hit"] >= 1 and got["load"]["miss"] == 0


def test_an_unreadable_compile_cache_is_reported_and_ignored(tmp_path):
    from eagle3fn.train.compile_cache import COMPILE_CACHE, load_compile_cache

    (tmp_path / COMPILE_CACHE).write_bytes(b"not a cache")
    lines = []
    assert load_compile_cache(tmp_path, lines.append) == 0
    assert len(lines) == 1 and "could not load" in lines[0] and COMPILE_CACHE in lines[0]
    assert load_compile_cache(tmp_path / "absent", lines.append) == 0 and len(lines) == 1


def test_the_loop_writes_the_cache_after_a_checkpoint_and_on_a_stop(workdir, tmp_path, monkeypatch):  # noqa: F811
    """The training loop's wiring: a run that compiled graphs writes the cache after a
    checkpoint, and a run stopped by SIGTERM between checkpoints writes it with the
    stop's own save (a preempted run resumes warm elsewhere). Compilation is simulated
    (dynamo's graph counter grows at every read, the artifacts are fixed bytes) on a
    tiny CPU run. Control: a run that compiled nothing writes no file."""
    import signal
    import time

    import torch
    from test_train import config
    from torch.compiler._cache import CacheInfo

    from eagle3fn.io.stop import Stopped
    from eagle3fn.train import compile_cache, train

    info = CacheInfo()
    info.artifacts["inductor"].append("key")
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: (b"artifacts", info))
    monkeypatch.setattr(compile_cache, "_graphs", lambda: 0)  # the control: nothing compiled
    train(config(workdir, tmp_path / "none", max_steps=2), log=lambda s: None)
    assert not (tmp_path / "none" / COMPILE_CACHE).exists()

    graphs = iter(range(10 ** 6))
    monkeypatch.setattr(compile_cache, "_graphs", lambda: next(graphs))  # new graphs at every read
    train(config(workdir, tmp_path / "saved", max_steps=2), log=lambda s: None)
    assert (tmp_path / "saved" / COMPILE_CACHE).read_bytes() == b"artifacts"

    def stop_at_1(step):
        if step == 1:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)  # the handler runs between bytecodes

    with pytest.raises(Stopped):
        train(config(workdir, tmp_path / "stopped", max_steps=4, save_every=1000), log=lambda s: None,
              on_step=stop_at_1)
    assert (tmp_path / "stopped" / COMPILE_CACHE).read_bytes() == b"artifacts"

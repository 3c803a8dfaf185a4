"""One TTT training step (forward + backward, teacher included, no optimizer) at the
BENCH.md "8B shapes", eagle3fn's paths beside SpecForge 0.2.0 in the same process.

    python benchmarks/step.py --seq-lens 8192 --modes specforge none loss --json out.json

Protocol (../shared/BENCH.md): bf16 weights and activations, fp32 loss math, random
seeded inputs in the offline layout (aux ``[1, S, 12288]``, final hidden
``[1, S, 4096]``, random bf16 target head with the draft rows scaled by 1.5), 2+
warm-ups then the median of >= 6 steps timed with CUDA events; peak =
``max_memory_allocated`` after ``reset_peak_memory_stats``. Prints a table last.
"""

from __future__ import annotations

import gc
import json
import platform
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Literal

import torch
import tyro

from eagle3fn.align import shift_left, supervised_mask
from eagle3fn.draft import DraftConfig, init_params
from eagle3fn.rowmap import build_rowmap
from eagle3fn.shapes import Features
from eagle3fn.unrolled import TTTConfig, choose_trim, ttt
from eagle3fn.vocab import build_vocab_map
from meta import run_metadata
from timing import cuda_timed

Mode = Literal["specforge", "none", "loss", "backbone", "auto", "loss-mesh"]


@dataclass(kw_only=True)
class BenchArgs:
    """Benchmark settings (defaults: BENCH.md's standard configuration)."""

    seq_lens: tuple[int, ...] = (8192,)
    """Sequence lengths S to run."""
    densities: tuple[float, ...] = (0.3,)
    """Fractions of supervised positions to run."""
    patterns: tuple[Literal["tail", "scattered"], ...] = ("tail",)
    """Contiguous tail (prompt-heavy chat) and/or scattered at random."""
    modes: tuple[Mode, ...] = ("none", "loss", "specforge")
    """What to time: SpecForge 0.2.0 (flex attention), eagle3fn trim=none / loss /
    backbone / auto;
    ``loss-mesh``: trim=loss through ``eagle3fn.parallel`` on a one-process group
    (DTensor-sharded params gathered, sums all-reduced, gradients reduce-scattered)."""
    warmup: int = 2
    """Untimed steps first."""
    iters: int = 6
    """Timed steps (median reported)."""
    hidden: int = 4096
    intermediate: int = 14336
    heads: int = 32
    kv_heads: int = 8
    vocab: int = 128256
    draft_vocab: int = 32000
    ttt_length: int = 7
    head_chunk_rows: int | None = None
    """eagle3fn modes: rows per chunk of the fused head (None: ``TTTConfig``'s default)."""
    flex_kernel_options: str | None = None
    """eagle3fn modes: FlexAttention ``kernel_options`` as a JSON object (``null``: none,
    inductor's defaults); not given: ``TTTConfig.flex_kernel_options``' default."""
    json: str | None = None
    """Write the results here as JSON."""
    profile: str | None = None
    """Profile one step of each mode after timing and write the kernel tables here."""
    isolate: bool = False
    """Run every (S, pattern, density, mode) in its own process, so that every peak
    starts from a clean GPU (a process keeps about 1.75 GiB of SpecForge's weights after
    its mode, which shows in the next modes' peaks). Slower: each process compiles its
    kernels again."""
    optimizer: bool = False
    """eagle3fn modes: time a training step as ``eagle3fn train`` runs it on CUDA: fp32
    master weights, bf16 compute copies (gradients flow back through the cast),
    fp32 gradients and the AdamW step included; the peak then holds the optimizer
    state (compare ``eagle3fn plan --optimizer``)."""
    host_profile: str | None = None
    """Append where the host time of one step of each mode goes to this file: torch
    profiler CPU ops by total and by self CPU time (forward and autograd's backward
    threads), and cProfile of the forward's Python (backward runs in autograd's
    threads, which cProfile does not see)."""
    diagnose: bool = False
    """Also report per mode: host ms (time for the Python of one step to return, before
    the GPU finishes), GPU busy ms (sum of kernel times in a profiled step), kernel
    launches and host-device syncs in one step (``torch.cuda.set_sync_debug_mode``).
    A step is host-bound when its median is near its host ms, not its busy ms."""


def matmul_tflops() -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ a
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        a @ a
    torch.cuda.synchronize()
    return 10 * 2 * 8192**3 / (time.perf_counter() - t) / 1e12


def make_inputs(args: BenchArgs, S: int, density: float, pattern: str):
    g = torch.Generator(device="cuda").manual_seed(S)
    bf = dict(device="cuda", dtype=torch.bfloat16)
    counts = torch.randint(0, 10**6, (args.vocab,), generator=g, device="cuda")
    d2t, t2d = build_vocab_map(counts, args.draft_vocab)
    head = torch.randn(args.vocab, args.hidden, generator=g, **bf) * 0.02
    head[t2d] *= 1.5
    pos = torch.arange(S, device="cuda")[None]
    if pattern == "tail":
        loss_mask = pos >= int(S * (1 - density))
    else:
        loss_mask = torch.rand(1, S, generator=g, device="cuda") < density
    features = Features(
        input_ids=torch.randint(0, args.vocab, (1, S), generator=g, device="cuda"),
        aux=torch.randn(1, S, 3 * args.hidden, generator=g, **bf),
        attention_mask=torch.ones(1, S, dtype=torch.long, device="cuda"),
        final_hidden=torch.randn(1, S, args.hidden, generator=g, **bf),
        target_head=head,
    )
    return features, loss_mask, d2t, t2d


def draft_config(args: BenchArgs) -> DraftConfig:
    return DraftConfig(hidden_size=args.hidden, intermediate_size=args.intermediate,
                       num_heads=args.heads, num_kv_heads=args.kv_heads, vocab_size=args.vocab,
                       draft_vocab_size=args.draft_vocab)


def step_config(args, cfg, trim) -> TTTConfig:
    """The TTT config of an eagle3fn mode's step."""
    chunk = {} if args.head_chunk_rows is None else dict(head_chunk_rows=args.head_chunk_rows)
    return TTTConfig(draft=cfg, ttt_length=args.ttt_length, trim=trim, attention="flex", **chunk,
                     **flex_options(args))


def flex_options(args) -> dict:
    """``TTTConfig(flex_kernel_options=...)`` from ``--flex-kernel-options`` (nothing when
    not given: the config's default)."""
    if args.flex_kernel_options is None:
        return {}
    given = json.loads(args.flex_kernel_options) or {}
    return dict(flex_kernel_options=tuple(given.items()) or None)


def auto_path(args, cfg, features, loss_mask) -> str:
    """The path ``trim="auto"`` takes on this batch (its row map is freed on return,
    so it does not count in the timed step's peak)."""
    rm = build_rowmap(supervised_mask(loss_mask, features.attention_mask), args.ttt_length)
    return choose_trim(rm, step_config(args, cfg, "auto"))


def eagle3fn_step(args, cfg, params, features, loss_mask, d2t, t2d, trim):
    config = step_config(args, cfg, trim)
    if args.optimizer:
        return training_step(args, config, params, features, loss_mask, d2t, t2d)

    def step():
        rm = build_rowmap(supervised_mask(loss_mask, features.attention_mask), args.ttt_length)
        out = ttt(params, features, rm, config, d2t=d2t, t2d=t2d)
        out.objective.backward()
        for p in params.values():
            p.grad = None
        return out
    return step


def training_step(args, config, params, features, loss_mask, d2t, t2d):
    """One optimizer step as ``train.loop`` takes it on CUDA (fp32 masters, bf16 copies,
    gradient clipping, AdamW with the loop's betas). docs/bench/step-262144-optimizer.json
    was measured before the clipping was added here."""
    masters = init_params(config.draft, seed=0, device="cuda")  # fp32, as the loop's
    trainable = [p for p in masters.values() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-4, betas=(0.9, 0.95), weight_decay=0.0)

    def step():
        rm = build_rowmap(supervised_mask(loss_mask, features.attention_mask), args.ttt_length)
        out = ttt({n: p.to(torch.bfloat16) for n, p in masters.items()}, features, rm, config,
                  d2t=d2t, t2d=t2d)
        out.objective.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 0.5)  # TrainConfig.grad_clip's default
        opt.step()
        opt.zero_grad(set_to_none=True)
        return out
    return step


def mesh_step(args, cfg, params, features, loss_mask, d2t, t2d):
    """trim=loss with the distributed code active on a one-process group."""
    from eagle3fn.parallel import (ParallelConfig, build_layout, collectives, gather,
                                   init_distributed, reduce_grads, shard)

    device = torch.device("cuda")
    init_distributed(device)
    layout = build_layout(ParallelConfig(), device)
    sharded = shard(params, layout)
    config = TTTConfig(draft=cfg, ttt_length=args.ttt_length, trim="loss", attention="flex",
                       **flex_options(args))

    def step():
        rm = build_rowmap(supervised_mask(loss_mask, features.attention_mask), args.ttt_length)
        whole = gather(sharded)
        out = ttt(whole, features, rm, config, d2t=d2t, t2d=t2d,
                  collectives=collectives(layout, rm.denominator, device,
                                          compile_elementwise=config.compile_elementwise))
        out.objective.backward()
        reduce_grads(sharded, whole)
        for p in sharded.values():
            p.grad = None
        return out
    return step


def specforge_step(args, cfg, params, features, loss_mask, d2t, t2d):
    from transformers import LlamaConfig
    from specforge.algorithms.eagle3.model import OnlineEagle3Model
    from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3

    config = LlamaConfig(hidden_size=args.hidden, intermediate_size=args.intermediate,
                         num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                         head_dim=cfg.d, vocab_size=args.vocab, draft_vocab_size=args.draft_vocab,
                         num_hidden_layers=1, max_position_embeddings=max(args.seq_lens) + 64,
                         rms_norm_eps=cfg.rms_norm_eps, rope_theta=cfg.rope.theta,
                         tie_word_embeddings=False)
    with torch.device("cuda"):
        draft = LlamaForCausalLMEagle3(config, attention_backend="flex_attention")
    draft = draft.to(torch.bfloat16)
    state = {n: p.detach() for n, p in params.items()}
    state.update(d2t=d2t, t2d=t2d)
    draft.load_state_dict(state, strict=True)
    draft.freeze_embedding()
    model = OnlineEagle3Model(draft_model=draft, length=args.ttt_length,
                              attention_backend="flex_attention")
    # Its data path: ids' and z' shifted left, loss mask unshifted [B, S, 1].
    ids = shift_left(features.input_ids)
    lm = loss_mask.clone()
    lm[:, -1] = False

    def step():
        target = shift_left(features.final_hidden) @ features.target_head.T  # z', bf16
        plosses, *_ = model(input_ids=ids, attention_mask=features.attention_mask, target=target,
                            loss_mask=lm[..., None].int(), hidden_states=features.aux)
        sum(0.8**j * p for j, p in enumerate(plosses)).backward()
        draft.zero_grad(set_to_none=True)
        return plosses
    return step


def timed(step, warmup: int, iters: int) -> tuple[float, float]:
    ms, peak, _ = cuda_timed(step, warmup, iters)
    return ms, peak / 2**30


def diagnose(step, iters: int) -> dict:
    """Host ms, GPU busy ms, kernel launches and syncs of one step (see ``--diagnose``)."""
    import warnings

    from torch.profiler import ProfilerActivity, profile

    host = []
    for _ in range(iters):
        torch.cuda.synchronize()
        t = time.perf_counter()
        step()
        host.append((time.perf_counter() - t) * 1e3)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    syncs = sum("synchroniz" in str(w.message) for w in caught)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    kernels = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    return dict(host_ms=round(statistics.median(host), 2),
                busy_ms=round(sum(e.self_device_time_total for e in kernels) / 1e3, 2),
                kernels=sum(e.count for e in kernels), syncs=syncs)


def profile_step(step, path: str, title: str) -> None:
    """Append the top kernels and ops of one profiled step to ``path``."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    with open(path, "a") as f:
        f.write(f"\n==== {title}\n")
        f.write(prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=70))


def host_profile_step(step, path: str, title: str) -> None:
    """Append the host side of one step to ``path`` (see ``--host-profile``)."""
    import cProfile
    import io
    import pstats

    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    torch.cuda.synchronize()
    averages = prof.key_averages()
    tables = [averages.table(sort_by=key, row_limit=45, max_name_column_width=80)
              for key in ("cpu_time_total", "self_cpu_time_total")]
    forward = cProfile.Profile()
    real_backward = torch.Tensor.backward
    torch.Tensor.backward = lambda self, *a, **k: (forward.disable(), real_backward(self, *a, **k))[1]
    try:
        forward.enable()
        step()
        forward.disable()
    finally:
        torch.Tensor.backward = real_backward
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(forward, stream=text).sort_stats("tottime").print_stats(40)
    pstats.Stats(forward, stream=text).sort_stats("cumulative").print_stats(40)
    with open(path, "a") as f:
        f.write(f"\n==== {title}\n" + "\n".join(tables) + "\n---- cProfile, forward\n" + text.getvalue())


def isolated(args: BenchArgs, ceiling: float) -> list[dict]:
    """``measure`` of each (S, pattern, density, mode) in a fresh Python process."""
    import subprocess
    import sys
    from pathlib import Path

    rows = []
    for S in args.seq_lens:
        for pattern in args.patterns:
            for density in args.densities:
                for mode in args.modes:
                    one = asdict(args) | dict(seq_lens=[S], patterns=[pattern], densities=[density],
                                              modes=[mode], json=None, isolate=False)
                    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); import step; "
                            "print('ROWS=' + json.dumps(step.measure(step.BenchArgs(**json.loads(sys.argv[2])))[1]))")
                    out = subprocess.run([sys.executable, "-c", code, str(Path(__file__).parent),
                                          json.dumps(one)], capture_output=True, text=True)
                    found = [line for line in out.stdout.splitlines() if line.startswith("ROWS=")]
                    if out.returncode or not found:
                        raise RuntimeError(f"S={S} {pattern} {density} {mode} failed:\n{out.stderr[-3000:]}")
                    rows += json.loads(found[-1][len("ROWS="):])
                    print(rows[-1], flush=True)
                    write_json(args, ceiling, rows)
    return rows


OUTPUT_PATHS = ("json", "profile", "host_profile")


def resolved_args(args: BenchArgs) -> dict:
    """``args`` as the run used them, for its JSON (``meta.run_metadata`` refuses a
    ``None``): ``head_chunk_rows`` from the eagle3fn modes' ``TTTConfig``,
    ``flex_kernel_options`` as passed to FlexAttention (``{}``: none, inductor's
    defaults); output paths that were not given are left out."""
    resolved = {k: v for k, v in asdict(args).items() if not (k in OUTPUT_PATHS and v is None)}
    resolved["head_chunk_rows"] = step_config(args, draft_config(args), "none").head_chunk_rows
    resolved["flex_kernel_options"] = flex_options_used(args)
    return resolved


def flex_options_used(args: BenchArgs) -> dict:
    """The FlexAttention ``kernel_options`` of the eagle3fn modes (``{}``: none): the
    flag's, or the library's when the flag is not given."""
    given = args.flex_kernel_options
    return dict((step_config(args, draft_config(args), "none").flex_kernel_options if given is None
                 else json.loads(given)) or {})


def write_json(args: BenchArgs, ceiling: float, rows: list[dict]) -> None:
    if args.json:  # after every row: a killed run keeps what it measured
        with open(args.json, "w") as f:
            json.dump(dict(run_metadata(resolved_args(args)), matmul_tflops=ceiling, results=rows,
                           compile_elementwise=step_config(args, draft_config(args), "none").compile_elementwise,
                           # gVisor reports kernel 4.4.0; its kernel launches cost far more host time
                           kernel=platform.release()), f, indent=1)


def main(args: BenchArgs) -> None:
    if args.optimizer and {"specforge", "loss-mesh"} & set(args.modes):
        raise SystemExit("--optimizer times eagle3fn's training step: use it with the modes "
                         "none / loss / backbone / auto only")
    if args.json:  # fails before any GPU time without git or EAGLE3FN_COMMIT
        run_metadata(resolved_args(args))
    torch.backends.cuda.matmul.allow_tf32 = True
    if args.isolate:
        ceiling = matmul_tflops()
        rows = isolated(args, ceiling)
    else:
        ceiling, rows = measure(args)
    report(args, ceiling, rows)


def measure(args: BenchArgs) -> tuple[float, list[dict]]:
    """Time every configuration in this process: (matmul TFLOP/s, result rows)."""
    torch.backends.cuda.matmul.allow_tf32 = True
    ceiling = matmul_tflops()
    cfg = draft_config(args)
    rows = []
    for S in args.seq_lens:
        # detach: leaves on the GPU (a .to() of a CPU leaf would send every gradient
        # back to the host in backward).
        params = None if args.optimizer else {  # the training step makes its own masters
            n: p.detach().to("cuda", torch.bfloat16).requires_grad_(p.requires_grad)
            for n, p in init_params(cfg, seed=0).items()}
        for pattern in args.patterns:
            for density in args.densities:
                features, loss_mask, d2t, t2d = make_inputs(args, S, density, pattern)
                for mode in args.modes:
                    if mode == "specforge":
                        step = specforge_step(args, cfg, params, features, loss_mask, d2t, t2d)
                    elif mode == "loss-mesh":
                        step = mesh_step(args, cfg, params, features, loss_mask, d2t, t2d)
                    else:
                        step = eagle3fn_step(args, cfg, params, features, loss_mask, d2t, t2d, mode)
                    extra = {}
                    if mode == "auto":
                        extra["took"] = auto_path(args, cfg, features, loss_mask)
                    try:
                        ms, gib = timed(step, args.warmup, args.iters)
                        if args.diagnose:
                            extra.update(diagnose(step, args.iters))
                        if args.host_profile:
                            host_profile_step(step, args.host_profile, f"S={S} {density} {pattern} mode={mode}")
                        if args.profile:
                            profile_step(step, f"{args.profile}", f"S={S} {density} {pattern} mode={mode}")
                    except torch.OutOfMemoryError:
                        ms, gib = float("nan"), float("nan")
                    # Drop this mode's closures (SpecForge's model holds its own weights)
                    # so the next mode's peak starts from the same memory.
                    del step
                    gc.collect()
                    torch.cuda.empty_cache()
                    rows.append(dict(S=S, mode=mode, density=density, pattern=pattern,
                                     median_ms=round(ms, 2), peak_gib=round(gib, 2), **extra))
                    print(rows[-1], flush=True)
                    write_json(args, ceiling, rows)
    return ceiling, rows


def report(args: BenchArgs, ceiling: float, rows: list[dict]) -> None:
    """The table, last."""
    key = lambda r: (r["S"], r["density"], r["pattern"])  # noqa: E731
    base = {key(r): r["median_ms"] for r in rows if r["mode"] == "specforge"}
    print(f"\nbf16 8192^3 matmul: {ceiling:.0f} TFLOP/s; kernel {platform.release()}")
    extra = ("host_ms", "busy_ms", "kernels", "syncs") if args.diagnose else ()
    print(f"{'S':>7} {'density':>8} {'pattern':>10} {'mode':>13} {'median ms':>10} {'peak GiB':>9} "
          f"{'vs SpecForge':>13}" + "".join(f" {e:>8}" for e in extra))
    for r in rows:
        ratio = r["median_ms"] / base[key(r)] if key(r) in base else float("nan")
        mode = r["mode"] + (f"/{r['took']}" if "took" in r else "")  # auto/<path it took>
        print(f"{r['S']:>7} {r['density']:>8.0%} {r['pattern']:>10} {mode:>13} "
              f"{r['median_ms']:>10.1f} {r['peak_gib']:>9.2f} {ratio:>12.2f}x"
              + "".join(f" {r.get(e, float('nan')):>8}" for e in extra))


if __name__ == "__main__":
    main(tyro.cli(BenchArgs))

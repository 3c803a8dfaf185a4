"""The embedded default's closing evaluation (``eagle3fn train`` with no model or data):
the table of the untrained and the trained draft, the target alone on both CPU paths,
and the last line that says plainly whether the draft made decoding faster."""

from __future__ import annotations

from eagle3fn.cli import run

DEMO_K, DEMO_BATCH = 1, 1
"""The demo's closing evaluation: one draft token per round, one prompt at a time, the
fastest setting measured on the 2-core CPU for the demo's minutes-trained draft
(docs/results.md, "The CPU demo")."""

DEMO_IMPL, DEMO_OTHER_IMPL = "graph", "dynamic"
"""The draft decodes on ``graph``'s path (static caches; run eagerly on the CPU), its
fastest CPU path measured for the demo's draft; the target alone is timed on that path
and on ``dynamic``'s (transformers' cache), its own fastest on the CPU, and the verdict
divides by the faster of the two (the baseline at its best)."""


def demo_report(out_dir: str, *, num_prompts: int, max_new_tokens: int,
                untrained_new_tokens: int) -> None:
    """The embedded default's closing table: acceptance length of the untrained and the
    trained draft on held-out prompts (k = ``DEMO_K``, batch ``DEMO_BATCH``, decoding path
    ``DEMO_IMPL``), the target alone on that path and on ``DEMO_OTHER_IMPL``'s (with the
    trained draft there too), the held-out training objective, where the run's files are,
    and the commands that reproduce the numbers and export the draft. The last line
    (``demo_verdict``) compares the draft's fastest path with the target alone's."""
    import shlex
    from pathlib import Path

    from eagle3fn.train import CHECKPOINT, METRICS
    from eagle3fn.train.checkpoint import BEST
    from eagle3fn.train.metrics import read_metrics

    out = Path(out_dir)
    q = shlex.quote(str(out))
    base = (f"eagle3fn eval --run {q} --num-prompts {num_prompts} --num-draft-tokens {DEMO_K} "
            f"--batch-size {DEMO_BATCH}")
    setting = dict(run=str(out), num_prompts=num_prompts, num_draft_tokens=(DEMO_K,), batch_size=(DEMO_BATCH,))
    untrained = run.evaluate(run.EvalArgs(**setting, max_new_tokens=untrained_new_tokens, untrained=True,
                                          baseline=untrained_new_tokens != max_new_tokens, impl=DEMO_IMPL))
    trained = run.evaluate(run.EvalArgs(**setting, max_new_tokens=max_new_tokens, impl=DEMO_IMPL))
    other = run.evaluate(run.EvalArgs(**setting, max_new_tokens=max_new_tokens, impl=DEMO_OTHER_IMPL))
    if "speedup" not in untrained:  # the same prompts and settings: one target-alone timing serves both
        untrained["speedup"] = untrained["tokens_per_s"] / trained["target_tokens_per_s"]
    flags = f"--max-new-tokens {max_new_tokens} --impl"
    rows = [(f"untrained (step 0), {DEMO_IMPL}",
             f"{base} --max-new-tokens {untrained_new_tokens} --impl {DEMO_IMPL} --untrained", untrained),
            (f"trained (step {trained['step']}), {DEMO_IMPL}", f"{base} {flags} {DEMO_IMPL}", trained),
            (f"trained (step {trained['step']}), {DEMO_OTHER_IMPL}", f"{base} {flags} {DEMO_OTHER_IMPL}", other)]
    kind = "held-out" if trained["held_out"] else "trained-on"
    print(f"\nspeculative decoding on {trained['n_prompts']} {kind} prompts (greedy, "
          f"k={DEMO_K} draft tokens per round, KV caches, batches of {DEMO_BATCH}; speedup against the "
          "target alone on the same decoding path):")
    print(f"  {'draft, decoding path':<29} {'new tokens':>10} {'acceptance length':>18} {'simulated tau':>14} "
          f"{'tokens/s':>9} {'speedup':>8}   reproduce with")
    for name, command, r in rows:
        print(f"  {name:<29} {r['tokens']:>10} {r['acceptance_length']:>18.2f} {r['simulated_tau']:>14.2f} "
              f"{r['tokens_per_s']:>9.1f} {r['speedup']:>7.2f}x   {command}")
    for impl, r in ((DEMO_IMPL, trained), (DEMO_OTHER_IMPL, other)):
        print(f"  {'target alone, ' + impl:<29} {'':>10} {1.0:>18.2f} {'':>14} {r['target_tokens_per_s']:>9.1f} "
              f"{1.0:>7.2f}x   (the same prompts, batches and settings, timed in this process)")
    if untrained_new_tokens != max_new_tokens:
        print(f"  (the untrained draft generates {untrained_new_tokens} tokens per prompt, not {max_new_tokens}, "
              "to keep the demo short: acceptance length is a mean per round either way)")
    held = [r for r in read_metrics(out / METRICS) if r.get("split") == "eval"]
    if held:
        h = held[-1]
        print(f"held-out training objective at step {h['step']}: loss {h['loss']:.4f}, "
              f"acc per step {[round(a, 2) for a in h['acc']]}, simulated tau {h['tau']:.2f}")
    during = [r for r in held if "acceptance_length" in r]
    if during:
        steps = ", ".join(f"step {r['step']}: {r['acceptance_length']:.2f}" for r in during)
        best = max(during, key=lambda r: r["acceptance_length"])  # first of equals, as training keeps
        print(f"acceptance length during training ({during[-1]['accept_tokens']} new tokens of held-out prompts "
              f"per evaluation): {steps}; best: step {best['step']} ({BEST})")
    print(f"checkpoint  {out / CHECKPOINT}\nmetrics     {out / METRICS}\nplot        {out / 'loss.png'}")
    print(f"export      eagle3fn export --run {q} --out {shlex.quote(str(out / 'draft'))}")
    if (out / BEST).exists():
        print(f"export best eagle3fn export --run {q} --out {shlex.quote(str(out / 'draft-best'))} --best")
    print(demo_verdict(fastest(trained, other)))


def fastest(*results: dict) -> dict:
    """The speculative result of the fastest decoding path among ``results`` (each an
    ``evaluate`` dict of one path), its ``speedup`` divided by the target alone's
    fastest path instead of its own (the baseline at its best) and ``impl`` / ``baseline_impl``
    naming both paths."""
    draft = max(results, key=lambda r: r["tokens_per_s"])
    alone = max(results, key=lambda r: r["target_tokens_per_s"])
    return {**draft, "speedup": draft["tokens_per_s"] / alone["target_tokens_per_s"],
            "baseline_impl": alone.get("impl")}


def demo_verdict(trained: dict) -> str:
    """The demo's last line: whether the trained draft made decoding faster on this
    machine, said plainly, and the real-weights GPU result shipped with the package
    (``eagle3fn/demo/gpu_result.json``, a summary of docs/results.md's JSON) beside it."""
    import json
    from importlib import resources

    speedup, length = trained["speedup"], trained["acceptance_length"]
    where = "this machine"
    if trained.get("baseline_impl"):
        where += f" ({trained.get('impl')} path; the target alone on its fastest, {trained['baseline_impl']})"
    if speedup > 1.0:
        line = (f"result: with the trained draft, decoding on {where} is {speedup:.2f}x the target alone "
                f"(acceptance length {length:.2f}).")
    else:
        line = (f"result: with the trained draft, decoding on {where} is SLOWER than the target alone "
                f"({speedup:.2f}x, acceptance length {length:.2f}): minutes of training on the demo's "
                "conversations do not make a draft that pays for its own cost here; a draft pays once "
                "trained on the target's own answers at scale (eagle3fn synthesize, then train).")
    source = resources.files("eagle3fn.demo") / "gpu_result.json"
    if source.is_file():
        g = json.loads(source.read_text())
        line += (f"\n        on {g['device']}, {g['target']} trained on {g['conversations']} conversations it "
                 f"synthesized: acceptance length {g['acceptance_length']:.2f} at k={g['k']}, speedup "
                 f"{g['speedup']:.2f}x at batch {g['batch']} (docs/results.md)")
    return line

"""What fp8 e4m3 aux storage (``prepare --aux-dtype float8_e4m3``) costs, measured on
the real embedded target (SmolLM2-135M-Instruct, CPU, fp32) and its bundled demo
conversations.

The target runs once; its fp32 features are written three times with ``write_cache``:
``f32`` (the reference), ``bf16`` (the default storage, exact w.r.t. bf16 training)
and ``fp8`` (bf16 storage, aux in e4m3 with one fp32 scale per token and aux layer).
Against ``f32``, for ``bf16`` and ``fp8``:

- features: ``err = max|X - Y| / max|Y|`` and the RMS relative error of each aux
  layer (real tokens) and of the final hidden (teacher rows);
- teacher table (``teacher.teacher_table_from_hidden`` at the teacher rows): max
  probability difference and the share of rows whose target token or gate changed;
- gradients of the first optimizer step (same seed, same batch): ``err`` per parameter,
  the worst one;
- training: ``--steps`` optimizer steps from each cache (same seed and order), then the
  held-out loss, the simulated acceptance length ``tau`` and, where the loop records
  it, the acceptance length of real greedy speculative decoding of held-out prompts.

    python benchmarks/fp8_cache.py --out fp8-cache.json
"""

from __future__ import annotations

import dataclasses
import json
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import tyro

sys.path.insert(0, str(Path(__file__).parent))
from meta import run_metadata  # noqa: E402


@dataclass(kw_only=True)
class Args:
    max_length: int = 256
    """Tokens per conversation."""
    batch_size: int = 4
    """Conversations per shard (one micro-batch)."""
    eval_holdout: int = 8
    """Held-out conversations (the last two shards)."""
    epochs: int = 1
    """Epochs over the other 88 conversations (22 steps each)."""
    draft_vocab_size: int = 8192
    lr: float = 1e-3
    seed: int = 0
    train_caches: tuple[str, ...] = ("f32", "bf16", "fp8")
    """The caches trained from (each for --epochs)."""
    accept_prompts: int = 8
    """Held-out prompts decoded for the acceptance length (where the loop supports it)."""
    work_dir: str = ""
    """Caches and runs (default: a temporary directory, removed at the end)."""
    out: str = "fp8-cache.json"


def err(x: torch.Tensor, y: torch.Tensor) -> float:
    """``max|x - y| / max|y|``."""
    return float((x.double() - y.double()).abs().max() / y.double().abs().max())


def rms_err(x: torch.Tensor, y: torch.Tensor) -> float:
    return float((x.double() - y.double()).norm() / y.double().norm())


def write_caches(args: Args, work: Path, model: Path) -> tuple[dict[str, Path], float]:
    """The three caches of the demo data (one target pass); seconds of the target."""
    from transformers import AutoTokenizer

    from eagle3fn.demo import __file__ as demo_init
    from eagle3fn.io.batching import batches, collate
    from eagle3fn.io.cache import write_cache
    from eagle3fn.io.data import tokenize_file
    from eagle3fn.io.fingerprint import file_fingerprint, target_fingerprint
    from eagle3fn.io.target import load_target, target_features

    data = Path(demo_init).parent / "chat.jsonl"
    tok = AutoTokenizer.from_pretrained(model)
    examples = tokenize_file(data, tok, max_length=args.max_length)
    target = load_target(model, dtype=torch.float32)
    groups = list(batches(examples, batch_size=args.batch_size, seed=0, shuffle=False))
    pad = tok.pad_token_id or 0
    t = time.perf_counter()
    feats = [target_features(target, b["input_ids"], b["attention_mask"])
             for b in (collate(g, pad) for g in groups)]
    seconds = time.perf_counter() - t
    fingerprint = {"target": target_fingerprint(model), "target_dtype": "float32", "data": file_fingerprint(data),
                   "max_length": args.max_length, "on_error": "raise", "batch_size": args.batch_size,
                   "aux_layer_ids": list(target.aux_layer_ids)}
    caches = {}
    for name, dtype, aux in (("f32", torch.float32, "storage"), ("bf16", torch.bfloat16, "storage"),
                             ("fp8", torch.bfloat16, "float8_e4m3")):
        it = iter(feats)
        caches[name] = work / name
        write_cache(caches[name], ({**collate(g, pad), "sources": [e.source for e in g]} for g in groups),
                    lambda batch: next(it), fingerprint=fingerprint, dtype=dtype, aux_dtype=aux,
                    log=lambda s: None)
    return caches, seconds


def feature_errors(caches: dict[str, Path], draft_vocab_size: int) -> dict:
    """Feature and teacher-table errors of bf16 and fp8 against f32 (module docstring)."""
    from eagle3fn.io.cache import FeatureCache
    from eagle3fn.io.cache.layout import teacher_mask
    from eagle3fn.teacher import teacher_table_from_hidden

    read = {k: FeatureCache(v, dtype=torch.float32) for k, v in caches.items()}
    ref = [read["f32"][i] for i in range(len(read["f32"]))]
    V = ref[0].features.target_head.shape[0]
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[:draft_vocab_size] = True  # a fixed draft vocab: the table's renormalisation over it
    out = {}
    for name in ("bf16", "fp8"):
        got = [read[name][i] for i in range(len(read[name]))]
        pairs = {"aux": ([], []), "final_hidden": ([], [])}
        probs, tokens, gates = [], [], []
        for r, g in zip(ref, got):
            real = r.features.attention_mask.bool()
            teach = teacher_mask(r.loss_mask, r.features.attention_mask)
            pairs["aux"][0].append(g.features.aux[real])
            pairs["aux"][1].append(r.features.aux[real])
            pairs["final_hidden"][0].append(g.features.final_hidden[teach])
            pairs["final_hidden"][1].append(r.features.final_hidden[teach])
            a = teacher_table_from_hidden(r.features.final_hidden[teach], r.features.target_head, t2d)
            b = teacher_table_from_hidden(g.features.final_hidden[teach], g.features.target_head, t2d)
            p = lambda table: torch.exp(table.logits.double() - table.lse_draft.double()[:, None])  # noqa: E731
            probs.append((p(a) - p(b)).abs().max())
            tokens.append((a.target_token != b.target_token).double().mean())
            gates.append((a.gate != b.gate).double().mean())
        aux_g, aux_r = torch.cat(pairs["aux"][0]), torch.cat(pairs["aux"][1])
        third = aux_r.shape[-1] // 3
        layers = [{"err": err(aux_g[:, i * third:(i + 1) * third], aux_r[:, i * third:(i + 1) * third]),
                   "rms": rms_err(aux_g[:, i * third:(i + 1) * third], aux_r[:, i * third:(i + 1) * third])}
                  for i in range(3)]
        fh_g, fh_r = torch.cat(pairs["final_hidden"][0]), torch.cat(pairs["final_hidden"][1])
        out[name] = {"aux_layers": layers, "aux": {"err": err(aux_g, aux_r), "rms": rms_err(aux_g, aux_r)},
                     "final_hidden": {"err": err(fh_g, fh_r), "rms": rms_err(fh_g, fh_r)},
                     "teacher": {"max_prob_diff": float(max(probs)),
                                 "token_changed": float(torch.stack(tokens).mean()),
                                 "gate_changed": float(torch.stack(gates).mean())}}
    return out


def config(args: Args, model: Path, cache: Path, out_dir: Path, **kw):
    from eagle3fn.train.config import TrainConfig

    extra = {"eval_accept_prompts": args.accept_prompts} if any(
        f.name == "eval_accept_prompts" for f in dataclasses.fields(TrainConfig)) else {}
    return TrainConfig(model=str(model), cache=str(cache), out_dir=str(out_dir), max_length=args.max_length,
                       draft_vocab_size=args.draft_vocab_size, lr=args.lr, epochs=args.epochs, seed=args.seed,
                       eval_holdout=args.eval_holdout, save_every=10 ** 6, device="cpu", precision="float32",
                       **extra, **kw)


def first_grads(cfg) -> dict[str, torch.Tensor]:
    from eagle3fn.train.loop import train

    got = {}

    def keep(step, grads):
        if step == 1:
            got.update({n: g.detach().double().clone() for n, g in grads.items()})
    train(dataclasses.replace(cfg, max_steps=1, eval_holdout=cfg.eval_holdout), log=lambda s: None, on_grads=keep)
    return got


def main(args: Args) -> None:
    from eagle3fn.io.smollm2 import smollm2_path
    from eagle3fn.train.loop import train
    from eagle3fn.train.metrics import read_metrics

    model = smollm2_path()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.work_dir or tmp)
        caches, target_s = write_caches(args, work, model)
        print(f"target pass {target_s:.1f} s; caches in {work}", flush=True)
        result = {"target_seconds": target_s, "features": feature_errors(caches, args.draft_vocab_size)}
        grads = {k: first_grads(config(args, model, v, work / f"grads-{k}")) for k, v in caches.items()}
        result["gradients"] = {k: {"worst_err": max(err(grads[k][n], grads["f32"][n]) for n in grads["f32"]),
                                   "per_param": {n: err(grads[k][n], grads["f32"][n]) for n in grads["f32"]}}
                               for k in ("bf16", "fp8")}
        print(json.dumps({k: result[k] for k in ("features",)}, indent=1), flush=True)
        runs = {}
        for k, v in caches.items():
            if k not in args.train_caches:
                continue
            t = time.perf_counter()
            last = train(config(args, model, v, work / f"run-{k}"), log=lambda s: None)
            rows = read_metrics(work / f"run-{k}" / "metrics.jsonl")
            evals = [r for r in rows if r.get("split") == "eval"]
            runs[k] = {"steps": last["step"], "train_loss": last["loss"], "eval": evals[-1] if evals else None,
                       "seconds": time.perf_counter() - t}
            print(k, json.dumps(runs[k]), flush=True)
        result["training"] = runs
    Path(args.out).write_text(json.dumps({**run_metadata(asdict(args)), "results": result}, indent=1))
    for k in ("bf16", "fp8"):
        f, g = result["features"][k], result["gradients"][k]
        print(f"{k}: aux err {f['aux']['err']:.3g} (rms {f['aux']['rms']:.3g}), final hidden err "
              f"{f['final_hidden']['err']:.3g}, teacher max prob diff {f['teacher']['max_prob_diff']:.3g}, "
              f"first-step grads worst err {g['worst_err']:.3g}")
    for k, r in result["training"].items():
        e = r["eval"] or {}
        print(f"{k}: {r['steps']} steps, held-out loss {e.get('loss')}, tau {e.get('tau')}, "
              f"acceptance length {e.get('acceptance_length', '-')}")


if __name__ == "__main__":
    main(tyro.cli(Args))

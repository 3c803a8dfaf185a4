"""SpecForge 0.2.0's EAGLE-3 loop trained as an ``eagle3fn train`` run trains (issue 34,
deliverable 3): the same target, conversations, tokens and loss masks, vocab map, draft
shape, seed, batches in the same order, optimizer steps, AdamW and learning-rate
schedule; its draft saved with its own ``save_pretrained``, the wall-clock time recorded,
so that ``eagle3fn eval`` (``io.import_draft``) measures its acceptance beside eagle3fn's.

    python benchmarks/outcome_specforge.py --model TARGET --data chat.jsonl \\
        --vocab-map runs/eagle3fn/vocab.safetensors --max-steps 2000 --batch-size 4 \\
        --max-length 2048 --lr 1e-4 --seed 0 --eval-holdout 64 --save-every 500 \\
        --out-dir runs/specforge --json outcome-specforge.json

It prints the ``eagle3fn train`` command whose run it mirrors (``--no-pack``: SpecForge
batches whole conversations, one per row; JSON ``eagle3fn_command``). What is shared, by
calling eagle3fn's own functions rather than restating them:

- data: ``io.data.tokenize_file`` (chat template, loss mask, ``--max-length`` cut, dropped
  conversations) of ``--data``; the last ``--eval-holdout`` conversations left out;
  micro-batches of ``--batch-size`` consecutive conversations, the epoch's order
  ``train.sources.Source.order(epoch, seed)``, ``--grad-accum`` micro-batches per step
  (``train.step.step_starts``), the step count as ``train.build`` counts it;
- supervised positions: ``align.supervised_mask`` (the chat mask, never a sample's last
  position, whose next token does not exist: what SpecForge's offline normalizer does;
  its online path as shipped would train that row against a padding row);
- vocab map: ``io.vocab_io.resolve_vocab_map`` (``--vocab-map``, else built from the
  training conversations as ``eagle3fn train`` builds it); draft shape:
  ``train.build.draft_config_for``, checked against SpecForge's generated draft config;
- schedule: ``train.step.lr_at`` (linear warm-up over ``--warmup-ratio`` of the steps,
  then cosine to 0) set on SpecForge's optimizer every step (a ``LambdaLR`` replacing
  its own scheduler, whose warm-up rounds down and may be 0 steps), AdamW betas (0.9, 0.95)
  and ``--weight-decay`` as eagle3fn's, gradient clipping ``--grad-clip`` (SpecForge's
  clip is the same formula); step weights ``--step-weight-decay ** j`` over
  ``--ttt-length`` steps.

SpecForge's own: its draft (``train_specforge.specforge_draft``: its config generated
from the target's, its initialisation under ``torch.manual_seed(--seed)``, lm_head
random where eagle3fn starts it from the target's head rows), the frozen target
embedding, ``OnlineEagle3Model`` (FlexAttention on CUDA in bf16; sdpa on the CPU in
fp32, dynamo off, Triton interpreted), its per-step losses and ``BF16Optimizer`` (fp32
masters). The target's features are captured as ``benchmarks/train.py``'s SpecForge loop
captures them (``train_specforge.capture``: hooks on the aux layers, the model's logits).

Steady state (issue 35): every micro-batch is padded to one shape, ``[--batch-size,
--max-length]`` (a short last batch gets filler rows: one attended padding token, no
loss), so its compiled functions see one shape and stop recompiling after the first
steps (JSON ``recompiles_after_warmup``). Its maths stay those of SpecForge as shipped,
which pads to the batch's longest conversation: its step losses are means over
``B * S`` positions, so the objective is scaled by ``B_pad * S_pad / (B * S_longest)``
(and by ``1 / micro-batches`` under ``--grad-accum``, eagle3fn's ``local_mean``).

Recorded (JSON, beside ``meta.run_metadata``): ``startup_s`` (launch to the first step:
imports, target load, tokenization), ``train_s`` / ``total_s``, every saved checkpoint
(``<out-dir>/specforge-step<N>``, which ``eagle3fn.io.import_draft`` reads, with its step
from the name) with ``wall_s`` since launch and ``train_s`` since the first step (saving
excluded), the logged steps (loss, per-step accuracy, lr, grad norm), the draft config
and the steady-state note.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shlex
import sys
import time
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

BENCH_DIR = Path(__file__).resolve().parent
LAUNCH = time.time()


@dataclass(kw_only=True)
class OutcomeArgs:
    """Train SpecForge 0.2.0's EAGLE-3 loop as ``eagle3fn train --no-pack`` with these
    flags would train (module docstring)."""

    model: str
    """Local HF target directory (as ``eagle3fn train --model``)."""
    data: str
    """Chat JSONL (OpenAI ``messages`` or ShareGPT lines, as ``eagle3fn train --data``)."""
    out_dir: str = "runs/specforge"
    """Where the drafts go (``specforge-step<N>``, SpecForge's ``save_pretrained``)."""
    json: str = ""
    """Results file; default ``<out-dir>/outcome_specforge.json``."""
    vocab_map: str = ""
    """eagle3fn's ``vocab.safetensors`` (an eagle3fn run's, or ``eagle3fn vocab``'s);
    empty: built from the training conversations as ``eagle3fn train`` builds it."""
    draft_vocab_size: int = 32000
    """Vd (capped at the target vocab)."""
    aux_layer_ids: tuple[int, int, int] | None = None
    """Target layers captured (default [1, N//2-1, N-4], SpecForge's and eagle3fn's)."""
    max_length: int = 2048
    """Tokens per conversation (longer ones cut) and the fixed padded length."""
    batch_size: int = 4
    """Conversations per micro-batch."""
    grad_accum: int = 1
    """Micro-batches per optimizer step."""
    epochs: int = 1
    """Passes over the data."""
    max_steps: int | None = None
    """Stop after this many optimizer steps (default: the epochs)."""
    seed: int = 0
    """Data order and SpecForge's draft initialisation."""
    lr: float = 1e-4
    """Peak learning rate."""
    warmup_ratio: float = 0.015
    """Linear warm-up over this fraction of the steps, then cosine to 0."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    grad_clip: float = 0.5
    """Global gradient norm clip."""
    ttt_length: int = 7
    """k, unrolled TTT steps."""
    step_weight_decay: float = 0.8
    """Step j weighs ``step_weight_decay ** j``."""
    eval_holdout: int = 0
    """Conversations at the end of the data left out of training and of the vocab map
    (as ``eagle3fn train --eval-holdout``)."""
    on_error: Literal["raise", "skip"] = "raise"
    """Bad data lines: stop, or skip and count."""
    save_every: int = 0
    """Also save the draft every N optimizer steps (0: only at the end)."""
    log_every: int = 10
    """Record loss and accuracies every N steps."""
    warmup_steps: int = 2
    """Steps after which no recompilation is expected (``recompiles_after_warmup``)."""
    device: str = "auto"
    """``cuda`` when available, else ``cpu``."""


def resolved_device(args: OutcomeArgs):
    """``args.device`` with ``auto`` resolved (CUDA when visible, else the CPU)."""
    import torch

    return torch.device("cuda" if args.device == "auto" and torch.cuda.is_available()
                        else "cpu" if args.device == "auto" else args.device)


def precision(args: OutcomeArgs) -> str:
    """The compute dtype of both sides: SpecForge's (bf16 on CUDA, fp32 on the CPU), which
    the eagle3fn run is given explicitly (its ``auto`` is bf16 on a CPU with AMX)."""
    return "bfloat16" if resolved_device(args).type == "cuda" else "float32"


def train_config(args: OutcomeArgs):
    """The ``eagle3fn train`` config these flags mirror (its checks run here too)."""
    from eagle3fn.loss import LossConfig
    from eagle3fn.train.config import TrainConfig

    return TrainConfig(model=args.model, data=args.data, vocab_map=args.vocab_map or None, draft_vocab_size=args.draft_vocab_size,
                       aux_layer_ids=args.aux_layer_ids, max_length=args.max_length, pack=False,
                       on_error=args.on_error, ttt_length=args.ttt_length,
                       loss=LossConfig(step_weight_decay=args.step_weight_decay), lr=args.lr,
                       warmup_ratio=args.warmup_ratio, weight_decay=args.weight_decay, grad_clip=args.grad_clip,
                       batch_size=args.batch_size, grad_accum=args.grad_accum, epochs=args.epochs,
                       max_steps=args.max_steps, seed=args.seed, eval_holdout=args.eval_holdout,
                       precision=precision(args))


def eagle3fn_command(args: OutcomeArgs, total: int) -> str:
    """The ``eagle3fn train`` command line of the run this one mirrors."""
    flags = ["--model", args.model, "--data", args.data, "--no-pack", "--max-length", args.max_length,
             "--batch-size", args.batch_size, "--grad-accum", args.grad_accum, "--epochs", args.epochs,
             "--max-steps", total, "--seed", args.seed, "--lr", args.lr, "--warmup-ratio", args.warmup_ratio,
             "--weight-decay", args.weight_decay, "--grad-clip", args.grad_clip, "--ttt-length", args.ttt_length,
             "--loss.step-weight-decay", args.step_weight_decay, "--draft-vocab-size", args.draft_vocab_size,
             "--eval-holdout", args.eval_holdout, "--on-error", args.on_error, "--precision", precision(args)]
    if args.vocab_map:
        flags += ["--vocab-map", args.vocab_map]
    if args.aux_layer_ids:
        flags += ["--aux-layer-ids", *args.aux_layer_ids]
    return "eagle3fn train " + " ".join(shlex.quote(str(f)) for f in flags)


def fixed_batch(group: list, pad: int, batch_size: int, length: int) -> dict:
    """``group``'s conversations (``io.batching.collate``) padded to ``[batch_size,
    length]``, filler rows holding one attended padding token and no loss; plus
    ``supervised`` (``align.supervised_mask``, bool ``[batch_size, length]``), ``tokens``
    (real tokens) and ``scale`` (``B_pad * S_pad / (B * S_longest)``, module docstring)."""
    import torch
    import torch.nn.functional as F

    from eagle3fn.align import supervised_mask
    from eagle3fn.io.batching import collate

    b = collate(group, pad)
    rows, longest = b["input_ids"].shape
    fill = (0, length - longest, 0, batch_size - rows)
    ids = F.pad(b["input_ids"], fill, value=pad)
    attention = F.pad(b["attention_mask"], fill)
    attention[rows:, 0] = 1  # a filler row attends its one token: no all-masked row, no NaN
    loss = F.pad(b["loss_mask"], fill)
    return {"input_ids": ids, "attention_mask": attention, "supervised": supervised_mask(loss, attention),
            "tokens": int(b["attention_mask"].sum()), "scale": batch_size * length / (rows * longest)}


class SpecForgeRun:
    """The target, SpecForge's draft, ``OnlineEagle3Model`` and ``BF16Optimizer`` set up
    as the module docstring says; ``step(batches)`` trains one optimizer step."""

    def __init__(self, args: OutcomeArgs, device, draft_cfg, d2t, t2d, total: int, cfg) -> None:
        import torch
        from specforge.algorithms.eagle3.model import OnlineEagle3Model
        from specforge.optimizer import BF16Optimizer
        from transformers import AutoModelForCausalLM

        from eagle3fn.train.step import lr_at
        from train_specforge import specforge_draft

        cuda = device.type == "cuda"
        self.device, self.args = device, args
        self.target = AutoModelForCausalLM.from_pretrained(
            args.model, dtype=torch.bfloat16 if cuda else torch.float32).to(device).eval().requires_grad_(False)
        self.layers = list(cfg.aux_layer_ids)
        torch.manual_seed(args.seed)  # SpecForge's post_init draws from the global generator
        self.draft = specforge_draft(types.SimpleNamespace(draft_vocab=draft_cfg.draft_vocab_size),
                                     Path(args.model), str(device), d2t.to(device), t2d.to(device),
                                     self.target.get_input_embeddings().weight)
        self.check_shape(draft_cfg)
        self.model = OnlineEagle3Model(draft_model=self.draft, length=args.ttt_length,
                                       attention_backend="flex_attention" if cuda else "sdpa")
        self.model.train()
        self.opt = BF16Optimizer(self.draft, lr=args.lr, weight_decay=args.weight_decay,
                                 max_grad_norm=args.grad_clip, total_steps=total, warmup_ratio=args.warmup_ratio)
        for group in self.opt.optimizer.param_groups:
            group["betas"] = (0.9, 0.95)  # eagle3fn's (train.build); SpecForge keeps AdamW's (0.9, 0.999)
        # eagle3fn's schedule (lr_at of the step about to run), replacing SpecForge's: its
        # warm-up is int(ratio * total) steps (0 below 67 steps), eagle3fn's max(1, round(..)).
        self.opt.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.opt.optimizer, lambda step: lr_at(step, total, cfg) / args.lr)

    def check_shape(self, draft_cfg) -> None:
        """RuntimeError unless SpecForge's generated draft has eagle3fn's draft shape."""
        c = self.draft.config
        theirs = dict(hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                      num_heads=c.num_attention_heads, num_kv_heads=c.num_key_value_heads,
                      head_dim=getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
                      vocab_size=c.vocab_size, draft_vocab_size=c.draft_vocab_size,
                      target_hidden_size=getattr(c, "target_hidden_size", None) or c.hidden_size)
        ours = dict(hidden_size=draft_cfg.hidden_size, intermediate_size=draft_cfg.intermediate_size,
                    num_heads=draft_cfg.num_heads, num_kv_heads=draft_cfg.num_kv_heads, head_dim=draft_cfg.d,
                    vocab_size=draft_cfg.vocab_size, draft_vocab_size=draft_cfg.draft_vocab_size,
                    target_hidden_size=draft_cfg.ht)
        if theirs != ours:
            raise RuntimeError(f"SpecForge's draft {theirs} differs from eagle3fn's {ours}")

    def step(self, batches: list[dict]) -> dict:
        """One optimizer step over ``batches`` (``fixed_batch`` dicts): the 0.8-weighted
        sum of SpecForge's step losses, scaled (module docstring), backward, its
        optimizer. Returns tensors (no host sync): ``loss`` and per-step ``acc`` [k],
        each the mean over the micro-batches, ``lr``."""
        import torch
        from specforge.utils import padding

        from train_specforge import capture

        loss, acc, lr = 0.0, 0.0, self.opt.get_learning_rate()
        for b in batches:
            ids, am, sup = (b[k].to(self.device, non_blocking=True)
                            for k in ("input_ids", "attention_mask", "supervised"))
            with torch.no_grad():
                aux, out = capture(self.target, self.target.model.layers, self.layers, ids, am)
                logits = padding(out.logits, left=False)
            plosses, _, acces, *_ = self.model(input_ids=padding(ids, left=False), attention_mask=am,
                                               target=logits, loss_mask=sup[..., None].int(), hidden_states=aux)
            objective = sum(self.args.step_weight_decay**j * p for j, p in enumerate(plosses))
            (objective * (b["scale"] / len(batches))).backward()
            loss = loss + objective.detach() / len(batches)
            acc = acc + torch.stack([torch.as_tensor(a, dtype=torch.float32) for a in acces]) / len(batches)
        grad_norm = self.opt.step()
        return {"loss": loss, "acc": acc, "lr": lr, "grad_norm": grad_norm}


def resolved(args: OutcomeArgs, cfg, total: int, out_json: Path) -> dict:
    """``args`` as the run used them (no None, for ``meta.run_metadata``)."""
    out = dataclasses.asdict(args)
    out.update(aux_layer_ids=list(cfg.aux_layer_ids), max_steps=total, json=str(out_json),
               vocab_map=args.vocab_map or "built from the training conversations (eagle3fn's rule)")
    return out


def main(args: OutcomeArgs) -> dict:
    """Train, save, time (module docstring); returns the JSON's dict."""
    if args.device == "cpu" or (args.device == "auto" and not _cuda_available()):
        os.environ.setdefault("TRITON_INTERPRET", "1")  # SpecForge's loss kernel on the CPU
    if str(BENCH_DIR) not in sys.path:
        sys.path.insert(0, str(BENCH_DIR))
    import torch
    from transformers import AutoConfig, AutoTokenizer

    from eagle3fn.compiled import RecompileCounter
    from eagle3fn.io.data import tokenize_file
    from eagle3fn.io.target import default_aux_layer_ids, validate_aux_layer_ids
    from eagle3fn.io.vocab_io import resolve_vocab_map
    from eagle3fn.train.build import draft_config_for
    from eagle3fn.train.sources import Source
    from eagle3fn.train.step import step_starts
    from meta import run_metadata

    cfg = train_config(args)
    device = resolved_device(args)
    out_dir = Path(args.out_dir)
    out_json = Path(args.json) if args.json else out_dir / "outcome_specforge.json"
    model_config = AutoConfig.from_pretrained(args.model)
    text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    layers = int(text.num_hidden_layers)
    ids = (validate_aux_layer_ids(args.aux_layer_ids, layers) if args.aux_layer_ids
           else default_aux_layer_ids(layers))
    cfg = dataclasses.replace(cfg, aux_layer_ids=ids)
    tok = AutoTokenizer.from_pretrained(args.model)
    examples = tokenize_file(args.data, tok, max_length=args.max_length, on_error=args.on_error)
    if args.eval_holdout >= len(examples):
        raise ValueError(f"--eval-holdout {args.eval_holdout} leaves nothing to train on: {args.data} has "
                         f"{len(examples)} usable conversations; hold out fewer")
    examples = examples[:len(examples) - args.eval_holdout]
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    vocab = int(text.vocab_size)
    draft_cfg = draft_config_for(model_config, args.draft_vocab_size, vocab, max_length=args.max_length)
    d2t, t2d = resolve_vocab_map(args.vocab_map or None, examples, vocab_size=vocab,
                                 draft_vocab_size=draft_cfg.draft_vocab_size)
    source = Source([examples[i:i + args.batch_size] for i in range(0, len(examples), args.batch_size)],
                    load=None)
    per_epoch = math.ceil(len(source.items) / args.grad_accum)
    total = min(args.max_steps or args.epochs * per_epoch, args.epochs * per_epoch)
    command = eagle3fn_command(args, total)
    print(f"SpecForge 0.2.0 on {device}: {len(examples)} conversations, {total} steps of {args.grad_accum} x "
          f"[{args.batch_size}, {args.max_length}]; mirrors: {command}", flush=True)

    run = SpecForgeRun(args, device, draft_cfg, d2t, t2d, total, cfg)
    out_dir.mkdir(parents=True, exist_ok=True)
    cuda = device.type == "cuda"
    counter = RecompileCounter()
    log, saves, saving_s, warm = [], [], 0.0, None
    step, epoch, pos = 0, 0, 0
    order = source.order(epoch, args.seed)
    first = time.time()
    with torch._dynamo.config.patch(disable=not cuda):
        while step < total:
            starts = step_starts(pos, len(order), 1, args.grad_accum)
            batches = [fixed_batch(source.items[order[s]], pad, args.batch_size, args.max_length) for s in starts]
            out = run.step(batches)
            step, pos = step + 1, starts[-1] + 1
            if pos == len(order):
                epoch, pos = epoch + 1, 0
                order = source.order(epoch, args.seed)
            if step == args.warmup_steps:
                warm = counter.count
            if step % args.log_every == 0 or step == total:
                loss, acc = float(out["loss"]), [round(float(a), 4) for a in out["acc"]]
                if not math.isfinite(loss):
                    raise RuntimeError(f"step {step}: SpecForge's loss is {loss}")
                log.append({"step": step, "train_s": round(time.time() - first - saving_s, 3),
                            "loss": round(loss, 5), "acc": acc, "lr": out["lr"],
                            "grad_norm": round(float(out["grad_norm"]), 5),
                            "tokens": sum(b["tokens"] for b in batches), "recompiles": counter.count})
                print(f"step {step}/{total}: loss {loss:.4f}, acc {acc}, lr {out['lr']:.3g}", flush=True)
            if step == total or (args.save_every and step % args.save_every == 0):
                if cuda:
                    torch.cuda.synchronize()
                now = time.time()
                path = out_dir / f"specforge-step{step}"
                run.draft.save_pretrained(path)
                saves.append({"step": step, "path": str(path), "wall_s": round(now - LAUNCH, 3),
                              "train_s": round(now - first - saving_s, 3)})
                saving_s += time.time() - now
    counter.close()
    end = time.time()
    report = {
        "eagle3fn_command": command,
        "steady_state": (f"every micro-batch padded to [{args.batch_size}, {args.max_length}] (filler rows for a "
                         "short batch), objective scaled by B_pad*S_pad/(B*S_longest): SpecForge's maths as "
                         "shipped at one fixed shape"),
        "recompiles_after_warmup": None if warm is None else counter.count - warm,  # None: no steady window
        "recompiles": counter.count, "recompile_examples": counter.examples,
        "device": str(device), "dtype": "bfloat16" if cuda else "float32",
        "attention": "flex_attention" if cuda else "sdpa",
        "conversations": len(examples), "steps": total,
        "startup_s": round(first - LAUNCH, 3), "train_s": round(end - first - saving_s, 3),
        "saving_s": round(saving_s, 3), "total_s": round(end - LAUNCH, 3),
        "draft_config": dataclasses.asdict(draft_cfg), "checkpoints": saves, "log": log,
        "differences": ["SpecForge's draft initialisation (lm_head random; eagle3fn starts it from the target's "
                        "head rows)", "unpacked batches (eagle3fn's default packs: compare with the "
                        "eagle3fn_command above, which passes --no-pack)"],
    }
    record = dict(run_metadata(resolved(args, cfg, total, out_json)), **report)
    out_json.parent.mkdir(parents=True, exist_ok=True)
    out_json.write_text(json.dumps(record, indent=1, default=str))
    print(f"SpecForge: {total} steps in {report['train_s']:.1f} s of training ({report['total_s']:.1f} s "
          f"from launch), {report['recompiles_after_warmup']} recompiles after warm-up; draft "
          f"{saves[-1]['path']}; {out_json}", flush=True)
    return record


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


if __name__ == "__main__":
    import tyro

    sys.path.insert(0, str(BENCH_DIR))
    main(tyro.cli(OutcomeArgs))

"""Conversations written by the target alone, the quick way (transformers' generate).

A stand-in used for the first real-weights outcome run before ``eagle3fn synthesize``
existed; kept so that run can be reproduced. Magpie-style: the chat template up to the
start of a user turn is fed to the target, which samples the user message until its
end-of-turn token; the answer is then generated greedily. Prompts that are empty, cut by
the prompt limit or exact duplicates are dropped (counts in the JSON report).

    python benchmarks/outcome_data.py --model DIR --out data.jsonl --n 12000 --batch 512

Writes ``data.jsonl`` (OpenAI-form, one conversation per line) and ``data.jsonl.report.json``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch


def user_prefix(tok) -> str:
    """The template's text up to where a user message starts (system turn included)."""
    marker = "XYZZY_MARKER"
    text = tok.apply_chat_template([{"role": "user", "content": marker}], tokenize=False)
    return text[:text.index(marker)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--n", type=int, default=12000)
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--prompt-tokens", type=int, default=96)
    ap.add_argument("--answer-tokens", type=int, default=512)
    ap.add_argument("--temperature", type=float, default=0.9)
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--time-budget", type=float, default=1e9, help="seconds; stop starting batches after it")
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to(device).eval()
    end = tok.convert_tokens_to_ids("<|im_end|>")
    eos = [end] + ([tok.eos_token_id] if tok.eos_token_id is not None else [])
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    prefix = tok(user_prefix(tok), return_tensors="pt", add_special_tokens=False)["input_ids"].to(device)
    seen: set[str] = set()
    counts = {"sampled": 0, "empty": 0, "truncated_prompt": 0, "duplicate": 0, "kept": 0,
              "answers_cut": 0, "answer_tokens": 0}
    torch.manual_seed(args.seed)
    t0 = time.perf_counter()
    out = Path(args.out)
    with out.open("w") as f, torch.no_grad():
        while counts["kept"] < args.n and time.perf_counter() - t0 < args.time_budget:
            ids = prefix.expand(args.batch, -1)
            gen = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True,
                                 temperature=args.temperature, top_p=args.top_p,
                                 max_new_tokens=args.prompt_tokens, eos_token_id=eos, pad_token_id=pad)
            users = []
            for row in gen[:, ids.shape[1]:].tolist():
                counts["sampled"] += 1
                if end not in row:
                    counts["truncated_prompt"] += 1
                    continue
                text = tok.decode(row[:row.index(end)], skip_special_tokens=True).strip()
                if not text:
                    counts["empty"] += 1
                elif text in seen:
                    counts["duplicate"] += 1
                else:
                    seen.add(text)
                    users.append(text)
            if not users:
                continue
            convs = [[{"role": "user", "content": u}] for u in users]
            texts = [tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in convs]
            tok.padding_side = "left"
            enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
            ans = model.generate(**enc, do_sample=False, max_new_tokens=args.answer_tokens,
                                 eos_token_id=eos, pad_token_id=pad)
            for conv, row in zip(convs, ans[:, enc["input_ids"].shape[1]:].tolist()):
                n = next((i for i, t in enumerate(row) if t in eos), None)
                counts["answers_cut"] += n is None
                row = row if n is None else row[:n]
                counts["answer_tokens"] += len(row) + (n is not None)
                conv.append({"role": "assistant", "content": tok.decode(row, skip_special_tokens=True)})
                f.write(json.dumps({"messages": conv}) + "\n")
                counts["kept"] += 1
            f.flush()
            el = time.perf_counter() - t0
            print(f"{counts['kept']} conversations, {el:.0f} s, {counts['answer_tokens'] / el:.0f} answer tok/s",
                  flush=True)
    seconds = time.perf_counter() - t0
    report = {**counts, "seconds": seconds, "args": vars(args), "device": device,
              "gpu": torch.cuda.get_device_name() if device == "cuda" else None}
    Path(str(out) + ".report.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report))


if __name__ == "__main__":
    main()

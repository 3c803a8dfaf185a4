"""A/B on the GPU, one process: eval's graph path with the draft's elementwise chains eager
(FUSED_DRAFT False, the code before) and compiled (True), same run, prompts, k, batch; then
where a round's time goes (StageTimes) for each. argv: run dir, out json."""
import json, os, sys, time, torch
DEV, NP, NT = os.environ.get("DEV", "cuda"), int(os.environ.get("NP", 16)), int(os.environ.get("NT", 128))
from eagle3fn.cli.run import EvalArgs, evaluate
from eagle3fn.evaluation import graphed
run, out = sys.argv[1], sys.argv[2]
res = {}
for fused in (False, True, False, True)[:int(os.environ.get("NAB", 4))]:
    graphed.FUSED_DRAFT = fused
    r = evaluate(EvalArgs(run=run, num_draft_tokens=[2, 3, 4, 5], batch_size=[1], num_prompts=NP, max_new_tokens=NT, device=DEV))
    res.setdefault(f"fused={fused}", []).append(r)
    print("fused", fused, [(x["k"], round(x["acceptance_length"], 3), round(x["tokens_per_s"], 1), round(x["speedup"], 3)) for x in (r["result"]["rows"] if "result" in r else r["rows"])], flush=True)
# stage breakdown, k = 3, batch 1, the same 16 prompts
from eagle3fn.evaluation import SpecConfig, StageTimes, generate
from eagle3fn.evaluation.generation import generate as gen
import eagle3fn.cli.run as cr
from eagle3fn.train.checkpoint import load_run
from eagle3fn.io.target import load_target
from transformers import AutoTokenizer
R = load_run(run); cfg = R["config"]; kw = cr._run_target(cfg, weights=True, tokenizer=True)
tok = AutoTokenizer.from_pretrained(cfg["model"], **kw)
target = load_target(cfg["model"], aux_layer_ids=R["aux_layer_ids"], device=torch.device(DEV), dtype=torch.bfloat16 if DEV == "cuda" else torch.float32, **kw)
params = {n: t.to(DEV, torch.bfloat16 if DEV == "cuda" else torch.float32) for n, t in {**R["params"], "embed_tokens.weight": target.embed_tokens}.items()}
prompts = [torch.tensor(p, device=DEV) for p in R["holdout_prompts"][:NP]]
stages = {}
for fused in (False, True):
    graphed.FUSED_DRAFT = fused
    for k in (3, 5):
        sc = SpecConfig(num_draft_tokens=k, max_new_tokens=NT)
        gen(target, tok, params, R["draft"], R["d2t"], prompts[:1], sc)  # warm-up
        st = StageTimes()
        for p in prompts:
            gen(target, tok, params, R["draft"], R["d2t"], [p], sc, stages=st)
        d = {f: getattr(st, f) for f in ("total_s", "prefill_s", "verify_s", "draft_context_s", "draft_chain_s", "record_s", "rounds")}
        d["per_round_ms"] = {f: 1e3 * d[f] / d["rounds"] for f in ("total_s", "verify_s", "draft_context_s", "draft_chain_s")}
        d["bookkeeping_ms"] = 1e3 * (d["total_s"] - d["prefill_s"] - d["verify_s"] - d["draft_context_s"] - d["draft_chain_s"] - d["record_s"]) / d["rounds"]
        stages[f"fused={fused},k={k}"] = d
        print("stages fused", fused, "k", k, json.dumps({a: round(b, 4) if isinstance(b, float) else b for a, b in d.items() if a != "per_round_ms"}), {a: round(b, 3) for a, b in d["per_round_ms"].items()}, flush=True)
json.dump({"sweeps": res, "stages": stages}, open(out, "w"), indent=1, default=str)

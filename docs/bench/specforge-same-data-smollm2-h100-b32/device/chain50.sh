#!/bin/bash
# chain50.sh: the whole session's GPU work, in order, each stage timed (run under setsid by run50.sh).
R=$(cd "$(dirname "$0")/.." && pwd); cd $R; . .gpu/env.sh
REC=$HOME/rec; mkdir -p $REC $HOME/r8b; cd $HOME
st() { echo "$(date +%s) $*" >> $REC/stages.txt; }
export $(cat $R/.gpu/meta); st start $(cat $R/.gpu/meta)
python3 -c "from eagle3fn.io.smollm2 import smollm2_path; print(smollm2_path())" > $REC/convert.log 2>&1
python3 $R/docs/bench/outcome-smollm2-h100-40k/merge.py $R/docs/bench/outcome-smollm2-h100-40k/syn40k.jsonl.gz merged.jsonl > $REC/merge.log 2>&1
head -n 12864 merged.jsonl > sub.jsonl; tail -n 64 sub.jsonl > heldout.jsonl; sha256sum sub.jsonl heldout.jsonl >> $REC/merge.log
st nopack-begin
e3 train --model $M --data sub.jsonl --out-dir nopack --no-pack --lr 7e-4 --max-length 1024 --batch-size 32 --epochs 1 --seed 0 --eval-holdout 64 > $REC/nopack.log 2>&1; st nopack-end rc $?
cp nopack/record.json $REC/record-nopack.json 2>/dev/null; cp nopack/metrics.jsonl $REC/metrics-nopack.jsonl 2>/dev/null
st sf-begin
python3 $R/benchmarks/outcome_specforge.py --model $M --data sub.jsonl --vocab-map nopack/vocab.safetensors --out-dir sf --lr 7e-4 --max-length 1024 --batch-size 32 --epochs 1 --seed 0 --eval-holdout 64 --json $REC/outcome-specforge.json > $REC/sf.log 2>&1; st sf-end rc $?
SF=$(ls -d sf/specforge-step* 2>/dev/null | sort -V | tail -1); echo "sf draft: $SF" >> $REC/stages.txt
EV="--prompts heldout.jsonl --num-draft-tokens 3 7 --batch-size 1 --num-prompts 16 --max-new-tokens 128"
st ev-nopack-begin; e3 eval --run nopack $EV --json $REC/cmp-eval-nopack.json > $REC/cmp-eval-nopack.log 2>&1; st ev-nopack-end rc $?
st ev-sf-begin; e3 eval --draft $SF --model $M $EV --json $REC/cmp-eval-specforge.json > $REC/cmp-eval-specforge.log 2>&1; st ev-sf-end rc $?
st 8b-begin
( cd $R && TORCH_LOGS=graph_breaks,recompiles timeout 1000 python3 benchmarks/train.py --shape llama-3.1-8b --loops offline --modes loss --packs True --variants compile-step --specforge-shapes steady --steps 26 --warmup-steps 8 --batch-size 4 --max-length 2048 --out $HOME/r8b/train-8b-offline-compile-vs-sf.json > $HOME/r8b/log.txt 2>&1 ); st 8b-end rc $?
rm -rf /tmp/eagle3fn-bench-llama-3.1-8b
st packed-begin
e3 train --model $M --data sub.jsonl --out-dir packed --lr 7e-4 --max-length 1024 --batch-size 32 --epochs 2 --seed 0 --eval-holdout 64 > $REC/packed.log 2>&1; st packed-end rc $?
cp packed/record.json $REC/record-packed.json 2>/dev/null
st ev-packed-begin; e3 eval --run packed $EV --json $REC/cmp-eval-packed.json > $REC/cmp-eval-packed.log 2>&1; st ev-packed-end rc $?
st done

#!/bin/bash
# run40.sh WATCH_S EPOCHS: start the 8B compile-step repro in the background, synthesize 20k
# conversations (seed 2), merge, start training in the background, watch until WATCH_S.
cd "$(dirname "$0")/.."; . .gpu/env.sh; cat .gpu/meta
T00=$(date +%s); mkdir -p $HOME/rec $HOME/r8b
python3 -c "from eagle3fn.io.smollm2 import smollm2_path; print(smollm2_path())" 2>&1 | tail -2
R=$PWD
( cd $R && TORCH_LOGS=graph_breaks,recompiles TORCH_FAKE_TENSOR_DEBUG=1 timeout 1500 python3 benchmarks/train.py --shape llama-3.1-8b --loops offline --modes loss --packs True --no-specforge --variants compile-step --out $HOME/r8b/train-8b-offline-compile-step.json > $HOME/r8b/log.txt 2>&1; echo $? > $HOME/r8b/rc ) > /dev/null 2>&1 &
cd $HOME
e3 synthesize --model.path $M --num-conversations 20000 --seed 2 --max-new-tokens 384 --keep-truncated --batch-size 1024 --out $HOME/syn40k.jsonl 2>&1 | grep -v Loading | tee $HOME/rec/synth.log
gzip -k $HOME/syn40k.jsonl; cp $HOME/syn40k.jsonl.gz $HOME/syn40k.jsonl.*.json $HOME/rec/ 2>/dev/null
python3 $R/docs/bench/outcome-smollm2-h100-40k/merge.py $HOME/syn40k.jsonl $HOME/merged.jsonl 2>&1 | tee $HOME/rec/merge.log
T0=$(date +%s)
setsid nohup bash -c ". $R/.gpu/env.sh; python3 -m eagle3fn.cli train --model \$M --data $HOME/merged.jsonl --out-dir $HOME/run --max-length 1024 --batch-size 32 --lr 7e-4 --eval-holdout 64 --eval-every 200 --eval-accept-prompts 8 --epochs $2 > $HOME/rec/train.log 2>&1; echo \$? > $HOME/rec/train.rc; date +%s > $HOME/rec/train.end" > /dev/null 2>&1 &
echo $T0 > $HOME/rec/train.start
end=$((T00 + $1))
while [ $(date +%s) -lt $end ] && [ ! -f $HOME/rec/train.rc ]; do sleep 10; done
tail -c 1500 $HOME/rec/train.log; nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv
echo "--- 8B repro"; tail -c 1500 $HOME/r8b/log.txt
cp $HOME/rec/* $OUT/ 2>/dev/null; cp $HOME/run/metrics.jsonl $OUT/ 2>/dev/null; true

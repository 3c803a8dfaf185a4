#!/bin/bash
# train.sh WATCH_S EPOCHS: merge, convert, start training in the background, watch WATCH_S seconds.
cd "$(dirname "$0")/.."; . .gpu/env.sh; cat .gpu/meta
mkdir -p $HOME/rec
python3 docs/bench/outcome-smollm2-h100-20k-5ep/merge.py $HOME/merged.jsonl 2>&1 | tee $HOME/rec/merge.log
python3 -c "from eagle3fn.io.smollm2 import smollm2_path; print(smollm2_path())" 2>&1 | tail -2
T0=$(date +%s)
cd $HOME && setsid nohup bash -c ". $OLDPWD/.gpu/env.sh; python3 -m eagle3fn.cli train --model \$M --data $HOME/merged.jsonl --out-dir $HOME/run --max-length 1024 --batch-size 32 --lr 7e-4 --eval-holdout 64 --eval-every 200 --eval-accept-prompts 8 --epochs $2 > $HOME/rec/train.log 2>&1; echo \$? > $HOME/rec/train.rc; date +%s > $HOME/rec/train.end" > /dev/null 2>&1 &
echo $T0 > $HOME/rec/train.start
cd $OLDPWD
end=$((T0 + $1))
while [ $(date +%s) -lt $end ] && [ ! -f $HOME/rec/train.rc ]; do sleep 10; done
tail -c 3000 $HOME/rec/train.log; nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv
cp $HOME/rec/* $OUT/ 2>/dev/null; cp $HOME/run/metrics.jsonl $OUT/ 2>/dev/null; true

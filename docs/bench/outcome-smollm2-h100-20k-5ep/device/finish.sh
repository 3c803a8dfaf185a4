#!/bin/bash
# finish.sh [WAIT_S]: wait for training (else SIGTERM it), then evaluate.
cd "$(dirname "$0")/.."; . .gpu/env.sh
test -f $HOME/rec/train.start || { echo "BARE machine"; exit 3; }
W=${1:-240}; end=$(( $(date +%s) + W ))
while [ $(date +%s) -lt $end ] && [ ! -f $HOME/rec/train.rc ]; do sleep 5; done
if [ ! -f $HOME/rec/train.rc ]; then echo "stopping training (SIGTERM)"; pkill -TERM -f '^python3 -m eagle3fn.cli train'; while [ ! -f $HOME/rec/train.rc ]; do sleep 2; done; fi
echo "train rc $(cat $HOME/rec/train.rc), $(( $(cat $HOME/rec/train.end) - $(cat $HOME/rec/train.start) )) s"
tail -c 2500 $HOME/rec/train.log
cp $HOME/rec/* $OUT/; cp $HOME/run/metrics.jsonl $OUT/ 2>/dev/null
cd $HOME
e3 eval --run run --num-draft-tokens 1 2 3 4 5 6 7 --batch-size 1 --num-prompts 16 --max-new-tokens 128 --json $OUT/eval-b1.json 2>&1 | tee $OUT/eval-b1.log
e3 eval --run run --num-draft-tokens 1 2 3 4 5 6 7 --batch-size 4 16 --num-prompts 32 --max-new-tokens 128 --json $OUT/eval-b4-16.json 2>&1 | tee $OUT/eval-b4-16.log

#!/bin/bash
# fin40.sh DEADLINE_S: wait for training, then run each evaluation not yet done; stop before DEADLINE_S.
cd "$(dirname "$0")/.."; . .gpu/env.sh
test -f $HOME/rec/train.start || { echo "BARE machine"; exit 3; }
T00=$(date +%s); end=$((T00 + $1))
while [ $(date +%s) -lt $end ] && [ ! -f $HOME/rec/train.rc ]; do sleep 5; done
cp $HOME/r8b/log.txt $OUT/r8b-log.txt 2>/dev/null; cp $HOME/r8b/*.json $HOME/r8b/rc $OUT/ 2>/dev/null
test -f $HOME/rec/train.rc || { tail -c 800 $HOME/rec/train.log; cp $HOME/rec/* $OUT/; echo "TRAINING STILL RUNNING"; exit 0; }
echo "train rc $(cat $HOME/rec/train.rc), $(( $(cat $HOME/rec/train.end) - $(cat $HOME/rec/train.start) )) s"
tail -c 2500 $HOME/rec/train.log
cp $HOME/rec/* $OUT/; cp $HOME/run/metrics.jsonl $OUT/ 2>/dev/null
cd $HOME; mkdir -p ev
ev() { name=$1; shift; [ -f ev/$name.json ] && return 0; [ $(( end - $(date +%s) )) -lt $need ] && { echo "SKIP $name (time)"; return 0; }
  e3 eval --run run "$@" --max-new-tokens 128 --json ev/$name.tmp 2>&1 | tee ev/$name.log && mv ev/$name.tmp ev/$name.json; cp ev/$name.* $OUT/ 2>/dev/null; }
need=130; ev eval-b1 --num-draft-tokens 1 2 3 4 5 6 7 --batch-size 1 --num-prompts 16
need=150; ev eval-b4-16 --num-draft-tokens 1 2 3 4 5 6 7 --batch-size 4 16 --num-prompts 32
need=150; ev eval-demo --prompts /tmp/site/eagle3fn/demo/chat.jsonl --num-prompts 48 --num-draft-tokens 3 4 5 --batch-size 1
e3 export --run run --out draft --best 2>&1 | tail -3 | tee $OUT/export.log
cp ev/* $OUT/ 2>/dev/null; ls $OUT

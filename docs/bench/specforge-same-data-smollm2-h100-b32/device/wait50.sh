#!/bin/bash
# wait50.sh SECONDS: wait for the chain (until SECONDS pass or it is done), then bring back what it has.
test -f $HOME/rec/stages.txt || { echo "BARE machine"; exit 3; }
end=$(( $(date +%s) + $1 ))
while [ $(date +%s) -lt $end ] && ! grep -q " done" $HOME/rec/stages.txt; do sleep 5; done
T0=$(head -1 $HOME/rec/stages.txt | cut -d' ' -f1); awk -v t=$T0 '{ $1 = $1 - t; print }' $HOME/rec/stages.txt
for f in nopack sf packed; do echo "--- $f"; tail -c 600 $HOME/rec/$f.log 2>/dev/null; done
for f in cmp-eval-nopack cmp-eval-specforge cmp-eval-packed; do echo "--- $f"; tail -n 12 $HOME/rec/$f.log 2>/dev/null; done
echo "--- 8B"; grep -v "^step\|Recompil" $HOME/r8b/log.txt 2>/dev/null | tail -c 2500
nvidia-smi --query-gpu=name,utilization.gpu,memory.used --format=csv,noheader
cd $HOME && tar czf $OUT/rec50.tgz rec r8b/log.txt r8b/*.json 2>/dev/null; ls -la $OUT

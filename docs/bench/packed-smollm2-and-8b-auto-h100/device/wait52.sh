#!/bin/bash
# wait52.sh SECONDS: wait for the chain (until SECONDS pass or it is done), then bring back what it has.
test -f $HOME/rec/stages.txt || { echo "BARE machine"; exit 3; }
end=$(( $(date +%s) + $1 ))
while [ $(date +%s) -lt $end ] && ! grep -q " done" $HOME/rec/stages.txt; do sleep 5; done
T0=$(head -1 $HOME/rec/stages.txt | cut -d' ' -f1); awk -v t=$T0 '{ $1 = $1 - t; print }' $HOME/rec/stages.txt
echo "--- p14cs"; grep -E "^step (1|10|100|200|300)/|compile" $HOME/rec/p14cs.log; tail -c 700 $HOME/rec/p14cs.log 2>/dev/null
echo "--- eval"; tail -n 14 $HOME/rec/cmp-eval-p14cs.log 2>/dev/null
echo "--- test_gpu"; tail -n 25 $HOME/rec/test_gpu.log 2>/dev/null
echo "--- 8B"; grep -v "^step\|Recompil" $HOME/r8b/log.txt 2>/dev/null | tail -c 2500
echo "--- 135"; tail -c 1500 $HOME/r8b/log135.txt 2>/dev/null
for P in prompt-heavy sharegpt; do echo "--- 8B online $P"; tail -c 1200 $HOME/r8b/logon-$P.txt 2>/dev/null; done
nvidia-smi --query-gpu=name,utilization.gpu,memory.used --format=csv,noheader
cd $HOME && tar czf $OUT/rec52.tgz rec r8b/*.txt r8b/*.json 2>/dev/null; ls -la $OUT

#!/bin/bash
# run51.sh: start chain51.sh detached (setsid: it outlives this call while the machine is held).
cd "$(dirname "$0")/.."; test -f $HOME/rec/stages.txt && { echo "already started"; exit 0; }
mkdir -p $HOME/rec; cp -r .gpu $HOME/gpu51 2>/dev/null
setsid nohup bash .gpu/chain51.sh > $HOME/rec/chain.log 2>&1 < /dev/null &
sleep 5; cat $HOME/rec/stages.txt

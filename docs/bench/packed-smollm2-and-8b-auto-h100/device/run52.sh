#!/bin/bash
# run52.sh: start chain52.sh detached (setsid: it outlives this call while the machine is held).
cd "$(dirname "$0")/.."; test -f $HOME/rec/stages.txt && { echo "already started"; exit 0; }
mkdir -p $HOME/rec; cp -r .gpu $HOME/gpu52 2>/dev/null
setsid nohup bash .gpu/chain52.sh > $HOME/rec/chain.log 2>&1 < /dev/null &
sleep 5; cat $HOME/rec/stages.txt

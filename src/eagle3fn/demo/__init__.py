"""The bundled demo data: 96 prompts written for eagle3fn, answered by SmolLM2-135M-Instruct
(``eagle3fn regenerate``, greedy, 160 new tokens at most), in OpenAI JSONL form."""

from pathlib import Path


def demo_data_path() -> Path:
    """The demo conversations (``chat.jsonl`` inside this package)."""
    return Path(__file__).with_name("chat.jsonl")

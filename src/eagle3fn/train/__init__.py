"""The training product, one module a stage:

- ``config``: ``TrainConfig`` (the CLI only overrides it) and presets.
- ``sources``: micro-batches from the target online, or from the offline cache.
- ``build``: input checks, then the run (draft, vocab map, params, optimizer, resume).
- ``step``: one optimizer step (micro-batches -> TTT -> gradients -> finiteness -> AdamW).
- ``evaluate``: the objective on the held-out conversations.
- ``checkpoint``: checkpoints that cannot run code, the run fingerprint, ``load_run``.
- ``loop``: ``train``, which only orchestrates the stages.
"""

from eagle3fn.train.checkpoint import CHECKPOINT, initial_params, load_run
from eagle3fn.train.config import TrainConfig
from eagle3fn.train.evaluate import evaluate_holdout
from eagle3fn.train.loop import METRICS, train

__all__ = ["CHECKPOINT", "METRICS", "TrainConfig", "evaluate_holdout", "initial_params", "load_run", "train"]

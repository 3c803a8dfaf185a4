"""Measuring a draft where users decide: acceptance, speedup, and the output check.

- ``identity``: greedy speculative output must equal the target alone, token for token;
  a difference is either an argmax near-tie of the low-precision target (reported) or a
  bug (raised).
- ``sweep``: speculative decoding for every k and batch size asked, each timed against
  the target alone on the same batches in the same process, the best k per batch, and
  the acceptance the training-time metrics imply beside the measured one.
- ``graphed``: ``speculative.generate(impl="graph")`` and its target-alone baseline, both
  on a static KV cache with CUDA graphs (imported by ``speculative`` when asked for, not
  here: it reads ``speculative``).
"""

from eagle3fn.evaluation.identity import Divergence, IdentityReport, OutputMismatch, check_identity
from eagle3fn.evaluation.sweep import implied_acceptance_length, sweep

__all__ = ["Divergence", "IdentityReport", "OutputMismatch", "check_identity",
           "implied_acceptance_length", "sweep"]

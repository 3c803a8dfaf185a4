"""eagle3fn: EAGLE-3 draft training that computes only what is supervised, exactly.

The data flow, one stage per module::

    batch (ids, loss mask, attention mask, target features)
      -> align.supervised_mask      sup = {t : m_t, t <= L-2}        bool [B, T]
      -> rowmap.build_rowmap        rows_j = {s - j}, teacher positions U, table rows
      -> teacher.teacher_table_*    draft logits [U, Vd], lse_draft / lse_full / token / gate [U]
      -> ttt                        draft unrolled k steps (draft.py, unrolled/), logits_j
                                    only at rows_j under trim="loss"   [n_j, Vd]
      -> loss.step_terms            gated sums and metric counts per step
      -> loss.objective             sum_j 0.8**j * loss_j, acc, accept, tau

A packed batch (several conversations per row, ``io.packing``) adds one tensor,
``Features.positions`` restarting at 0 in each conversation; passed to
``supervised_mask`` and ``build_rowmap`` (``positions=``), it keeps every conversation
exactly as if alone (SPEC section 9).

``reference.reference_objective`` is the dense full-length oracle of the same
objective; ``check.trimmed_objective`` composes the trimmed stages for comparison.
``eagle3fn.ttt`` is the function (its package is ``eagle3fn.unrolled``: config,
unroll, attention, step layout, trim policy); the training product is
``eagle3fn.train`` (``from eagle3fn.train import TrainConfig, train``).
"""

from importlib import metadata as _metadata

from eagle3fn.align import sequence_lengths, shift_left, supervised_mask
from eagle3fn.draft import DraftConfig, Eagle3Draft, RopeConfig, init_params
from eagle3fn.loss import LossConfig, objective, soft_cross_entropy, step_terms
from eagle3fn.reference import reference_objective
from eagle3fn.rowmap import build_rowmap
from eagle3fn.shapes import Features, Objective, RowMap, StepTerms, TeacherTable
from eagle3fn.teacher import teacher_table_from_hidden, teacher_table_from_logits
from eagle3fn.unrolled import TTTConfig, ttt
from eagle3fn.vocab import build_vocab_map, count_tokens, validate_vocab_map

try:  # one source of truth: the installed package's metadata (pyproject.toml)
    __version__ = _metadata.version("eagle3fn")
except _metadata.PackageNotFoundError:  # imported from a source tree that was never installed
    __version__ = "0+unknown"

__all__ = [
    "DraftConfig",
    "Eagle3Draft",
    "Features",
    "RopeConfig",
    "TTTConfig",
    "init_params",
    "LossConfig",
    "Objective",
    "RowMap",
    "StepTerms",
    "TeacherTable",
    "build_rowmap",
    "build_vocab_map",
    "count_tokens",
    "objective",
    "reference_objective",
    "sequence_lengths",
    "shift_left",
    "soft_cross_entropy",
    "step_terms",
    "supervised_mask",
    "teacher_table_from_hidden",
    "teacher_table_from_logits",
    "ttt",
    "validate_vocab_map",
]

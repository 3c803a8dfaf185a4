"""Triton kernels, each in four layers: private kernels -> launcher (asserts shapes,
dtypes, contiguity) -> ``autograd.Function`` -> public function. Every kernel has a
readable PyTorch twin beside it that the tests compare outputs and gradients with.

``loss.py`` reaches the soft cross-entropy through its ``impl="triton"`` switch and
``unrolled.merge_diagonal`` the diagonal-key merge (CUDA only); nothing else imports them.
"""

from eagle3fn.kernels.merge import merge_diagonal, merge_diagonal_naive
from eagle3fn.kernels.soft_ce import SoftCE, indexed_soft_ce, indexed_soft_ce_naive

__all__ = ["SoftCE", "indexed_soft_ce", "indexed_soft_ce_naive", "merge_diagonal",
           "merge_diagonal_naive"]

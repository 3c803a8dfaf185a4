"""Triton kernels, each in four layers: private kernels -> launcher (asserts shapes,
dtypes, contiguity) -> ``autograd.Function`` -> public function. Every kernel has a
readable PyTorch twin beside it that the tests compare outputs and gradients with.

``loss.py`` reaches these through its ``impl="triton"`` switch; nothing else imports
them.
"""

from eagle3fn.kernels.soft_ce import SoftCE, indexed_soft_ce, indexed_soft_ce_naive

__all__ = ["SoftCE", "indexed_soft_ce", "indexed_soft_ce_naive"]

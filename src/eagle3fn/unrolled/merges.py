"""Log-sum-exp merges of partial attentions (``unrolled.attention``): the diagonal keys of
steps ``1..j`` merged into the step-0 output (``merge_diagonal``, a Triton kernel on
CUDA), and two key blocks' outputs merged (``merge_blocks``, the sequence-parallel
ring's).

Legend: N query rows, h heads, g kv heads, d head dim, j the step.
"""

from __future__ import annotations

import math

import torch

from eagle3fn.kernels import merge as merge_kernel


def use_merge_kernel(q_NhD: torch.Tensor) -> bool:
    """Whether ``merge_diagonal`` runs the Triton kernel for these queries: CUDA
    (bf16/fp16/fp32), outside ``torch.func`` transforms and outside a graph being
    compiled (the one-graph step, ``train.onegraph``: there the PyTorch twin is traced and
    inductor fuses it; dynamo cannot trace ``is_functorch_wrapped_tensor`` and would
    break the graph on it, so it is asked last)."""
    return (q_NhD.is_cuda
            and q_NhD.dtype in (torch.bfloat16, torch.float16, torch.float32)
            and not torch.compiler.is_compiling()
            and not torch._C._functorch.is_functorch_wrapped_tensor(q_NhD))


def merge_diagonal(o_NhD: torch.Tensor, lse_Nh: torch.Tensor, q_NhD: torch.Tensor,
                   k_jNgd: torch.Tensor, v_jNgd: torch.Tensor, scale: float) -> torch.Tensor:
    """Add the diagonal keys of steps ``1..j`` to causal attention outputs: ``o`` and
    ``lse`` (natural log-sum-exp of the scaled scores) over the step-0 keys, merged
    with each row's own keys ``k_jNgd, v_jNgd`` by log-sum-exp (fp32 math, output in
    ``q``'s dtype; GQA by broadcasting, nothing is repeated). ``[N, h, d]``.

    On CUDA (bf16/fp16/fp32) one Triton kernel each way (``kernels.merge``: nothing
    ``[N, h, j]``-sized is stored); elsewhere its PyTorch twin
    ``kernels.merge.merge_diagonal_naive``, which callers with
    ``compile_elementwise`` off call directly (``merge_diagonal_as``)."""
    if use_merge_kernel(q_NhD):
        return merge_kernel.merge_diagonal(o_NhD, lse_Nh, q_NhD, k_jNgd, v_jNgd, scale)
    return merge_kernel.merge_diagonal_naive(o_NhD, lse_Nh, q_NhD, k_jNgd, v_jNgd, scale)


def merge_diagonal_as(fused: bool):
    """The diagonal merge a caller's ``compile_elementwise`` asks for: ``merge_diagonal``
    (the Triton kernel on CUDA) when ``fused``, else always the PyTorch twin. Both take
    ``(o, lse, q, k, v, scale)``."""
    return merge_diagonal if fused else merge_kernel.merge_diagonal_naive


def merge_blocks(o: torch.Tensor, lse: torch.Tensor, o_t: torch.Tensor,
                 lse_t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two partial attentions by log-sum-exp (the flex path's): ``o [N, h, d]``
    (any dtype) with natural log-sum-exp ``lse [N, h]`` (fp32; ``-inf``: the row saw no
    key there). The weights are fp32 ``[N, h]``, the weighted sum is in ``o``'s dtype
    (as the eager merge), so nothing ``[N, h, d]``-sized is kept in fp32. NaN-free when both are
    ``-inf`` (the result is 0 with ``-inf``); the shift by the larger ``lse`` is a
    constant of the maths, so it carries no gradient. Returns the merged ``(o, lse)``."""
    top = torch.maximum(lse, lse_t).detach()
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    w, w_t = torch.exp(lse - top), torch.exp(lse_t - top)
    denom = w + w_t
    seen = denom > 0
    safe = torch.where(seen, denom, torch.ones_like(denom))
    out = (w / safe).to(o.dtype)[..., None] * o + (w_t / safe).to(o.dtype)[..., None] * o_t
    return out, torch.where(seen, top + torch.log(safe), torch.full_like(top, -math.inf))


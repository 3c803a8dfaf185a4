"""What a target must satisfy for eagle3fn's teacher and aux features (``io.target``).

Legend: N target decoder layers, Ht target hidden size, V target vocab, B batch.

Aux layer ids are output-of-layer ids: three increasing ids in ``[0, N - 2]``
(``validate_aux_layer_ids``), EAGLE-3's defaults from N (``default_aux_layer_ids``).
The teacher is ``softmax(final_hidden @ lm_head.weight.T)``: a target whose logits are
transformed after lm_head (a bias, softcapping, a logit scale) is refused when loaded
(``check_teacher_is_head``, from its config) and when it runs (``check_logits``, from its
own last-position logits).
"""

from __future__ import annotations

import operator

import torch
import torch.nn.functional as F
from torch import nn

# Config fields by which transformers models change their logits after lm_head
# (Gemma 2, Cohere, Granite, ...), with the value that means "no change".
LOGIT_TRANSFORMS = {
    "final_logit_softcapping": None,
    "logit_scale": 1.0,
    "logits_scaling": 1.0,
    "output_multiplier": 1.0,
}

# How far (relative to max |z|) the model's own last-position logits may sit from
# final_hidden @ lm_head.T: bf16 output rounding is 2**-9 relative, TF32 about 1e-3.
HEAD_CHECK_RTOL = 1e-2


def validate_aux_layer_ids(aux_layer_ids, num_layers: int) -> tuple[int, int, int]:
    """The ids as a tuple after checking them: three ints, strictly increasing, in
    ``[0, N - 2]``.

    Increasing because serving engines capture in layer order and the draft's ``fc``
    reads the chunks in that order; at most ``N - 2`` because they capture before
    layer ``i + 1``, which must exist.
    """
    try:
        ids = tuple(operator.index(i) for i in aux_layer_ids)
    except TypeError:
        ids = ()
    if (len(ids) != 3 or not all(a < b for a, b in zip(ids, ids[1:]))
            or ids[0] < 0 or ids[-1] > num_layers - 2):
        raise ValueError(
            f"aux_layer_ids={list(aux_layer_ids)} must be three strictly increasing "
            f"output-of-layer ids in [0, {num_layers - 2}] for a {num_layers}-layer target "
            "(the serving engine captures them in layer order, before layer id + 1)"
        )
    return ids  # type: ignore[return-value]


def default_aux_layer_ids(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's default output-of-layer ids ``(1, N//2 - 1, N - 4)`` of an N-layer
    target, e.g. ``(1, 15, 28)`` for 32 layers.

    Raises ValueError when they are not three distinct increasing layers (N < 7):
    pass ``aux_layer_ids`` explicitly then.
    """
    ids = (1, num_layers // 2 - 1, num_layers - 4)
    try:
        return validate_aux_layer_ids(ids, num_layers)
    except ValueError:
        hint = ("pass aux_layer_ids explicitly, e.g. (0, 1, 2)" if num_layers >= 4
                else "an EAGLE-3 target needs at least 4 decoder layers")
        raise ValueError(
            f"the default aux layers (1, N//2 - 1, N - 4) = {list(ids)} of a "
            f"{num_layers}-layer target are not three increasing layers in "
            f"[0, {num_layers - 2}] (that needs N >= 7); {hint}"
        ) from None


def _configs(model: nn.Module) -> list:
    """``model.config`` and, when it differs, its text config (``get_text_config()``);
    empty for a model without a config."""
    config = getattr(model, "config", None)
    if config is None:
        return []
    found = [config]
    get_text = getattr(config, "get_text_config", None)
    if callable(get_text) and get_text() is not config:
        found.append(get_text())
    return found


def check_teacher_is_head(model: nn.Module, lm_head: nn.Module) -> None:
    """Raise ValueError when the model's logits are not ``final_hidden @ lm_head.weight.T``
    by its own description: ``lm_head`` has a bias, or a config of ``model`` sets one of
    ``LOGIT_TRANSFORMS`` to a value other than its identity."""
    if getattr(lm_head, "bias", None) is not None:
        raise ValueError(
            "the target's lm_head has a bias; eagle3fn's teacher is final_hidden @ "
            "lm_head.weight.T and would differ from the model's logits"
        )
    for config in _configs(model):
        for name, identity in LOGIT_TRANSFORMS.items():
            value = getattr(config, name, identity)
            if value is not None and value != identity:
                raise ValueError(
                    f"the target sets {name}={value} ({type(config).__name__}), so its logits "
                    "are transformed after lm_head; eagle3fn's teacher is softmax(final_hidden "
                    "@ lm_head.weight.T) and would train the draft toward a different "
                    "distribution. Targets with logit softcapping or logit scaling are not "
                    "supported"
                )


def check_logits(model_logits_BV: torch.Tensor, hidden_BH: torch.Tensor,
                 head_VH: torch.Tensor) -> None:
    """Raise ValueError when the model's own logits ``[B, V]`` differ from ``hidden [B, Ht]
    @ head [V, Ht].T`` by more than ``HEAD_CHECK_RTOL * max|logit|`` (fp32 maths, on the
    head's device): a logit transform no config field announced."""
    want = model_logits_BV.float()
    got = F.linear(hidden_BH.to(head_VH.device).float(), head_VH.float()).to(want.device)
    err = (got - want).abs().max()
    scale = want.abs().max()
    if not bool(err <= HEAD_CHECK_RTOL * scale + 1e-6):
        raise ValueError(
            f"the model's logits differ from final_hidden @ lm_head.weight.T by "
            f"{err.item():.3g} (max |logit| {scale.item():.3g}): the model changes its logits "
            "after lm_head (softcapping, scaling) or its hidden states after the final norm, "
            "so a teacher streamed from final_hidden would not be the model's distribution"
        )

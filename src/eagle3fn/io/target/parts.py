"""Where a HF target keeps its parts: the text backbone (decoder layers and final norm)
and the lm_head, through causal-LM and multimodal wrappers, and ``TargetModel``, the
loaded target with those parts found (``io.target``).

Legend: N target decoder layers, Ht target hidden size, V target vocab.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn


def _is_backbone(module) -> bool:
    return (isinstance(module, nn.Module)
            and isinstance(getattr(module, "layers", None), nn.ModuleList)
            and len(module.layers) > 0
            and isinstance(getattr(module, "norm", None), nn.Module))


def _attribute_path(root, path: str):
    """``root`` followed along ``path`` (its first part names ``root`` itself); None
    where an attribute is missing."""
    for part in path.split(".")[1:]:
        root = getattr(root, part, None)
    return root


# Where wrappers keep the text decoder, in the order they are tried. transformers 5
# multimodal wrappers: model.model.language_model; causal LMs: model.model.
_BACKBONE_PATHS = ("model.model.language_model", "model.language_model",
                   "model.language_model.model", "model.model", "model")


def find_text_backbone(model: nn.Module) -> nn.Module:
    """The text decoder inside ``model``: the module holding ``.layers`` (a non-empty
    ModuleList of decoder layers) and ``.norm`` (the final norm).

    Tries ``model.model.language_model``, ``model.language_model`` (and its ``.model``),
    ``model.model``, ``model`` itself, then ``model.get_decoder()``; a vision tower
    (which has ``.layers`` but no ``.norm`` beside them) never qualifies.
    """
    tried = []
    for path in _BACKBONE_PATHS:
        found = _attribute_path(model, path)
        if _is_backbone(found):
            return found
        tried.append(f"{path} ({type(found).__name__ if found is not None else 'missing'})")
    get_decoder = getattr(model, "get_decoder", None)
    if callable(get_decoder):
        found = get_decoder()
        if _is_backbone(found):
            return found
        tried.append(f"model.get_decoder() ({type(found).__name__})")
    raise ValueError(
        f"no text backbone with .layers and .norm found in {type(model).__name__}; tried "
        + ", ".join(tried)
        + ". Pass a model whose decoder exposes its layers as .layers and its final norm "
        "as .norm"
    )


def find_lm_head(model: nn.Module) -> nn.Module:
    """The target's output head: ``model.lm_head``, else ``model.get_output_embeddings()``,
    else ``model.language_model.lm_head``; its ``weight`` is ``[V, Ht]``."""
    tried = []
    for path in ("model.lm_head", "model.get_output_embeddings()", "model.language_model.lm_head"):
        if path.endswith("()"):
            getter = getattr(model, "get_output_embeddings", None)
            head = getter() if callable(getter) else None
        else:
            head = _attribute_path(model, path)
        weight = getattr(head, "weight", None)
        if isinstance(head, nn.Module) and isinstance(weight, torch.Tensor) and weight.dim() == 2:
            return head
        tried.append(f"{path} ({type(head).__name__ if head is not None else 'missing'})")
    raise ValueError(
        f"no lm_head with a 2-D weight found in {type(model).__name__}; tried "
        + ", ".join(tried)
        + ". Load the model with its language-modelling head (AutoModelForCausalLM or "
        "AutoModelForImageTextToText, not AutoModel)"
    )


def find_backbone_attr(model: nn.Module, name: str) -> Any:
    """``model.<name>``, else the text backbone's ``<name>``: methods such as
    ``get_input_embeddings`` may live on the backbone, not on the wrapper."""
    if hasattr(model, name):
        return getattr(model, name)
    backbone = find_text_backbone(model)
    if hasattr(backbone, name):
        return getattr(backbone, name)
    raise ValueError(
        f"neither {type(model).__name__} nor its text backbone {type(backbone).__name__} "
        f"has {name!r}"
    )


def replace_submodules(
    root: nn.Module,
    match: Callable[[str, nn.Module], bool],
    make: Callable[[str, nn.Module], nn.Module],
) -> list[str]:
    """Replace every submodule of ``root`` for which ``match(name, module)`` holds by
    ``make(name, module)``; return the dotted names replaced, in tree order.

    The tree is listed once (``named_modules`` materialised, duplicates kept) before
    anything changes, and each replacement goes through ``root.set_submodule`` (a
    dotted ``setattr`` would add an attribute named ``"a.b"`` to ``root`` instead).
    A module reachable under several names (tied weights) is made once and set at
    every name. Matches inside an already replaced module are left to the
    replacement.
    """
    entries = list(root.named_modules(remove_duplicate=False))
    made: dict[int, nn.Module] = {}
    replaced: list[str] = []
    for name, module in entries:
        parts = name.split(".")
        if any(".".join(parts[:n]) in replaced for n in range(1, len(parts))):
            continue
        if not match(name, module):
            continue
        if name == "":
            raise ValueError(
                f"match selects the root {type(root).__name__} itself; replace it directly"
            )
        if id(module) not in made:
            made[id(module)] = make(name, module)
        root.set_submodule(name, made[id(module)])
        replaced.append(name)
    return replaced


@dataclass(frozen=True)
class TargetModel:
    """A loaded target and where its EAGLE-3 features come from.

    Fields:
        model: the full HF model (causal LM or multimodal wrapper), eval mode, frozen.
        backbone: its text decoder; ``backbone.layers`` has N layers, ``backbone.norm``
            is the final norm whose output ``[B, S, Ht]`` is ``final_hidden``.
        lm_head: the output head, ``weight [V, Ht]``, no bias.
        aux_layer_ids: three increasing output-of-layer ids in ``[0, N - 2]``; aux is
            ``[B, S, 3*Ht]`` in this order.
        num_layers: N.
        hidden_size: Ht.
        vocab_size: V, rows of ``lm_head.weight`` (the draft's ``vocab_size``).
        compiled_layers: None (every layer eager), or N callables from
            ``compile_decoder_layers``: the compiled forward of ``backbone.layers[i]``, None
            where that layer runs eagerly; ``target_features`` runs them.
    """

    model: nn.Module
    backbone: nn.Module
    lm_head: nn.Module
    aux_layer_ids: tuple[int, int, int]
    num_layers: int
    hidden_size: int
    vocab_size: int
    compiled_layers: tuple[Callable | None, ...] | None = None

    @property
    def head_weight(self) -> torch.Tensor:
        """The lm_head weight ``[V, Ht]``, detached."""
        return self.lm_head.weight.detach()

    @property
    def embed_tokens(self) -> torch.Tensor:
        """The input embedding weight ``[V, Ht]`` (for the draft's frozen copy).

        Unscaled: Gemma multiplies it by ``sqrt(Ht)`` in its forward, which the draft's
        RMSNorm on the embedding cancels (up to its epsilon).
        """
        return find_backbone_attr(self.model, "get_input_embeddings")().weight.detach()


"""Loading a target (``io.target``): the whole model (``load_target``), or only its
input embedding and lm_head weight read by name from its safetensors
(``load_embedding_and_head``, what an offline run needs).

Legend: N target decoder layers, Ht target hidden size, V target vocab.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from eagle3fn.io.model_dir import check_model_dir
from eagle3fn.io.target.checks import check_teacher_is_head, default_aux_layer_ids, validate_aux_layer_ids
from eagle3fn.io.target.parts import TargetModel, find_backbone_attr, find_lm_head, find_text_backbone


def _auto_class(config):
    import transformers
    from transformers.models.auto import modeling_auto

    auto_map = getattr(config, "auto_map", None) or {}
    for cls_name, names in (
        ("AutoModelForCausalLM", modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES),
        ("AutoModelForImageTextToText", modeling_auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES),
        ("AutoModel", modeling_auto.MODEL_MAPPING_NAMES),
    ):
        if config.model_type in names or cls_name in auto_map:
            return getattr(transformers, cls_name)
    raise ValueError(
        f"no transformers auto class knows model_type={config.model_type!r}; build the "
        "model yourself and pass the nn.Module to load_target"
    )


def load_target(
    model_or_path: nn.Module | str | Path,
    *,
    aux_layer_ids=None,
    dtype: torch.dtype | None = torch.float32,
    device: torch.device | str | None = "cpu",
    **from_pretrained_kwargs,
) -> TargetModel:
    """Load a target (or take a built one), find its backbone and head, freeze it.

    Args:
        model_or_path: an ``nn.Module`` already built, or a local directory holding a HF
            model (``config.json`` + weights, or a GGUF file inside it named by the
            ``gguf_file`` keyword; checked by ``check_model_dir``). The class is the first of
            AutoModelForCausalLM, AutoModelForImageTextToText, AutoModel whose mapping
            (or the config's ``auto_map``) knows the model type.
        aux_layer_ids: three increasing output-of-layer ids; default
            ``default_aux_layer_ids(N)``.
        dtype, device: what the target runs in; None keeps the module's own (use None
            with ``device_map=...``).
        **from_pretrained_kwargs: passed to ``from_pretrained`` (a path only), e.g.
            ``trust_remote_code=True``, ``device_map="auto"``.

    Raises:
        FileNotFoundError: the path does not exist or holds no ``config.json`` or no
            weights (``check_model_dir``; UsageError when it is a file).
        ValueError: no backbone / head found, bad aux ids, or the model transforms its
            logits after lm_head (softcapping, logit scale, lm_head bias), which a
            teacher streamed from ``final_hidden @ lm_head.T`` would not reproduce.
    """
    if isinstance(model_or_path, nn.Module):
        if from_pretrained_kwargs:
            raise ValueError(
                f"from_pretrained arguments {sorted(from_pretrained_kwargs)} only apply when "
                "loading from a path, not to a built nn.Module"
            )
        model = model_or_path
    else:
        gguf_file = from_pretrained_kwargs.get("gguf_file")
        path = check_model_dir(model_or_path, gguf_file)
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(
            path, trust_remote_code=from_pretrained_kwargs.get("trust_remote_code", False),
            **({"gguf_file": gguf_file} if gguf_file else {}))
        kwargs = dict(from_pretrained_kwargs)
        if "device_map" in kwargs and device is not None:
            raise ValueError(
                f"device_map={kwargs['device_map']!r} and device={device!r} both place the "
                "model; pass device=None with device_map"
            )
        if dtype is not None:
            kwargs["dtype"] = dtype
        model = _auto_class(config).from_pretrained(path, **kwargs)
    if dtype is not None or device is not None:
        model.to(device=device, dtype=dtype)
    model.eval()
    model.requires_grad_(False)

    backbone = find_text_backbone(model)
    lm_head = find_lm_head(model)
    check_teacher_is_head(model, lm_head)
    num_layers = len(backbone.layers)
    ids = (default_aux_layer_ids(num_layers) if aux_layer_ids is None
           else validate_aux_layer_ids(aux_layer_ids, num_layers))
    vocab_size, hidden_size = lm_head.weight.shape
    return TargetModel(model=model, backbone=backbone, lm_head=lm_head, aux_layer_ids=ids,
                       num_layers=num_layers, hidden_size=hidden_size, vocab_size=vocab_size)


@dataclass(frozen=True)
class TargetWeights:
    """The two tensors of a target that an offline run needs (``load_embedding_and_head``),
    in place of a loaded ``TargetModel``.

    Fields:
        embed_tokens: the input embedding weight ``[V, Ht]`` (the draft's frozen copy).
        head_weight: the lm_head weight ``[V, Ht]`` (the draft's head starts as its
            draft-vocab rows).
        aux_layer_ids: the cache's three aux layer ids (for the checkpoint).
        source: the weight files and keys the two came from (for messages).
    """

    embed_tokens: torch.Tensor
    head_weight: torch.Tensor
    aux_layer_ids: tuple[int, int, int]
    source: str


def _checkpoint_keys(path: Path) -> dict[str, Path]:
    """Every tensor name of a safetensors checkpoint directory and the file holding it,
    from the files transformers reads: ``model.safetensors.index.json``'s map, else
    ``model.safetensors``; empty for other formats (other ``*.safetensors`` files in the
    directory are not the model's)."""
    import json

    from safetensors import safe_open

    index, single = path / "model.safetensors.index.json", path / "model.safetensors"
    if index.is_file():
        return {k: path / f for k, f in json.loads(index.read_text())["weight_map"].items()}
    if not single.is_file():
        return {}
    with safe_open(str(single), framework="pt") as f:
        return {k: single for k in f.keys()}


def _match_key(name: str, keys: dict[str, Path]) -> str | None:
    """The checkpoint key of the module parameter ``name``: itself, else the only key
    ending with its last 2, 3, ... components (checkpoints of older transformers name
    a wrapper's parts differently, e.g. ``language_model.model.embed_tokens.weight``
    for ``model.language_model.embed_tokens.weight``); None when none or several do."""
    if name in keys:
        return name
    parts = name.split(".")
    for n in range(2, len(parts) + 1):
        tail = "." + ".".join(parts[-n:])
        hits = [k for k in keys if k.endswith(tail) or k == tail[1:]]
        if len(hits) == 1:
            return hits[0]
        if not hits:
            return None
    return None


def load_embedding_and_head(path: str | Path, *, aux_layer_ids, dtype: torch.dtype,
                            device: torch.device | str,
                            head_device: torch.device | str | None = None) -> TargetWeights | str:
    """The input embedding and the lm_head weight of the target in ``path``, read from
    its safetensors files by name, without building or loading the rest of the model:
    what training from an offline cache needs of a target (its layers ran in
    ``eagle3fn prepare``), a few hundred MB instead of the whole model.

    The names come from the model class built on the meta device (the same class and
    the same ``find_text_backbone`` / ``find_lm_head`` / ``get_input_embeddings`` that
    ``load_target`` uses, and its head checks); a tied head reads the embedding. The
    tensors are cast to ``dtype`` on ``device`` as ``load_target`` casts the model, so
    they are the same values; the head goes to ``head_device`` when given (an offline
    run reads it once, to start the draft's head from its rows: the host will do).

    Returns:
        ``TargetWeights`` (``embed_tokens``, ``head_weight`` ``[V, Ht]``), or a string
        saying why the names could not be matched to one tensor each in the checkpoint
        (no ``model.safetensors`` or index, a model class that cannot be built on the meta
        device, a key missing or ambiguous, a shape that differs, a quantized dtype): the
        caller then loads the whole target with ``load_target``.
    """
    from safetensors import safe_open
    from transformers import AutoConfig

    path = check_model_dir(path)
    keys = _checkpoint_keys(path)
    if not keys:
        return f"no model.safetensors or model.safetensors.index.json in {path}"
    try:  # a model whose class cannot be built here is loaded whole (which says why if it fails)
        config = AutoConfig.from_pretrained(path)
        with torch.device("meta"):
            model = _auto_class(config).from_config(config)
    except (ValueError, TypeError, ImportError, OSError, RuntimeError) as e:
        return f"its model class could not be built on the meta device ({type(e).__name__}: {e})"
    lm_head = find_lm_head(model)
    check_teacher_is_head(model, lm_head)
    embed = find_backbone_attr(model, "get_input_embeddings")()
    names = {}
    for n, m in model.named_modules(remove_duplicate=False):
        names.setdefault(id(m), n)  # the first path to each module
    name = lambda m: None if id(m) not in names else ".".join(filter(None, (names[id(m)], "weight")))  # noqa: E731
    wanted = {"embedding": name(embed), "head": name(lm_head)}
    tied = lm_head.weight is embed.weight
    found = {}
    for what, name in wanted.items():
        key = None if name is None else _match_key(name, keys)
        if key is None and what == "head" and (tied or getattr(config, "tie_word_embeddings", False)):
            key = found.get("embedding")  # a tied head is saved once, as the embedding
        if key is None:
            return f"the {what} ({name}) matches no single tensor of {path}"
        found[what] = key
    tensors = {}
    for what, key in found.items():
        with safe_open(str(keys[key]), framework="pt") as f:
            tensors[what] = f.get_tensor(key)
    want = {"embedding": tuple(embed.weight.shape), "head": tuple(lm_head.weight.shape)}
    for what, t in tensors.items():
        if tuple(t.shape) != want[what]:
            return f"{found[what]} in {path} has shape {tuple(t.shape)}, the model's {what} {want[what]}"
        if t.dtype not in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
            return f"{found[what]} in {path} is stored as {t.dtype} (quantized: transformers dequantizes it)"
    embedding = tensors["embedding"].to(device=device, dtype=dtype)
    head = tensors["head"].to(device=device if head_device is None else head_device, dtype=dtype)
    if found["head"] == found["embedding"] and head.device == embedding.device:
        head = embedding  # tied: one tensor
    return TargetWeights(embed_tokens=embedding, head_weight=head, aux_layer_ids=tuple(aux_layer_ids),
                         source=f"{path}: {found['embedding']}, {found['head']}")


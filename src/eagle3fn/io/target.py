"""HF target backend: load a causal LM or a multimodal wrapper and capture EAGLE-3 features.

Legend: B batch, S sequence length, N target decoder layers, Ht target hidden size,
V target vocab.

One target forward per batch, under no grad, with hooks on the text backbone::

    model(input_ids, attention_mask, pixel_values, ...)      the wrapper's own forward
      pre-hook on backbone.layers[i + 1], i in aux_layer_ids  -> aux [B, S, 3*Ht]
      hook on backbone.norm (its output)                      -> final_hidden [B, S, Ht]
      lm_head.weight                                          -> target_head [V, Ht]

``compile_decoder_layers`` compiles each decoder layer's forward (on CUDA); the hooks
stay outside the compiled graphs.

Aux layer ids are output-of-layer ids: id ``i`` is the residual stream leaving decoder
layer ``i``, read where layer ``i + 1`` takes it in (SGLang and vLLM store ``i + 1``
and capture before that layer; both only capture before an existing layer, hence
``i <= N - 2``). For every model this equals HF's ``output_hidden_states[i + 1]``
except where a model adds something between layers: Qwen3-VL adds its deepstack
visual features to the image positions after layers ``0..d-1``, and the stream the
next layer (and the serving engine) reads includes them.

The teacher is never materialised here: ``final_hidden`` and ``target_head`` let
``teacher.teacher_table_from_hidden`` stream ``softmax(final_hidden @ target_head.T)``
in vocab chunks at the supervised positions only, for any V.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import operator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from eagle3fn.compiled import compile_backend, compiler
from eagle3fn.errors import UsageError
from eagle3fn.io.model_dir import check_model_dir
from eagle3fn.shapes import Features

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


def _configs(model: nn.Module) -> list:
    config = getattr(model, "config", None)
    if config is None:
        return []
    found = [config]
    get_text = getattr(config, "get_text_config", None)
    if callable(get_text) and get_text() is not config:
        found.append(get_text())
    return found


def _check_teacher_is_head(model: nn.Module, lm_head: nn.Module) -> None:
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
    _check_teacher_is_head(model, lm_head)
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
    _check_teacher_is_head(model, lm_head)
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


def compile_decoder_layers(target: TargetModel) -> TargetModel:
    """``target`` with the forward of each decoder layer of its text backbone compiled,
    for ``target_features`` to run.

    Each ``backbone.layers[i].forward`` (hidden ``[B, S, Ht]`` -> ``[B, S, Ht]``: the two
    RMSNorms, attention with its rotary application, the MLP, the residual adds, the
    dtype casts) is compiled with ``compiled.compiler`` (shape-dynamic; inductor with
    ``INDUCTOR_OPTIONS``), the backend ``compiled.compile_backend`` gives for the device
    of the layer's weights: inductor on CUDA, None (the layer stays eager) on the CPU
    unless ``compiled.compile_on_cpu`` says otherwise. The embedding, the rotary tables,
    the attention mask, the final norm and the head stay eager.

    The layers share their code, so dynamo makes one graph for all N of them; it adds
    one where its guards tell calls apart: a batch whose SDPA mask transformers drops
    (an unpacked batch without padding, a packed batch whose rows hold one conversation
    each: the mask is then None, not a tensor), a batch of one row (dynamo specialises
    size 1), layers whose forward differs. Each graph is compiled the first time such a
    batch comes; later lengths reuse it.

    Only ``forward`` is compiled, not the module's ``__call__``: the forward hooks of
    ``target_features`` (pre-hooks on ``layers[i + 1]``, the hook on the final norm) run
    eagerly around the compiled forward and read the same tensors as without it (a
    compiled ``__call__`` would trace the hooks, which change at every call). The
    compiled forwards are set on the layers only while ``target_features`` runs, so
    other calls of ``target.model`` (the KV-cached decoding of ``evaluation``) run
    eagerly.

    Args:
        target: from ``load_target``.

    Returns:
        A ``TargetModel`` on the same modules with ``compiled_layers`` (N entries, None
        for an eager layer); ``target`` itself when no layer is compiled (the CPU by
        default), so CPU behaviour is unchanged.
    """
    forwards = []
    for layer in target.backbone.layers:
        weight = next(layer.parameters(), None)
        backend = None if weight is None else compile_backend(weight.device)
        forwards.append(None if backend is None else compiler(layer.forward, backend))
    if all(forward is None for forward in forwards):
        return target
    return dataclasses.replace(target, compiled_layers=tuple(forwards))


@contextlib.contextmanager
def _compiled_forwards(target: TargetModel):
    """Inside the block each layer with a compiled forward runs it; the layers' own
    ``forward`` attributes come back after it, also on error."""
    saved = []
    try:
        for layer, forward in zip(target.backbone.layers, target.compiled_layers or ()):
            if forward is not None:
                saved.append((layer, layer.__dict__.get("forward")))
                layer.forward = forward
        yield
    finally:
        for layer, before in saved:
            if before is None:
                del layer.forward
            else:
                layer.forward = before


class FeatureCapture:
    """Hook state of one forward: the aux streams, copied into one ``[B, S, 3*Ht]``
    buffer at the moment layer ``i + 1`` reads them (so an in-place update of the stream
    later in the forward cannot leak in), the final norm's output, and call counts.
    ``target_features`` and ``evaluation.kv.target_forward`` hook its ``stream`` into a
    forward."""

    def __init__(self, num_aux: int) -> None:
        self.aux: torch.Tensor | None = None
        self.final: torch.Tensor | None = None
        self.calls = [0] * (num_aux + 1)  # aux slots, then the final norm

    def stream(self, slot: int, module, args, kwargs) -> None:
        hidden = args[0] if args else kwargs.get("hidden_states")
        if not isinstance(hidden, torch.Tensor):
            raise ValueError(
                f"{type(module).__name__} was called without a positional input or a "
                f"hidden_states keyword (got {sorted(kwargs)}); cannot read the residual stream"
            )
        self.calls[slot] += 1
        if self.calls[slot] > 1:
            return  # reported after the forward
        width = hidden.shape[-1]
        if self.aux is None:
            num_aux = len(self.calls) - 1
            self.aux = hidden.new_empty(*hidden.shape[:-1], num_aux * width)
        self.aux[..., slot * width:(slot + 1) * width].copy_(hidden)

    def norm(self, module, args, output) -> None:
        self.calls[-1] += 1
        self.final = output


@torch.no_grad()
def target_features(
    target: TargetModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    position_ids: torch.Tensor | None = None,
    check_head: bool = True,
    **model_inputs,
) -> Features:
    """Run the target once and return the batch's EAGLE-3 features.

    Args:
        target: from ``load_target``.
        input_ids: int64 ``[B, S]``, right-padded (image placeholder tokens included).
        attention_mask: ``[B, S]``, 1 on real tokens.
        position_ids: int64 ``[B, S]`` or None: a packed batch (SPEC 9), positions
            restarting at 0 in each document (``io.packing.collate_packed``). The model
            runs on them without a 2-D mask: transformers' packed-sequence support
            (``masking_utils.find_packed_sequence_indices``) then attends causally
            inside each document, and every document's features equal its own alone
            (right padding comes after every real token). Text targets only.
        check_head: compare the model's own last-position logits with
            ``final_hidden @ lm_head.T`` and raise ValueError if they differ by more than
            ``HEAD_CHECK_RTOL * max|z|`` (a logit transform no config field announced).
        **model_inputs: passed to the model's forward unchanged, e.g. ``pixel_values``,
            ``image_grid_thw``, ``mm_token_type_ids`` (Qwen2-VL), ``token_type_ids``.

    Returns:
        Features with ``aux [B, S, 3*Ht]`` (the residual stream after each aux layer,
        before any norm, concatenated in ``aux_layer_ids`` order), ``final_hidden
        [B, S, Ht]`` (after the final norm), ``target_head [V, Ht]`` (the lm_head weight,
        not copied), ``target_logits=None``, and ``input_ids`` / ``attention_mask`` /
        ``positions`` (= ``position_ids``) as given. Hooks are removed before
        returning, also on error. The decoder layers run their compiled forwards where
        ``target.compiled_layers`` has them (``compile_decoder_layers``).
    """
    if position_ids is not None and (model_inputs or position_ids.shape != input_ids.shape):
        raise UsageError(f"packed batches (position_ids {tuple(position_ids.shape)}) are for text targets "
                         f"with input_ids of that shape {tuple(input_ids.shape)}; got model inputs "
                         f"{sorted(model_inputs)}: pass multimodal batches unpacked")
    backbone = target.backbone
    capture = FeatureCapture(len(target.aux_layer_ids))
    handles = []
    try:
        for slot, i in enumerate(target.aux_layer_ids):
            handles.append(backbone.layers[i + 1].register_forward_pre_hook(
                functools.partial(capture.stream, slot), with_kwargs=True))
        handles.append(backbone.norm.register_forward_hook(capture.norm))
        kwargs = {"use_cache": False}
        if "logits_to_keep" in inspect.signature(target.model.forward).parameters:
            kwargs["logits_to_keep"] = 1  # only the check reads logits: [B, 1, V], not [B, S, V]
        kwargs.update(model_inputs)
        if position_ids is None:
            kwargs["attention_mask"] = attention_mask
        else:  # a 2-D mask would turn transformers' packed-sequence detection off
            kwargs["position_ids"] = position_ids
        with _compiled_forwards(target):
            out = target.model(input_ids=input_ids, **kwargs)
    finally:
        for handle in handles:
            handle.remove()

    wheres = [f"layer {i + 1}" for i in target.aux_layer_ids] + ["the final norm"]
    for calls, where in zip(capture.calls, wheres):
        if calls != 1:
            raise ValueError(
                f"{where} of the text backbone ran {calls} times in one forward; "
                "eagle3fn expects one pass of the decoder per batch"
            )
    final_hidden = capture.final
    aux = capture.aux.to(final_hidden.device)
    if aux.shape[:-1] != input_ids.shape or final_hidden.shape[:-1] != input_ids.shape:
        raise ValueError(
            f"captured hidden states of shape {tuple(final_hidden.shape)} do not line up "
            f"with input_ids {tuple(input_ids.shape)}; the model reshapes its sequence "
            "(e.g. packs or drops tokens), which eagle3fn does not support"
        )
    head = target.lm_head.weight.detach()
    if check_head:
        _check_logits(out.logits[:, -1], final_hidden[:, -1], head)
    return Features(input_ids=input_ids, aux=aux, attention_mask=attention_mask,
                    final_hidden=final_hidden, target_head=head, positions=position_ids)


def _check_logits(model_logits_BV: torch.Tensor, hidden_BH: torch.Tensor,
                  head_VH: torch.Tensor) -> None:
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

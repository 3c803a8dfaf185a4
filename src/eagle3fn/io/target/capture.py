"""Feature capture (``io.target``): one target forward under no grad, with hooks on the
text backbone, gives a batch's EAGLE-3 features; ``compile_decoder_layers`` compiles
the decoder layers that forward runs.

Legend: B batch, S sequence length, N target decoder layers, Ht target hidden size,
V target vocab.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect

import torch

from eagle3fn.compiled import compile_backend, compiler
from eagle3fn.errors import UsageError
from eagle3fn.io.target.checks import check_logits
from eagle3fn.io.target.parts import TargetModel
from eagle3fn.shapes import Features


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

    aux, final_hidden = _checked_capture(capture, target.aux_layer_ids, input_ids)
    head = target.lm_head.weight.detach()
    if check_head:
        check_logits(out.logits[:, -1], final_hidden[:, -1], head)
    return Features(input_ids=input_ids, aux=aux, attention_mask=attention_mask,
                    final_hidden=final_hidden, target_head=head, positions=position_ids)


def _checked_capture(capture: FeatureCapture, aux_layer_ids: tuple[int, ...],
                     input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(aux [B, S, 3*Ht], final_hidden [B, S, Ht])`` of one forward's ``capture``, aux
    moved to final_hidden's device, after checking that each hooked module (layer
    ``i + 1`` per aux id, the final norm) ran once and that both line up with
    ``input_ids [B, S]`` (ValueError otherwise)."""
    wheres = [f"layer {i + 1}" for i in aux_layer_ids] + ["the final norm"]
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
    return aux, final_hidden

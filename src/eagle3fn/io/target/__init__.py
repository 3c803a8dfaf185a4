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

The modules, in the order a batch meets them::

    checks.py   aux layer ids (validate, EAGLE-3 defaults); the teacher-is-the-head checks
    parts.py    the backbone and head found through wrappers; TargetModel
    loading.py  load_target (the whole model); load_embedding_and_head (two tensors by name)
    capture.py  compile_decoder_layers; FeatureCapture, the hooks; target_features
"""

from eagle3fn.io.target.capture import FeatureCapture, compile_decoder_layers, target_features
from eagle3fn.io.target.checks import (HEAD_CHECK_RTOL, LOGIT_TRANSFORMS, check_logits, check_teacher_is_head,
                                       default_aux_layer_ids, validate_aux_layer_ids)
from eagle3fn.io.target.loading import TargetWeights, load_embedding_and_head, load_target
from eagle3fn.io.target.parts import (TargetModel, find_backbone_attr, find_lm_head, find_text_backbone,
                                      replace_submodules)

__all__ = ["HEAD_CHECK_RTOL", "LOGIT_TRANSFORMS", "FeatureCapture", "TargetModel", "TargetWeights",
           "check_logits", "check_teacher_is_head", "compile_decoder_layers", "default_aux_layer_ids",
           "find_backbone_attr", "find_lm_head", "find_text_backbone", "load_embedding_and_head",
           "load_target", "replace_submodules", "target_features", "validate_aux_layer_ids"]

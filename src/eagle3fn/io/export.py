"""Export a trained draft as a directory that SGLang and vLLM load as an EAGLE-3 draft.

Legend: V target vocab, Vd draft vocab, H draft hidden, Ht target hidden, N target
decoder layers. Aux layer ids are output-of-layer ids (``io.target.checks``).

Layout (docs/reference/what-an-export-contains.md gives every key and how each engine reads it)::

    config.json          LlamaConfig-style dict: architectures ["LlamaForCausalLMEagle3"],
                         sizes, draft_vocab_size, target_hidden_size, rope fields,
                         [fc_norm: true],
                         eagle_config.eagle_aux_hidden_state_layer_ids = ids       (SGLang)
                         eagle_aux_hidden_state_layer_ids              = ids + 1   (vLLM)
    model.safetensors    fc, [fc_norm.*], midlayer.*, norm, lm_head in ``dtype``;
                         d2t int64 [Vd], t2d bool [V] only when Vd < V (vLLM refuses a
                         d2t when Vd == V); no embed_tokens (the engines share the
                         target's) unless H != Ht

Both files are written to temporary names and renamed into place, into a directory
that is new, empty or an earlier export's (``io.paths.claim_dir``: it holds
``.eagle3fn-output.json``); another model's directory is refused unless
``overwrite``. A draft trained with
``norm_output=False`` is refused: SGLang and vLLM always norm before lm_head (their
``norm_output`` key means something else). ``export_speculators`` writes the
vllm-project speculators layout instead::

    config.json          Eagle3SpeculatorConfig dict: speculators_model_type "eagle3",
                         transformer_layer_config (Llama), draft_vocab_size, fc_norm,
                         eagle_aux_hidden_state_layer_ids = ids + 1, speculators_config
                         (verifier = the target's path and architectures)
    model.safetensors    embed_tokens (the target's), fc, [fc_norm.*], layers.0.*,
                         norm, lm_head; d2t, t2d only when Vd < V
"""

from __future__ import annotations

import json
import operator
import os
import warnings
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from eagle3fn.draft import DraftConfig, Eagle3Draft
from eagle3fn.io.paths import atomic_write, claim_dir
from eagle3fn.rope import ROPE_TYPE_KEYS, RopeConfig
from eagle3fn.vocab import validate_vocab_map

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
ARCHITECTURE = "LlamaForCausalLMEagle3"
EMBEDDING = "embed_tokens.weight"
COMMAND = "eagle3fn export"
"""The writer named in an export directory's ``io.paths.MARKER``."""
DEFAULT_MAX_POSITIONS = 2048
"""``max_position_embeddings`` without a target config or a scaled RoPE; pass the
target's config so the draft's rotary cache covers the target's context."""

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}

def rope_scaling_dict(rope: RopeConfig) -> dict | None:
    """HF ``rope_scaling`` of a RopeConfig (None for ``default``): ``rope_type`` plus
    the fields that type reads, all explicit (SpecForge has no yarn defaults)."""
    if rope.rope_type == "default":
        return None
    fields = {k: getattr(rope, k) for k in ROPE_TYPE_KEYS[rope.rope_type]}
    # Written only where they differ from transformers' defaults (attention_factor
    # derived, truncate on), so a draft without them exports as before.
    fields = {k: list(v) if isinstance(v, tuple) else v for k, v in fields.items()
              if not (k == "attention_factor" and v is None) and not (k == "truncate" and v)}
    return {"rope_type": rope.rope_type, **fields}


def _text_config(target_config: dict | None) -> dict:
    if not target_config:
        return {}
    return target_config.get("text_config") or target_config


def _check_aux_ids(aux_layer_ids, num_layers: int | None) -> tuple[int, int, int]:
    try:
        ids = tuple(operator.index(i) for i in aux_layer_ids)
    except TypeError:
        ids = ()
    top = num_layers - 2 if num_layers is not None else None
    if (len(ids) != 3 or not all(a < b for a, b in zip(ids, ids[1:])) or ids[0] < 0
            or (top is not None and ids[-1] > top)):
        where = f"in [0, {top}] for a {num_layers}-layer target" if top is not None else ">= 0"
        raise ValueError(
            f"aux_layer_ids={list(aux_layer_ids)} must be three strictly increasing "
            f"output-of-layer ids {where}; pass the ids the draft was trained with "
            "(eagle3fn.io.target.default_aux_layer_ids gives the defaults)"
        )
    return ids  # type: ignore[return-value]


def expected_shapes(cfg: DraftConfig, *, with_embedding: bool) -> dict[str, tuple[int, ...]]:
    """Parameter name -> shape of the exported weights (``Eagle3Draft``'s names)."""
    with torch.device("meta"):
        skeleton = Eagle3Draft(cfg)
    return {n: tuple(p.shape) for n, p in skeleton.named_parameters()
            if with_embedding or n != EMBEDDING}


def _needs_embedding(cfg: DraftConfig) -> bool:
    # SGLang shares the target's embedding only when H == Ht (LlamaForCausalLM.set_embed);
    # a draft of another width must ship its own.
    return cfg.hidden_size != cfg.ht


def draft_config_dict(cfg: DraftConfig, aux_layer_ids: tuple[int, int, int], *,
                      max_position_embeddings: int, dtype: torch.dtype) -> dict:
    """The ``config.json`` dict of a draft (see the module docstring)."""
    dtype_name = str(dtype).removeprefix("torch.")
    config = {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.d,
        "num_hidden_layers": 1,
        "vocab_size": cfg.vocab_size,
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.ht,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": float(cfg.rope.theta),
        "rope_scaling": rope_scaling_dict(cfg.rope),
        "max_position_embeddings": int(max_position_embeddings),
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "pretraining_tp": 1,
        "torch_dtype": dtype_name,
        "dtype": dtype_name,
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": list(aux_layer_ids),
            "use_aux_hidden_state": True,
        },
        # vLLM reads this key first and captures *before* layer i: ids + 1.
        "eagle_aux_hidden_state_layer_ids": [i + 1 for i in aux_layer_ids],
    }
    if cfg.fc_norm:
        config["fc_norm"] = True
    return config


def export_draft(
    out_dir: str | os.PathLike,
    params: dict[str, torch.Tensor],
    cfg: DraftConfig,
    *,
    d2t: torch.Tensor,
    t2d: torch.Tensor,
    aux_layer_ids: tuple[int, int, int],
    target_config: dict | None = None,
    dtype: torch.dtype = torch.bfloat16,
    overwrite: bool = False,
) -> Path:
    """Write ``config.json`` and ``model.safetensors`` of an EAGLE-3 draft to ``out_dir``.

    Args:
        params: draft parameters by ``Eagle3Draft`` name (``init_params`` / training);
            ``embed_tokens.weight`` is dropped (the serving engine shares the target's)
            unless the draft's width differs from the target's (H != Ht), where it is
            required and exported.
        cfg: the draft's config; its sizes, rope and toggles go to config.json.
        d2t: int64 ``[Vd]``; t2d: bool ``[V]`` (checked with ``validate_vocab_map``).
        aux_layer_ids: the three output-of-layer ids the draft was trained on.
        target_config: the target's HF config dict (``text_config`` used when present):
            checks ``hidden_size == Ht``, ``vocab_size == V`` and the aux ids against
            ``num_hidden_layers``; its ``max_position_embeddings`` is copied (else
            ``original * factor`` for llama3 / yarn RoPE, else ``DEFAULT_MAX_POSITIONS``).
        dtype: dtype of the float weights (d2t / t2d keep theirs).
        overwrite: write into ``out_dir`` even when it holds files that no export wrote
            (UsageError otherwise, ``io.paths.claim_dir``).

    Returns:
        ``out_dir`` as a Path. ``d2t`` / ``t2d`` are written only when Vd < V (with
        Vd == V the map is the identity, and vLLM's loader has no parameter for a
        ``d2t`` then). Warns (UserWarning) where an engine would silently run something
        else: aux ids whose first id is not 1 (SGLang versions disagree on their
        convention) and RoPE fields the engines lack. Raises ValueError for a draft
        trained with ``norm_output=False`` (no engine computes it: ``check_servable``).
    """
    _check_servable_dtype(cfg, dtype)
    text, ids, tensors = _checked_export(params, cfg, d2t, t2d, aux_layer_ids, target_config)
    config = draft_config_dict(cfg, ids, max_position_embeddings=_max_positions(cfg, text), dtype=dtype)
    return _write(out_dir, tensors, config, cfg, d2t, t2d, dtype, overwrite)


def _write(out_dir, tensors: dict[str, torch.Tensor], config: dict, cfg: DraftConfig,
           d2t: torch.Tensor, t2d: torch.Tensor, dtype: torch.dtype, overwrite: bool) -> Path:
    """``model.safetensors`` (``tensors`` in ``dtype``, d2t / t2d when Vd < V) and
    ``config.json`` written to temporary names and renamed into ``out_dir``, once
    ``claim_dir`` found it ours (or ``overwrite``) and marked it."""
    out = claim_dir(out_dir, COMMAND, overwrite=overwrite)
    weights = {k: v.detach().to("cpu", dtype).contiguous() for k, v in tensors.items()}
    if cfg.draft_vocab_size < cfg.vocab_size:
        weights["d2t"] = d2t.detach().to("cpu", torch.int64).contiguous()
        weights["t2d"] = t2d.detach().to("cpu", torch.bool).contiguous()
    with atomic_write(out / WEIGHTS) as tmp:
        save_file(weights, str(tmp), metadata={"format": "pt"})
    with atomic_write(out / CONFIG) as tmp:
        tmp.write_text(json.dumps(config, indent=2) + "\n")
    return out


SPECULATORS_VERSION = "0.9.0"
"""The speculators release whose ``Eagle3DraftModel.from_pretrained`` the layout is
tested against (``tests/test_export_clients.py``)."""


def export_speculators(
    out_dir: str | os.PathLike,
    params: dict[str, torch.Tensor],
    cfg: DraftConfig,
    *,
    d2t: torch.Tensor,
    t2d: torch.Tensor,
    aux_layer_ids: tuple[int, int, int],
    target_config: dict | None = None,
    target_path: str,
    dtype: torch.dtype = torch.bfloat16,
    overwrite: bool = False,
) -> Path:
    """Write the draft in vllm-project speculators' EAGLE-3 layout (module docstring):
    a directory ``Eagle3DraftModel.from_pretrained`` loads, and vLLM serves as a
    speculators model (``vllm serve <out_dir>``).

    Args are ``export_draft``'s (``overwrite`` too), plus ``target_path``: the target's name or path,
    stored as ``speculators_config.verifier.name_or_path`` (``from_pretrained`` reads
    the target's config and its embedding / head / final norm files from there, so it
    must be where the draft will be loaded). ``params`` must hold ``embed_tokens.weight`` (the target's
    embedding ``[V, H]``, which speculators reads from the checkpoint). The aux ids
    are written as ``ids + 1``: speculators and vLLM capture *before* layer ``i``.

    Raises ValueError for what speculators 0.9.0 cannot represent: a draft whose
    width differs from the target's (its ``fc`` and ``fc_norm`` take ``3*H``), and
    ``norm_output=False`` (``check_servable``); and for ``export_draft``'s mismatches.
    """
    _check_servable_dtype(cfg, dtype)
    if not target_path:
        raise ValueError("target_path is empty: speculators' from_pretrained reads the "
                         "target (verifier) from there; pass the target's name or path")
    if cfg.hidden_size != cfg.ht:
        raise ValueError(
            f"the draft's hidden_size={cfg.hidden_size} differs from the target's "
            f"{cfg.ht}: speculators {SPECULATORS_VERSION} sizes fc and fc_norm by the draft's "
            "width; export it with --format eagle3 (SGLang and vLLM load that)")
    if EMBEDDING not in params:
        raise ValueError(
            "params lack embed_tokens.weight: the speculators layout ships the target's "
            "embedding; pass the run's parameters (the training copy of it)")
    text, ids, tensors = _checked_export(params, cfg, d2t, t2d, aux_layer_ids, target_config)
    tensors[EMBEDDING] = params[EMBEDDING]
    tensors = {k.replace("midlayer.", "layers.0.", 1): v for k, v in tensors.items()}
    dtype_name = str(dtype).removeprefix("torch.")
    layer = {k: v for k, v in draft_config_dict(
        cfg, ids, max_position_embeddings=_max_positions(cfg, text), dtype=dtype).items()
        if k not in ("architectures", "eagle_config", "eagle_aux_hidden_state_layer_ids",
                     "draft_vocab_size", "target_hidden_size", "fc_norm")}
    layer.update(attention_bias=False, mlp_bias=False)
    config = {
        "architectures": ["Eagle3DraftModel"],
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION,
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.ht,
        "eagle_aux_hidden_state_layer_ids": [i + 1 for i in ids],
        "fc_norm": cfg.fc_norm,
        "norm_before_fc": False,
        "norm_before_residual": False,
        "norm_output": False,
        "embed_requires_grad": False,
        "tie_word_embeddings": False,
        "dtype": dtype_name,
        "transformer_layer_config": layer,
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3,
                                  "accept_tolerance": 0.0, "verifier_accept_k": 1}],
            "verifier": {"name_or_path": target_path,
                         "architectures": (target_config or {}).get("architectures")
                         or ["LlamaForCausalLM"]},
        },
    }
    return _write(out_dir, tensors, config, cfg, d2t, t2d, dtype, overwrite)


def _check_servable_dtype(cfg: DraftConfig, dtype: torch.dtype) -> None:
    """ValueError for a weight dtype not in ``_DTYPES`` or a draft no engine computes
    (``check_servable``): the checks both export layouts make first."""
    if dtype not in _DTYPES.values():
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype}")
    check_servable(cfg)


def _checked_export(params: dict[str, torch.Tensor], cfg: DraftConfig, d2t: torch.Tensor, t2d: torch.Tensor,
                    aux_layer_ids: tuple[int, int, int], target_config: dict | None):
    """What both export layouts write, checked: ``(the target's text config, the aux
    ids, the tensors to export)`` (``_checked_params``), warning where the engines
    differ (``_warn_where_engines_differ``)."""
    text = _text_config(target_config)
    ids = _check_aux_ids(aux_layer_ids, text.get("num_hidden_layers"))
    tensors = _checked_params(params, cfg, text, d2t, t2d)
    _warn_where_engines_differ(cfg, ids)
    return text, ids, tensors


def _checked_params(params: dict[str, torch.Tensor], cfg: DraftConfig, text: dict, d2t: torch.Tensor,
                    t2d: torch.Tensor) -> dict[str, torch.Tensor]:
    """The tensors to export (``expected_shapes``), after checking them, the vocab map
    and the target config's sizes against ``cfg`` (ValueError naming the mismatch)."""
    for key, ours in (("hidden_size", cfg.ht), ("vocab_size", cfg.vocab_size)):
        if key in text and int(text[key]) != ours:
            raise ValueError(
                f"target_config {key}={text[key]} but the draft config has "
                f"{'target_hidden_size' if key == 'hidden_size' else key}={ours}; "
                "pass the config of the target the draft was trained on"
            )
    validate_vocab_map(d2t, t2d, vocab_size=cfg.vocab_size, draft_vocab_size=cfg.draft_vocab_size)
    expected = expected_shapes(cfg, with_embedding=_needs_embedding(cfg))
    tensors = {k: v for k, v in params.items() if k in expected}
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(params) - set(expected) - {EMBEDDING})
    if missing or unexpected:
        hint = (" (a draft with hidden_size != target_hidden_size exports its own "
                "embed_tokens.weight)" if EMBEDDING in missing else "")
        raise ValueError(
            f"params do not match the draft config: missing {missing}, unexpected "
            f"{unexpected}{hint}; pass the parameters of eagle3fn.draft.init_params(cfg)"
        )
    for name, t in tensors.items():
        if tuple(t.shape) != expected[name]:
            raise ValueError(
                f"params[{name!r}] has shape {tuple(t.shape)}, the draft config needs "
                f"{expected[name]}"
            )
    return tensors


def check_servable(cfg: DraftConfig) -> None:
    """Raise ValueError for a draft no serving engine computes as trained: one with
    ``norm_output=False`` (logits of the un-normed output). SGLang 0.5.23 and vLLM 0.34
    always apply ``norm`` before ``lm_head``; their ``norm_output`` config key only
    chooses whether the *next* draft step gets the normed state. RMSNorm divides by
    the row's RMS, so no weight change folds it away."""
    if not cfg.norm_output:
        raise ValueError(
            "this draft was trained with norm_output=False (no norm before lm_head), which "
            "SGLang and vLLM cannot run: they always norm before lm_head, and their "
            "norm_output key means 'feed the normed state to the next step'; train with "
            "norm_output=True (the default) to serve the draft")


def _warn_where_engines_differ(cfg: DraftConfig, ids: tuple[int, int, int]) -> None:
    """UserWarnings for what an engine would silently run differently: aux ids not
    starting at 1, RoPE fields the engines lack."""
    if ids[0] != 1:
        warnings.warn(
            f"aux_layer_ids={list(ids)} do not start at 1: SGLang before PR #25454 adds 1 "
            "to eagle_config's ids, later SGLang adds 1 only when the first id is 1, so "
            "SGLang versions capture different layers for this export (vLLM reads the "
            "unambiguous top-level ids); see docs/reference/what-an-export-contains.md", UserWarning, stacklevel=3)
    rope = cfg.rope
    if rope.rope_type == "longrope" or (rope.rope_type == "yarn" and (not rope.truncate
                                                                      or rope.attention_factor is not None)):
        warnings.warn(
            f"the draft's RoPE ({rope.rope_type}{', truncate false' if not rope.truncate else ''}"
            f"{', attention_factor' if rope.attention_factor is not None else ''}) is written as "
            "transformers defines it, but SGLang's yarn always truncates and scales attn_factor "
            "differently, and SpecForge has neither these yarn fields nor longrope: check that your "
            "engine computes these frequencies before serving (docs/reference/what-an-export-contains.md)", UserWarning, stacklevel=3)


def _max_positions(cfg: DraftConfig, text: dict) -> int:
    """The export's ``max_position_embeddings``: the target's, else ``original * factor``
    for a scaled RoPE, else ``DEFAULT_MAX_POSITIONS``."""
    if "max_position_embeddings" in text:
        return int(text["max_position_embeddings"])
    if cfg.rope.rope_type in ("llama3", "yarn", "longrope"):
        return int(cfg.rope.original_max_position_embeddings * cfg.rope.factor)
    return DEFAULT_MAX_POSITIONS


def draft_config_from_dict(config: dict) -> DraftConfig:
    """The DraftConfig of an exported ``config.json`` dict (head_dim and
    target_hidden_size explicit). ``norm_output`` is read as SGLang and vLLM read it
    (absent or false: the next step gets the pre-norm state, eagle3fn's draft; true:
    the normed state, which eagle3fn does not implement: ValueError)."""
    if config.get("norm_output"):
        raise ValueError("norm_output is true (SGLang/vLLM: feed the normed hidden state to "
                         "the next draft step), which eagle3fn drafts do not implement")
    return DraftConfig(
        hidden_size=int(config["hidden_size"]),
        intermediate_size=int(config["intermediate_size"]),
        num_heads=int(config["num_attention_heads"]),
        num_kv_heads=int(config.get("num_key_value_heads") or config["num_attention_heads"]),
        vocab_size=int(config["vocab_size"]),
        draft_vocab_size=int(config["draft_vocab_size"]),
        head_dim=int(config.get("head_dim")
                     or config["hidden_size"] // config["num_attention_heads"]),
        target_hidden_size=int(config.get("target_hidden_size") or config["hidden_size"]),
        rms_norm_eps=float(config["rms_norm_eps"]),
        rope=RopeConfig.from_hf(float(config.get("rope_theta", 10000.0)),
                                config.get("rope_scaling"),
                                max_position_embeddings=config.get("max_position_embeddings")),
        fc_norm=bool(config.get("fc_norm", False)),
    )


def load_export(
    path: str | os.PathLike,
) -> tuple[dict[str, torch.Tensor], DraftConfig, torch.Tensor, torch.Tensor, tuple[int, int, int]]:
    """Read an ``export_draft`` directory back: ``(params, cfg, d2t, t2d, aux_layer_ids)``.

    ``params`` are the stored tensors (export dtype), without ``embed_tokens.weight``
    unless the export has one (copy the target's: ``init_params(cfg, embed_tokens=...)``
    or ``params[...] = embedding``). ``aux_layer_ids`` are output-of-layer ids
    (``eagle_config``). Without ``d2t`` / ``t2d`` (Vd == V) the identity map is
    returned. Raises FileNotFoundError for a missing directory or file and
    ValueError, naming the file, for a config or tensor that does not match.
    """
    root = Path(path)
    config_path, weights_path = root / CONFIG, root / WEIGHTS
    for p in (config_path, weights_path):
        if not p.is_file():
            raise FileNotFoundError(
                f"{str(p)!r} not found; an export directory holds {CONFIG} and {WEIGHTS} "
                "written by eagle3fn.io.export.export_draft (`eagle3fn export`)"
            )
    try:
        config = json.loads(config_path.read_text())
        if config.get("architectures") != [ARCHITECTURE]:
            raise ValueError(f"architectures is {config.get('architectures')!r}, "
                             f"expected [{ARCHITECTURE!r}]")
        if config.get("num_hidden_layers", 1) != 1:
            raise ValueError(f"num_hidden_layers is {config['num_hidden_layers']}; "
                             "eagle3fn drafts have one layer")
        eagle = config.get("eagle_config") or {}
        if "eagle_aux_hidden_state_layer_ids" not in eagle:
            raise ValueError("eagle_config.eagle_aux_hidden_state_layer_ids is missing")
        ids = _check_aux_ids(eagle["eagle_aux_hidden_state_layer_ids"], None)
        top = config.get("eagle_aux_hidden_state_layer_ids")
        if top is not None and list(top) != [i + 1 for i in ids]:
            raise ValueError(
                f"top-level eagle_aux_hidden_state_layer_ids={list(top)} (vLLM, capture "
                f"before layer i) disagrees with eagle_config's {list(ids)} (output of "
                "layer i): they must differ by exactly 1"
            )
        cfg = draft_config_from_dict(config)
    except (KeyError, TypeError) as e:
        raise ValueError(f"{str(config_path)!r}: missing or malformed field {e}") from None
    except (ValueError, json.JSONDecodeError) as e:
        raise ValueError(f"{str(config_path)!r}: {e}") from None

    try:
        with safe_open(str(weights_path), framework="pt") as f:
            stored = {k: f.get_tensor(k) for k in f.keys()}
    except SafetensorError as e:
        raise ValueError(f"{str(weights_path)!r} is not a safetensors file ({e})") from None
    try:
        present = [key for key in ("d2t", "t2d") if key in stored]
        if not present and cfg.draft_vocab_size == cfg.vocab_size:
            d2t = torch.zeros(cfg.vocab_size, dtype=torch.int64)  # the identity map
            t2d = torch.ones(cfg.vocab_size, dtype=torch.bool)
        else:
            for key in ("d2t", "t2d"):
                if key not in stored:
                    raise ValueError(f"tensor {key!r} is missing")
            d2t, t2d = stored.pop("d2t").long(), stored.pop("t2d")
        validate_vocab_map(d2t, t2d, vocab_size=cfg.vocab_size,
                           draft_vocab_size=cfg.draft_vocab_size)
        expected = expected_shapes(cfg, with_embedding=EMBEDDING in stored
                                   or _needs_embedding(cfg))
        missing = sorted(set(expected) - set(stored))
        unexpected = sorted(set(stored) - set(expected))
        if missing or unexpected:
            raise ValueError(f"tensors missing {missing}, unexpected {unexpected} for the "
                             f"draft described by {CONFIG}")
        for name, t in stored.items():
            if tuple(t.shape) != expected[name]:
                raise ValueError(f"tensor {name!r} has shape {tuple(t.shape)}, {CONFIG} "
                                 f"implies {expected[name]}")
    except ValueError as e:
        raise ValueError(f"{str(weights_path)!r}: {e}") from None
    return stored, cfg, d2t, t2d, ids

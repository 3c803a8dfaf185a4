"""Bring your SpecForge / EAGLE-3 checkpoint: read an EAGLE-3 draft directory that another
trainer wrote into what eagle3fn's evaluation needs.

Legend: V target vocab, Vd draft vocab, H draft hidden, Ht target hidden, N target
decoder layers. Aux layer ids are output-of-layer ids (``io.target.checks``).

Directories read (``load_draft``)::

    eagle3fn export      .eagle3fn-output.json marker: io.export.load_export, unchanged
    SpecForge 0.2.0      save_pretrained of LlamaForCausalLMEagle3 (its training script's
                         and ``specforge.export.to_hf`` / ``to_sglang`` output):
                         config.json (LlamaConfig + draft_vocab_size, target_hidden_size,
                         [fc_norm], [norm_output]; transformers 5 writes rope_theta inside
                         rope_parameters) and model.safetensors
    EAGLE-3 release      SafeAILab's layout: the same names in pytorch_model.bin, config
                         architectures ["LlamaForCausalLM"] with one layer and
                         draft_vocab_size

Tensor names are eagle3fn's own (``draft.init_params``): SpecForge's module names
(``embed_tokens``, ``fc``, ``[fc_norm.{0,1,2}]``, ``midlayer.*``, ``norm``, ``lm_head``
and the ``d2t`` / ``t2d`` buffers) are exactly eagle3fn's, and SGLang reads them
unchanged (SpecForge's ``WEIGHT_MAPS`` is the identity). ``layers.0.*`` (speculators'
name for the layer) is read as ``midlayer.*``. ``d2t`` holds offsets in both
(draft id i is target id ``i + d2t[i]``). SpecForge's ``norm_output`` key means "norm
before lm_head" (its ``compute_logits``), which is ``DraftConfig.norm_output``; SGLang's
key of that name means something else, and eagle3fn exports never write it.

Neither SpecForge nor EAGLE-3 records the target layers the draft was trained on: then
the target's default ``io.target.default_aux_layer_ids(N)`` (SpecForge's default, its
``algorithms/model_providers.py``) is used and a note printed; ``aux_layer_ids`` given
explicitly always wins. ``as_run`` wraps the result as ``train.checkpoint.load_run``'s
dict, so ``eagle3fn eval`` evaluates a foreign draft exactly as one of its own runs.
"""

from __future__ import annotations

import dataclasses
import json
import operator
import os
from pathlib import Path
from typing import Callable

import torch
from safetensors import SafetensorError, safe_open

from eagle3fn.draft import DraftConfig
from eagle3fn.errors import UsageError
from eagle3fn.io.export import (ARCHITECTURE, CONFIG, EMBEDDING, WEIGHTS, draft_config_from_dict,
                                expected_shapes, load_export)
from eagle3fn.io.paths import MARKER
from eagle3fn.io.target import default_aux_layer_ids, validate_aux_layer_ids
from eagle3fn.io.weight_files import check_weight_files
from eagle3fn.vocab import validate_vocab_map

INDEX = "model.safetensors.index.json"
BIN = "pytorch_model.bin"
_WHAT = ("an EAGLE-3 draft directory holds config.json and model.safetensors (or pytorch_model.bin): "
         "SpecForge's save_pretrained of LlamaForCausalLMEagle3, an EAGLE-3 release, or eagle3fn export")
_RENAMES = (("layers.0.", "midlayer."),)
"""Prefixes read as eagle3fn's: speculators names the draft layer ``layers.0``."""


def load_draft(
    path: str | os.PathLike,
    *,
    aux_layer_ids=None,
    num_target_layers: int | None = None,
    log: Callable[[str], None] = print,
) -> tuple[dict[str, torch.Tensor], DraftConfig, torch.Tensor, torch.Tensor, tuple[int, int, int]]:
    """Read an EAGLE-3 draft directory (module docstring): ``(params, cfg, d2t, t2d,
    aux_layer_ids)``, as ``io.export.load_export`` returns them.

    ``params`` are the stored tensors by ``init_params`` name, in the stored dtype
    (``embed_tokens.weight`` only when the directory has one: SpecForge saves its frozen
    copy of the target's). ``d2t`` int64 ``[Vd]``, ``t2d`` bool ``[V]`` (the identity map
    when the directory has neither and Vd == V).

    Args:
        aux_layer_ids: the target layers the draft was trained on; overrides what the
            directory records. Needed (or ``num_target_layers``) when it records none.
        num_target_layers: N of the target, to check the ids and give the default
            ``default_aux_layer_ids(N)`` where the directory records none (noted via ``log``).

    Raises FileNotFoundError (no such directory, no config or weights) and ValueError /
    UsageError naming the file and the fix (not an EAGLE-3 draft, a config or tensor
    that does not match, a broken weight file).
    """
    root = Path(path)
    if not root.exists():
        raise FileNotFoundError(f"draft directory {str(root)!r} does not exist; {_WHAT}")
    if not root.is_dir():
        raise UsageError(f"draft path {str(root)!r} is a file, not a directory; pass the directory "
                         f"holding it ({str(root.parent)!r}): {_WHAT}")
    if (root / MARKER).is_file():
        params, cfg, d2t, t2d, ids = load_export(root)
        if aux_layer_ids is not None:
            ids = _checked_ids(aux_layer_ids, num_target_layers)
        elif num_target_layers is not None:
            ids = _checked_ids(ids, num_target_layers)
        return params, cfg, d2t, t2d, ids
    config_path = root / CONFIG
    if not config_path.is_file():
        raise FileNotFoundError(f"{str(config_path)!r} not found: {str(root)!r} is not an EAGLE-3 draft "
                                f"directory; {_WHAT}")
    try:
        config = json.loads(config_path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{str(config_path)!r} is not a JSON config ({e}); {_WHAT}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{str(config_path)!r} holds {type(config).__name__}, not a config object; {_WHAT}")
    _check_is_draft(config, config_path)
    try:
        cfg = _draft_config(config)
    except (KeyError, TypeError) as e:
        raise ValueError(f"{str(config_path)!r}: missing or malformed field {e}") from None
    except ValueError as e:
        raise ValueError(f"{str(config_path)!r}: {e}") from None
    weights_path, stored = _read_weights(root)
    try:
        params, d2t, t2d = _checked_tensors(stored, cfg)
    except ValueError as e:
        raise ValueError(f"{str(weights_path)!r}: {e}") from None
    if aux_layer_ids is not None:
        ids = _checked_ids(aux_layer_ids, num_target_layers)
    else:
        ids = _recorded_ids(config, config_path, num_target_layers, log)
    return params, cfg, d2t, t2d, ids


def as_run(path: str | os.PathLike, target_dir: str | os.PathLike, aux_layer_ids=None,
           log: Callable[[str], None] = print) -> dict:
    """The draft at ``path`` (``load_draft``) as ``train.checkpoint.load_run``'s dict, for
    the target at ``target_dir`` (a local HF model directory; only its config is read):
    ``params`` (the trainable ones, fp32, without ``embed_tokens.weight``: the evaluation
    uses the target's, as training does), ``draft``, ``d2t``, ``t2d``, ``config``
    (``model`` = ``target_dir``, ``gguf_file`` None, ``seed`` 0, ``data`` "", ``on_error``
    "raise": there are no training data to take prompts from, so evaluate on ``--prompts``),
    ``aux_layer_ids``, ``step`` (SpecForge's ``<run>-step<N>`` directory name, else 0),
    ``holdout_prompts`` [] and ``best`` None.

    Raises ValueError naming both directories when the draft was made for another
    target (its target hidden size or vocab differ from the target's config), and
    ``load_draft``'s errors."""
    from transformers import AutoConfig

    from eagle3fn.io.model_dir import check_model_dir

    check_model_dir(target_dir, None, weights=False, tokenizer=False)
    target = AutoConfig.from_pretrained(target_dir)
    text = target.get_text_config() if hasattr(target, "get_text_config") else target
    layers = int(text.num_hidden_layers)
    params, cfg, d2t, t2d, ids = load_draft(path, aux_layer_ids=aux_layer_ids, num_target_layers=layers,
                                            log=log)
    for what, ours, theirs in (("hidden size", cfg.ht, int(text.hidden_size)),
                               ("vocab size", cfg.vocab_size, int(text.vocab_size))):
        if ours != theirs:
            raise ValueError(
                f"the draft at {str(path)!r} was made for a target of {what} {ours} (its {CONFIG}), but "
                f"the target at {str(target_dir)!r} has {theirs}; pass the target the draft was trained for")
    trainable = {n: p.detach().to(torch.float32) for n, p in params.items() if n != EMBEDDING}
    return {"params": trainable, "draft": cfg, "d2t": d2t, "t2d": t2d,
            "config": {"model": str(target_dir), "gguf_file": None, "seed": 0, "data": "", "on_error": "raise"},
            "aux_layer_ids": ids, "step": _step_of(Path(path)), "holdout_prompts": [], "best": None}


def _step_of(root: Path) -> int:
    """The optimizer step in a SpecForge checkpoint directory's name (``<run>-step<N>``,
    its ``CheckpointManager.checkpoint_dir``), else 0."""
    name = root.resolve().name
    head, sep, tail = name.rpartition("-step")
    return int(tail) if sep and tail.isdigit() else 0


def _check_is_draft(config: dict, config_path: Path) -> None:
    """ValueError unless ``config`` describes a one-layer EAGLE-3 draft (naming what it
    looks like instead: a full model, or another draft family)."""
    arch = config.get("architectures") or []
    layers = config.get("num_hidden_layers", 1)
    if arch == [ARCHITECTURE] or (arch == ["LlamaForCausalLM"] and "draft_vocab_size" in config):
        if layers != 1:
            raise ValueError(f"{str(config_path)!r}: num_hidden_layers is {layers}; EAGLE-3 drafts as "
                             "eagle3fn evaluates them have one layer")
        return
    if config.get("speculators_model_type"):
        raise ValueError(f"{str(config_path)!r} is a speculators draft ({config['speculators_model_type']}), "
                         f"which this reader does not take; {_WHAT}")
    kind = f"architectures {arch}" + (f" with {layers} layers" if layers != 1 else "")
    raise ValueError(f"{str(config_path)!r} describes {kind}, not an EAGLE-3 draft "
                     f"({ARCHITECTURE}, one layer, draft_vocab_size): is this the target's directory? {_WHAT}")


def _draft_config(config: dict) -> DraftConfig:
    """``io.export.draft_config_from_dict`` of a SpecForge / EAGLE-3 config: transformers
    5's ``rope_parameters`` (holding ``rope_theta``) read as ``rope_theta`` +
    ``rope_scaling``, and SpecForge's ``norm_output`` (norm before lm_head) applied as
    ``DraftConfig.norm_output``."""
    config = dict(config)
    rope = config.get("rope_parameters")
    if isinstance(rope, dict):
        if "rope_theta" in rope:
            config["rope_theta"] = rope["rope_theta"]
        if not config.get("rope_scaling") and rope.get("rope_type", rope.get("type", "default")) != "default":
            config["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    norm_output = config.pop("norm_output", True)
    if not isinstance(norm_output, bool):
        raise ValueError(f"norm_output is {norm_output!r}; SpecForge writes true or false")
    return dataclasses.replace(draft_config_from_dict(config), norm_output=norm_output)


def _read_weights(root: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """``(the file read, its tensors renamed to eagle3fn's names)`` from
    ``model.safetensors``, a sharded safetensors index or ``pytorch_model.bin``, each
    header checked first (``io.weight_files``)."""
    check_weight_files(root)
    if (root / WEIGHTS).is_file():
        files, shown = [root / WEIGHTS], root / WEIGHTS
    elif (root / INDEX).is_file():
        index = json.loads((root / INDEX).read_text())
        files, shown = [root / f for f in sorted(set(index["weight_map"].values()))], root / INDEX
    elif (root / BIN).is_file():
        files, shown = [root / BIN], root / BIN
    else:
        raise FileNotFoundError(f"{str(root)!r} has {CONFIG} but no {WEIGHTS}, {INDEX} or {BIN}; {_WHAT}")
    stored: dict[str, torch.Tensor] = {}
    for f in files:
        if f.suffix == ".bin":
            try:
                stored.update(torch.load(f, map_location="cpu", weights_only=True))
            except Exception as e:  # noqa: BLE001 -- torch.load's many failure types, named with the file
                raise ValueError(f"{str(f)!r} is not a readable torch state dict ({type(e).__name__}: {e})") from None
            continue
        try:
            with safe_open(str(f), framework="pt") as handle:
                stored.update({k: handle.get_tensor(k) for k in handle.keys()})
        except SafetensorError as e:
            raise ValueError(f"{str(f)!r} is not a safetensors file ({e})") from None
    renamed = {}
    for name, t in stored.items():
        for old, new in _RENAMES:
            if name.startswith(old):
                name = new + name[len(old):]
        renamed[name] = t
    return shown, renamed


def _checked_tensors(stored: dict[str, torch.Tensor], cfg: DraftConfig):
    """``(params, d2t, t2d)`` from the stored tensors after checking the vocab map and
    every name and shape against ``cfg`` (ValueError naming the mismatch)."""
    stored = dict(stored)
    if "d2t" not in stored and "t2d" not in stored and cfg.draft_vocab_size == cfg.vocab_size:
        d2t = torch.zeros(cfg.vocab_size, dtype=torch.int64)  # the identity map
        t2d = torch.ones(cfg.vocab_size, dtype=torch.bool)
    else:
        for key in ("d2t", "t2d"):
            if key not in stored:
                raise ValueError(f"tensor {key!r} is missing (the draft vocab map; draft_vocab_size "
                                 f"{cfg.draft_vocab_size} < vocab_size {cfg.vocab_size})")
        d2t, t2d = stored.pop("d2t").long(), stored.pop("t2d").bool()
    validate_vocab_map(d2t, t2d, vocab_size=cfg.vocab_size, draft_vocab_size=cfg.draft_vocab_size)
    if EMBEDDING not in stored and cfg.hidden_size != cfg.ht:
        raise ValueError(f"{EMBEDDING} is missing: a draft of hidden size {cfg.hidden_size} beside a "
                         f"target of {cfg.ht} cannot share the target's embedding")
    expected = expected_shapes(cfg, with_embedding=EMBEDDING in stored)
    missing, unexpected = sorted(set(expected) - set(stored)), sorted(set(stored) - set(expected))
    if missing or unexpected:
        raise ValueError(f"tensors missing {missing}, unexpected {unexpected} for the draft described "
                         f"by {CONFIG}")
    for name, t in stored.items():
        if tuple(t.shape) != expected[name]:
            raise ValueError(f"tensor {name!r} has shape {tuple(t.shape)}, {CONFIG} implies {expected[name]}")
    return stored, d2t, t2d


def _checked_ids(ids, num_layers: int | None) -> tuple[int, int, int]:
    """``validate_aux_layer_ids``; without the target's depth, only three increasing ids >= 0."""
    if num_layers is not None:
        return validate_aux_layer_ids(ids, num_layers)
    try:
        out = tuple(operator.index(i) for i in ids)
    except TypeError:
        out = ()
    if len(out) != 3 or out[0] < 0 or not out[0] < out[1] < out[2]:
        raise ValueError(f"aux_layer_ids={list(ids)} must be three strictly increasing output-of-layer ids "
                         ">= 0 (the target layers the draft was trained on)")
    return out  # type: ignore[return-value]


def _recorded_ids(config: dict, config_path: Path, num_layers: int | None,
                  log: Callable[[str], None]) -> tuple[int, int, int]:
    """The aux ids the config records (``eagle_config``'s output-of-layer ids, else the
    top-level capture-before ids minus 1), else the target's default, noted."""
    eagle = config.get("eagle_config") or {}
    try:
        if "eagle_aux_hidden_state_layer_ids" in eagle:
            return _checked_ids(eagle["eagle_aux_hidden_state_layer_ids"], num_layers)
        if config.get("eagle_aux_hidden_state_layer_ids") is not None:  # vLLM: captured before layer i
            return _checked_ids([i - 1 for i in config["eagle_aux_hidden_state_layer_ids"]], num_layers)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{str(config_path)!r}: {e}") from None
    if num_layers is None:
        raise ValueError(f"{str(config_path)!r} records no aux layer ids (SpecForge and EAGLE-3 write "
                         "none): pass aux_layer_ids, or num_target_layers for the default")
    ids = default_aux_layer_ids(num_layers)
    log(f"note: {config_path} records no aux layer ids (SpecForge and EAGLE-3 write none); using the "
        f"default {list(ids)} of the {num_layers}-layer target, which SpecForge trains with; pass "
        "--aux-layer-ids if this draft was trained on others")
    return ids

"""Checkpoints that cannot run code, written atomically, and the run fingerprint a resume
must match.

A checkpoint (``checkpoint.pt``) holds only tensors and plain data, loaded with
``torch.load(weights_only=True)``: the trainable draft weights (fp32 masters; the frozen
target embedding is never stored, it is re-read from the target), the optimizer state,
the step / epoch / data position, the RNG state, the training config, the draft shape,
the aux layer ids, the held-out prompts and the run fingerprint.

The run fingerprint (``run_fingerprint``) is everything that changes the trajectory:
every training setting except where output goes and how often it logs, saves or
evaluates, with paths replaced by the content they hold (target config, tokenizer and
weights; data file; offline cache; the vocab map itself). ``check_resume`` lists every
difference, old and new.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import pickle
import zipfile
from pathlib import Path

import torch

from eagle3fn.draft import DraftConfig, RopeConfig, init_params
from eagle3fn.errors import RunError

CHECKPOINT = "checkpoint.pt"
CHECKPOINT_FORMAT = 1
"""Written into every checkpoint (``format``); a checkpoint without one predates it and
is read the same. A higher number was written by a newer eagle3fn and is refused."""
BEST = "checkpoint-best.pt"
"""The checkpoint of the evaluation with the highest acceptance length so far (a whole
checkpoint, with ``best = {"step", "acceptance_length"}``)."""
# Settings that do not change what is trained: where output goes, how often it is
# written, spellings replaced in the fingerprint by what they resolve to, and whether
# the target's layers or the draft's step are compiled (compile_target, compile_step:
# rounding only; the optimizer state keeps AdamW's names either way). A setting listed
# here never reaches a fingerprint, so removing it from TrainConfig leaves the checkpoints
# that recorded it resumable (their ``config`` keeps it, unread).
_NOT_TRAJECTORY = ("out_dir", "save_every", "log_every", "eval_every", "eval_accept_prompts",
                   "eval_accept_tokens", "tensorboard", "preset",
                   "model", "gguf_file", "data", "cache", "vocab_map", "device", "trim",
                   "trim_loss_positions", "parallel", "max_steps", "compile_target",
                   "compile_step", "allow_long", "memory_check")
# max_steps may change on resume (train a run further, or stop it earlier): it is kept
# beside the fingerprint, and ``check_resume`` says when the lr schedule is re-spanned.
_REQUIRED = ("params", "optimizer", "step", "epoch", "pos", "rng", "config", "draft", "aux_layer_ids",
             "holdout_prompts", "fingerprint")


def tensor_digest(*tensors: torch.Tensor) -> str:
    """sha256 of the tensors' bytes (CPU, contiguous), e.g. of a vocab map."""
    h = hashlib.sha256()
    for t in tensors:
        t = t.detach().cpu().contiguous()
        h.update(str((t.dtype, tuple(t.shape))).encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def run_fingerprint(cfg, *, device: torch.device, precision: torch.dtype, world: dict,
                    d2t: torch.Tensor, t2d: torch.Tensor) -> dict:
    """What a resume must match (JSON-able): ``settings`` (the TrainConfig fields that
    change the trajectory, the effective trim mode, the resolved device type and
    compute dtype, the data/sequence-parallel layout), ``target`` / ``data`` /
    ``cache`` content fingerprints and ``vocab_map`` (sha256 of d2t and t2d)."""
    from eagle3fn.io.fingerprint import file_fingerprint, target_fingerprint

    settings = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in _NOT_TRAJECTORY}
    for key in ("pack", "pack_length", "pack_window"):  # what counts is how batches are packed:
        settings.pop(key, None)  # absent when unpacked, so runs from before the flags still resume
    if cfg.packs:
        rows, length = cfg.packed_rows(device)
        settings.update(pack=True, pack_rows={"length": length, "window": cfg.pack_window,
                                              **({"rows": rows} if rows != cfg.batch_size else {})})
    settings.update(trim=cfg.trim_mode, device=device.type, precision=str(precision).removeprefix("torch."),
                    world=world)
    out = {"settings": _jsonable(settings), "target": target_fingerprint(cfg.model, cfg.gguf_file),
           "vocab_map": tensor_digest(d2t, t2d)}
    if cfg.cache:
        from eagle3fn.io.cache import cache_fingerprint

        out["cache"] = cache_fingerprint(cfg.cache)
    else:
        out["data"] = file_fingerprint(cfg.data)
    return out


def _jsonable(x):
    """Tuples as lists, recursively (a fingerprint compares equal after a JSON round trip)."""
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    return x


def save_checkpoint(path: Path, state: dict) -> None:
    """Write ``state`` to ``path`` through a temporary file renamed into place: a kill or
    a full disk leaves the previous checkpoint whole and no temporary file behind.
    Refuses non-finite weights (RunError naming the tensor)."""
    bad = [n for n, p in state["params"].items() if not bool(torch.isfinite(p).all())]
    if bad:
        raise RunError(f"refusing to save {path} at step {state['step']}: non-finite weights in {bad[:3]}; "
                       f"{_previous(path)}")
    tmp = path.with_name(path.name + ".tmp")
    try:
        torch.save({**state, "format": CHECKPOINT_FORMAT}, tmp)
        os.replace(tmp, path)
    except (OSError, RuntimeError) as e:
        tmp.unlink(missing_ok=True)
        raise RunError(f"could not write {path} at step {state['step']} ({' '.join(str(e).split())}); "
                       f"{_previous(path)}; free disk space (or fix the directory) and rerun the same "
                       "command to resume") from e


def _previous(path: Path) -> str:
    if not path.exists():
        return "no earlier checkpoint was written"
    try:
        step = torch.load(path, map_location="cpu", weights_only=True)["step"]
    except Exception:  # noqa: BLE001 - only for the message
        return f"the earlier {path} is intact"
    return f"the earlier {path} (step {step}) is intact"


def _unreadable(path: Path, error: Exception) -> str:
    """Why ``torch.load`` could not read ``path``, in words: truncated, not a torch file,
    or holding objects other than tensors and plain data."""
    if path.is_dir():
        return "it is a directory"
    size = path.stat().st_size
    if size == 0:
        return "it is empty (0 bytes: truncated)"
    with open(path, "rb") as f:
        start = f.read(4)
    if start == b"PK\x03\x04" and not zipfile.is_zipfile(path):
        return f"it is truncated ({size} bytes: the end of its zip archive is missing)"
    if not start.startswith(b"\x80") and not zipfile.is_zipfile(path):  # neither zip nor pickle
        return f"torch.save writes a zip archive, this file starts with {start!r}"
    if isinstance(error, pickle.UnpicklingError) or "weights_only" in str(error):
        return "it holds objects other than tensors and plain data (pickled code is never run)"
    return " ".join(str(error).split())[:200]


def read_checkpoint(path: Path) -> dict:
    """A checkpoint's state, loaded without running code; RunError (naming the file, what
    is wrong and the fix) for a truncated, foreign or code-carrying file, one written by
    a newer eagle3fn (``format`` above ``CHECKPOINT_FORMAT``), a missing field, or
    non-finite weights."""
    fix = "delete it and rerun train to start over, or use another --out-dir"
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # a truncated, foreign or code-carrying file
        raise RunError(f"checkpoint {path} is not a readable eagle3fn checkpoint ({_unreadable(path, e)}); "
                       f"{fix}") from e
    if not isinstance(state, dict):
        raise RunError(f"checkpoint {path} is not an eagle3fn checkpoint (it holds a {type(state).__name__}, "
                       f"not a dict); {fix}")
    version = state.get("format", CHECKPOINT_FORMAT)
    if not isinstance(version, int) or version > CHECKPOINT_FORMAT:
        raise RunError(f"checkpoint {path} has format {version!r}, written by a newer eagle3fn (this one "
                       f"reads format {CHECKPOINT_FORMAT} and older); upgrade eagle3fn to read it, or {fix}")
    missing = [k for k in _REQUIRED if k not in state]
    if missing:
        raise RunError(f"checkpoint {path} lacks {missing} (written by an older eagle3fn or another tool); "
                       f"{fix}")
    if not isinstance(state["params"], dict) or not all(isinstance(p, torch.Tensor)
                                                        for p in state["params"].values()):
        raise RunError(f"checkpoint {path}: its params are not a dict of tensors (written by another tool); "
                       f"{fix}")
    bad = [n for n, p in state["params"].items() if not bool(torch.isfinite(p).all())]
    if bad:
        raise RunError(f"{path} (step {state['step']}) has non-finite weights in {bad[:3]}; it cannot be "
                       "exported, evaluated or resumed: retrain (lower --lr, check the data)")
    return state


def check_resume(path: Path, state: dict, fingerprint: dict, trainable: dict, *, max_steps: int | None,
                 log=print) -> None:
    """RunError listing each difference (old -> new) between the checkpoint's run
    fingerprint and this run's, or a parameter of another shape. Another ``max_steps``
    is allowed and said (``log``): the learning-rate schedule then spans the new total."""
    from eagle3fn.io.fingerprint import diff

    old_max = state["config"].get("max_steps")
    if old_max != max_steps:
        log(f"note: --max-steps {max_steps} differs from the checkpoint's {old_max}: training goes on to "
            "the new total and the learning-rate schedule now spans it")
    differences = diff(_jsonable(state["fingerprint"]), _jsonable(fingerprint))
    if differences:
        old_settings, new_settings = state["fingerprint"].get("settings", {}), fingerprint.get("settings", {})
        old_rows, new_rows = old_settings.get("pack_rows") or {}, new_settings.get("pack_rows") or {}
        hint = (f" (offline on CUDA a micro-batch is now one row of --batch-size x --max-length; this run was "
                f"packed into rows of {old_rows['length']}: pass --pack-length {old_rows['length']} to resume it)"
                if "rows" in new_rows and "rows" not in old_rows and "length" in old_rows else "")
        old_precision = old_settings.get("precision")
        if (old_precision and old_precision != new_settings.get("precision")
                and old_settings.get("device") == new_settings.get("device")):  # not the fix across devices
            hint += (f" (this run trained in {old_precision}; --precision auto is bf16 on CUDA and on a CPU with "
                     f"AMX: pass --precision {old_precision} to resume it)")
        raise RunError(f"{path} was written by another run; it differs in: {'; '.join(differences)}{hint}. "
                       "Resume with the same settings, target, data and vocab map, or use another --out-dir")
    for name, p in trainable.items():
        if name not in state["params"] or state["params"][name].shape != p.shape:
            raise RunError(f"{path}: parameter {name} missing or of another shape; the draft "
                           "configuration changed since this checkpoint: use another --out-dir")


def best_record(out: Path, step: int, fingerprint: dict) -> dict | None:
    """The ``best`` record (``{"step", "acceptance_length"}``) of ``out``'s
    checkpoint-best.pt when it belongs to this run (same fingerprint) and is not newer
    than ``step`` (the checkpoint being resumed); None otherwise, and for a fresh run."""
    path = out / BEST
    if not path.exists():
        return None
    state = read_checkpoint(path)
    same = _jsonable(state["fingerprint"]) == _jsonable(fingerprint)
    return state.get("best") if same and state["step"] <= step else None


def load_run(out_dir: str | os.PathLike, *, best: bool = False) -> dict:
    """A finished (or interrupted) run: ``params`` (trainable, fp32, by name),
    ``draft`` (DraftConfig), ``d2t``/``t2d``, ``config`` (TrainConfig fields),
    ``aux_layer_ids``, ``step``, ``holdout_prompts`` (token id lists, one per
    held-out conversation; empty without --eval-holdout), ``best`` (the acceptance
    record, or None) and ``precision`` (the compute dtype it trained in, e.g.
    ``"bfloat16"``; None for a checkpoint without a fingerprint). ``best=True`` reads
    checkpoint-best.pt instead of the last checkpoint. RunError for a checkpoint that
    cannot be used (``read_checkpoint``)."""
    from eagle3fn.io.vocab_io import load_vocab_map

    out = Path(out_dir)
    if not (out / CHECKPOINT).exists():
        raise FileNotFoundError(f"no {CHECKPOINT} in {out}: train first (eagle3fn train --out-dir {out})")
    if best and not (out / BEST).exists():
        raise FileNotFoundError(f"no {BEST} in {out}: it is written when training measures the acceptance "
                                "length (--eval-holdout N, --eval-accept-prompts > 0); drop --best to use "
                                f"the last checkpoint, {out / CHECKPOINT}")
    state = read_checkpoint(out / (BEST if best else CHECKPOINT))
    draft = dict(state["draft"])
    draft_cfg = DraftConfig(**{**draft, "rope": RopeConfig(**draft["rope"])})
    d2t, t2d = load_vocab_map(out / "vocab.safetensors", vocab_size=draft_cfg.vocab_size,
                              draft_vocab_size=draft_cfg.draft_vocab_size)
    return {"params": state["params"], "draft": draft_cfg, "d2t": d2t, "t2d": t2d,
            "config": state["config"], "aux_layer_ids": tuple(state["aux_layer_ids"]),
            "step": state["step"], "holdout_prompts": state["holdout_prompts"], "best": state.get("best"),
            "precision": state.get("fingerprint", {}).get("settings", {}).get("precision")}


def initial_params(run: dict, target) -> dict[str, torch.Tensor]:
    """The trainable draft weights a run started from (step 0): ``init_params`` with
    the run's seed, ``target``'s head rows and the run's vocab map, as ``train`` builds
    them: the copied head rounded to the run's compute dtype first (``run["precision"]``,
    bf16 on CUDA and on a CPU with AMX), whatever dtype ``target`` was loaded in."""
    head = target.lm_head.weight.detach()
    if run.get("precision") in ("bfloat16", "float32"):
        head = head.to(getattr(torch, run["precision"]))
    params = init_params(run["draft"], embed_tokens=target.embed_tokens.float(),
                         target_lm_head=head.float(), t2d=run["t2d"], seed=run["config"]["seed"])
    return {n: p.detach() for n, p in params.items() if p.requires_grad}

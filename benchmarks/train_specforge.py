"""benchmarks/train.py's SpecForge 0.2.0 loop, run in the benchmark's process on the
same batches as eagle3fn (train.py's module docstring, step 4): its draft, the HF
backend's ``capture``, ``SpecForgeLoop`` and ``specforge_loop``."""

from __future__ import annotations

import gc
import time
from pathlib import Path

from train_probe import RecompileCounter, _step_record
from train_target import Shape


# ---------------------------------------------------------------------------- SpecForge


def _aux_layer_ids(layers: int) -> list[int]:
    from eagle3fn.io.target import default_aux_layer_ids

    return list(default_aux_layer_ids(layers))


def specforge_draft(shape: Shape, model_dir: Path, device: str, d2t, t2d, embed):
    """SpecForge's EAGLE-3 draft generated from the target's config as its
    ``_generate_draft_config`` does, on ``device`` in the compute dtype, with the vocab
    map and the frozen target embedding loaded."""
    import torch
    from specforge.modeling.auto import AutoDraftModel
    from specforge.training.model_loading import (_TARGET_ARCHITECTURE_FIELDS, _draft_config_from_dict,
                                                  _serializable_config_value)
    from transformers import AutoConfig

    target = AutoConfig.from_pretrained(model_dir)
    payload = {f: _serializable_config_value(getattr(target, f)) for f in _TARGET_ARCHITECTURE_FIELDS
               if getattr(target, f, None) is not None}
    payload.update(architectures=["LlamaForCausalLMEagle3"], model_type="llama", num_hidden_layers=1,
                   tie_word_embeddings=False, use_cache=True, draft_vocab_size=shape.draft_vocab)
    cuda = torch.device(device).type == "cuda"
    draft = AutoDraftModel.from_config(_draft_config_from_dict(payload),
                                       attention_backend="flex_attention" if cuda else "sdpa",
                                       torch_dtype=torch.bfloat16 if cuda else torch.float32).to(device)
    with torch.no_grad():
        draft.d2t.copy_(d2t)
        draft.t2d.copy_(t2d)
        draft.embed_tokens.weight.copy_(embed)
    draft.freeze_embedding()
    return draft


def capture(model, decoder, layers: list[int], input_ids, attention_mask):
    """The HF backend's capture: forward hooks on the ``layers`` of ``decoder`` (the
    target's decoder layers), one forward of ``model`` (the causal LM, or its backbone)
    with ``use_cache=False``; ``(aux [B, S, 3H], outputs)``."""
    import torch

    captured, handles = {}, []
    for i in layers:
        def hook(module, inputs, output, i=i):
            captured[i] = output[0] if isinstance(output, tuple) else output
        handles.append(decoder[i].register_forward_hook(hook))
    try:
        out = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return torch.cat([captured[i] for i in layers], dim=-1), out


def pad_batch(batch: dict, pad_to: int | None) -> dict:
    """``collate``'s batch (``[B, S]`` each) right-padded to ``[B, pad_to]`` (id 0, masks
    0): SpecForge's steady state. Its compiled functions (flex attention, the loss)
    recompile on every new sequence length; one fixed length compiles once, and the
    padding is masked, so the maths is unchanged (the work grows by the padding).
    None: as shipped, padded to the batch's longest."""
    import torch

    if pad_to is None:
        return batch
    B, S = batch["input_ids"].shape
    if S > pad_to:
        raise ValueError(f"a batch of {S} tokens does not fit pad_to={pad_to}")
    return {k: torch.cat((v, v.new_zeros(B, pad_to - S)), 1) for k, v in batch.items()}


class SpecForgeLoop:
    """SpecForge 0.2.0's training step on ``batches`` in order (module docstring): the
    target (online) or the captured features and the head (offline), its draft,
    ``OnlineEagle3Model`` and ``BF16Optimizer``. ``step(i)`` trains on batch i and
    returns its real tokens. ``pad_to``: every batch padded to this length (``pad_batch``:
    the steady state), None as shipped."""

    def __init__(self, shape: Shape, model_dir: Path, batches: list[list], *, offline: bool, device: str,
                 ttt_length: int, d2t, t2d, lr: float, pad_to: int | None = None) -> None:
        import torch
        from specforge.algorithms.eagle3.model import OnlineEagle3Model
        from specforge.optimizer import BF16Optimizer
        from transformers import AutoModelForCausalLM

        from eagle3fn.io.batching import collate

        cuda = torch.device(device).type == "cuda"
        if cuda:  # the peak counts from here, not from this process's earlier work
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        self.device, self.offline = device, offline
        self.target = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.bfloat16 if cuda else torch.float32).to(device).eval().requires_grad_(False)
        self.layers = _aux_layer_ids(shape.layers)
        self.draft = specforge_draft(shape, model_dir, device, d2t, t2d, self.target.get_input_embeddings().weight)
        self.model = OnlineEagle3Model(draft_model=self.draft, length=ttt_length,
                                       attention_backend="flex_attention" if cuda else "sdpa")
        self.model.train()
        self.opt = BF16Optimizer(self.draft, lr=lr, max_grad_norm=0.5, total_steps=len(batches), warmup_ratio=0.015)
        self.inputs = [pad_batch(collate(b, 0), pad_to) for b in batches]
        self.stored = []
        if offline:  # capture once, keep on the host, drop the target but its head
            with torch.no_grad():
                for b in self.inputs:
                    aux, out = capture(self.target.model, self.target.model.layers, self.layers,
                                       b["input_ids"].to(device), b["attention_mask"].to(device))
                    self.stored.append((aux.cpu(), out.last_hidden_state.cpu()))
            self.head = self.target.get_output_embeddings().weight.detach().clone()
            self.target = None
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()

    def step(self, i: int) -> int:
        import torch
        import torch.nn.functional as F
        from specforge.utils import padding

        b = self.inputs[i]
        ids, am, lm = (b[k].to(self.device) for k in ("input_ids", "attention_mask", "loss_mask"))
        if self.offline:
            aux, final = (x.to(self.device) for x in self.stored[i])
            lm = lm.clone()
            lm[torch.arange(lm.shape[0], device=lm.device), am.sum(1) - 1] = False  # normalize_offline_sample
            logits = F.linear(padding(final, left=False), self.head)  # TargetHead.preprocess + forward
        else:
            with torch.no_grad():
                aux, out = capture(self.target, self.target.model.layers, self.layers, ids, am)
                logits = padding(out.logits, left=False)
        plosses, *_ = self.model(input_ids=padding(ids, left=False), attention_mask=am, target=logits,
                                 loss_mask=lm[..., None].int(), hidden_states=aux)
        sum(0.8**j * p for j, p in enumerate(plosses)).backward()
        self.opt.step()
        return int(am.sum())


def specforge_loop(shape: Shape, model_dir: Path, batches: list[list], *, offline: bool, device: str,
                   ttt_length: int, d2t, t2d, recompiles: RecompileCounter, lr: float,
                   pad_to: int | None = None) -> list[dict]:
    """``SpecForgeLoop`` over every batch (``pad_to`` as there): per step records as
    ``_step_record``'s. On the CPU dynamo is off (a functional check; its compiled
    helpers would take longer to build than the steps)."""
    import torch

    cuda = torch.device(device).type == "cuda"
    loop = SpecForgeLoop(shape, model_dir, batches, offline=offline, device=device, ttt_length=ttt_length,
                         d2t=d2t, t2d=t2d, lr=lr, pad_to=pad_to)
    records, base = [], (recompiles.count, recompiles.limit_hits, recompiles.graphs())
    with torch._dynamo.config.patch(disable=not cuda):
        for i, b in enumerate(loop.inputs):
            t = time.time()
            tokens = loop.step(i)
            records.append(_step_record(t, tokens, b["input_ids"].numel(), recompiles))
    for r in records:  # counted from this loop's start
        r["recompiles"] -= base[0]
        r["limit_hits"] -= base[1]
        r["graphs"] -= base[2]
    del loop
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return records

"""``generate`` with ``impl="static"``: the target on transformers' ``DynamicCache`` as
``impl="dynamic"`` (the same rounds, crop and compaction; ``kv``), the draft on
preallocated buffers of fixed shapes (``static_draft.StaticDraft``: its cache in doubling
capacity, finished rows kept in place), so that on CUDA with greedy decoding each
round's draft work is two CUDA-graph replays.

Legend: B rows, S cache slots in use (both caches), k draft tokens per round.

``kv``'s, ``verify``'s and ``static_draft``'s functions are read through their modules
at call time (a benchmark's timer or a test's control put in their place is the one run).
"""

from __future__ import annotations

import torch

from eagle3fn.evaluation import kv, static_draft, verify
from eagle3fn.evaluation.results import emit, results
from eagle3fn.evaluation.rounds import live_positions, setup, verify_round


def generate_static(target, tokenizer_or_none, draft_params, draft_cfg, d2t, prompts, cfg, stage):
    """``generation.generate`` with ``impl="static"`` (module docstring): one
    ``SpecResult`` per prompt, the rounds of ``dynamic.generate_dynamic``.

    Args:
        prompts: int64 ``[L_i]`` each (``config.prompt_list``'s output).
        cfg: ``SpecConfig``; stage: ``timing.Stage`` (stage timings).
    """
    from transformers import DynamicCache

    k, temperature, device, eos, generators, pick, draft = setup(target, tokenizer_or_none, draft_params,
                                                                 draft_cfg, prompts, cfg)
    B = len(prompts)
    rows = list(range(B))
    new: list[list[int]] = [[] for _ in rows]
    accepted: list[list[int]] = [[] for _ in rows]
    slots = [p.numel() for p in prompts]  # valid slots of each row
    # One chooser for the whole batch (the recorded chain keeps the tensors it reads).
    choose = verify.draft_chooser(d2t, draft_cfg.vocab_size, temperature, draft.device, generators, rows)
    graph = draft.device.type == "cuda" and temperature == 0

    ids, valid, pos = kv.left_pad(prompts, device)
    cache = DynamicCache(config=target.model.config)
    with stage("prefill_s"):
        aux, logits = kv.target_forward(target, ids, valid, pos, cache, 1)
    token = pick(logits[:, -1], rows)
    S = ids.shape[1]  # cache slots in use (both caches)
    state = static_draft.StaticDraft(draft, B, k, aux.shape[-1], choose, graph,
                                     static_draft.initial_capacity(S + k + 1))
    with stage("draft_context_s"):
        dpos, dvalid = pos.to(draft.device), valid.to(draft.device)
        g, u, keys, values = draft.context(aux, torch.cat((ids[:, 1:], token[:, None]), 1).to(draft.device),
                                           dpos, dvalid)
        state.prefill(g, u, dpos, keys, values, dvalid)
    pos_t = pos[:, -1]
    for b, t in enumerate(token.tolist()):
        new[b].append(t)
    steps = torch.arange(k + 1, device=device)
    live_rows = None  # the live rows' indices into the buffers; None: all
    while True:
        live = live_positions(rows, new, cfg, eos, stage)
        if not live:
            break
        if len(live) < len(rows):  # finished rows leave the target's cache, keep their draft rows
            index = torch.tensor(live, device=device)
            cache.batch_select_indices(index)
            rows = [rows[i] for i in live]
            valid, pos_t, token = valid[index], pos_t[index], token[index]
            live_rows = torch.tensor(rows, device=draft.device)
        state.propose(S + k + 1, stage)
        proposal = (state.tokens.clone() if live_rows is None else state.tokens[live_rows]).to(device)
        probs = None if state.probs is None else state.probs if live_rows is None else state.probs[live_rows.cpu()]
        aux, positions, n, token, kept, nxt = verify_round(target, cache, token, proposal, probs, valid, pos_t,
                                                           steps, temperature, generators, rows, stage)
        state.put(live_rows, aux=aux, nxt=nxt, pos=positions, n=n, kept=kept)
        if state.update.due:
            with stage("record_s"):
                state.update.prepare()
        with stage("draft_context_s"):
            state.update()
        valid = torch.cat((valid, kept), 1)
        pos_t = positions.gather(1, n[:, None].long())[:, 0]
        host = torch.cat((n[:, None], token[:, None], proposal), 1).tolist()  # the round's sync
        drop = k - max(h[0] for h in host)
        S += k + 1 - drop
        state.slots.add_(k + 1 - drop)
        if drop:  # no row kept these: off both caches (the draft's slots are invalid already)
            cache.crop(-drop)
            valid = valid[:, :S]
        for r, (count, *_) in zip(rows, host):
            slots[r] += count + 1
        if S > 2 * max(slots[r] for r in rows) + kv.COMPACT_SLACK:  # mostly rolled back
            order = kv.compaction_order(valid)
            kv.compact_target(cache, order)
            state.compact(live_rows if live_rows is not None else state.rows, order, S, order.shape[1])
            valid, S = valid.gather(1, order), order.shape[1]
        emit(new, accepted, rows, host, eos, cfg.max_new_tokens)
    return results(new, accepted, k)


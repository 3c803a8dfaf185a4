"""``generate`` with ``impl="dynamic"``: the target on transformers' ``DynamicCache``,
the draft's cache grown by concatenation each round, finished rows removed from both,
every kernel launched from Python (``kv`` describes the shared slot layout).

Legend: B rows (finished ones leave the batch), S cache slots, k draft tokens per
round, H draft hidden, g kv heads, d head dim.

``kv``'s and ``verify``'s functions are read through their modules at call time (a
benchmark's timer or a test's control put in their place is the one run).
"""

from __future__ import annotations

import torch

from eagle3fn.evaluation import kv, verify
from eagle3fn.evaluation.results import emit, results
from eagle3fn.evaluation.rounds import live_positions, setup, verify_round


def generate_dynamic(target, tokenizer_or_none, draft_params, draft_cfg, d2t, prompts, cfg, stage):
    """``generation.generate`` with ``impl="dynamic"`` (module docstring): one
    ``SpecResult`` per prompt.

    Args:
        prompts: int64 ``[L_i]`` each (``config.prompt_list``'s output).
        cfg: ``SpecConfig``; stage: ``timing.Stage`` (stage timings).
    """
    from transformers import DynamicCache

    k, temperature, device, eos, generators, pick, draft = setup(target, tokenizer_or_none, draft_params,
                                                                 draft_cfg, prompts, cfg)
    rows = list(range(len(prompts)))
    new: list[list[int]] = [[] for _ in rows]
    accepted: list[list[int]] = [[] for _ in rows]
    slots = [p.numel() for p in prompts]  # valid slots of each row

    ids, valid, pos = kv.left_pad(prompts, device)
    cache = DynamicCache(config=target.model.config)
    with stage("prefill_s"):
        aux, logits = kv.target_forward(target, ids, valid, pos, cache, 1)
    token = pick(logits[:, -1], rows)
    with stage("draft_context_s"):
        g, u, keys, values = draft.context(aux, torch.cat((ids[:, 1:], token[:, None]), 1).to(draft.device),
                                           pos.to(draft.device), valid.to(draft.device))
    g_t, u_t, pos_t = g[:, -1], u[:, -1], pos[:, -1]  # each row's last context row t
    dvalid = valid.to(draft.device)
    for b, t in enumerate(token.tolist()):
        new[b].append(t)
    steps = torch.arange(k + 1, device=device)
    while True:
        live = live_positions(rows, new, cfg, eos, stage)
        if not live:
            break
        if len(live) < len(rows):  # finished rows leave both caches
            index = torch.tensor(live, device=device)
            dindex = index.to(draft.device)
            cache.batch_select_indices(index)
            rows = [rows[i] for i in live]
            valid, pos_t, token = valid[index], pos_t[index], token[index]
            keys, values, dvalid = keys[dindex], values[dindex], dvalid[dindex]
            g_t, u_t = g_t[dindex], u_t[dindex]
        choose = verify.draft_chooser(d2t, draft_cfg.vocab_size, temperature, draft.device, generators, rows)
        with stage("draft_chain_s"):
            proposal, probs = draft.chain(g_t, u_t, pos_t.to(draft.device), keys, values, dvalid, k, choose)
        proposal = proposal.to(device)
        aux, positions, n, token, kept, nxt = verify_round(target, cache, token, proposal, probs, valid, pos_t,
                                                           steps, temperature, generators, rows, stage)
        with stage("draft_context_s"):
            g, u, new_keys, new_values = draft.context(aux, nxt.to(draft.device), positions.to(draft.device),
                                                       kept.to(draft.device))
            keys, values = torch.cat((keys, new_keys), 2), torch.cat((values, new_values), 2)
        valid, dvalid = torch.cat((valid, kept), 1), torch.cat((dvalid, kept.to(draft.device)), 1)
        at = n.to(draft.device).long()
        g_t, u_t = g[torch.arange(len(rows)), at], u[torch.arange(len(rows)), at]
        pos_t = positions.gather(1, n[:, None].long())[:, 0]
        host = torch.cat((n[:, None], token[:, None], proposal), 1).tolist()  # the round's sync
        keys, values, dvalid = kv.crop(cache, keys, values, dvalid, k - max(h[0] for h in host))
        valid = valid[:, :dvalid.shape[1]]
        for r, (count, *_) in zip(rows, host):
            slots[r] += count + 1
        if valid.shape[1] > 2 * max(slots[r] for r in rows) + kv.COMPACT_SLACK:  # mostly rolled back
            keys, values, dvalid = kv.compact(cache, keys, values, dvalid)
            valid = dvalid.to(device)
        emit(new, accepted, rows, host, eos, cfg.max_new_tokens)
    return results(new, accepted, k)


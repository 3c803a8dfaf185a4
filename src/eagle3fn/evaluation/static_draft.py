"""The draft side of the static paths (``impl="static"`` and ``"graph"``): every tensor
a round reads or writes preallocated, so each round runs the same shapes and, on CUDA,
each of its two functions is one CUDA-graph replay (``decoding.Graphed``).

Legend: B rows of the batch, k draft tokens per round, K = k + 1 verified positions,
cap cache slots, S slots in use, H draft hidden, A*Ht aux width, V target vocab, g kv
heads, d head dim.
"""

from __future__ import annotations

import torch

from eagle3fn.decoding.graphs import Graphed
from eagle3fn.evaluation.cached_draft import Draft
from eagle3fn.evaluation.kv import gather_slots


def initial_capacity(slots: int) -> int:
    """The static draft cache's first capacity: the next power of two >= ``slots``, at
    least 64 (doubling from there keeps the recordings to a few per batch)."""
    return max(64, 1 << (slots - 1).bit_length())


class StaticDraft:
    """The draft side of ``generate``'s static path: every tensor a round reads or writes
    preallocated for the batch's ``B`` rows (finished rows keep their row, computed but
    never read; rows are independent), the step-0 cache in ``cap`` slots of which each row
    attends those marked in ``valid``, so every round runs the same shapes. Two functions,
    each one CUDA graph when ``graph`` (``Graphed``): ``update`` turns one verifying
    forward's ``k + 1`` positions into context rows (``Draft.context``, written at cache
    slots ``slots``) and picks each row's last context row t; ``chain`` runs the k draft
    steps from row t (``Draft.chain``). The cache grows by doubling (``reserve``), which
    records the graphs again.

    Buffers (inputs ``aux``, ``nxt``, ``pos``, ``n``, ``kept``, ``slots``; state ``keys``,
    ``values`` ``[B, g, cap, d]``, ``valid [B, cap]``, ``g_t [B, H]``, ``u_t [B, 2H]``,
    ``pos_t [B]``; output ``tokens [B, k]``, ``probs [B, k, V]`` or None).
    """

    def __init__(self, draft: Draft, B: int, k: int, aux_width: int, choose, graph: bool, cap: int) -> None:
        cfg, dev, dt = draft.cfg, draft.device, draft.dtype
        self.draft, self.k, self.choose, self.graph, self.cap = draft, k, choose, graph, cap
        self.keys = torch.zeros(B, cfg.num_kv_heads, cap, cfg.d, dtype=dt, device=dev)
        self.values = torch.zeros_like(self.keys)
        self.valid = torch.zeros(B, cap, dtype=torch.bool, device=dev)
        self.aux = torch.zeros(B, k + 1, aux_width, dtype=dt, device=dev)
        self.nxt = torch.zeros(B, k + 1, dtype=torch.long, device=dev)
        self.pos = torch.zeros(B, k + 1, dtype=torch.long, device=dev)
        self.n = torch.zeros(B, dtype=torch.long, device=dev)
        self.kept = torch.zeros(B, k + 1, dtype=torch.bool, device=dev)
        self.slots = torch.arange(k + 1, device=dev)
        self.g_t = torch.zeros(B, cfg.hidden_size, dtype=dt, device=dev)
        self.u_t = torch.zeros(B, 2 * cfg.hidden_size, dtype=dt, device=dev)
        self.pos_t = torch.zeros(B, dtype=torch.long, device=dev)
        self.rows = torch.arange(B, device=dev)
        self.tokens = torch.zeros(B, k, dtype=torch.long, device=dev)
        self.probs: torch.Tensor | None = None
        self._record()

    def _record(self) -> None:
        self.update = Graphed(self._update, self.graph, self.keys.device)
        self.chain = Graphed(self._chain, self.graph, self.keys.device)

    def propose(self, slots: int, stage) -> None:
        """The round's k proposals into ``tokens`` (and ``probs``): room for ``slots``
        draft slots, the chain recorded if due (timed as ``record_s``), then run (timed
        as ``draft_chain_s``)."""
        self.reserve(slots)
        if self.chain.due:
            with stage("record_s"):
                self.chain.prepare()
        with stage("draft_chain_s"):
            self.chain()

    def _update(self) -> None:
        g, u, keys, values = self.draft.context(self.aux, self.nxt, self.pos, self.kept)
        self.keys.index_copy_(2, self.slots, keys)
        self.values.index_copy_(2, self.slots, values)
        self.valid.index_copy_(1, self.slots, self.kept)
        self.g_t.copy_(g[self.rows, self.n])
        self.u_t.copy_(u[self.rows, self.n])
        self.pos_t.copy_(self.pos[self.rows, self.n])

    def _chain(self) -> None:
        tokens, self.probs = self.draft.chain(self.g_t, self.u_t, self.pos_t, self.keys, self.values,
                                              self.valid, self.k, self.choose)
        self.tokens.copy_(tokens)

    def prefill(self, g_BLH: torch.Tensor, u_BL2H: torch.Tensor, pos_BL: torch.Tensor,
                keys_BgLd: torch.Tensor, values_BgLd: torch.Tensor, valid_BL: torch.Tensor) -> None:
        """The prompts' context rows into slots ``0..L-1``, the slots after them invalid
        (a pooled state's earlier batch left them valid); row t = each row's last."""
        L = valid_BL.shape[1]
        self.reserve(L)
        self.keys[:, :, :L], self.values[:, :, :L], self.valid[:, :L] = keys_BgLd, values_BgLd, valid_BL
        self.valid[:, L:] = False
        self.g_t.copy_(g_BLH[:, -1])
        self.u_t.copy_(u_BL2H[:, -1])
        self.pos_t.copy_(pos_BL[:, -1])
        self.slots.copy_(torch.arange(L, L + self.k + 1, device=self.slots.device))

    def reserve(self, slots: int) -> None:
        """At least ``slots`` cache slots: the capacity doubles until it holds them (the
        cache copied over, the graphs recorded again)."""
        if slots <= self.cap:
            return
        cap = self.cap
        while cap < slots:
            cap *= 2
        grow = lambda x: torch.cat((x, x.new_zeros(*x.shape[:-2], cap - self.cap, x.shape[-1])), -2)  # noqa: E731
        self.keys, self.values = grow(self.keys), grow(self.values)
        self.valid = torch.cat((self.valid, self.valid.new_zeros(self.valid.shape[0], cap - self.cap)), 1)
        self.cap = cap
        self._record()

    def put(self, live: torch.Tensor | None, **inputs: torch.Tensor) -> None:
        """Copy a round's inputs (``aux``, ``nxt``, ``pos``, ``n``, ``kept``: live rows
        only) into their buffers at the live rows (all rows when ``live`` is None)."""
        for name, x in inputs.items():
            buffer = getattr(self, name)
            if live is None:
                buffer.copy_(x)
            else:
                buffer.index_copy_(0, live, x.to(device=buffer.device, dtype=buffer.dtype))

    def compact(self, live: torch.Tensor, order_BS: torch.Tensor, S: int, S_new: int) -> None:
        """Live rows' slots ``0..S-1`` reordered by ``order [B_live, S_new]`` (each row's
        valid slots first, ``kv.compact``), the slots past ``S_new`` invalid."""
        keys, values = self.keys[live, :, :S], self.values[live, :, :S]
        self.keys[live, :, :S_new] = gather_slots(keys, order_BS.to(keys.device))
        self.values[live, :, :S_new] = gather_slots(values, order_BS.to(keys.device))
        valid = self.valid[live, :S].gather(1, order_BS.to(keys.device))
        self.valid[live, :S] = torch.cat((valid, valid.new_zeros(valid.shape[0], S - S_new)), 1)
        self.slots.copy_(torch.arange(S_new, S_new + self.k + 1, device=self.slots.device))


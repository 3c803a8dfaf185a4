"""One draft layer (``eagle3fn.draft``'s functions of the params dict) for training and
decoding.

The TTT unroll (``unrolled.backbone``) and the cached batched draft that speculative
decoding runs (``evaluation.cached_draft.Draft``: its context rows and chain, what the
eager and CUDA-graph paths call) give the same logits on the same inputs, fp64: step 0
at every row of a sequence, and every step of each row's chain with its proposals as
the teacher-forced tokens. Controls: the hidden norm dropped from the decoding side
alone, or the chain's positions shifted by one, are caught by the same comparison; a
change made once in ``eagle3fn.draft`` (the hidden norm dropped there) moves both sides
and they still agree. The layer reads exactly the weights the export writes, and no
other source module names a layer weight.
"""

import ast
import pathlib

import pytest
import torch

import eagle3fn.draft as draft_module
import eagle3fn.evaluation.cached_draft as cached_draft
from eagle3fn.draft import DraftConfig, Eagle3Draft, RopeConfig, head, init_params
from eagle3fn.evaluation import propose
from eagle3fn.io.export import expected_shapes
from eagle3fn.rowmap import build_rowmap
from eagle3fn.shapes import Features
from eagle3fn.unrolled import TTTConfig, backbone, ttt
from eagle3fn.vocab import build_vocab_map

V, VD, H, HT, K = 61, 23, 32, 24, 3
LENGTHS = (2, 5, 9)  # context rows C of each decoded row (prefixes of one sequence)
CONFIGS = {
    "default": DraftConfig(hidden_size=H, intermediate_size=40, num_heads=4, num_kv_heads=2, vocab_size=V,
                           draft_vocab_size=VD, target_hidden_size=HT),
    "fc_norm-llama3-no_output_norm": DraftConfig(
        hidden_size=H, intermediate_size=40, num_heads=4, num_kv_heads=2, vocab_size=V, draft_vocab_size=VD,
        target_hidden_size=HT, fc_norm=True, norm_output=False,
        rope=RopeConfig(rope_type="llama3", factor=8.0, original_max_position_embeddings=8)),
}
SRC = pathlib.Path(__file__).resolve().parents[1] / "src" / "eagle3fn"

pytestmark = pytest.mark.usefixtures("one_thread")


def setup(cfg, seed=0):
    """fp64 params (perturbed past the init scale so every weight matters), d2t, and one
    sequence: ids ``[T]``, aux ``[T, 3*Ht]``."""
    g = torch.Generator().manual_seed(seed)
    d2t, _ = build_vocab_map(torch.randint(0, 100, (V,), generator=g), VD)
    params = init_params(cfg, dtype=torch.float64, seed=seed)
    with torch.no_grad():
        for name, p in params.items():
            p.add_(torch.randn(p.shape, generator=g, dtype=torch.float64) * (0.3 if "norm" in name else 0.15))
    T = max(LENGTHS) + 1
    return params, d2t, torch.randint(0, V, (T,), generator=g), torch.randn(T, 3 * HT, generator=g,
                                                                             dtype=torch.float64)


def decode(params, cfg, d2t, ids, aux, shift=0):
    """The cached draft as ``generate`` runs it: rows b with ``LENGTHS[b]`` context rows
    of the sequence, left-padded; context, then K chain steps from each row's last
    context row (its positions moved by ``shift``). Returns the logits ``[K, B, Vd]``
    the chain's chooser saw and the greedy proposals ``[B, K]`` (target ids)."""
    W, B = max(LENGTHS), len(LENGTHS)
    aux_B = torch.zeros(B, W, aux.shape[1], dtype=aux.dtype)
    nxt, keep = torch.zeros(B, W, dtype=torch.long), torch.zeros(B, W, dtype=torch.bool)
    for b, C in enumerate(LENGTHS):
        aux_B[b, W - C:], nxt[b, W - C:], keep[b, W - C:] = aux[:C], ids[1:C + 1], True
    pos = (keep.long().cumsum(1) - 1).clamp_min(0)
    seen = []
    target_ids = d2t + torch.arange(VD)

    def choose(logits_BVd):
        seen.append(logits_BVd)
        return target_ids[logits_BVd.argmax(-1)], None

    draft = cached_draft.Draft(params, cfg)
    with torch.no_grad():
        g, u, keys, values = draft.context(aux_B, nxt, pos, keep)
        tokens, _ = draft.chain(g[:, -1], u[:, -1], pos[:, -1] + shift, keys, values, keep, K, choose)
    return torch.stack(seen), tokens


def unrolled_logits(params, cfg, ids, aux, proposals):
    """``unrolled.backbone`` per decoded row b, its K - 1 first proposals as the
    teacher-forced tokens after ``ids[:C + 1]``: the head's logits ``[K, B, Vd]`` at row
    t = C - 1 of each step; and the step-0 logits ``[T - 1, Vd]`` of every row of the
    whole sequence (one unroll)."""
    draft = Eagle3Draft(cfg).double()
    draft.load_state_dict(params)

    def run(ids_T, aux_T3, C, k):
        f = Features(input_ids=ids_T[None], aux=aux_T3[None], attention_mask=torch.ones(1, ids_T.shape[0],
                                                                                        dtype=torch.long))
        with torch.no_grad():
            return [head(params, out[0], cfg, fused=False) for out in backbone(draft, f, C, k)]

    per_row = []
    for b, C in enumerate(LENGTHS):
        ids_b = torch.cat((ids[:C + 1], proposals[b, :K - 1]))
        aux_b = torch.cat((aux[:C], torch.zeros(K, aux.shape[1], dtype=aux.dtype)))
        per_row.append(torch.stack([z[C - 1] for z in run(ids_b, aux_b, C, K)]))
    T = ids.shape[0]
    return torch.stack(per_row, 1), run(ids, aux, T - 1, 1)[0]


def mismatch(params, cfg, d2t, ids, aux, shift=0) -> tuple[float, float]:
    """Relative max error of the decoding logits against the unrolled ones: every step
    of every decoded row, and step 0 of every row of the sequence."""
    got, proposals = decode(params, cfg, d2t, ids, aux, shift)
    want, step0 = unrolled_logits(params, cfg, ids, aux, proposals)
    rel = lambda a, b: ((a - b).abs().max() / b.abs().max()).item()  # noqa: E731
    at = torch.tensor([C - 1 for C in LENGTHS])
    return rel(got, want), rel(got[0], step0[at])


@pytest.mark.parametrize("name", CONFIGS)
def test_unrolled_steps_equal_the_decoding_steps(name, monkeypatch):
    cfg = CONFIGS[name]
    params, d2t, ids, aux = setup(cfg)
    all_steps, step0 = mismatch(params, cfg, d2t, ids, aux)
    assert all_steps < 1e-13 and step0 < 1e-13
    # Controls: the decoding side alone without its hidden norm, or its chain's
    # queries and own keys one position on.
    assert min(mismatch(params, cfg, d2t, ids, aux, shift=1)) > 1e-4
    real = cached_draft.layer_input
    ones = torch.ones(H, dtype=torch.float64)
    monkeypatch.setattr(cached_draft, "layer_input", lambda p, *a: real(
        {**p, "midlayer.hidden_norm.weight": ones}, *a))
    assert min(mismatch(params, cfg, d2t, ids, aux)) > 1e-4


def test_one_change_reaches_training_and_decoding(monkeypatch):
    """The hidden norm dropped once, in ``eagle3fn.draft`` (``norm_pair``, eager and
    fused): the unroll, the cached draft and the uncached chain all change, and still
    agree."""
    cfg = CONFIGS["default"]
    params, d2t, ids, aux = setup(cfg)
    before, proposals = decode(params, cfg, d2t, ids, aux)
    chain_before = propose(params, cfg, d2t, aux[:8], ids[:9], K).hidden
    real = draft_module.norm_pair

    def without_hidden_norm(x, g, x_weight, g_weight, eps):
        return real.eager(x, g, x_weight, torch.ones_like(g_weight), eps)

    without_hidden_norm.eager = without_hidden_norm
    monkeypatch.setattr(draft_module, "norm_pair", without_hidden_norm)
    after, _ = decode(params, cfg, d2t, ids, aux)
    assert ((after - before).abs().max() / before.abs().max()).item() > 1e-4
    assert max(mismatch(params, cfg, d2t, ids, aux)) < 1e-13
    chain_after = propose(params, cfg, d2t, aux[:8], ids[:9], K).hidden
    assert ((chain_after - chain_before).abs().max() / chain_before.abs().max()).item() > 1e-4


class Reads(dict):
    """A params dict that records the names read."""

    def __init__(self, *a):
        super().__init__(*a)
        self.read = set()

    def __getitem__(self, name):
        self.read.add(name)
        return super().__getitem__(name)


@pytest.mark.parametrize("name", CONFIGS)
def test_layer_reads_the_exported_weights(name):
    """Training (``ttt``) and decoding (cached draft, chain) read exactly the weights
    ``io.export`` writes for the config (with the embedding): no weight the export
    misses, none it writes left unread."""
    cfg = CONFIGS[name]
    params, d2t, ids, aux = setup(cfg)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[d2t + torch.arange(VD)] = True
    want = set(expected_shapes(cfg, with_embedding=True))
    mask = torch.ones(1, ids.shape[0], dtype=torch.bool)
    mask[0, -1] = False
    f = Features(input_ids=ids[None], aux=aux[None], attention_mask=torch.ones(1, ids.shape[0], dtype=torch.long),
                 target_logits=torch.randn(1, ids.shape[0], V, dtype=torch.float64))
    for trim in ("none", "backbone"):
        training = Reads(params)
        ttt(training, f, build_rowmap(mask, K), TTTConfig(draft=cfg, ttt_length=K, trim=trim), d2t=d2t, t2d=t2d)
        assert training.read == want, trim
    decoding = Reads(params)
    decode(decoding, cfg, d2t, ids, aux)
    assert decoding.read == want
    chain = Reads(params)
    propose(chain, cfg, d2t, aux[:4], ids[:5], K)
    assert chain.read == want


LAYER_WEIGHTS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                 "input_layernorm", "hidden_norm", "post_attention_layernorm")


def names_layer_weights(source: str) -> list[str]:
    """Where ``source`` names a layer weight in code (an attribute such as
    ``.o_proj``, or a string such as ``"midlayer.self_attn.o_proj.weight"``); docstrings
    and other bare strings are prose and not counted."""
    tree = ast.parse(source)
    prose = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Expr)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in LAYER_WEIGHTS:
            found.append(f"line {node.lineno}: .{node.attr}")
        elif (isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in prose
              and any(w in node.value for w in LAYER_WEIGHTS)):
            found.append(f"line {node.lineno}: {node.value!r}")
    return found


def test_layer_weights_are_named_in_one_module():
    """Only ``eagle3fn.draft`` names the layer's weights (the skeleton and the
    functions); ``eagle3fn.testing`` builds test targets, whose own layers share the
    names. Control: the old unroll's ``self_attn.o_proj.weight.t()`` and a string key
    are caught, and draft.py itself is found."""
    found = {str(path.relative_to(SRC)): names_layer_weights(path.read_text()) for path in SRC.rglob("*.py")
             if path.relative_to(SRC).parts[0] != "testing"}
    assert {path for path, hits in found.items() if hits} == {"draft.py"}
    assert names_layer_weights("r = torch.addmm(g, a, layer.self_attn.o_proj.weight.t())")
    assert names_layer_weights('w = params["midlayer.mlp.up_proj.weight"]')
    assert not names_layer_weights('def f():\n    """the o_proj and MLP of the rows"""\n')

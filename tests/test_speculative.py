"""Speculative decoding (``eagle3fn.evaluation``: the rules, the chain, the uncached twin)
with tiny HF Llama targets built from config.

Greedy output equals ``model.generate(do_sample=False)`` token for token for a random
draft and for oracle drafts that are partly right (every acceptance count and the bonus
path); EOS stops both at the same place. A perfect draft accepts k per round and a
useless one 0, with real models (a constant target whose greedy token a zero-norm draft
always proposes) and with oracles; the training-time tau agrees at both ends. The draft
chain equals the TTT unroll (``ttt.backbone``) of its last row. Speculative sampling:
the acceptance-rejection mixture equals the target's distribution exactly, and sampled
outputs pass chi-square tests (unit, whole loop on a bigram target, a real model's
acceptance rate). Every check carries a negative control that the same check catches.
"""

import math
import random
import types
from collections import Counter

import pytest
import torch

import eagle3fn.evaluation.chain as chain
import eagle3fn.evaluation.twin as twin
import eagle3fn.evaluation.verify as verify
from eagle3fn.draft import Eagle3Draft
from eagle3fn.evaluation import (
    Proposal, SpecConfig, acceptance_stats, evaluate, propose, residual_distribution,
    sample_from, simulated_tau, speculative_generate, verify_greedy, verify_sampled,
)
from eagle3fn.shapes import Features
from eagle3fn.unrolled import backbone
from spec_setup import H, V, greedy, make_draft, make_target, target  # noqa: F401 - target: a fixture

PROMPTS = ([5], [17, 3, 99, 42], [7, 7, 1, 64, 120, 33, 2, 9, 88, 15, 61])
NEW = 16

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def references(target):
    """Each prompt's greedy continuation, long enough for an oracle to read k past NEW."""
    return {tuple(p): greedy(target, p, NEW + 8) for p in PROMPTS}


def oracle(references, corrupt=0.0, seed=0):
    """A ``propose`` that reads the target's greedy continuation; with ``corrupt``,
    each proposal is replaced by a wrong token with that probability."""
    rng = random.Random(seed)

    def fake_propose(params, cfg, d2t, aux_C3, ids_T, k, *, temperature=0.0, generator=None):
        assert aux_C3.shape[0] == ids_T.shape[0] - 1
        ids = ids_T.tolist()
        prompt = next(p for p in references if tuple(ids[:len(p)]) == p)
        full = list(prompt) + references[prompt]
        tokens = full[len(ids):len(ids) + k]
        tokens = [(t + 1) % V if rng.random() < corrupt else t for t in tokens]
        return Proposal(tokens=torch.tensor(tokens), probs=None, hidden=torch.zeros(k, H))

    return fake_propose


# ------------------------------------------------------------------------------ greedy


@pytest.mark.parametrize("k", [1, 3, 6])
@pytest.mark.parametrize("draft", ["random", "half-right oracle"])
def test_greedy_equals_target_generate(target, references, monkeypatch, k, draft):
    params, cfg, d2t = make_draft(target)
    if draft != "random":
        monkeypatch.setattr(twin, "propose", oracle(references, corrupt=0.25, seed=k))
    rounds = []
    for prompt in PROMPTS:
        out = speculative_generate(target, None, params, cfg, d2t, torch.tensor([prompt]),
                                   SpecConfig(num_draft_tokens=k, max_new_tokens=NEW))
        assert out.tokens == references[tuple(prompt)][:NEW]
        assert out.target_forwards == len(out.accepted_per_round) + 1
        assert 1 + sum(n + 1 for n in out.accepted_per_round) >= NEW
        assert 1 + sum(n + 1 for n in out.accepted_per_round[:-1]) < NEW
        rounds += out.accepted_per_round
    if draft != "random":  # none accepted, partly, all (+ bonus); every count for k <= 3
        assert {0, k} <= set(rounds) and (k == 1 or set(rounds) - {0, k})
        assert k > 3 or set(rounds) == set(range(k + 1))


def test_greedy_negative_control(target, references, monkeypatch):
    """An acceptance rule that keeps one draft token too many (off by one) is caught."""
    params, cfg, d2t = make_draft(target)
    monkeypatch.setattr(twin, "propose", oracle(references, corrupt=0.5, seed=1))
    real = twin.verify_greedy
    monkeypatch.setattr(twin, "verify_greedy",
                        lambda z, d: (min(real(z, d)[0] + 1, len(d)), real(z, d)[1]))
    outs = [speculative_generate(target, None, params, cfg, d2t, torch.tensor([p]),
                                 SpecConfig(num_draft_tokens=3, max_new_tokens=NEW)).tokens
            for p in PROMPTS]
    assert any(o != references[tuple(p)][:NEW] for o, p in zip(outs, PROMPTS))


def test_greedy_stops_at_eos_like_generate(target, references):
    prompt = list(PROMPTS[1])
    ref = references[tuple(prompt)]
    eos = ref[5]
    stop = ref.index(eos) + 1
    params, cfg, d2t = make_draft(target)
    run = lambda tok: speculative_generate(  # noqa: E731
        target, tok, params, cfg, d2t, torch.tensor([prompt]),
        SpecConfig(num_draft_tokens=3, max_new_tokens=NEW)).tokens
    assert run(types.SimpleNamespace(eos_token_id=eos)) == ref[:stop]  # the tokenizer's EOS
    target.model.generation_config.eos_token_id = eos  # the model's EOS, as generate reads it
    try:
        assert greedy(target, prompt, NEW) == ref[:stop]
        assert run(None) == ref[:stop]
    finally:
        target.model.generation_config.eos_token_id = None
    assert run(None) == ref[:NEW]  # negative control: no EOS, no stop


@pytest.mark.parametrize("k", [1, 3, 6])
def test_perfect_and_useless_oracles(target, references, monkeypatch, k):
    params, cfg, d2t = make_draft(target)
    cfg_ = SpecConfig(num_draft_tokens=k, max_new_tokens=NEW)
    monkeypatch.setattr(twin, "propose", oracle(references))
    out = speculative_generate(target, None, params, cfg, d2t, torch.tensor([PROMPTS[2]]), cfg_)
    assert out.tokens == references[tuple(PROMPTS[2])][:NEW]
    assert out.acceptance_length == k + 1 and out.per_position_acceptance == [1.0] * k
    assert out.target_forwards == 1 + math.ceil((NEW - 1) / (k + 1))
    monkeypatch.setattr(twin, "propose", oracle(references, corrupt=1.0))  # never the target's
    out = speculative_generate(target, None, params, cfg, d2t, torch.tensor([PROMPTS[2]]), cfg_)
    assert out.tokens == references[tuple(PROMPTS[2])][:NEW]
    assert out.acceptance_length == 1.0 and out.per_position_acceptance == [0.0] * k
    assert out.target_forwards == NEW


def test_useless_real_draft(target, references):
    """A draft vocab holding no token the target emits: nothing is ever accepted."""
    emitted = {t for p in PROMPTS for t in references[tuple(p)][:NEW + 1]}
    counts = torch.tensor([0 if v in emitted else 1 for v in range(V)])
    params, cfg, d2t = make_draft(target, vd=32, counts=counts)
    assert not emitted & set((d2t + torch.arange(32)).tolist())
    result = evaluate(target, params, cfg, d2t, [torch.tensor(p) for p in PROMPTS],
                      SpecConfig(num_draft_tokens=4, max_new_tokens=NEW))
    assert result["acceptance_length"] == 1.0 and result["per_position_acceptance"] == [0.0] * 4
    assert result["n_prompts"] == 3 and result["tokens"] == 3 * NEW
    assert result["rounds"] == 3 * (NEW - 1) and result["target_forwards"] == 3 * NEW
    assert result["simulated_tau"] == 1.0 and result["simulated_acc"] == [0.0] * 4


@pytest.mark.parametrize("k", [1, 4])
def test_constant_target_perfect_real_draft(k):
    """Every target logit is 0 (greedy token 0); a draft whose norm weight is 0 has
    logits 0 and proposes draft id 0 = target id 0. Real models, perfect acceptance,
    and the training-time tau is k + 1 too; with id 0 outside the draft vocab, neither
    accepts anything (the negative control)."""
    target = make_target(constant=True)
    prompts = [torch.tensor(p) for p in PROMPTS]
    counts = torch.zeros(V, dtype=torch.long)
    counts[0] = 1  # id 0 in the draft vocab: d2t[0] = 0
    params, cfg, d2t = make_draft(target, counts=counts, zero_norm=True)
    cfg_ = SpecConfig(num_draft_tokens=k, max_new_tokens=NEW)
    result = evaluate(target, params, cfg, d2t, prompts, cfg_)
    assert result["acceptance_length"] == k + 1 and result["per_position_acceptance"] == [1.0] * k
    assert result["simulated_tau"] == k + 1 and result["simulated_acc"] == [1.0] * k
    assert result["tokens"] == 3 * NEW
    assert speculative_generate(target, None, params, cfg, d2t, prompts[0][None],
                                cfg_).tokens == [0] * NEW == greedy(target, PROMPTS[0], NEW)
    counts = torch.ones(V, dtype=torch.long)
    counts[0] = 0
    params, cfg, d2t = make_draft(target, counts=counts, zero_norm=True)
    result = evaluate(target, params, cfg, d2t, prompts, cfg_)
    assert result["acceptance_length"] == 1.0 and result["simulated_tau"] == 1.0


def test_chain_is_the_ttt_unroll_of_the_last_row(monkeypatch):
    """``propose`` == ``ttt.backbone`` at row t with the proposals as teacher-forced
    tokens, fp64, every step; tokens = argmax of the head mapped through d2t.
    Negative controls: RoPE that does not advance with the step, or a step that does
    not see its own earlier keys, is caught by the same comparison."""
    target = make_target()
    params, cfg, d2t = make_draft(target, dtype=torch.float64)
    g = torch.Generator().manual_seed(3)
    C, k = 9, 5
    aux = torch.randn(C, 3 * H, generator=g, dtype=torch.float64)
    ids = torch.randint(0, V, (C + 1,), generator=g)

    def compare():
        prop = propose(params, cfg, d2t, aux, ids, k)
        draft = Eagle3Draft(cfg).double()
        draft.load_state_dict(params)
        feats = Features(input_ids=torch.cat((ids, prop.tokens[:-1]))[None],
                         aux=torch.cat((aux, torch.zeros(k - 1, 3 * H, dtype=aux.dtype)))[None],
                         attention_mask=torch.ones(1, C + k, dtype=torch.long))
        with torch.no_grad():
            outs = backbone(draft, feats, C, k, "eager")
            rows = torch.stack([o[0, C - 1] for o in outs])
            best = draft.head(prop.hidden).argmax(-1)
        assert torch.equal(prop.tokens, best + d2t[best])
        return (prop.hidden - rows).abs().max() / rows.abs().max()

    assert compare() < 1e-13
    with monkeypatch.context() as m:
        rope = chain.rope_cos_sin
        m.setattr(chain, "rope_cos_sin", lambda pos, *a: rope(pos.clamp_max(C - 1), *a))
        assert compare() > 1e-3
    with monkeypatch.context() as m:
        attend = chain.attend
        m.setattr(chain, "attend", lambda q, kk, vv: attend(q, kk[:, :C], vv[:, :C]))
        assert compare() > 1e-3


# ---------------------------------------------------------------------------- sampling


def chi2_test(samples, probs_V):
    """``(chi2, critical)``: Pearson's statistic of the sample counts against probs, cells
    with expected count < 5 pooled; critical = the 1e-4 upper quantile
    (Wilson-Hilferty), so a correct sampler fails with probability 1e-4."""
    n = len(samples)
    counts = Counter(samples)
    cells, pooled_o, pooled_e = [], 0.0, 0.0
    for v, p in enumerate(probs_V.tolist()):
        if n * p >= 5:
            cells.append((counts.get(v, 0), n * p))
        else:
            pooled_o, pooled_e = pooled_o + counts.get(v, 0), pooled_e + n * p
    if pooled_e > 0:
        cells.append((pooled_o, max(pooled_e, 1e-9)))
    chi2 = sum((o - e) ** 2 / e for o, e in cells)
    df = len(cells) - 1
    z = 3.719  # one-sided 1e-4
    critical = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    return chi2, critical


P6 = torch.tensor([0.30, 0.05, 0.25, 0.0, 0.15, 0.25], dtype=torch.float64)
Q6 = torch.tensor([0.05, 0.40, 0.10, 0.20, 0.25, 0.0], dtype=torch.float64)
WRONG_RESIDUALS = {
    "resample from the target": lambda p, q: p,
    "residual not renormalised": lambda p, q: (p - q).clamp_min(0),
}


def mixture(p, q):
    """The emitted token's exact distribution: accepted draft + rejected -> residual."""
    accept = torch.minimum(p, q)
    return accept + (1 - accept.sum()) * verify.residual_distribution(p, q)


def test_mixture_is_the_target_distribution_exactly(monkeypatch):
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        p = torch.softmax(torch.randn(11, generator=g, dtype=torch.float64) * 3, -1)
        q = torch.softmax(torch.randn(11, generator=g, dtype=torch.float64) * 3, -1)
        q[torch.randperm(11, generator=g)[:3]] = 0  # outside the draft vocab
        q /= q.sum()
        assert torch.allclose(mixture(p, q), p, rtol=0, atol=1e-15)
    assert torch.equal(residual_distribution(P6, P6), P6)
    for wrong in WRONG_RESIDUALS.values():
        monkeypatch.setattr(verify, "residual_distribution", wrong)
        assert (mixture(P6, Q6) - P6).abs().max() > 0.05


def sample_round(k, n, seed):
    """n rounds of ``verify_sampled`` with fixed per-position p (P6 rolled) and q (Q6
    rolled), proposals drawn from q: the first two emitted tokens (or -1)."""
    g = torch.Generator().manual_seed(seed)
    p = torch.stack([P6.roll(i) for i in range(k + 1)])
    q = torch.stack([Q6.roll(i) for i in range(k)])
    out = []
    for _ in range(n):
        tokens = torch.tensor([sample_from(q[i], g) for i in range(k)])
        accepted, nxt = verify_sampled(p, q, tokens, g)
        emitted = tokens[:accepted].tolist() + [nxt]
        out.append((emitted[0], emitted[1] if len(emitted) > 1 else -1))
    return out


def test_sampled_verification_is_distributed_as_the_target(monkeypatch):
    """First emitted token ~ p_0; the second, given the first was an accepted draft
    token, ~ p_1 (k = 2: the second position's accept/residual rule)."""
    n = 6000
    out = sample_round(2, n, seed=0)
    chi2, crit = chi2_test([a for a, _ in out], P6)
    assert chi2 < crit, (chi2, crit)
    chi2, crit = chi2_test([b for _, b in out if b >= 0], P6.roll(1))
    assert chi2 < crit, (chi2, crit)
    # d_1 accepted w.p. sum min(p_0, q_0): the second token exists that often.
    rate = sum(b >= 0 for _, b in out) / n
    expect = float(torch.minimum(P6, Q6).sum())
    assert abs(rate - expect) < 4 * math.sqrt(expect * (1 - expect) / n)
    for name, wrong in WRONG_RESIDUALS.items():
        monkeypatch.setattr(verify, "residual_distribution", wrong)
        chi2, crit = chi2_test([a for a, _ in sample_round(2, n, seed=0)], P6)
        assert chi2 > crit, name


def test_sample_from():
    g = torch.Generator().manual_seed(0)
    probs = torch.tensor([0.0, 0.5, 0.0, 0.2, 0.3], dtype=torch.float64)
    draws = [sample_from(probs, g) for _ in range(4000)]
    assert set(draws) <= {1, 3, 4}
    chi2, crit = chi2_test(draws, probs)
    assert chi2 < crit
    assert sample_from(torch.tensor([0.0, 1.0, 0.0]), g) == 1


def bigram_world(monkeypatch, v=4, seed=0):
    """A bigram target (logits = table[previous token]) and a bigram draft sampling
    its own table, patched in for the target forward and ``propose``: the whole loop
    (rounds, rows judged, temperature, bonus) at thousands of samples a second."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(v, v, generator=g, dtype=torch.float64) * 2
    noise = torch.randn(v, v, generator=g, dtype=torch.float64) * 2
    q_table = torch.softmax(z / 0.7 + noise, -1)  # correlated with p: every acceptance count

    def target_step(target, ids_T, last, check_head=False):
        return torch.zeros(ids_T.shape[0], 3), z[ids_T[-last:]]

    def fake_propose(params, cfg, d2t, aux_C3, ids_T, k, *, temperature=0.0, generator=None):
        tokens, probs, prev = [], [], int(ids_T[-1])
        for _ in range(k):
            probs.append(q_table[prev])
            prev = sample_from(q_table[prev], generator)
            tokens.append(prev)
        return Proposal(tokens=torch.tensor(tokens), probs=torch.stack(probs),
                        hidden=torch.zeros(k, 1))

    monkeypatch.setattr(twin, "target_step", target_step)
    monkeypatch.setattr(twin, "propose", fake_propose)
    monkeypatch.setattr(twin, "check_inputs", lambda *a: None)
    fake = types.SimpleNamespace(model=types.SimpleNamespace(generation_config=None))
    return fake, z


def bigram_sequences(z, temperature, first, length):
    """Exact distribution ``[v**length]`` of the ``length`` tokens sampled after token
    ``first``; sequence ``t_0..t_{n-1}`` has index ``sum_i t_i * v**(n-1-i)``."""
    p = torch.softmax(z / temperature, -1)
    v = p.shape[0]
    dist = p[first]
    for _ in range(length - 1):
        dist = (dist[:, None] * p[torch.arange(dist.shape[0]) % v]).flatten()
    return dist


def test_sampling_loop_is_distributed_as_the_target(monkeypatch):
    """The whole speculative sampling loop (k = 2, 4 new tokens: prefill + rounds with
    every acceptance count) against the bigram target's exact 4-token distribution at
    temperature 0.7. Negative controls: the same samples against temperature 1, and a
    loop that resamples rejected tokens from the target."""
    fake, z = bigram_world(monkeypatch)
    v, new, temperature, n = z.shape[0], 4, 0.7, 3000
    rounds = Counter()

    def draw(seed):
        out = speculative_generate(fake, None, None, None, None, torch.tensor([[3, 2]]),
                                   SpecConfig(num_draft_tokens=2, max_new_tokens=new,
                                              temperature=temperature, seed=seed))
        rounds.update(out.accepted_per_round)
        assert len(out.tokens) == new
        return sum(t * v ** (new - 1 - i) for i, t in enumerate(out.tokens))

    exact = bigram_sequences(z, temperature, first=2, length=new)
    samples = [draw(s) for s in range(n)]
    assert set(rounds) == {0, 1, 2}
    chi2, crit = chi2_test(samples, exact)
    assert chi2 < crit, (chi2, crit)
    assert chi2_test(samples, bigram_sequences(z, 1.0, first=2, length=new))[0] > crit
    monkeypatch.setattr(verify, "residual_distribution", lambda p, q: p)
    assert chi2_test([draw(s) for s in range(n)], exact)[0] > crit


def test_sampling_real_models_acceptance_rate(monkeypatch):
    """Constant target (uniform p over V) and zero-norm draft (uniform q over Vd): each
    draft token is accepted with probability sum min(p, q) = Vd / V, and the output is
    uniform, half of it outside the draft vocab. Negative control: resampling
    rejections from the target puts about 3/4 of the output in the draft vocab. Also:
    Vd = V (q = p) accepts everything, and the seed fixes the output."""
    target = make_target(constant=True)
    prompt = torch.tensor([PROMPTS[1]])
    params, cfg, d2t = make_draft(target, vd=V // 2, zero_norm=True)
    in_vocab = set((d2t + torch.arange(V // 2)).tolist())

    def run(new=200, seed=5):
        out = speculative_generate(target, None, params, cfg, d2t, prompt, SpecConfig(
            num_draft_tokens=3, max_new_tokens=new, temperature=0.8, seed=seed))
        return out, sum(t in in_vocab for t in out.tokens) / len(out.tokens)

    out, share = run()
    sigma = math.sqrt(0.25 / len(out.tokens))
    rounds = len(out.accepted_per_round)
    assert abs(out.per_position_acceptance[0] - 0.5) < 4 * math.sqrt(0.25 / rounds)
    assert abs(share - 0.5) < 4 * sigma
    assert run(20)[0] == run(20)[0] != run(20, seed=6)[0]
    with monkeypatch.context() as m:
        m.setattr(verify, "residual_distribution", lambda p, q: p)
        wrong_share = run()[1]
        assert wrong_share - 0.5 > 5 * sigma, wrong_share
    params, cfg, d2t = make_draft(target, vd=V, zero_norm=True)
    out = speculative_generate(target, None, params, cfg, d2t, prompt,
                               SpecConfig(num_draft_tokens=3, max_new_tokens=30, temperature=1.3))
    assert out.acceptance_length == 4 and out.per_position_acceptance == [1.0] * 3


# ------------------------------------------------------------------------ bookkeeping


def test_acceptance_stats():
    length, per_position = acceptance_stats([0, 2, 3, 1], 3)
    assert length == 2.5
    assert per_position == [0.75, 2 / 3, 0.5]
    assert acceptance_stats([], 2) == (0.0, [0.0, 0.0])
    assert acceptance_stats([0, 0], 2) == (1.0, [0.0, 0.0])


def test_verify_greedy():
    logits = torch.zeros(4, 6)
    logits[torch.arange(4), torch.tensor([2, 5, 1, 3])] = 1
    assert verify_greedy(logits, torch.tensor([2, 5, 1])) == (3, 3)  # all + bonus
    assert verify_greedy(logits, torch.tensor([2, 4, 1])) == (1, 5)  # correction
    assert verify_greedy(logits, torch.tensor([0, 5, 1])) == (0, 2)
    assert verify_greedy(torch.zeros(2, 6), torch.tensor([0])) == (1, 0)  # ties -> lowest id


def test_simulated_tau_is_ttt(target):
    """``simulated_tau`` runs the training objective with m_p = 1 from the last prompt row."""
    params, cfg, d2t = make_draft(target)
    seqs = [torch.tensor(PROMPTS[1] + [3, 9, 27, 81, 115]), torch.tensor(PROMPTS[0] + [1, 2])]
    out = simulated_tau(target, params, cfg, d2t, seqs, [4, 1], 3)
    assert out.acc.shape == (3,) and 1 <= float(out.tau) <= 4
    assert float(out.tau) == pytest.approx(1 + float(torch.cumprod(out.acc, 0).sum()))


def test_errors(target):
    params, cfg, d2t = make_draft(target)
    with pytest.raises(ValueError, match="num_draft_tokens"):
        SpecConfig(num_draft_tokens=0)
    with pytest.raises(ValueError, match="temperature"):
        SpecConfig(temperature=-1.0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        SpecConfig(max_new_tokens=0)
    with pytest.raises(ValueError, match=r"one prompt \[1, L\]"):
        speculative_generate(target, None, params, cfg, d2t, torch.zeros(2, 3, dtype=torch.long),
                             SpecConfig())
    with pytest.raises(ValueError, match="d2t has shape"):
        speculative_generate(target, None, params, cfg, d2t[:-1],
                             torch.zeros(1, 3, dtype=torch.long), SpecConfig())
    small = make_target(vocab=64, layers=4, aux=(0, 1, 2))
    with pytest.raises(ValueError, match="vocab_size=128"):
        speculative_generate(small, None, params, cfg, d2t, torch.zeros(1, 3, dtype=torch.long),
                             SpecConfig())
    with pytest.raises(ValueError, match="at least one prompt"):
        evaluate(target, params, cfg, d2t, [], SpecConfig())



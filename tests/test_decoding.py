"""eagle3fn.decoding against transformers: the static cache's forwards equal plain full
forwards, greedy ``generate`` equals ``model.generate`` token for token (refill, limits,
EOS), sampling follows softmax exactly and depends only on each request's seed. Tiny
random Llama / Qwen3 models in fp64 on the CPU (argmax ties cannot flip); the CUDA-graph
path is checked at the end where a GPU is."""

import dataclasses

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from eagle3fn.decoding import (Counters, GenerateConfig, StaticKVCache, cache_bytes, cached_forward, generate,
                               pick_tokens, prefill)
from eagle3fn.decoding.static_cache import kv_shape

pytestmark = pytest.mark.usefixtures("one_thread")

FAMILIES = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen3": (Qwen3Config, Qwen3ForCausalLM)}


def tiny(family: str = "llama", attn: str = "sdpa", vocab: int = 96, dtype=torch.float64, seed: int = 0):
    config_cls, model_cls = FAMILIES[family]
    config = config_cls(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
                        attn_implementation=attn, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(seed)
    return model_cls(config).to(dtype).eval()


def prompts_of(lengths, vocab: int = 96, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def hf_generate(model, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt], device=model.device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                         pad_token_id=0)
    return out[0, len(prompt):].tolist()


LENGTHS = [5, 1, 11, 3, 8, 2, 13]
LIMITS = [6, 9, 1, 12, 4, 7, 10]


def greedy_case(family: str, attn: str):
    """Model, prompts, limits and the reference answers, with an EOS id that one
    answer (request 3) reaches mid-way."""
    model = tiny(family, attn)
    prompts = prompts_of(LENGTHS)
    free = hf_generate(model, prompts[3], LIMITS[3])
    model.generation_config.eos_token_id = free[4]
    refs = [hf_generate(model, p, n) for p, n in zip(prompts, LIMITS)]
    return model, prompts, refs


def decode_all(model, prompts, cfg, limits=LIMITS, **kw) -> dict[int, tuple[list[int], bool]]:
    out = {}
    for index, tokens, eos in generate(model, prompts, cfg, max_new_tokens=limits, **kw):
        assert index not in out
        out[index] = (tokens, eos)
    assert sorted(out) == list(range(len(prompts)))
    return out


@pytest.mark.parametrize("family,attn,engine_attn", [
    ("llama", "sdpa", "grouped"), ("llama", "sdpa", "model"), ("llama", "eager", "model"),
    ("qwen3", "eager", "grouped"), ("qwen3", "sdpa", "model"), ("qwen3", "eager", "model")])
def test_greedy_equals_model_generate(family, attn, engine_attn):
    """``engine_attn="model"``: the engine runs the model's own sdpa / eager attention on
    the 4-D mask; ``"grouped"``: its own kv-head-grouped attention."""
    model, prompts, refs = greedy_case(family, attn)
    eos = model.generation_config.eos_token_id
    assert any(len(r) < n and r[-1] == eos for r, n in zip(refs, LIMITS)), "no answer ends on EOS mid-way"
    counters = Counters()
    # 3 slots for 7 prompts: slots are refilled; check_every=2 and prefills of <= 24 tokens
    out = decode_all(model, prompts, GenerateConfig(batch_size=3, check_every=2, prefill_tokens=24,
                                                    attention=engine_attn), counters=counters)
    for i, ref in enumerate(refs):
        assert out[i] == (ref, ref[-1] == eos), i
    assert counters.generated_tokens == sum(len(r) for r in refs) and counters.prefills > 3


@pytest.mark.parametrize("bug", ["position", "mask", "kv head"])
def test_greedy_identity_catches_wrong_positions_and_masks(bug, monkeypatch):
    """Control: the same comparison fails with positions off by one, a mask that hides
    each query's own column, or grouped attention reading the wrong kv head."""
    model, prompts, refs = greedy_case("llama", "sdpa")
    if bug == "position":
        real = StaticKVCache.position_ids
        monkeypatch.setattr(StaticKVCache, "position_ids", lambda self, q: real(self, q) + 1)
    elif bug == "kv head":  # every query head reads kv head 0
        import eagle3fn.decoding.attention as attention
        real_attention = attention.grouped_attention

        def first_head(module, query, key, value, *args, **kwargs):
            return real_attention(module, query, key[:, :1].expand_as(key), value[:, :1].expand_as(value),
                                  *args, **kwargs)
        monkeypatch.setattr(attention, "grouped_attention", first_head)
    else:
        real = StaticKVCache.attention_mask

        def shifted(self, q, dtype):  # query i reads columns < n_b + i (misses itself)
            mask = real(self, q, dtype)
            return torch.cat((mask[..., :1], mask[..., :-1]), -1)
        monkeypatch.setattr(StaticKVCache, "attention_mask", shifted)
    out = decode_all(model, prompts, GenerateConfig(batch_size=3, check_every=2))
    assert sum(out[i][0] != ref for i, ref in enumerate(refs)) >= 3


@pytest.mark.parametrize("attn", ["grouped", "model"])
def test_verify_forward_equals_full_forward_and_rolls_back(attn):
    """Prefill 3 prompts into a 5-row cache, feed q = 4 tokens per row with the aux
    features of layers (0, 1): logits and aux equal a plain forward of the whole
    sequence; then accept 1 of 3 proposals (n += 2) and feed 2 more tokens: the logits
    equal a plain forward of the accepted sequence. Control: no rollback (n += 4)."""
    model = tiny("qwen3")
    prompts = prompts_of([6, 2, 9])
    tmp, last, _, start, lengths = prefill(model, prompts, dtype=torch.float64, device="cpu", attn=attn)
    rows = torch.tensor([3, 0, 2])
    with torch.no_grad():
        for r, p in enumerate(prompts):
            torch.testing.assert_close(last[r], model(torch.tensor([p])).logits[0, -1], rtol=0, atol=1e-12)
        cache = StaticKVCache(model.config, 5, 24, dtype=torch.float64, device="cpu")
        cache.load_rows(rows, tmp, start, lengths)
        feed = torch.randint(0, 96, (5, 4), generator=torch.Generator().manual_seed(3))
        logits, aux = cached_forward(model, cache, feed, aux_layers=(0, 1), attn=attn)
        assert logits.shape == (5, 4, 96) and aux.shape == (5, 4, 64)
        for r, b in enumerate(rows.tolist()):
            full = model(torch.tensor([prompts[r] + feed[b].tolist()]), output_hidden_states=True)
            torch.testing.assert_close(logits[b], full.logits[0, -4:], rtol=0, atol=1e-12)
            torch.testing.assert_close(aux[b], torch.cat(full.hidden_states[1:3], -1)[0, -4:], rtol=0, atol=1e-12)
        before = cache.lengths.clone()
        for advance, equal in ((2, True), (4, False)):
            cache.lengths.copy_(before + advance)
            more = torch.randint(0, 96, (5, 2), generator=torch.Generator().manual_seed(4))
            logits, _ = cached_forward(model, cache, more, attn=attn)
            for r, b in enumerate(rows.tolist()):
                accepted = prompts[r] + feed[b, :2].tolist() + more[b].tolist()
                full = model(torch.tensor([accepted])).logits[0, -2:]
                assert torch.allclose(logits[b], full, rtol=0, atol=1e-12) == equal, (advance, b)


def test_cache_memory_formula():
    model = tiny()
    cache = StaticKVCache(model.config, 3, 17, dtype=torch.bfloat16, device="cpu")
    held = sum(x.numel() * x.element_size() for layer in cache.layers for x in (layer.keys, layer.values))
    assert held == cache_bytes(model.config, 3, 17, torch.bfloat16) == 2 * 3 * 3 * 2 * 17 * 8 * 2
    assert kv_shape(model.config) == (3, 2, 8)


# ------------------------------------------------------------------------- sampling


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 1.0), (1.3, 0.8)])
def test_pick_tokens_is_exactly_the_softmax(temperature, top_p):
    """Token j is picked for a set of u of measure p_j: on a grid of 20000 uniforms the
    frequencies equal the (nucleus-renormalised) softmax within the grid step. Control:
    the softmax at another temperature is far off."""
    logits = torch.randn(2, 9, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 2
    N = 20000
    u = (torch.arange(N, dtype=torch.float64) + 0.5) / N
    freq = torch.stack([torch.bincount(pick_tokens(logits[r].expand(N, -1), u, temperature, top_p), minlength=9)
                        for r in range(2)]).double() / N

    def expected(t):
        p = torch.softmax(logits / t, -1)
        s, order = p.sort(-1, descending=True)
        keep = (s.cumsum(-1) - s) < top_p
        q = torch.zeros_like(p).scatter_(1, order, s * keep)
        return q / q.sum(-1, keepdim=True)

    assert (freq - expected(temperature)).abs().max() <= 2 / N
    assert (freq - expected(temperature * 1.5)).abs().max() > 0.02
    if top_p < 1:
        assert (freq == 0).any()  # the tail outside the nucleus is never picked


def test_sampled_first_tokens_follow_the_softmax():
    """600 requests of one token from the same prompt (seeds 0..599): the counts pass a
    chi-square test against softmax(logits / T) of the prompt; control: the softmax at
    2T is rejected."""
    model = tiny(vocab=12)
    with torch.no_grad():
        model.lm_head.weight.mul_(10)  # logits spread: temperatures tell apart, every expected count >= 12
    prompt = prompts_of([5], vocab=12)[0]
    n, T = 600, 0.8
    out = decode_all(model, [prompt] * n, GenerateConfig(batch_size=64, temperature=T), limits=[1] * n)
    counts = torch.bincount(torch.tensor([out[i][0][0] for i in range(n)]), minlength=12).double()
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, -1]

    def p_value(t):
        expected = n * torch.softmax(logits / t, -1)
        stat = ((counts - expected) ** 2 / expected).sum()
        return float(torch.special.gammaincc(torch.tensor((12 - 1) / 2, dtype=torch.float64), stat / 2))

    assert p_value(T) > 1e-3
    assert p_value(2 * T) < 1e-6


def test_sampling_depends_on_the_seed_alone():
    """The same requests (prompt, seed) sampled in 2 slots and in 7 slots, in another
    order: the same answers. Control: other seeds give other answers."""
    model = tiny()
    prompts = prompts_of(LENGTHS)
    cfg = GenerateConfig(batch_size=2, temperature=1.0, top_p=0.9, check_every=3)
    seeds = [100 + i for i in range(len(prompts))]
    a = decode_all(model, prompts, cfg, seeds=seeds)
    order = [4, 6, 0, 2, 1, 5, 3]
    b = decode_all(model, [prompts[i] for i in order], dataclasses.replace(cfg, batch_size=7, check_every=1),
                   limits=[LIMITS[i] for i in order], seeds=[seeds[i] for i in order])
    assert all(b[j] == a[i] for j, i in enumerate(order))
    c = decode_all(model, prompts, cfg, seeds=[200 + i for i in range(len(prompts))])
    assert sum(c[i] != a[i] for i in range(len(prompts))) >= 3


# ---------------------------------------------------------------------------- errors


@pytest.mark.parametrize("prompts,limits,cfg,match", [
    ([[1, 2], []], None, GenerateConfig(), "prompt 1 is empty"),
    ([[1, 2], [3, 500]], None, GenerateConfig(), "token id 500"),
    ([[1, 2, 3]], None, GenerateConfig(max_new_tokens=10, max_len=12), "needs 13 cache columns"),
    ([[1, 2, 3]], [0], GenerateConfig(), "max_new_tokens of request 0 is 0"),
    ([[1, 2, 3]], None, GenerateConfig(graph=True), "graph=True needs a CUDA model"),
])
def test_bad_requests_are_refused_before_work(prompts, limits, cfg, match):
    with pytest.raises(ValueError, match=match):
        next(generate(tiny(), prompts, cfg, max_new_tokens=limits))


def test_bad_config_is_refused():
    with pytest.raises(ValueError, match="top_p=0"):
        GenerateConfig(top_p=0)
    with pytest.raises(ValueError, match="sliding"):
        StaticKVCache(_sliding_config(), 1, 4, dtype=torch.float32, device="cpu")


def _sliding_config():
    config = tiny().config
    config.layer_types = ["sliding_attention"] * config.num_hidden_layers
    return config


# ------------------------------------------------------------------------------- GPU


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("family,engine_attn", [("llama", "grouped"), ("llama", "model"), ("qwen3", "grouped")])
def test_gpu_graph_replay_equals_eager_and_model_generate(family, engine_attn):
    """fp32 on the GPU (TF32 off): the CUDA-graph decode equals the eager decode and
    ``model.generate`` token for token; bf16 graph equals bf16 eager, greedy and sampled."""
    torch.backends.cuda.matmul.allow_tf32 = False
    model = tiny(family, dtype=torch.float32).cuda()
    prompts = prompts_of(LENGTHS)
    refs = [hf_generate(model, p, n) for p, n in zip(prompts, LIMITS)]
    cfg = GenerateConfig(batch_size=3, check_every=2, attention=engine_attn)
    graphed = decode_all(model, prompts, dataclasses.replace(cfg, graph=True))
    eager = decode_all(model, prompts, dataclasses.replace(cfg, graph=False))
    assert graphed == eager
    assert all(graphed[i][0] == ref for i, ref in enumerate(refs))
    model = model.to(torch.bfloat16)
    assert decode_all(model, prompts, dataclasses.replace(cfg, graph=True)) == \
        decode_all(model, prompts, dataclasses.replace(cfg, graph=False))
    sampled = dataclasses.replace(cfg, temperature=1.0, top_p=0.9)
    assert decode_all(model, prompts, dataclasses.replace(sampled, graph=True)) == \
        decode_all(model, prompts, dataclasses.replace(sampled, graph=False))


def test_eager_windows_are_tight_and_exact(monkeypatch):
    """Eager decoding attends only the columns some slot can hold (``set_window``): with
    windows rounded to 1 column they are as tight as they get and the answers still
    equal ``model.generate``'s; control: windows one column short change an answer (only
    the slot holding the most columns reaches a window's last one)."""
    import eagle3fn.decoding.generator as generator

    model, prompts, refs = greedy_case("llama", "sdpa")
    monkeypatch.setattr(generator, "WINDOW_STEP", 1)
    windows = []
    real = generator.StaticKVCache.attention_mask

    def spy(self, q, dtype):
        windows.append(self.window)
        return real(self, q, dtype)
    monkeypatch.setattr(generator.StaticKVCache, "attention_mask", spy)
    cfg = GenerateConfig(batch_size=3, check_every=2)
    out = decode_all(model, prompts, cfg)
    assert all(out[i][0] == ref for i, ref in enumerate(refs))
    assert min(windows) < max(windows) < max(LENGTHS) + max(LIMITS)
    real_set = generator._Slots.set_window

    def short(self, steps):
        real_set(self, steps)
        self.cache.window -= 1
    monkeypatch.setattr(generator._Slots, "set_window", short)
    out = decode_all(model, prompts, cfg)
    assert sum(out[i][0] != ref for i, ref in enumerate(refs)) >= 1


def test_compiled_cpu_step_equals_model_generate_and_follows_the_weights(monkeypatch):
    """``compile=True`` (the CPU's decode step through inductor, weights frozen into the
    graph), fp64: the same answers as ``model.generate``; a second model of the same
    shape with other weights gets its own answers (frozen weights are never reused
    across models: the step recompiles). Control: positions off by one inside the
    compiled step fail the same comparison."""
    model, prompts, refs = greedy_case("llama", "sdpa")
    cfg = GenerateConfig(batch_size=3, check_every=2, compile=True)
    out = decode_all(model, prompts, cfg)
    assert all(out[i][0] == ref for i, ref in enumerate(refs))
    other = tiny("llama", "sdpa", seed=5)
    other.generation_config.eos_token_id = model.generation_config.eos_token_id
    other_refs = [hf_generate(other, p, n) for p, n in zip(prompts, LIMITS)]
    assert other_refs != refs
    out = decode_all(other, prompts, cfg)
    assert all(out[i][0] == ref for i, ref in enumerate(other_refs))
    real = StaticKVCache.position_ids
    monkeypatch.setattr(StaticKVCache, "position_ids", lambda self, q: real(self, q) + 1)
    torch._dynamo.reset()  # dynamo does not guard on a patched class attribute: compile anew
    out = decode_all(model, prompts, cfg)
    assert sum(out[i][0] != ref for i, ref in enumerate(refs)) >= 3
    torch._dynamo.reset()  # no compiled step with the bug outlives the test


def test_compiled_cache_write_is_in_place(monkeypatch):
    """Inductor writes the new columns into the cache buffer itself: no generated kernel
    walks all B*g*M*d elements of a layer's buffer (the copy of the whole cache, and the
    copy back, that a ``scatter_`` on a graph input became, every layer at every decode
    step). Control: the scatter version of ``update`` does produce that copy. The written
    columns equal the eager write either way."""
    from torch._inductor.utils import run_and_get_code

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    B, M = 8, 256
    g, d = 2, 8

    def scatter_update(self, key_states, value_states, layer_idx, *args, **kwargs):
        layer = self.layers[layer_idx]
        index = (self.lengths[:, None] + self._steps[:key_states.shape[2]])[:, None, :, None].expand_as(key_states)
        layer.keys.scatter_(2, index, key_states)
        layer.values.scatter_(2, index, value_states)
        return layer.keys, layer.values

    def kernels_over_the_whole_buffer() -> int:
        torch._dynamo.reset()
        cache = StaticKVCache(config, B, M, dtype=torch.float32, device="cpu")
        cache.advance(torch.arange(B) * 7)
        k, v = torch.randn(2, B, g, 2, d).unbind(0)

        def write(k, v):
            keys, values = cache.update(k, v, 0)
            return keys[:, :, 0].sum() + values[:, :, 0].sum()

        _, code = run_and_get_code(torch.compile(write, backend="inductor", dynamic=False), k, v)
        eager = StaticKVCache(config, B, M, dtype=torch.float32, device="cpu")
        eager.advance(torch.arange(B) * 7)
        eager.update(k, v, 0)
        assert torch.equal(cache.layers[0].keys, eager.layers[0].keys)
        assert torch.equal(cache.layers[0].values, eager.layers[0].values)
        return sum(c.count(f"<static_cast<int64_t>({B * g * M * d}L)") for c in code)

    assert kernels_over_the_whole_buffer() == 0
    monkeypatch.setattr(StaticKVCache, "update", scatter_update)
    whole = kernels_over_the_whole_buffer()
    assert whole > 0  # the control: a scatter_ copies the buffer


def test_pooled_calls_reuse_one_recording_and_equal_fresh_ones(monkeypatch):
    """``generate(pool=GraphPool())`` called batch after batch, the CUDA graph simulated
    on the CPU (a warm-up run at recording, then replays): every answer equals the
    reference, the step is recorded once for all calls of one shape (columns rounded up
    to ``pool.COLUMN_ALIGN``), and without the pool once per call; a sampled call after
    them records its own step and equals its unpooled self. Control: a pool that hands
    out any entry whatever its key replays the greedy step for the sampled call."""
    import eagle3fn.decoding.generator as generator
    from eagle3fn.decoding import GraphPool, Graphed

    recordings = []

    class Replayed(Graphed):  # graph mode on the CPU: prepare runs fn once, then each call replays it
        def __init__(self, fn, graph, device):
            super().__init__(fn, True, device)

        def prepare(self):
            if self.due:
                self.fn()
                self.recorded = True
                recordings.append(self)

        def __call__(self):
            self.prepare()
            self.fn()

    monkeypatch.setattr(generator, "Graphed", Replayed)
    model, prompts, _ = greedy_case("llama", "sdpa")  # request 3 ends at an EOS mid-way
    refs = [hf_generate(model, p, 12) for p in prompts]
    groups = [[0, 1, 2], [3, 4], [5, 6], [6, 0, 3]]  # three slots: the second call refills one
    cfg = GenerateConfig(batch_size=2, max_new_tokens=12)

    def run(pool):
        out = []
        for group in groups:
            got = decode_all(model, [prompts[i] for i in group], cfg, limits=None, pool=pool)
            out.append([got[j][0] for j in range(len(group))])
        return out

    want = [[refs[i] for i in group] for group in groups]
    assert run(None) == want and len(recordings) == len(groups)
    recordings.clear()
    pool = GraphPool()
    assert run(pool) == want
    assert len(recordings) == 1 and (pool.hits, pool.misses) == (len(groups) - 1, 1)
    # A call needing more columns replaces the state; a later shorter call fits in it.
    long = prompts_of([40], seed=5)[0]
    recordings.clear()
    assert decode_all(model, [long, prompts[0]], cfg, limits=None, pool=pool)[0][0] == hf_generate(model, long, 12)
    assert decode_all(model, prompts[1:3], cfg, limits=None, pool=pool) == \
        {j: (refs[1 + j], refs[1 + j][-1:] == [model.generation_config.eos_token_id]) for j in range(2)}
    assert len(recordings) == 1 and len(pool.entries) == 1 and next(iter(pool.entries.values())).cache.max_len >= 52
    sampled = dataclasses.replace(cfg, temperature=1.0)
    alone = decode_all(model, prompts[:2], sampled, limits=None)
    recordings.clear()
    assert decode_all(model, prompts[:2], sampled, limits=None, pool=pool) == alone
    assert len(recordings) == 1 and len(pool.entries) == 2
    monkeypatch.setattr(GraphPool, "take",
                        lambda self, key, fits=None: self.entries.popitem()[1] if self.entries else None)
    pool = GraphPool()
    run(pool)
    assert decode_all(model, prompts[:2], sampled, limits=None, pool=pool) != alone

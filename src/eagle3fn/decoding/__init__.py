"""Fast decoding of a HF causal LM: static KV cache, continuous refill, CUDA graphs.

API (what ``eagle3fn synthesize`` and evaluation use)::

    from eagle3fn.decoding import GenerateConfig, Counters, generate

    cfg = GenerateConfig(max_new_tokens=512, batch_size=64)   # greedy; temperature=, top_p=, seed=
    counters = Counters()
    for index, tokens, eos in generate(model, prompts, cfg, tokenizer=tok, counters=counters):
        ...   # request `index` (position in `prompts`, a list of token-id lists) is done:
              # `tokens` its new ids (EOS kept, as model.generate), `eos` False if cut at its limit
    counters.generated_tokens, counters.seconds, counters.tokens_per_s

``generate`` yields each request as soon as it ends (finishing order); optional
``max_new_tokens=[...]`` and ``seeds=[...]`` per request. Greedy output equals
``model.generate(do_sample=False)`` of each prompt alone. Sampling: request i's answer
depends only on its prompt and seed (``seeds[i]``, default ``cfg.seed + i``: token t uses
draw t of ``torch.rand(n, generator=torch.Generator().manual_seed(seed), dtype=float64)``),
not on its slot or batch. The model runs in its own dtype and device (load it in bf16 on
the GPU); on CUDA the decode step is one CUDA-graph replay.

Memory: the cache is ``2 * layers * batch_size * kv_heads * M * head_dim * itemsize``
bytes, ``M = longest prompt + max_new_tokens`` (``static_cache.cache_bytes``).

Modules, in the order data flows:
    static_cache  ``StaticKVCache``: ``[B, g, M, d]`` per layer, per-row lengths, 4-D masks
    attention     ``grouped_attention``: kv heads not repeated (registered in transformers)
    forward       ``cached_forward`` (decode step, prefill, verification with aux features)
    sampling      ``pick_tokens`` (greedy / temperature / top-p from one uniform per row)
    graphs        ``Graphed``: a step recorded once as a CUDA graph, replayed
    pool          ``GraphPool``: recorded states kept across calls (record once per shape)
    generator     ``generate``: slots, refill, stop rules, counters
    cpu_linear    ``few_rows``: on a CPU, linear layers of 2-64 rows as ``W @ X^T`` where timed faster
"""

from eagle3fn.decoding.forward import cached_forward, prefill
from eagle3fn.decoding.generator import Counters, Finished, GenerateConfig, eos_token_ids, generate
from eagle3fn.decoding.graphs import Graphed
from eagle3fn.decoding.pool import GraphPool
from eagle3fn.decoding.sampling import pick_tokens, request_uniforms
from eagle3fn.decoding.static_cache import StaticKVCache, cache_bytes

__all__ = ["Counters", "Finished", "GenerateConfig", "GraphPool", "Graphed", "StaticKVCache", "cache_bytes", "cached_forward",
           "eos_token_ids", "generate", "pick_tokens", "prefill", "request_uniforms"]

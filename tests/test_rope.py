"""The draft's RoPE against transformers' own (the oracle, imported): inverse frequencies
and cos/sin scale of ``RopeConfig.from_hf_config(target text config)`` for the rope
types a Llama-style draft inherits, on real models' shapes and rope settings.

Legend: d head dim. Each case names a field perturbation (mostly the reading eagle3fn
had before) that the same comparison must catch.
"""

from __future__ import annotations

import dataclasses
import json
import types
from dataclasses import dataclass, field

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding  # noqa: E402

from eagle3fn.draft import RopeConfig, rope_cos_sin, rope_frequencies  # noqa: E402
from eagle3fn.errors import UsageError  # noqa: E402

FREQ_RTOL = 1e-6
"""transformers computes in fp32: its inverse frequencies are within a few ulp (<4e-7)."""
SCALE_RTOL = 1e-12
"""Both sides compute the scale in Python floats."""


def _factors(n: int, lo: float, hi: float, power: float) -> list[float]:
    """A monotone LongRoPE factor list of ``n`` entries (Phi-3's shape: ~1 at high
    frequencies rising towards the low ones)."""
    return [lo + (hi - lo) * (i / (n - 1)) ** power for i in range(n)]


@dataclass(frozen=True)
class Case:
    make: object
    """() -> the target's HF text config."""
    perturb: dict
    """RopeConfig fields whose change the comparison must catch."""
    seq_lens: tuple = (None,)
    """seq_len values to compare at (longrope switches factors past the original length)."""
    layer_type: str | None = None
    """transformers' layer_type for per-layer-type rope parameters."""
    extra: dict = field(default_factory=dict)


def _llama31():
    return transformers.LlamaConfig(
        hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        max_position_embeddings=131072,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192})


def _qwen25_yarn():
    return transformers.Qwen2Config(
        hidden_size=3584, num_attention_heads=28, num_key_value_heads=4,
        max_position_embeddings=131072,
        rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
        rope_theta=1000000.0)


def _qwen3_yarn(**extra):
    return transformers.Qwen3Config(
        hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        max_position_embeddings=131072,
        rope_parameters={"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0,
                         "original_max_position_embeddings": 32768, **extra})


def _deepseek_v3(**rope):
    # DeepSeek-V3's rotary part: qk_rope_head_dim = 64 (the config's head_dim).
    return transformers.DeepseekV3Config(
        hidden_size=7168, num_attention_heads=128, qk_rope_head_dim=64,
        max_position_embeddings=163840,
        rope_scaling={"type": "yarn", "factor": 40.0, "beta_fast": 32, "beta_slow": 1,
                      "original_max_position_embeddings": 4096, **rope},
        rope_theta=10000.0)


def _kimi_k2():
    return transformers.DeepseekV3Config(
        hidden_size=7168, num_attention_heads=64, qk_rope_head_dim=64,
        max_position_embeddings=131072,
        rope_scaling={"type": "yarn", "factor": 32.0, "beta_fast": 1.0, "beta_slow": 1.0,
                      "mscale": 1.0, "mscale_all_dim": 1.0,
                      "original_max_position_embeddings": 4096},
        rope_theta=50000.0)


def _gpt_oss():
    return transformers.GptOssConfig(
        hidden_size=2880, num_attention_heads=64, num_key_value_heads=8, head_dim=64,
        max_position_embeddings=131072,
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0,
                         "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                         "original_max_position_embeddings": 4096})


def _phi3(short: list[float], long: list[float], key: str = "type", **extra):
    # Phi-3-mini-128k / Phi-3.5-mini: d = 3072 / 32 = 96, factors of length 48, the
    # pretraining length outside the rope dict.
    return transformers.Phi3Config(
        hidden_size=3072, num_attention_heads=32, max_position_embeddings=131072,
        original_max_position_embeddings=4096,
        rope_scaling={key: "longrope", "short_factor": short, "long_factor": long, **extra})


def _linear():
    return transformers.LlamaConfig(
        hidden_size=4096, num_attention_heads=32, max_position_embeddings=16384,
        rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0})


def _default():
    return transformers.LlamaConfig(
        hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        max_position_embeddings=8192, rope_theta=500000.0)


def _dynamic():
    return transformers.LlamaConfig(
        hidden_size=4096, num_attention_heads=32, max_position_embeddings=4096,
        rope_scaling={"type": "dynamic", "factor": 2.0})


def _gemma3():
    return transformers.Gemma3TextConfig(
        hidden_size=2560, num_attention_heads=8, num_key_value_heads=4, head_dim=256,
        max_position_embeddings=131072,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 8.0,
                                            "rope_theta": 1000000.0}})


PHI3_SHORT = _factors(48, 1.05, 1.25, 2.0)
PHI3_LONG = _factors(48, 1.0, 64.0, 3.0)
PHI35_SHORT = _factors(48, 1.0, 1.2, 1.0)
PHI35_LONG = _factors(48, 1.08, 40.0, 2.0)
# NTK base at 2x max_position_embeddings: what an engine's static dynamic-NTK computes.
_NTK_THETA = 10000.0 * (2.0 * 2 - 1) ** (128 / 126)

CASES = {
    "llama3.1": Case(_llama31, {"factor": 4.0}),
    "qwen2.5-yarn": Case(_qwen25_yarn, {"beta_fast": 16.0}),
    "qwen3-yarn": Case(_qwen3_yarn, {"factor": 2.0}),
    # before: an explicit attention_factor was ignored (1.3 read as 0.1*ln(4)+1 = 1.139)
    "qwen3-yarn-attention-factor": Case(lambda: _qwen3_yarn(attention_factor=1.3),
                                        {"attention_factor": None}),
    "deepseek-v3": Case(lambda: _deepseek_v3(mscale=1.0, mscale_all_dim=1.0),
                        {"mscale_all_dim": 0.0}),
    # before: mscale_all_dim without mscale was divided out (transformers ignores it)
    "deepseek-mscale-all-dim-only": Case(lambda: _deepseek_v3(mscale_all_dim=0.707),
                                         {"mscale_all_dim": 0.707}),
    "kimi-k2": Case(_kimi_k2, {"beta_fast": 32.0}),
    # before: truncate=False was ignored (frequencies off by up to 76%)
    "gpt-oss": Case(_gpt_oss, {"truncate": True}),
    # before: longrope was refused
    "phi3-mini-128k": Case(lambda: _phi3(PHI3_SHORT, PHI3_LONG),
                           {"short_factor": tuple(PHI3_LONG), "long_factor": tuple(PHI3_SHORT)},
                           seq_lens=(None, 4096, 4097, 131072)),
    "phi3.5-mini": Case(lambda: _phi3(PHI35_SHORT, PHI35_LONG, key="rope_type"),
                        {"factor": 1.0}, seq_lens=(None, 8192)),
    "linear": Case(_linear, {"factor": 2.0}),
    "default": Case(_default, {"theta": 500000.0 * 1.001}),
    # before: dynamic was refused; its init frequencies are the default ones
    "dynamic": Case(_dynamic, {"theta": _NTK_THETA}),
    # before: theta 10000 and no scaling (the nested dict was not read)
    "gemma3-full-attention": Case(_gemma3, {"theta": 10000.0, "rope_type": "default"},
                                  layer_type="full_attention"),
}


def oracle(config, seq_len: int | None = None, layer_type: str | None = None):
    """transformers' (inv_freq fp32 [d/2], attention_scaling) at init (or for ``seq_len``)."""
    params = config.rope_parameters[layer_type] if layer_type else config.rope_parameters
    if params["rope_type"] == "default":
        return LlamaRotaryEmbedding.compute_default_rope_parameters(config)
    fn = ROPE_INIT_FUNCTIONS[params["rope_type"]]
    if layer_type:
        return fn(config, "cpu", seq_len=seq_len, layer_type=layer_type)
    return fn(config, "cpu", seq_len=seq_len)


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def errors(rope: RopeConfig, config, seq_len=None, layer_type=None) -> tuple[float, float]:
    """Max relative error of the inverse frequencies and relative error of the scale."""
    want, want_scale = oracle(config, seq_len, layer_type)
    got, scale = rope_frequencies(rope, head_dim_of(config), seq_len)
    freq = ((got - want.double()).abs() / want.double()).max().item()
    return freq, abs(scale - want_scale) / want_scale


@pytest.mark.parametrize("name", list(CASES))
def test_frequencies_and_scale_match_transformers(name):
    case = CASES[name]
    config = case.make()
    rope = RopeConfig.from_hf_config(config)
    for seq_len in case.seq_lens:
        freq, scale = errors(rope, config, seq_len, case.layer_type)
        assert freq < FREQ_RTOL and scale < SCALE_RTOL, (seq_len, freq, scale)
    # negative control: the perturbed config fails the same comparison
    bad = dataclasses.replace(rope, **case.perturb)
    assert any(f >= FREQ_RTOL or s >= SCALE_RTOL
               for f, s in (errors(bad, config, n, case.layer_type) for n in case.seq_lens))


@pytest.mark.parametrize("name", ["qwen2.5-yarn", "qwen3-yarn-attention-factor", "gpt-oss",
                                  "phi3-mini-128k"])
def test_cos_sin_match_transformers_rotary_embedding(name):
    """The cos/sin the draft applies equal, scale included, a Llama rotary embedding's
    built from the same target config (positions below the original length)."""
    config = CASES[name].make()
    rope, d = RopeConfig.from_hf_config(config), head_dim_of(config)
    positions = torch.arange(64)[None]
    want_cos, want_sin = LlamaRotaryEmbedding(config)(torch.zeros(1, dtype=torch.float32),
                                                      positions)
    cos, sin = rope_cos_sin(positions, rope, d, torch.float64)
    torch.testing.assert_close(cos, want_cos.double(), rtol=0, atol=1e-5)
    torch.testing.assert_close(sin, want_sin.double(), rtol=0, atol=1e-5)
    bad = dataclasses.replace(rope, attention_factor=1.0)  # the scale left out
    assert not torch.allclose(rope_cos_sin(positions, bad, d, torch.float64)[0],
                              want_cos.double(), rtol=0, atol=1e-5)


def test_longrope_long_factor_as_transformers_switches_at_run_time():
    """A batch reaching past original_max_position_embeddings makes transformers swap in
    long_factor for every position; rope_frequencies(seq_len=) gives the same set."""
    config = CASES["phi3-mini-128k"].make()
    rope, d = RopeConfig.from_hf_config(config), 96
    emb = LlamaRotaryEmbedding(config)
    for last, factors in ((4095, PHI3_SHORT), (4096, PHI3_LONG)):
        emb(torch.zeros(1), torch.tensor([[0, 1, last]]))
        got, _ = rope_frequencies(rope, d, seq_len=last + 1)
        torch.testing.assert_close(got, emb.inv_freq.double(), rtol=FREQ_RTOL, atol=0)
        base = 1.0 / 10000.0 ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
        torch.testing.assert_close(got, base / torch.tensor(factors, dtype=torch.float64))


def test_dynamic_is_default_below_max_positions_only():
    """Dynamic NTK equals the default RoPE while positions stay below
    max_position_embeddings (4096 here); a longer batch re-bases transformers' RoPE,
    which the static draft does not follow (the documented limit)."""
    config = CASES["dynamic"].make()
    rope = RopeConfig.from_hf_config(config)
    assert rope == RopeConfig(theta=10000.0)
    ours, _ = rope_frequencies(rope, 128)
    emb = LlamaRotaryEmbedding(config)
    emb(torch.zeros(1), torch.tensor([[0, 4095]]))
    torch.testing.assert_close(emb.inv_freq.double(), ours, rtol=FREQ_RTOL, atol=0)
    emb(torch.zeros(1), torch.tensor([[0, 8191]]))
    assert not torch.allclose(emb.inv_freq.double(), ours, rtol=1e-3, atol=0)


def test_old_style_attributes_and_raw_dicts_read_the_same():
    """transformers < 5 configs (rope_theta + rope_scaling attributes) and the raw
    ``from_hf(theta, rope_scaling)`` of a config.json give the same RopeConfig."""
    config = CASES["gpt-oss"].make()
    scaling = {k: v for k, v in config.rope_parameters.items() if k != "rope_theta"}
    old = types.SimpleNamespace(rope_theta=150000.0, rope_scaling=scaling,
                                max_position_embeddings=131072)
    want = RopeConfig.from_hf_config(config)
    assert want.truncate is False and want.rope_type == "yarn"
    assert RopeConfig.from_hf_config(old) == want
    assert RopeConfig.from_hf(150000.0, scaling) == want
    phi = json.loads(json.dumps(dict(CASES["phi3-mini-128k"].make().rope_parameters)))
    rope = RopeConfig.from_hf(10000.0, phi, max_position_embeddings=131072)
    assert hash(rope) == hash(dataclasses.replace(rope))  # lists became tuples
    assert rope == RopeConfig.from_hf_config(CASES["phi3-mini-128k"].make())


def test_mrope_sections_leave_text_rope_alone():
    rope = RopeConfig.from_hf(1e6, {"rope_type": "default", "rope_theta": 1e6,
                                    "mrope_section": [16, 24, 24], "mrope_interleaved": True})
    assert rope == RopeConfig(theta=1e6)


@pytest.mark.parametrize("scaling,match", [
    ({"rope_type": "su"}, "rope_type='su'"),
    ({"rope_type": "proportional", "partial_rotary_factor": 0.5}, "rope_type='proportional'"),
    ({"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 16384,
      "llama_4_scaling_beta": 0.1}, "llama_4_scaling_beta"),
    ({"rope_type": "default", "factor": 2.0}, r"\['factor'\]"),
    ({"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192},
     "high_freq_factor"),
    ({"rope_type": "yarn", "factor": 4.0}, "original_max_position_embeddings"),
    ({"rope_type": "longrope", "short_factor": [1.0] * 48, "long_factor": [1.0] * 48,
      "original_max_position_embeddings": 4096}, r"\['factor'\]"),
    ({"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.75},
     "partial_rotary_factor=0.75"),
])
def test_unsupported_rope_raises_naming_it(scaling, match):
    with pytest.raises(UsageError, match=match):
        RopeConfig.from_hf(10000.0, scaling)


def test_unsupported_configs_raise_naming_it():
    # Phi-4-mini: d = 3072 / 24 = 128, three quarters rotated (factors of length 48)
    phi4_mini = transformers.Phi3Config(
        hidden_size=3072, num_attention_heads=24, max_position_embeddings=131072,
        original_max_position_embeddings=4096, partial_rotary_factor=0.75,
        rope_scaling={"type": "longrope", "short_factor": PHI3_SHORT, "long_factor": PHI3_LONG})
    with pytest.raises(UsageError, match="partial_rotary_factor=0.75"):
        RopeConfig.from_hf_config(phi4_mini)
    nested = types.SimpleNamespace(rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        "chunked_attention": {"rope_type": "default", "rope_theta": 1e4}})
    with pytest.raises(UsageError, match="full_attention"):
        RopeConfig.from_hf_config(nested)
    rope = RopeConfig.from_hf(10000.0, {"rope_type": "longrope", "short_factor": [1.0] * 48,
                                        "long_factor": [1.0] * 48, "factor": 32.0,
                                        "original_max_position_embeddings": 4096})
    with pytest.raises(UsageError, match="short_factor has 48 entries but head_dim=128"):
        rope_frequencies(rope, 128)

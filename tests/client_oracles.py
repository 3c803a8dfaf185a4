"""The serving clients' own EAGLE-3 draft code as test oracles for ``eagle3fn export``.

Each client is *imported* (installed test-only with ``pip install --no-deps``, README's
test command), never copied; what cannot run on a CPU without its dependency tree is
replaced here, and only that:

* SGLang 0.5.23 (``sglang.srt.models.llama_eagle3.LlamaForCausalLMEagle3`` and its
  ``load_weights``): modules its import chain names but this code path never calls
  (web server, GPU kernels, vision) are empty stand-ins during the import only; one
  rank's parallel groups are published as SGLang's own tests publish them
  (``sglang.test.parallel_groups``); its ``RadixAttention`` (the paged-KV attention
  backend) is replaced by ``TTTAttention``, the training-time-test pattern.
* speculators 0.9.0 (``Eagle3DraftModel.from_pretrained`` and its own TTT forward):
  its data-generation and HTTP imports are stand-ins; ``loguru`` is real.
* vLLM 0.34.0 (``llama_eagle3.py``): it imports with stand-ins for its serving
  modules, but its model ``__init__`` needs a whole engine (a served target, compile
  and cache configs), so ``vllm_draft`` stands in for the module tree: vLLM's own layers
  and ops (the torch path of its ``CustomOp``s) and its own ``load_weights`` and
  ``forward`` functions, with ``TTTAttention`` for its paged ``Attention``.

Importing SGLang or vLLM patches transformers and other process-wide state, so the tests
call the ``run_*`` functions in a separate worker process (``worker`` below), never in
the pytest process.

Legend: B batch, S sequence, N = B*S flattened tokens, h heads, g kv heads, d head dim,
H draft hidden, Ht target hidden, V target vocab, Vd draft vocab.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
import warnings
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from torch import nn

# Top-level modules SGLang's import chain names without the EAGLE-3 draft using them:
# HTTP/ZMQ serving, notebooks, vision, quantisation and GPU kernel packages.
SGLANG_STAND_INS = ("IPython", "aiohttp", "compressed_tensors", "sentencepiece", "starlette",
                    "torchvision", "tvm_ffi", "zmq")


class _StandIn(types.ModuleType):
    """An absent module: every attribute is a ``_Nothing`` (classes may subclass it)."""

    __path__: list = []

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Nothing()


class _Nothing:
    def __call__(self, *args, **kwargs):
        # Used as a decorator (``@x`` / ``@x(...)``) it returns the decorated function.
        return args[0] if len(args) == 1 and callable(args[0]) and not kwargs else _Nothing()

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Nothing()

    def __mro_entries__(self, bases):
        return (object,)

    def __iter__(self):
        return iter(())

    def __bool__(self):
        return False

    def __or__(self, other):  # ``Completion | ChatCompletion`` in annotations
        return self

    __ror__ = __or__

    def __getitem__(self, key):
        return self


class _StandInFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, roots):
        self.roots = set(roots)

    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in self.roots:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        return _StandIn(spec.name)

    def exec_module(self, module):
        pass


def _import_with_stand_ins(package: str, installs: str, stand_ins, modules: tuple[str, ...]):
    """Import ``modules`` of ``package`` (the first is returned; skips when ``package`` is
    absent, naming ``installs``) with the ``stand_ins`` roots that are not installed
    served by ``_StandInFinder`` for the duration of the import only: afterwards
    ``find_spec`` of those names answers as before (transformers' availability checks
    stay true) and the stand-in modules leave ``sys.modules``."""
    if importlib.util.find_spec(package) is None:
        pytest.skip(f"{package} is not installed (README's test command installs {installs})")
    roots = [r for r in stand_ins if importlib.util.find_spec(r) is None]
    # transformers decides what is installed at its first import of these modules.
    import transformers.models.auto.processing_auto  # noqa: F401

    finder = _StandInFinder(roots)
    sys.meta_path.append(finder)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            loaded = [importlib.import_module(m) for m in modules]
    finally:
        sys.meta_path.remove(finder)
        for name in [n for n in sys.modules if n.split(".")[0] in finder.roots]:
            del sys.modules[name]
    return loaded[0]


@functools.cache
def sglang_eagle3():
    """SGLang's ``llama_eagle3`` module, importable on CPU (skips when SGLang is absent)."""
    module = _import_with_stand_ins("sglang", "0.5.23", SGLANG_STAND_INS, ("sglang.srt.models.llama_eagle3",))
    # Its CPU-engine flag would route RoPE and norms to sgl_kernel's CPU ops; the
    # native torch path is what a CPU check can run (the rotary base class reads it).
    import sglang.srt.layers.rotary_embedding.base as rotary_base

    rotary_base._is_cpu = True
    return module


class TTTAttention(nn.Module):
    """Stands in for SGLang's ``RadixAttention``: the training-time-test pattern.

    Step ``j`` (the ``j``-th call) of query row ``t`` attends to the step-0 keys of its
    sequence at ``u <= t`` that are real tokens, and to its own row's keys of steps
    ``1..j`` (the diagonal), as eagle3fn and SpecForge train. Inputs are SGLang's
    flattened ``q [N, h*d]``, ``k, v [N, g*d]``; output ``[N, h*d]``.
    """

    def __init__(self, *, num_heads: int, num_kv_heads: int, head_dim: int, scaling: float,
                 attention_mask: torch.Tensor) -> None:
        super().__init__()
        self.h, self.g, self.d, self.scaling = num_heads, num_kv_heads, head_dim, scaling
        self.valid = attention_mask.bool()  # [B, S]
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []

    def forward(self, q, k, v, forward_batch=None, **kwargs):
        B, S = self.valid.shape
        q = q.view(B, S, self.h, self.d).transpose(1, 2)                     # [B, h, S, d]
        rep = self.h // self.g
        k = k.view(B, S, self.g, self.d).transpose(1, 2).repeat_interleave(rep, 1)
        v = v.view(B, S, self.g, self.d).transpose(1, 2).repeat_interleave(rep, 1)
        self.keys.append(k)
        self.values.append(v)
        causal = torch.ones(S, S, dtype=torch.bool).tril()
        allowed = causal[None, None] & self.valid[:, None, None, :]        # [B, 1, S, S]
        scores = (q @ self.keys[0].transpose(-1, -2)) * self.scaling
        scores = [scores.masked_fill(~allowed, float("-inf"))]
        scores += [(q * key).sum(-1, keepdim=True) * self.scaling for key in self.keys[1:]]
        probs = torch.softmax(torch.cat(scores, dim=-1), dim=-1)
        out = probs[..., :S] @ self.values[0]
        for i, value in enumerate(self.values[1:]):
            out = out + probs[..., S + i:S + i + 1] * value
        return out.transpose(1, 2).reshape(B * S, self.h * self.d)


def _publish_one_rank() -> None:
    """One rank's config and groups, as SGLang's own layer tests publish them."""
    from types import SimpleNamespace

    from sglang.srt.runtime_context import SpawnRanks, get_parallel, reset_context
    from sglang.srt.server_args import ServerArgs
    from sglang.test.parallel_groups import publish

    reset_context()
    publish(ServerArgs(model_path="dummy", device="cpu"), role="test",
            ranks=SpawnRanks(world_rank=0))
    get_parallel().override_permanently(pp_group=SimpleNamespace(
        world_size=1, rank_in_group=0, is_first_rank=True, is_last_rank=True))


def sglang_draft(export_dir: Path, target_embed: torch.Tensor):
    """SGLang's ``LlamaForCausalLMEagle3`` built from the export's ``config.json``
    (``AutoConfig``, as SGLang reads a draft), weights fed through its own
    ``load_weights`` from ``model.safetensors``, and the target's embedding ``[V, Ht]``
    handed over by its ``set_embed`` (what SGLang's EAGLE worker does; a draft of another
    width keeps its own). fp32, eval mode."""
    module = sglang_eagle3()
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(export_dir))
    _publish_one_rank()
    with torch.device("cpu"):
        model = module.LlamaForCausalLMEagle3(config)
    with safe_open(str(Path(export_dir) / "model.safetensors"), framework="pt") as f:
        model.load_weights((k, f.get_tensor(k)) for k in f.keys())
    model.set_embed(nn.Parameter(target_embed.clone(), requires_grad=False))
    return model.float().eval()


def sglang_ttt_logits(model, input_ids: torch.Tensor, aux: torch.Tensor,
                      attention_mask: torch.Tensor, ttt_length: int) -> list[torch.Tensor]:
    """``ttt_length`` per-step draft logits ``[B, S, Vd]`` from SGLang's ``LlamaModel``
    forward (fc, fc_norm, decoder layer, norm) and ``lm_head``, driven as EAGLE-3 is
    trained: step 0 takes the aux features ``[B, S, 3*Ht]``, step ``j + 1`` the hidden
    state SGLang hands to the next draft step (its ``aux`` output), token ids shifted
    left once per step, step ``j`` at positions ``j..S-1+j`` (the draft token of step
    ``j`` sits ``j`` places after its row's token, as in serving)."""
    from types import SimpleNamespace

    B, S = input_ids.shape
    layer = model.model.layers[0].self_attn
    attn = TTTAttention(num_heads=layer.num_heads, num_kv_heads=layer.num_kv_heads,
                        head_dim=layer.head_dim, scaling=layer.scaling,
                        attention_mask=attention_mask)
    original, layer.attn = layer.attn, attn
    mode = SimpleNamespace(is_extend=lambda: False, is_draft_extend_v2=lambda: False)
    spec = SimpleNamespace(hidden_states=aux.reshape(B * S, -1))
    batch = SimpleNamespace(forward_mode=mode, spec_info=spec, mm_input_embeds=None,
                            contains_mm_inputs=lambda: False)
    positions = torch.arange(S).repeat(B)
    ids = input_ids
    vd = model.config.draft_vocab_size
    logits = []
    try:
        with torch.no_grad():
            for j in range(ttt_length):
                ids = torch.cat([ids[:, 1:], torch.zeros_like(ids[:, :1])], dim=1)
                normed, (aux_out,) = model.model(ids.reshape(-1), positions + j, batch)
                # ParallelLMHead pads its rows to a multiple of 64; the first Vd are the head.
                logits.append((normed @ model.lm_head.weight[:vd].T).view(B, S, vd))
                spec.hidden_states = aux_out
    finally:
        layer.attn = original
    return logits


# Modules speculators' package import names (data generation, HTTP clients, logging)
# that loading and running ``Eagle3DraftModel`` never calls.
SPECULATORS_STAND_INS = ("aiohttp", "datasets", "hs_connectors", "httpx", "openai")
@functools.cache
def speculators_eagle3():
    """speculators' ``models.eagle3`` module (skips when speculators is absent)."""
    return _import_with_stand_ins("speculators", "0.9.0", SPECULATORS_STAND_INS, ("speculators.models.eagle3",))


def tiny_target(path: Path, embed: torch.Tensor, *, num_layers: int, intermediate_size: int = 64,
                num_heads: int = 4, num_kv_heads: int = 2, head_dim: int = 8) -> Path:
    """A random transformers Llama target saved at ``path`` whose embedding is
    ``embed [V, H]``: the verifier speculators' ``from_pretrained`` reads."""
    from transformers import LlamaConfig, LlamaForCausalLM

    V, H = embed.shape
    config = LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=intermediate_size,
                         num_hidden_layers=num_layers, num_attention_heads=num_heads,
                         num_key_value_heads=num_kv_heads, head_dim=head_dim,
                         tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(embed)
    model.save_pretrained(str(path))
    return path


def speculators_draft(export_dir: Path):
    """speculators' ``Eagle3DraftModel.from_pretrained(export_dir)`` (its config class
    reads ``config.json``; eager attention, the CPU choice among its backends), fp32."""
    module = speculators_eagle3()
    config = module.Eagle3SpeculatorConfig.from_pretrained(str(export_dir))
    config.transformer_layer_config._attn_implementation = "eager"
    model = module.Eagle3DraftModel.from_pretrained(str(export_dir), config=config)
    return model.float().eval()


def speculators_ttt_logits(model, input_ids: torch.Tensor, aux: torch.Tensor,
                           attention_mask: torch.Tensor, ttt_length: int) -> list[torch.Tensor]:
    """``ttt_length`` per-step draft logits ``[B, S, Vd]`` from ``Eagle3DraftModel.forward``
    (its own TTT loop; ``lm_head`` outputs recorded), one sample at a time over its
    real tokens (speculators packs documents and has no padding mask). Step 0 gets the
    ids shifted left once (eagle3fn's convention; speculators shifts the rest itself),
    positions ``0..L-1``; rows past a sample's length stay zero."""
    B, S = input_ids.shape
    out = [torch.zeros(B, S, model.draft_vocab_size) for _ in range(ttt_length)]
    seen = []
    hook = model.lm_head.register_forward_hook(lambda mod, args, result: seen.append(result))
    try:
        with torch.no_grad():
            for b in range(B):
                n = int(attention_mask[b].sum())
                ids = input_ids[b:b + 1, :n]
                ids = torch.cat([ids[:, 1:], torch.zeros_like(ids[:, :1])], dim=1)
                seen.clear()
                model(hidden_states=aux[b:b + 1, :n], input_ids=ids,
                      document_ids=torch.zeros(1, n, dtype=torch.long),
                      position_ids=torch.arange(n)[None], ttt_steps=ttt_length)
                for j in range(ttt_length):
                    out[j][b, :n] = seen[j][0]
    finally:
        hook.remove()
    return out


# Modules vLLM's import chain names (serving, structured output, telemetry) that its
# EAGLE-3 weight loading never calls.
VLLM_STAND_INS = ("aiohttp", "cloudpickle", "cpuinfo", "llguidance", "prometheus_client", "uvloop",
                  "xgrammar", "zmq")
@functools.cache
def vllm_eagle3():
    """vLLM's ``llama_eagle3`` module (skips when vLLM is absent). Its compiled ops
    (``vllm._C``) are absent on a CPU-only install: vLLM itself logs that and goes on."""
    return _import_with_stand_ins("vllm", "0.34.0", VLLM_STAND_INS,
                                  ("vllm.model_executor.models.llama_eagle3", "vllm.model_executor.layers.linear"))


def vllm_draft(export_dir: Path, target_vocab_size: int):
    """vLLM's ``Eagle3LlamaForCausalLM.load_weights`` (and its ``LlamaModel.load_weights``
    with ``hf_to_vllm_mapper``, ``AutoWeightsLoader``, the layers' own weight loaders)
    run on the export's ``model.safetensors``.

    vLLM's model ``__init__`` needs a whole engine config (a served target, a compile
    config), so the module tree it builds is stood in for here: vLLM's own layer classes
    (``QKVParallelLinear``, ``MergedColumnParallelLinear``, ``RowParallelLinear``,
    ``ReplicatedLinear``, ``VocabParallelEmbedding``, ``ParallelLMHead``, ``RMSNorm``) at
    one tensor-parallel rank, placed and sized as ``llama_eagle3.py`` 0.34 places them
    from the export's ``config.json`` (read with ``AutoConfig``), with its
    ``draft_id_to_target_id`` only when ``draft_vocab_size != target_vocab_size``.
    Raises what vLLM's loader raises for a name it has no parameter for."""
    module = vllm_eagle3()
    from types import SimpleNamespace

    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state

    parallel_state._TP = SimpleNamespace(world_size=1, rank_in_group=0)
    # vLLM's tests' default_vllm_config, on the CPU (no accelerator platform is found)
    with set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device="cpu"))):
        return _vllm_draft(module, export_dir, target_vocab_size)


def _vllm_draft(module, export_dir: Path, target_vocab_size: int):
    from transformers import AutoConfig
    from vllm.model_executor.custom_op import CustomOp
    from vllm.model_executor.layers.layernorm import RMSNorm
    from vllm.model_executor.layers.linear import (
        QKVParallelLinear,
        ReplicatedLinear,
        RowParallelLinear,
    )
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        ParallelLMHead,
        VocabParallelEmbedding,
    )
    from vllm.model_executor.models import llama
    from vllm.model_executor.models.interfaces import SupportsEagle3

    config = AutoConfig.from_pretrained(str(export_dir))
    if getattr(config, "draft_vocab_size", None) is None:
        config.draft_vocab_size = config.vocab_size
    H, eps = config.hidden_size, config.rms_norm_eps
    Ht = getattr(config, "target_hidden_size", H)
    eagle = getattr(config, "eagle_config", None) or {}

    class Attention(nn.Module):  # llama.LlamaAttention without its paged-KV Attention
        forward = llama.LlamaAttention.forward
        _init_rotary_emb = llama.LlamaAttention._init_rotary_emb

    class Layer(nn.Module):  # llama_eagle3.LlamaDecoderLayer, layer 0
        forward = module.LlamaDecoderLayer.forward
        _residual_norm = (module.LlamaDecoderLayer._norm_before_residual
                          if getattr(config, "norm_before_residual", False)
                          else module.LlamaDecoderLayer._norm_after_residual)

    class Model(nn.Module):  # llama_eagle3.LlamaModel
        forward = module.LlamaModel.forward
        embed_input_ids = module.LlamaModel.embed_input_ids
        load_weights = module.LlamaModel.load_weights
        hf_to_vllm_mapper = module.LlamaModel.hf_to_vllm_mapper

    class Draft(nn.Module, SupportsEagle3):  # the interface sets has_own_embed_tokens
        load_weights = module.Eagle3LlamaForCausalLM.load_weights
        combine_hidden_states = module.Eagle3LlamaForCausalLM.combine_hidden_states

    attn = Attention()
    attn.head_dim = getattr(config, "head_dim", None) or H // config.num_attention_heads
    attn.num_heads, attn.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
    attn.q_size, attn.kv_size = attn.num_heads * attn.head_dim, attn.num_kv_heads * attn.head_dim
    attn.scaling = attn.head_dim ** -0.5
    attn.max_position_embeddings = getattr(config, "max_position_embeddings", 8192)
    attn.qkv_proj = QKVParallelLinear(2 * H, attn.head_dim, attn.num_heads, attn.num_kv_heads, bias=False)
    attn.o_proj = RowParallelLinear(attn.q_size, H, bias=False)
    attn._init_rotary_emb(config, None)
    attn.attn = None  # TTTAttention per forward (vllm_ttt_logits)
    layer = Layer()
    layer.layer_idx = 0
    layer.self_attn = attn
    layer.mlp = llama.LlamaMLP(H, config.intermediate_size, "silu", quant_config=None)
    for name in ("input_layernorm", "post_attention_layernorm", "hidden_norm"):
        setattr(layer, name, RMSNorm(H, eps=eps))

    model = Model()
    model.config = config
    model.use_aux_hidden_state = eagle.get("use_aux_hidden_state", True)
    model.norm_before_fc = bool(eagle.get("norm_before_fc", getattr(config, "norm_before_fc", False)))
    model.input_norm = None
    model.num_aux_hidden_states = 3
    model.norm_output = getattr(config, "norm_output", False)
    model.embed_tokens = VocabParallelEmbedding(config.vocab_size, H)
    model.layers = nn.ModuleList([layer])
    model.fc_norm = (nn.ModuleList([RMSNorm(Ht, eps=eps) for _ in range(3)])
                     if getattr(config, "fc_norm", False) else None)
    model.fc = ReplicatedLinear(3 * Ht, H, bias=False, return_bias=False)
    model.norm = RMSNorm(H, eps=eps)
    draft = Draft()
    draft.config = config
    draft.model = model
    draft.lm_head = ParallelLMHead(config.draft_vocab_size, H)
    draft.draft_id_to_target_id = (
        nn.Parameter(torch.zeros(config.draft_vocab_size, dtype=torch.long), requires_grad=False)
        if config.draft_vocab_size != target_vocab_size else None)
    for op in draft.modules():  # the torch path of vLLM's own ops (its CPU kernels are absent)
        if isinstance(op, CustomOp):
            op._forward_method = op.forward_native
    with safe_open(str(Path(export_dir) / "model.safetensors"), framework="pt") as f:
        draft.load_weights((k, f.get_tensor(k)) for k in f.keys())
    return draft


def vllm_ttt_logits(draft, target_embed, input_ids, aux, attention_mask, ttt_length):
    """``ttt_length`` per-step draft logits ``[B, S, Vd]`` from vLLM's forward code
    (``combine_hidden_states``: fc_norm and fc; ``LlamaModel.forward``: decoder layer,
    norm; ``lm_head``), driven as ``sglang_ttt_logits`` drives SGLang's (attention:
    ``TTTAttention``); the target's embedding is used unless the draft ships one."""
    B, S = input_ids.shape
    attn = draft.model.layers[0].self_attn
    attn.attn = TTTAttention(num_heads=attn.num_heads, num_kv_heads=attn.num_kv_heads,
                             head_dim=attn.head_dim, scaling=attn.scaling,
                             attention_mask=attention_mask)
    if not getattr(draft, "has_own_embed_tokens", False):  # vLLM shares the target's
        draft.model.embed_tokens.weight.data[:target_embed.shape[0]] = target_embed
    positions = torch.arange(S).repeat(B)
    vd = draft.config.draft_vocab_size
    logits, ids = [], input_ids
    with torch.no_grad():
        hidden = draft.combine_hidden_states(aux.reshape(B * S, -1))
        for j in range(ttt_length):
            ids = torch.cat([ids[:, 1:], torch.zeros_like(ids[:, :1])], dim=1)
            normed, hidden = draft.model(ids.reshape(-1), positions + j, hidden)
            logits.append((normed @ draft.lm_head.weight[:vd].T).view(B, S, vd))
    return logits


# --- the worker process ------------------------------------------------------------------

CLIENTS = {"sglang": "SGLang 0.5.23", "speculators": "speculators 0.9.0", "vllm": "vLLM 0.34.0"}


def require(client: str) -> None:
    """Skip the calling test when ``client`` is not installed (checked without importing)."""
    if importlib.util.find_spec(client) is None:
        pytest.skip(f"{CLIENTS[client]} is not installed (README's test command installs it)")


@contextlib.contextmanager
def worker():
    """A callable ``call(name, *args)`` running ``client_oracles.<name>(*args)`` in one
    spawned process (clients imported there once), for the ``with`` block."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        yield lambda name, *args: pool.submit(_call, name, args).result()


def _call(name, args):
    torch.use_deterministic_algorithms(True)
    return globals()[name](*args)


def run_sglang(export_dir, target_embed, input_ids, aux, attention_mask, ttt_length):
    """``(per-step logits, hot_token_id)`` of SGLang's draft loaded from ``export_dir``."""
    model = sglang_draft(Path(export_dir), target_embed)
    logits = sglang_ttt_logits(model, input_ids, aux, attention_mask, ttt_length)
    return logits, model.get_hot_token_id()


def run_speculators(export_dir, input_ids, aux, attention_mask, ttt_length):
    """``(per-step logits, facts)`` of speculators' ``Eagle3DraftModel`` loaded from
    ``export_dir``; ``facts``: aux ids after ``from_pretrained``, whether fc_norm was
    built, embedding, d2t, t2d and the verifier path it names."""
    model = speculators_draft(Path(export_dir))
    logits = speculators_ttt_logits(model, input_ids, aux, attention_mask, ttt_length)
    facts = {"aux_ids": list(model.config.eagle_aux_hidden_state_layer_ids),
             "fc_norm": model.fc_norm is not None, "embed": model.embed_tokens.weight.detach(),
             "d2t": model.d2t, "t2d": model.t2d,
             "verifier": model.config.speculators_config.verifier.name_or_path}
    return logits, facts


def run_vllm(export_dir, target_vocab_size, target_embed=None, input_ids=None, aux=None,
             attention_mask=None, ttt_length=0):
    """``(parameters by name, has_own_embed_tokens, per-step logits)`` after vLLM's
    loader took the export (logits ``vllm_ttt_logits`` when inputs are given)."""
    draft = vllm_draft(Path(export_dir), target_vocab_size)
    params = {n: p.detach().clone() for n, p in draft.named_parameters()}
    own = getattr(draft, "has_own_embed_tokens", False)
    logits = (vllm_ttt_logits(draft, target_embed, input_ids, aux, attention_mask, ttt_length)
              if input_ids is not None else None)
    return params, own, logits

"""HF target backend (io/target/) on real tiny transformers models built from config.

Backbone and head are found through multimodal wrappers; the captured aux features
equal ``output_hidden_states[i + 1]`` (Qwen3-VL: plus its deepstack injection, what the
next layer reads); ``final_hidden @ lm_head.T`` is the model's logits; the draft trains
one step on the features; vocabularies of 262144 and 163840 go through capture,
teacher, loss (torch and Triton) and an optimizer step; nested submodules are replaced
by name. Every equivalence carries a negative control that the same check catches.
"""

import functools

import pytest
import torch
from torch import nn
from transformers import (
    CohereConfig, CohereForCausalLM, Gemma3Config, Gemma3ForCausalLM,
    Gemma3ForConditionalGeneration, Gemma3TextConfig, GraniteConfig, GraniteForCausalLM,
    Kimi_K25Config, Kimi_K25ForConditionalGeneration, LlamaConfig, LlamaForCausalLM, LlavaConfig,
    LlavaForConditionalGeneration, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration,
    Qwen2VLConfig, Qwen2VLForConditionalGeneration, Qwen3Config, Qwen3ForCausalLM, Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
)

import eagle3fn.io.target as target_module
from eagle3fn import build_rowmap, build_vocab_map, count_tokens, supervised_mask
from eagle3fn.draft import DraftConfig, init_params
from eagle3fn.io.target import (
    default_aux_layer_ids, find_backbone_attr, find_lm_head, find_text_backbone, load_target,
    replace_submodules, target_features, validate_aux_layer_ids,
)
from eagle3fn.teacher import teacher_table_from_hidden, teacher_table_from_logits
from eagle3fn.unrolled import TTTConfig, ttt

V, H, N, B, S = 128, 32, 4, 2, 16
AUX = (0, 1, 2)
IMAGE, VIDEO, START, END = V - 1, V - 2, V - 3, V - 4
TEXT = dict(vocab_size=V, hidden_size=H, intermediate_size=64, num_hidden_layers=N,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=128,
            bos_token_id=0, eos_token_id=1, pad_token_id=2)
QWEN_TEXT = dict(TEXT, rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                                            mrope_section=[1, 1, 2]))
QWEN_IDS = dict(image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START,
                vision_end_token_id=END)
QWEN_VISION = dict(depth=1, num_heads=2, patch_size=2, temporal_patch_size=2, spatial_merge_size=2,
                   in_channels=3)

BUILD = {
    "llama": lambda: LlamaForCausalLM(LlamaConfig(**TEXT)),
    "qwen3": lambda: Qwen3ForCausalLM(Qwen3Config(**TEXT)),
    "gemma3-text": lambda: Gemma3ForCausalLM(Gemma3TextConfig(**TEXT)),
    "llava": lambda: LlavaForConditionalGeneration(LlavaConfig(
        text_config=dict(TEXT, model_type="llama"),
        vision_config=dict(model_type="clip_vision_model", hidden_size=16, intermediate_size=32,
                           num_hidden_layers=1, num_attention_heads=2, image_size=8, patch_size=4),
        image_token_index=IMAGE, image_seq_length=4, vision_feature_layer=-1)),
    "qwen2-vl": lambda: Qwen2VLForConditionalGeneration(Qwen2VLConfig(
        text_config=QWEN_TEXT, vision_config=dict(QWEN_VISION, embed_dim=16, hidden_size=H, mlp_ratio=2),
        **QWEN_IDS)),
    "qwen2.5-vl": lambda: Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(
        text_config=QWEN_TEXT, vision_config=dict(QWEN_VISION, hidden_size=16, out_hidden_size=H,
                                                  intermediate_size=32, window_size=8,
                                                  fullatt_block_indexes=[0]),
        **QWEN_IDS)),
    "qwen3-vl": lambda: Qwen3VLForConditionalGeneration(Qwen3VLConfig(
        text_config=QWEN_TEXT,
        vision_config=dict(QWEN_VISION, depth=2, hidden_size=16, out_hidden_size=H, intermediate_size=32,
                           num_position_embeddings=16, deepstack_visual_indexes=[0, 1]),
        **QWEN_IDS)),
    "gemma3": lambda: Gemma3ForConditionalGeneration(Gemma3Config(
        text_config=TEXT, vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                             num_attention_heads=2, image_size=16, patch_size=4),
        mm_tokens_per_image=4, boi_token_index=START, eoi_token_index=END, image_token_index=IMAGE)),
}
VLMS = ("llava", "qwen2-vl", "qwen2.5-vl", "qwen3-vl", "gemma3")
CASES = [(k, False) for k in BUILD] + [(k, True) for k in VLMS]


def build(kind):
    torch.manual_seed(0)
    model = BUILD[kind]().eval()
    if kind == "gemma3":  # its image projection starts at zero: images would change nothing
        nn.init.normal_(model.model.multi_modal_projector.mm_input_projection_weight, std=0.5)
    return model


@functools.lru_cache(maxsize=None)
def target(kind):
    """One frozen target per kind for the whole module (tests must not mutate it)."""
    return load_target(build(kind), aux_layer_ids=AUX)


def inputs(kind, image, pixel_scale=1.0):
    """Right-padded ids [B, S] (sample 1 has 12 tokens); with ``image``, one image of 4
    placeholder tokens at positions 2..5 of sample 0, plus the model's image inputs."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, V - 8, (B, S), generator=g)
    attention = torch.ones(B, S, dtype=torch.long)
    attention[1, 12:] = 0
    extra = {}
    if image:
        ids[0, 1], ids[0, 2:6], ids[0, 6] = START, IMAGE, END
        if kind == "llava":
            extra = dict(pixel_values=torch.randn(1, 3, 8, 8, generator=g))
        elif kind == "gemma3":
            extra = dict(pixel_values=torch.randn(1, 3, 16, 16, generator=g),
                         token_type_ids=(ids == IMAGE).long())
        else:  # Qwen-VL: 4x4 patches of 2x2x2 pixels, merged 2x2 -> 4 tokens
            extra = dict(pixel_values=torch.randn(16, 3 * 2 * 2 * 2, generator=g),
                         image_grid_thw=torch.tensor([[1, 4, 4]]),
                         mm_token_type_ids=(ids == IMAGE).long())
        extra["pixel_values"] = extra["pixel_values"] * pixel_scale
    return ids, attention, extra


def rel_err(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def reference_streams(model, ids, attention, extra):
    """HF's forward with output_hidden_states: the residual stream each layer i + 1
    reads (index i + 1, for i = -1..N-2; that is hidden_states[i + 1], plus Qwen3-VL's
    deepstack features at the image positions after layers 0..d-1), the final hidden
    (after the norm), the logits, and the stream entering the final norm."""
    pre_norm = []
    handle = find_text_backbone(model).norm.register_forward_pre_hook(
        lambda m, args: pre_norm.append(args[0]))
    try:
        with torch.no_grad():
            out = model(input_ids=ids, attention_mask=attention, output_hidden_states=True,
                        use_cache=False, **extra)
    finally:
        handle.remove()
    with torch.no_grad():
        streams = [h.clone() for h in out.hidden_states]
        if isinstance(model, Qwen3VLForConditionalGeneration) and "pixel_values" in extra:
            vision = model.model.get_image_features(extra["pixel_values"], extra["image_grid_thw"])
            for i, deep in enumerate(vision.deepstack_features):
                streams[i + 1][ids == IMAGE] += torch.cat(deep)
    return streams, out.hidden_states[-1], out.logits, pre_norm[0]


def capture_hooks(model):
    """How many of eagle3fn's capture hooks are registered anywhere in ``model`` (HF
    installs hooks of its own lazily, so only ours are counted)."""
    ours = (target_module.FeatureCapture.stream, target_module.FeatureCapture.norm)
    hooks = [h for m in model.modules()
             for h in (*m._forward_hooks.values(), *m._forward_pre_hooks.values())]
    return sum(getattr(getattr(h, "func", h), "__func__", None) in ours for h in hooks)


# -- aux layer ids ---------------------------------------------------------------------


def test_default_aux_layer_ids():
    assert default_aux_layer_ids(32) == (1, 15, 28)
    assert default_aux_layer_ids(36) == (1, 17, 32)
    assert default_aux_layer_ids(80) == (1, 39, 76)
    assert default_aux_layer_ids(7) == (1, 2, 3)
    for n in (6, 5, 4):  # (1, 2, 2), (1, 1, 1), (1, 1, 0): not three increasing layers
        with pytest.raises(ValueError, match="pass aux_layer_ids explicitly"):
            default_aux_layer_ids(n)
    with pytest.raises(ValueError, match="at least 4 decoder layers"):
        default_aux_layer_ids(3)


@pytest.mark.parametrize("ids", [(0, 1), (0, 1, 2, 3), (2, 1, 0), (0, 1, 1), (-1, 0, 1),
                                 (0, 1, 3), (0, 1, 2.0)])
def test_aux_layer_ids_rejected(ids):
    """Unordered or repeated ids would not match the serving engine's layer-order capture;
    id N-1 = 3 has no layer N to capture before."""
    with pytest.raises(ValueError, match="strictly increasing"):
        validate_aux_layer_ids(ids, N)
    assert validate_aux_layer_ids([0, 1, 2], N) == (0, 1, 2)


def test_default_ids_used_by_load_target():
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**dict(TEXT, num_hidden_layers=7))).eval()
    tm = load_target(model)
    assert tm.aux_layer_ids == (1, 2, 3) and tm.num_layers == 7
    ids, attention, _ = inputs("llama", False)
    streams, *_ = reference_streams(model, ids, attention, {})
    f = target_features(tm, ids, attention)
    for chunk, i in zip(f.aux.split(H, dim=-1), (1, 2, 3)):
        assert rel_err(chunk, streams[i + 1]) < 1e-6
        assert rel_err(chunk, streams[i]) > 1e-3  # negative control: off by one


# -- finding the backbone and the head ---------------------------------------------------


@pytest.mark.parametrize("kind", list(BUILD))
def test_backbone_and_head_found_through_wrappers(kind):
    tm = target(kind)
    m = tm.model
    want = m.model.language_model if kind in VLMS else m.model
    assert tm.backbone is want and tm.lm_head is m.lm_head
    assert (tm.num_layers, tm.hidden_size, tm.vocab_size) == (N, H, V)
    assert tm.embed_tokens.shape == (V, H)
    assert not any(p.requires_grad for p in m.parameters()) and not m.training


def test_backbone_and_head_of_an_old_style_wrapper():
    """A wrapper whose language_model is itself a causal LM (transformers 4 Llava style),
    with methods that only the backbone has."""

    class Wrapper(nn.Module):
        def __init__(self, lm):
            super().__init__()
            self.vision_tower = nn.Module()
            self.vision_tower.layers = nn.ModuleList([nn.Linear(2, 2)])  # no .norm: not a text backbone
            self.language_model = lm

    lm = build("llama")
    wrapper = Wrapper(lm)
    assert find_text_backbone(wrapper) is lm.model
    assert find_lm_head(wrapper) is lm.lm_head
    assert find_backbone_attr(wrapper, "get_input_embeddings")() is lm.model.embed_tokens
    with pytest.raises(ValueError, match="set_eagle3_layers_to_capture"):
        find_backbone_attr(wrapper, "set_eagle3_layers_to_capture")


def test_no_backbone_or_head_is_a_clear_error():
    with pytest.raises(ValueError, match=r"tried model\.model\.language_model .*model\.model"):
        find_text_backbone(nn.Sequential(nn.Linear(2, 2)))
    with pytest.raises(ValueError, match="AutoModelForCausalLM"):
        find_lm_head(build("llama").model)  # the bare decoder has no head


# -- features against output_hidden_states ------------------------------------------------


@pytest.mark.parametrize("kind,image", CASES,
                         ids=[f"{k}-{'image' if i else 'text'}" for k, i in CASES])
def test_features_equal_hf_hidden_states(kind, image):
    tm = target(kind)
    ids, attention, extra = inputs(kind, image)
    f = target_features(tm, ids, attention, **extra)
    assert capture_hooks(tm.model) == 0
    streams, last, logits, pre_norm = reference_streams(tm.model, ids, attention, extra)

    assert f.aux.shape == (B, S, 3 * H) and f.final_hidden.shape == (B, S, H)
    for chunk, i in zip(f.aux.split(H, dim=-1), AUX):
        assert rel_err(chunk, streams[i + 1]) < 1e-6
        # Negative control: an off-by-one layer in either direction is caught.
        assert rel_err(chunk, streams[i]) > 1e-3 and rel_err(chunk, streams[i + 2]) > 1e-3
    assert rel_err(f.final_hidden, last) < 1e-6
    assert rel_err(f.final_hidden, pre_norm) > 1e-3  # negative control: before the norm
    # The streamed teacher's logits are the model's logits (no softcapping, no scale).
    assert rel_err(f.final_hidden @ f.target_head.T, logits) < 1e-5
    assert rel_err(f.aux[..., -H:] @ f.target_head.T, logits) > 1e-3
    assert f.target_logits is None and f.positions is None
    assert f.input_ids is ids and f.attention_mask is attention
    assert f.target_head.data_ptr() == tm.lm_head.weight.data_ptr()  # not copied

    if image:  # the image really reaches the backbone: other pixels, other features
        other = target_features(tm, ids, attention, **inputs(kind, image, pixel_scale=-1.0)[2])
        assert rel_err(other.aux[0, 2:6], f.aux[0, 2:6]) > 1e-3
        assert rel_err(other.aux[0, :1], f.aux[0, :1]) < 1e-6  # causal: before the image


def test_qwen3_vl_deepstack_is_in_the_captured_stream():
    """After layers 0 and 1 Qwen3-VL adds deepstack visual features at the image
    positions; the next layer (and SGLang's capture) reads them, HF's
    hidden_states[i + 1] does not have them."""
    tm = target("qwen3-vl")
    ids, attention, extra = inputs("qwen3-vl", True)
    f = target_features(tm, ids, attention, **extra)
    with torch.no_grad():
        hf = tm.model(input_ids=ids, attention_mask=attention, output_hidden_states=True,
                      use_cache=False, **extra).hidden_states
    image = ids == IMAGE
    chunks = f.aux.split(H, dim=-1)
    for c, i in enumerate(AUX):
        assert rel_err(chunks[c][~image], hf[i + 1][~image]) < 1e-6
    assert rel_err(chunks[0][image], hf[1][image]) > 1e-3
    assert rel_err(chunks[1][image], hf[2][image]) > 1e-3
    assert rel_err(chunks[2][image], hf[3][image]) < 1e-6  # no deepstack after layer 2


def test_aux_is_copied_when_captured():
    """The stream is copied when layer i + 1 reads it: an in-place update of that tensor
    later in the forward does not reach the features."""
    tm = target("llama")
    ids, attention, _ = inputs("llama", False)
    clean = target_features(tm, ids, attention)
    kept = []

    def update_input_in_place(module, args, out):
        args[0].add_(1.0)

    handles = [tm.backbone.layers[1].register_forward_pre_hook(lambda m, args: kept.append(args[0])),
               tm.backbone.layers[1].register_forward_hook(update_input_in_place)]
    try:
        dirty = target_features(tm, ids, attention)
    finally:
        for h in handles:
            h.remove()
    assert torch.equal(dirty.aux, clean.aux)
    assert rel_err(kept[0], clean.aux[..., :H]) > 1e-3  # negative control: a kept reference


def test_qwen2_vl_image_needs_mm_token_type_ids_and_hooks_go_on_error():
    tm = target("qwen2-vl")
    ids, attention, extra = inputs("qwen2-vl", True)
    del extra["mm_token_type_ids"]
    during = []
    handle = tm.model.model.visual.register_forward_hook(
        lambda *_: during.append(capture_hooks(tm.model)))
    try:
        with pytest.raises(ValueError, match="mm_token_type_ids"):
            target_features(tm, ids, attention, **extra)
    finally:
        handle.remove()
    assert during == [4]  # negative control: the counter sees them while the forward runs
    assert capture_hooks(tm.model) == 0


def test_unannounced_logit_transform_is_caught():
    """A head whose output is changed after the matmul (no config field says so): the
    last-position check sees the model's logits differ from final_hidden @ lm_head.T."""
    tm = target("llama")
    ids, attention, _ = inputs("llama", False)
    handle = tm.lm_head.register_forward_hook(lambda m, a, out: out * 1.5)
    try:
        with pytest.raises(ValueError, match="differ from final_hidden"):
            target_features(tm, ids, attention)
        target_features(tm, ids, attention, check_head=False)
    finally:
        handle.remove()
    target_features(tm, ids, attention)  # negative control: the plain head passes


@pytest.mark.parametrize("field,make", [
    ("final_logit_softcapping",
     lambda: Gemma3ForCausalLM(Gemma3TextConfig(**TEXT, final_logit_softcapping=1.0))),
    ("logit_scale", lambda: CohereForCausalLM(CohereConfig(**TEXT, logit_scale=0.25))),
    ("logits_scaling", lambda: GraniteForCausalLM(GraniteConfig(**TEXT, logits_scaling=4.0))),
])
def test_logit_transforms_are_rejected(field, make):
    torch.manual_seed(0)
    model = make().eval()
    ids, attention, _ = inputs("llama", False)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=attention, output_hidden_states=True)
    # The transform is real: a teacher from final_hidden @ lm_head.T would differ.
    assert rel_err(out.hidden_states[-1] @ model.lm_head.weight.T, out.logits) > 1e-2
    with pytest.raises(ValueError, match=field):
        load_target(model, aux_layer_ids=AUX)


def test_lm_head_bias_is_rejected():
    model = build("llama")
    replace_submodules(model, lambda n, m: n == "lm_head", lambda n, m: nn.Linear(H, V, bias=True))
    with pytest.raises(ValueError, match="bias"):
        load_target(model, aux_layer_ids=AUX)


def test_bf16_target_passes_the_head_check():
    tm = load_target(build("qwen2-vl"), aux_layer_ids=AUX, dtype=torch.bfloat16)
    ids, attention, extra = inputs("qwen2-vl", True)
    f = target_features(tm, ids, attention, **extra)
    streams, *_ = reference_streams(tm.model, ids, attention, extra)
    assert f.aux.dtype == torch.bfloat16
    assert rel_err(f.aux[..., :H], streams[1]) == 0


def test_a_decoder_run_twice_is_an_error():
    class Twice(nn.Module):
        def __init__(self, lm):
            super().__init__()
            self.model, self.lm_head = lm.model, lm.lm_head
            self.lm = lm

        def forward(self, **kw):
            self.lm(**kw)
            return self.lm(**kw)

    tm = target("llama")
    twice = load_target(Twice(tm.model), aux_layer_ids=AUX)
    with pytest.raises(ValueError, match="ran 2 times"):
        target_features(twice, *inputs("llama", False)[:2])


# -- loading from a path -----------------------------------------------------------------


@pytest.mark.parametrize("kind,cls", [("llama", LlamaForCausalLM),
                                      ("qwen2-vl", Qwen2VLForConditionalGeneration)])
def test_load_target_from_a_local_path(kind, cls, tmp_path):
    target(kind).model.save_pretrained(tmp_path)
    loaded = load_target(tmp_path, aux_layer_ids=AUX)
    assert type(loaded.model) is cls
    ids, attention, extra = inputs(kind, kind != "llama")
    a = target_features(target(kind), ids, attention, **extra)
    b = target_features(loaded, ids, attention, **extra)
    assert torch.equal(a.aux, b.aux) and torch.equal(a.final_hidden, b.final_hidden)


def test_load_target_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_target(tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_target(tmp_path)
    with pytest.raises(ValueError, match="only apply when loading from a path"):
        load_target(build("llama"), aux_layer_ids=AUX, trust_remote_code=True)


# -- replacing nested submodules -----------------------------------------------------------


class Scaled(nn.Module):
    def __init__(self, inner, scale=2.0):
        super().__init__()
        self.inner, self.scale = inner, scale

    def forward(self, x):
        return self.inner(x) * self.scale


def test_replace_submodules_nested_in_a_wrapper():
    model = build("llava")
    ids, attention, _ = inputs("llava", False)
    with torch.no_grad():
        before = model(input_ids=ids, attention_mask=attention).logits
    originals = [layer.mlp.down_proj for layer in model.model.language_model.layers]
    names = replace_submodules(model, lambda n, m: n.endswith("mlp.down_proj")
                               and ".language_model." in n, lambda n, m: Scaled(m))
    assert names == [f"model.language_model.layers.{i}.mlp.down_proj" for i in range(N)]
    for name, orig in zip(names, originals):
        new = model.get_submodule(name)
        assert isinstance(new, Scaled) and new.inner is orig
    assert not any("." in key for m in model.modules() for key in m._modules)
    with torch.no_grad():
        assert rel_err(model(input_ids=ids, attention_mask=attention).logits, before) > 1e-3
    # Matches inside a replacement are left to it: a second pass over the Scaled
    # modules does not descend into them.
    again = replace_submodules(model, lambda n, m: isinstance(m, (Scaled, nn.Linear))
                               and "layers.0.mlp.down_proj" in n, lambda n, m: Scaled(m))
    assert again == ["model.language_model.layers.0.mlp.down_proj"]
    assert model.get_submodule(again[0]).inner.inner is originals[0]


def test_naive_replacement_fails_where_replace_submodules_works():
    """Negative controls: the SpecForge bug (setattr with a dotted name while iterating
    named_modules) raises, or silently leaves the real module in place."""
    model = build("llava")
    with pytest.raises(RuntimeError, match="changed size during iteration"):
        for name, m in model.named_modules():
            if name.endswith("language_model.norm"):
                setattr(model, name, Scaled(m))
    model = build("llava")
    name = "model.language_model.norm"
    setattr(model, name, Scaled(model.get_submodule(name)))
    assert not isinstance(model.get_submodule(name), Scaled)  # a stray attribute instead
    assert name in model._modules
    model = build("llava")
    assert replace_submodules(model, lambda n, m: n == name, lambda n, m: Scaled(m)) == [name]
    assert isinstance(model.get_submodule(name), Scaled)


def test_replace_submodules_keeps_shared_modules_shared():
    shared = nn.Linear(2, 2)
    root = nn.Module()
    root.a, root.b = nn.Sequential(shared), nn.Sequential(shared)
    made = []
    names = replace_submodules(root, lambda n, m: m is shared,
                               lambda n, m: made.append(n) or Scaled(m))
    assert names == ["a.0", "b.0"] and made == ["a.0"]
    assert root.a[0] is root.b[0] and root.a[0].inner is shared
    with pytest.raises(ValueError, match="root"):
        replace_submodules(root, lambda n, m: n == "", lambda n, m: m)


# -- the draft trains on the features ------------------------------------------------------


def train_one_step(tm, features, loss_mask, draft_vocab, *, k=3, loss_impl="torch"):
    """Vocab map from the batch, draft initialised from the target (embeddings, head
    rows), one TTT objective with trim="loss", backward, one AdamW step (no weight decay,
    so only a gradient moves a parameter)."""
    Ht = tm.hidden_size
    d2t, t2d = build_vocab_map(count_tokens(features.input_ids, loss_mask, tm.vocab_size), draft_vocab)
    cfg = DraftConfig(hidden_size=Ht, intermediate_size=2 * Ht, num_heads=Ht // 8, num_kv_heads=1,
                      vocab_size=tm.vocab_size, draft_vocab_size=draft_vocab, target_hidden_size=Ht)
    params = init_params(cfg, embed_tokens=tm.embed_tokens, target_lm_head=features.target_head,
                         t2d=t2d)
    before = {n: p.detach().clone() for n, p in params.items()}
    rowmap = build_rowmap(supervised_mask(loss_mask, features.attention_mask), k)
    out = ttt(params, features, rowmap, TTTConfig(draft=cfg, ttt_length=k, trim="loss",
                                                  loss_impl=loss_impl), d2t=d2t, t2d=t2d)
    out.objective.backward()
    trainable = [p for p in params.values() if p.requires_grad]
    torch.optim.AdamW(trainable, lr=1e-3, weight_decay=0.0).step()
    return out, params, before


def assert_trained(out, params, before):
    assert torch.isfinite(out.objective) and out.objective > 0
    for name, p in params.items():
        if p.requires_grad:
            assert torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name
            assert not torch.equal(p.detach(), before[name]), name
        else:
            assert p.grad is None and torch.equal(p, before[name]), name


@pytest.mark.parametrize("kind", list(BUILD))
def test_draft_trains_one_step_on_the_features(kind):
    tm = target(kind)
    image = kind in VLMS
    ids, attention, extra = inputs(kind, image)
    f = target_features(tm, ids, attention, **extra)
    loss_mask = attention.bool() & (torch.arange(S) >= 7)  # the "answer" after the image
    assert_trained(*train_one_step(tm, f, loss_mask, draft_vocab=64))


# -- large vocabularies: no special casing, no fallback ----------------------------------


def gemma3_262144():
    v = 262144
    return Gemma3ForConditionalGeneration(Gemma3Config(
        text_config=dict(TEXT, vocab_size=v, hidden_size=16, num_attention_heads=2, num_key_value_heads=1),
        vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                           num_attention_heads=2, image_size=16, patch_size=4),
        mm_tokens_per_image=4, boi_token_index=START, eoi_token_index=END, image_token_index=IMAGE))


def kimi_k25_163840():
    """Kimi-K2.5's wrapper (DeepSeek-V3 MoE text model, vocab 163840), the target of
    the SpecForge bug report."""
    return Kimi_K25ForConditionalGeneration(Kimi_K25Config(
        text_config=dict(model_type="deepseek_v3", vocab_size=163840, hidden_size=16,
                         intermediate_size=32, moe_intermediate_size=16, num_hidden_layers=N,
                         num_attention_heads=2, num_key_value_heads=2, n_routed_experts=4,
                         num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
                         kv_lora_rank=8, q_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4,
                         v_head_dim=4, n_group=1, topk_group=1, max_position_embeddings=128,
                         bos_token_id=0, eos_token_id=1, pad_token_id=2),
        vision_config=dict(patch_size=2, pos_emb_height=4, pos_emb_width=4, pos_emb_time=1,
                           num_attention_heads=2, num_hidden_layers=1, hidden_size=16,
                           intermediate_size=32),
        projection_hidden_size=16))


@pytest.mark.parametrize("make,vocab", [(gemma3_262144, 262144), (kimi_k25_163840, 163840)],
                         ids=["gemma3-262144", "kimi-k2.5-163840"])
def test_large_vocab_capture_teacher_loss_and_step(make, vocab):
    torch.manual_seed(0)
    tm = load_target(make().eval(), aux_layer_ids=AUX)
    assert tm.vocab_size == vocab and tm.backbone is tm.model.model.language_model
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(3, vocab, (B, S), generator=g)
    attention = torch.ones(B, S, dtype=torch.long)
    attention[1, 12:] = 0
    f = target_features(tm, ids, attention)
    streams, _, logits, _ = reference_streams(tm.model, ids, attention, {})
    for chunk, i in zip(f.aux.split(tm.hidden_size, dim=-1), AUX):
        assert rel_err(chunk, streams[i + 1]) < 1e-6 and rel_err(chunk, streams[i]) > 1e-3

    # Teacher: streamed from (final_hidden, lm_head) in vocab chunks == from the model's
    # logits, at the supervised positions (z'[s] = z[s + 1]).
    loss_mask = attention.bool() & (torch.arange(S) >= 10)
    rows = supervised_mask(loss_mask, attention).flatten().nonzero().flatten() + 1
    d2t, t2d = build_vocab_map(count_tokens(ids, loss_mask, vocab), vocab)
    streamed = teacher_table_from_hidden(f.final_hidden.flatten(0, 1)[rows], f.target_head, t2d)
    dense = teacher_table_from_logits(logits.flatten(0, 1)[rows], t2d)
    assert torch.equal(streamed.target_token, dense.target_token)
    assert rel_err(streamed.probs, dense.probs) < 1e-5
    shifted = teacher_table_from_logits(logits.flatten(0, 1)[rows - 1], t2d)  # negative control
    assert rel_err(shifted.probs, dense.probs) > 1e-3

    # Loss and one step with the full vocab as the draft vocab (SpecForge's Triton loss
    # stops at 131072 and falls back); the torch loss here, the Triton kernel (CPU
    # interpreter) on the 163840 case, both from the same code path.
    run = train_one_step(tm, f, loss_mask, draft_vocab=vocab, k=2)
    assert_trained(*run)
    if vocab == 163840:
        kernel = train_one_step(tm, f, loss_mask, draft_vocab=vocab, k=2, loss_impl="triton")
        assert_trained(*kernel)
        assert rel_err(kernel[0].objective.detach(), run[0].objective.detach()) < 1e-5
        for name, p in run[1].items():
            if p.requires_grad:
                assert rel_err(kernel[1][name].grad, p.grad) < 1e-4, name

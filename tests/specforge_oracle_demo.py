"""Demo: run SpecForge 0.2.0's EAGLE-3 TTT (tests/specforge_oracle.py) on a tiny
random config and cross-check it against an independent fp64 implementation of
SPEC sections 1-3 and 5 (written from the SPEC, not from SpecForge).

Run:  . .venv/bin/activate && python tests/specforge_oracle_demo.py
"""

from __future__ import annotations

import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import specforge_oracle as so  # noqa: E402  (sets TRITON_INTERPRET first)
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

CFG = dict(
    hidden_size=32,
    target_hidden_size=32,
    intermediate_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    vocab_size=96,
    draft_vocab_size=40,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    rope_scaling=None,
    max_position_embeddings=64,
)
K, B, S = 3, 2, 12
LENGTHS = [12, 8]  # sample 1 right padded


def make_inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    shapes = so.param_shapes(CFG)
    weights = {}
    for n, shp in shapes.items():
        if len(shp) == 1:
            weights[n] = 1.0 + 0.1 * torch.randn(shp, generator=g)
        else:
            weights[n] = torch.randn(shp, generator=g) / math.sqrt(shp[-1])
    weights["embed_tokens.weight"] = torch.randn(shapes["embed_tokens.weight"], generator=g)
    V, Vd, Ht = CFG["vocab_size"], CFG["draft_vocab_size"], CFG["target_hidden_size"]
    used = torch.sort(torch.randperm(V, generator=g)[:Vd]).values
    d2t = used - torch.arange(Vd)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[used] = True
    input_ids = torch.randint(1, V, (B, S), generator=g)
    attention_mask = torch.zeros(B, S, dtype=torch.long)
    loss_mask = torch.zeros(B, S, dtype=torch.long)
    for b, L in enumerate(LENGTHS):
        attention_mask[b, :L] = 1
        loss_mask[b, 2 : L - 1] = 1  # loss_mask[L-1] = 0 (SPEC parity rule)
        input_ids[b, L:] = 0
    loss_mask[0, 5] = 0
    aux = torch.randn(B, S, 3 * Ht, generator=g)
    z = 3.0 * torch.randn(B, S, V, generator=g)
    z[..., t2d] += 1.5  # most argmaxes inside the draft vocab
    z[1, 3, :] = -5.0
    z[1, 3, 1 if not t2d[1] else int((~t2d).nonzero()[0])] = 5.0  # one gated-off teacher
    z = z * attention_mask[..., None]  # pipeline: zero hidden -> zero logits at pads
    return weights, dict(
        input_ids=input_ids,
        attention_mask=attention_mask,
        loss_mask=loss_mask,
        aux_hidden=aux,
        target_logits=z,
        d2t=d2t,
        t2d=t2d,
    )


# ---------------- independent fp64 reference (SPEC 1-3, 5) -----------------
def _rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x, pos, theta, hd):
    inv = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    fr = pos[..., None].double() * inv  # [B,S,hd/2]
    emb = torch.cat((fr, fr), -1)[:, None]  # [B,1,S,hd]
    x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
    return x * emb.cos() + torch.cat((-x2, x1), -1) * emb.sin()


def reference(weights, inp, k):
    W = {n: t.double() for n, t in weights.items()}
    eps, theta = CFG["rms_norm_eps"], CFG["rope_theta"]
    nh, nkv, hd = CFG["num_attention_heads"], CFG["num_key_value_heads"], CFG["head_dim"]
    ids, am, m = inp["input_ids"], inp["attention_mask"].bool(), inp["loss_mask"].double()
    z, a, d2t, t2d = inp["target_logits"].double(), inp["aux_hidden"].double(), inp["d2t"], inp["t2d"]
    Bn, Sn = ids.shape
    ids_s = torch.cat([ids[:, 1:], torch.zeros_like(ids[:, :1])], 1)
    z_s = torch.cat([z[:, 1:], torch.zeros_like(z[:, :1])], 1)
    tok = z_s.argmax(-1)
    gate = t2d[tok].double() * m  # position_mask (m unshifted)
    probs = torch.softmax(z_s[..., t2d], -1)
    pod = torch.exp(z_s[..., t2d] - torch.logsumexp(z_s, -1, keepdim=True))
    pos = torch.arange(Sn).expand(Bn, Sn)
    causal = torch.tril(torch.ones(Sn, Sn, dtype=torch.bool))
    allowed0 = causal[None] & am[:, None, :]  # key padding masked, queries not
    g = a @ W["fc.weight"].T
    rep = nh // nkv
    keys, vals = [], []
    out_l, acc_l, acr_l, logits_l = [], [], [], []

    def sh(x, j):  # row p reads x[p + j], zero beyond S
        if j == 0:
            return x
        pad = torch.zeros_like(x[:, :j])
        return torch.cat([x[:, j:], pad], 1)

    for j in range(k):
        e = W["embed_tokens.weight"][sh(ids_s, j)]
        u = torch.cat(
            [_rms(e, W["midlayer.input_layernorm.weight"], eps),
             _rms(g, W["midlayer.hidden_norm.weight"], eps)], -1)
        q = (u @ W["midlayer.self_attn.q_proj.weight"].T).view(Bn, Sn, nh, hd).transpose(1, 2)
        kk = (u @ W["midlayer.self_attn.k_proj.weight"].T).view(Bn, Sn, nkv, hd).transpose(1, 2)
        vv = (u @ W["midlayer.self_attn.v_proj.weight"].T).view(Bn, Sn, nkv, hd).transpose(1, 2)
        q, kk = _rope(q, pos + j, theta, hd), _rope(kk, pos + j, theta, hd)
        kk, vv = kk.repeat_interleave(rep, 1), vv.repeat_interleave(rep, 1)
        keys.append(kk)
        vals.append(vv)
        s0 = (q @ keys[0].transpose(-1, -2)) / math.sqrt(hd)
        s0 = s0.masked_fill(~allowed0[:, None], float("-inf"))
        diag = [(q * keys[i]).sum(-1, keepdim=True) / math.sqrt(hd) for i in range(1, j + 1)]
        p = torch.softmax(torch.cat([s0] + diag, -1), -1)
        o = p[..., :Sn] @ vals[0]
        for i in range(1, j + 1):
            o = o + p[..., Sn + i - 1 : Sn + i] * vals[i]
        o = o.transpose(1, 2).reshape(Bn, Sn, nh * hd) @ W["midlayer.self_attn.o_proj.weight"].T
        r = g + o
        h = _rms(r, W["midlayer.post_attention_layernorm.weight"], eps)
        mlp = (F.silu(h @ W["midlayer.mlp.gate_proj.weight"].T) * (h @ W["midlayer.mlp.up_proj.weight"].T)) @ W["midlayer.mlp.down_proj.weight"].T
        out = r + mlp
        logits = _rms(out, W["norm.weight"], eps) @ W["lm_head.weight"].T
        gj, pj, podj, tokj, mj = sh(gate, j), sh(probs, j), sh(pod, j), sh(tok, j), sh(m, j)
        lsm = torch.log_softmax(logits, -1)
        loss = (gj * -(pj * lsm).sum(-1)).sum() / (Bn * Sn)
        pred = logits.argmax(-1)
        acc = ((pred + d2t[pred] == tokj).double() * mj).sum() / mj.sum().clamp_min(1e-6)
        acr = (gj * torch.minimum(podj, torch.softmax(logits, -1)).sum(-1)).sum() / gj.sum().clamp_min(1e-8)
        out_l.append(loss)
        acc_l.append(acc)
        acr_l.append(acr)
        logits_l.append(logits)
        g = out
    return out_l, acc_l, acr_l, logits_l


def main():
    weights, inp = make_inputs()
    res = so.specforge_ttt(weights, CFG, ttt_length=K, **inp)
    print("SpecForge OnlineEagle3Model (sdpa, fp32, CPU), k =", K, "B =", B, "S =", S)
    for j in range(K):
        print(
            f"  step {j}: ploss={res['plosses'][j].item():.7f} "
            f"acc={res['acces'][j].item():.4f} "
            f"accept={res['acceptance_rates'][j].item():.4f}"
        )
    print(f"  objective={res['objective'].item():.7f}")
    print("grads (trainable parameters):")
    for n, gr in res["grads"].items():
        print(f"  {n:42s} {tuple(gr.shape)}  |g|max={gr.abs().max().item():.3e}")

    # independent fp64 reference
    W64 = {n: t.detach().double().requires_grad_(n != "embed_tokens.weight") for n, t in weights.items()}
    losses, accs, acrs, logits = reference(W64, inp, K)
    sum(0.8**j * losses[j] for j in range(K)).backward()
    worst = 0.0
    for j in range(K):
        dl = abs(res["plosses"][j].item() - losses[j].item()) / abs(losses[j].item())
        dlg = (res["logits"][j].double() - logits[j]).abs().max().item()
        print(
            f"  ref step {j}: ploss={losses[j].item():.7f} acc={accs[j].item():.4f} "
            f"accept={acrs[j].item():.4f}  rel.dloss={dl:.1e} max|dlogits|={dlg:.1e}"
        )
        assert abs(res["acces"][j].item() - accs[j].item()) < 1e-6
        assert abs(res["acceptance_rates"][j].item() - acrs[j].item()) < 1e-5
        worst = max(worst, dl)
    gerr = 0.0
    for n, gr in res["grads"].items():
        ref = W64[n].grad
        gerr = max(gerr, ((gr.double() - ref).abs().max() / ref.abs().max()).item())
    print(f"max rel loss err={worst:.2e}  max grad err (maxabs/maxabs)={gerr:.2e}")
    assert worst < 1e-5 and gerr < 1e-4, "SpecForge disagrees with SPEC reference"
    print("OK: SpecForge matches the independent SPEC reference")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Makes tiny random DeepSeek-V3 checkpoints and their transformers fp32 goldens (the layout of
scripts/gen_arch_goldens.py: input_ids, logits, hidden_states.0..L):

  deepseekv3-fp8-tiny      q LoRA, YaRN (mscale != mscale_all_dim, so both the cos/sin factor and
                           the attention scale change), rope_interleave, 3 layers with
                           first_k_dense_replace = 1, 16 experts in 4 groups (topk_group 2), one
                           shared expert; every decoder Linear but the routers block-quantized to
                           FP8 E4M3 ([32, 32] blocks, partial ones at the edges: kv_a_proj_with_mqa
                           has 40 rows, the dense MLP 80), config quantization_config {quant_method
                           fp8, weight_block_size [32, 32]}; its golden is transformers' fp32 model
                           on the dequantized weights
  deepseekv3-tiny          the same model unquantized: the FP8 weights dequantized (F32; the rest
                           BF16 as saved), so deepseekv3-fp8-tiny.golden.safetensors is its golden
                           too, plus an MTP layer's tensors (model.layers.3.*: embed_tokens, enorm,
                           hnorm, eh_proj, shared_head.norm/head and a whole MoE decoder layer,
                           deterministic values) appended as real releases carry them; config
                           num_nextn_predict_layers 1. Derived without torch, so
                               python3 scripts/gen_deepseek_goldens.py --derive OUT_DIR
                           remakes it from OUT_DIR/deepseekv3-fp8-tiny anywhere.
  deepseekv3-noqlora-tiny  q_lora_rank null (plain q_proj), no RoPE scaling, rope_interleave false,
                           one expert group, 8 experts top-2

Run where PyTorch + transformers (>= 5, DeepseekV3ForCausalLM) are installed, CPU, fp32:
    python3 scripts/gen_deepseek_goldens.py OUT_DIR
(8 files: what one device call brings back). Routers are drawn until every top-k and group choice
of the golden input has a margin of at least 2e-4 (sigmoid scores), and the selection bias is
positive.
"""
import json, math, os, struct, sys

E4M3_NAN = 0x7F


def e4m3_value(b):
    s = -1.0 if b & 0x80 else 1.0
    e, m = (b >> 3) & 15, b & 7
    if (b & 0x7F) == E4M3_NAN:
        return float("nan")
    return s * (m / 8.0) * 2.0 ** -6 if e == 0 else s * (1 + m / 8.0) * 2.0 ** (e - 7)


def st_read(path):
    with open(path, "rb") as f:
        raw = f.read()
    n = struct.unpack("<Q", raw[:8])[0]
    head = json.loads(raw[8:8 + n])
    head.pop("__metadata__", None)
    return {k: (v["dtype"], v["shape"], raw[8 + n + v["data_offsets"][0]:8 + n + v["data_offsets"][1]])
            for k, v in head.items()}


def st_write(path, tensors):
    head, off, blobs = {}, 0, []
    for k in sorted(tensors):
        dt, shp, data = tensors[k]
        head[k] = {"dtype": dt, "shape": list(shp), "data_offsets": [off, off + len(data)]}
        blobs.append(data)
        off += len(data)
    head["__metadata__"] = {"format": "pt"}
    h = json.dumps(head, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def bf16_bytes(vals):
    out = bytearray()
    for v in vals:
        u = struct.unpack("<I", struct.pack("<f", v))[0]
        u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16   # round to nearest even
        out += struct.pack("<H", u & 0xFFFF)
    return bytes(out)


def derive(out_root):
    """deepseekv3-tiny from deepseekv3-fp8-tiny: each FP8 weight times its block scale as one
    fp32 product (what transformers ran on), then the MTP layer."""
    src = os.path.join(out_root, "deepseekv3-fp8-tiny")
    dst = os.path.join(out_root, "deepseekv3-tiny")
    os.makedirs(dst, exist_ok=True)
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    br, bc = cfg.pop("quantization_config")["weight_block_size"]
    cfg["num_nextn_predict_layers"] = 1
    t = st_read(os.path.join(src, "model.safetensors"))
    out = {}
    for k, (dt, shp, data) in t.items():
        if k.endswith("_scale_inv"):
            continue
        if dt != "F8_E4M3":
            out[k] = (dt, shp, data)
            continue
        sdt, sshp, sdata = t[k + "_scale_inv"]
        assert sdt == "F32"
        R, C = shp
        nbc = sshp[1]
        sc = struct.unpack("<%df" % (sshp[0] * nbc), sdata)
        vals = [e4m3_value(data[r * C + c]) * sc[(r // br) * nbc + c // bc]
                for r in range(R) for c in range(C)]
        out[k] = ("F32", shp, struct.pack("<%df" % len(vals), *vals))
    # the MTP layer (layer L = num_hidden_layers): layer L-1's tensors with other values, and
    # the MTP-only tensors; a 32-bit LCG gives values in [-0.1, 0.1) (norms 1 +- 0.1)
    L, H, V = cfg["num_hidden_layers"], cfg["hidden_size"], cfg["vocab_size"]
    state = [12345]

    def rnd(n, base):
        vals = []
        for _ in range(n):
            state[0] = (state[0] * 1664525 + 1013904223) & 0xFFFFFFFF
            vals.append(base + 0.2 * (state[0] / 2.0 ** 32 - 0.5))
        return vals

    shapes = {}
    for k, (dt, shp, data) in t.items():
        if k.startswith(f"model.layers.{L - 1}.") and not k.endswith("_scale_inv"):
            shapes[k.replace(f"model.layers.{L - 1}.", f"model.layers.{L}.", 1)] = shp
    for k, shp in {"embed_tokens.weight": [V, H], "enorm.weight": [H], "hnorm.weight": [H],
                   "eh_proj.weight": [H, 2 * H], "shared_head.norm.weight": [H],
                   "shared_head.head.weight": [V, H]}.items():
        shapes[f"model.layers.{L}.{k}"] = shp
    for k in sorted(shapes):
        n = 1
        for d in shapes[k]:
            n *= d
        norm = k.endswith("norm.weight")
        out[k] = ("BF16", shapes[k], bf16_bytes(rnd(n, 1.0 if norm else 0.0)))
    st_write(os.path.join(dst, "model.safetensors"), out)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    print("derived", dst, len(out), "tensors")


if sys.argv[1] == "--derive":
    derive(sys.argv[2])
    sys.exit(0)

import torch
import transformers
from safetensors.torch import save_file, load_file

out_root = sys.argv[1]
os.makedirs(out_root, exist_ok=True)
T_GOLDEN = 32
V = 4096


def base_cfg(**kw):
    c = dict(vocab_size=V, hidden_size=64, intermediate_size=80, moe_intermediate_size=32,
             num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
             n_shared_experts=1, n_routed_experts=16, routed_scaling_factor=2.5,
             kv_lora_rank=32, q_lora_rank=64, qk_rope_head_dim=8, v_head_dim=16,
             qk_nope_head_dim=16, n_group=4, topk_group=2, num_experts_per_tok=3,
             first_k_dense_replace=1, norm_topk_prob=True, max_position_embeddings=1024,
             rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=0, tie_word_embeddings=False,
             rope_interleave=True, attention_bias=False)
    c.update(kw)
    return c


def make_config(rope, **kw):
    c = base_cfg(**kw)
    try:
        cfg = transformers.DeepseekV3Config(rope_parameters=rope, **c)
    except TypeError:
        cfg = transformers.DeepseekV3Config(rope_scaling=rope, **c)
    return cfg


YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=256,
            beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=0.8)
PLAIN = dict(rope_type="default", rope_theta=10000.0)


def randomize(model, router_scale):
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.08)
            if name.endswith("mlp.gate.weight"):
                p.mul_(router_scale)
        for mod in model.modules():
            b = getattr(mod, "e_score_correction_bias", None)
            if isinstance(b, torch.Tensor):
                b.copy_(0.05 + 0.1 * torch.rand_like(b))


def routing_margin(model, cfg, ids):
    """Smallest gap, over the golden input, between the last chosen and the first rejected
    score of every top-k and group choice (transformers' own routing recomputed from the
    router inputs captured by hooks)."""
    caught = []
    hooks = []
    for layer in model.model.layers:
        if hasattr(layer.mlp, "gate") and hasattr(layer.mlp.gate, "e_score_correction_bias"):
            # the router's logits recomputed from its input (the gate returns logits, or, in
            # newer transformers, (logits, weights, indices))
            hooks.append(layer.mlp.gate.register_forward_hook(
                lambda mod, inp, out: caught.append((torch.nn.functional.linear(
                    inp[0].detach().reshape(-1, mod.weight.shape[1]).float(),
                    mod.weight.float()), mod))))
    with torch.no_grad():
        model(ids)
    for h in hooks:
        h.remove()
    E, G, TG, K = cfg.n_routed_experts, cfg.n_group, cfg.topk_group, cfg.num_experts_per_tok
    worst = 1.0
    for logits, mod in caught:
        s = logits.sigmoid() + mod.e_score_correction_bias.float()
        gs = s.view(-1, G, E // G).topk(2, dim=-1)[0].sum(-1)
        if TG < G:
            srt = gs.sort(dim=-1, descending=True)[0]
            worst = min(worst, float((srt[:, TG - 1] - srt[:, TG]).min()))
        idx = gs.topk(TG, dim=-1)[1]
        mask = torch.zeros_like(gs).scatter_(1, idx, 1).bool()
        m = mask.unsqueeze(-1).expand(-1, G, E // G).reshape(-1, E)
        cand = s.masked_fill(~m, -1.0).sort(dim=-1, descending=True)[0]
        worst = min(worst, float((cand[:, K - 1] - cand[:, K]).min()))
    return worst


def golden(model, ids, path):
    model.eval()
    with torch.no_grad():
        o = model(ids, output_hidden_states=True)
    t = {"input_ids": ids[0].to(torch.int32).contiguous(), "logits": o.logits[0].float().contiguous()}
    for i, h in enumerate(o.hidden_states):
        t[f"hidden_states.{i}"] = h[0].float().contiguous()
    save_file(t, path)
    return o.logits[0].float()


def build(name, cfg, router_scale, ids, seed):
    best = None
    for attempt in range(60):
        torch.manual_seed(seed + attempt)
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        randomize(model, router_scale)
        # the margins of the bf16 weights the checkpoint will hold
        model = model.to(torch.bfloat16).to(torch.float32)
        marg = routing_margin(model, cfg, ids)
        if best is None or marg > best[0]:
            best = (marg, seed + attempt, model)
        if marg >= 2e-4:
            break
    print(name, "seed", best[1], "routing margin", best[0])
    return best[2]


def save(model, d):
    os.makedirs(d, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(d)
    model.to(torch.float32)


def reload_golden(d, ids, gpath):
    ref = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    return golden(ref, ids, gpath), ref


g = torch.Generator().manual_seed(7)
ids = torch.randint(2, V, (1, T_GOLDEN), generator=g)

# ---- the BF16 model behind deepseekv3-fp8-tiny and deepseekv3-tiny -----------------------------
import shutil
cfg = make_config(YARN, num_nextn_predict_layers=1)
d = os.path.join(out_root, "_bf16")
model = build("deepseekv3-tiny", cfg, 3.0, ids, 100)
save(model, d)
ref = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
print("deepseekv3-tiny scaling", ref.model.layers[0].self_attn.scaling,
      "attention_scaling", getattr(ref.model.rotary_emb, "attention_scaling", None))
plain_state = load_file(os.path.join(d, "model.safetensors"))
print("deepseekv3-tiny keys", sorted(plain_state)[:6], "...", len(plain_state))

# ---- deepseekv3-noqlora-tiny -----------------------------------------------------------------
cfg2 = make_config(PLAIN, q_lora_rank=None, num_hidden_layers=2, n_group=1, topk_group=1,
                   rope_interleave=False, n_routed_experts=8, num_experts_per_tok=2,
                   routed_scaling_factor=1.5)
d2 = os.path.join(out_root, "deepseekv3-noqlora-tiny")
model2 = build("deepseekv3-noqlora-tiny", cfg2, 3.0, ids, 300)
save(model2, d2)
if os.path.exists(os.path.join(d2, "generation_config.json")):
    os.remove(os.path.join(d2, "generation_config.json"))
reload_golden(d2, ids, os.path.join(out_root, "deepseekv3-noqlora-tiny.golden.safetensors"))

# ---- deepseekv3-fp8-tiny ---------------------------------------------------------------------
BR, BC = 32, 32
fd = os.path.join(out_root, "deepseekv3-fp8-tiny")
os.makedirs(fd, exist_ok=True)
fp8_state, deq = {}, {}
for k, v in plain_state.items():
    quant = (k.startswith("model.layers.") and k.endswith(".weight") and v.dim() == 2
             and not k.endswith("mlp.gate.weight"))
    if not quant:
        fp8_state[k] = v
        continue
    w = v.float()
    R, C = w.shape
    nbr, nbc = (R + BR - 1) // BR, (C + BC - 1) // BC
    s = torch.zeros(nbr, nbc)
    q32 = torch.zeros(R, C)
    for i in range(nbr):
        for j in range(nbc):
            blk = w[i * BR:(i + 1) * BR, j * BC:(j + 1) * BC]
            amax = float(blk.abs().max())
            sc = amax / 448.0 if amax > 0 else 1.0
            s[i, j] = sc
            q32[i * BR:(i + 1) * BR, j * BC:(j + 1) * BC] = \
                (blk / sc).clamp(-448, 448).to(torch.float8_e4m3fn).float()
    q = q32.to(torch.float8_e4m3fn)   # exact: every value is an E4M3 number already
    fp8_state[k] = q
    fp8_state[k + "_scale_inv"] = s
    full = s.repeat_interleave(BR, 0)[:R].repeat_interleave(BC, 1)[:, :C]
    deq[k] = q.float() * full
save_file(fp8_state, os.path.join(fd, "model.safetensors"), metadata={"format": "pt"})
with open(os.path.join(d, "config.json")) as f:
    c8 = json.load(f)
c8.pop("num_nextn_predict_layers", None)
c8["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                             "weight_block_size": [BR, BC]}
with open(os.path.join(fd, "config.json"), "w") as f:
    json.dump(c8, f, indent=2)
# the dequantized weights as an fp32 checkpoint in the hub layout, loaded as a user would
tmp = os.path.join(out_root, "_fp8_dequantized")
os.makedirs(tmp, exist_ok=True)
dq_state = {k: (deq[k] if k in deq else v.float()) for k, v in plain_state.items()}
save_file(dq_state, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
c32 = dict(c8)
c32.pop("quantization_config")
with open(os.path.join(tmp, "config.json"), "w") as f:
    json.dump(c32, f, indent=2)
ref8 = transformers.AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32)
golden(ref8, ids, os.path.join(out_root, "deepseekv3-fp8-tiny.golden.safetensors"))
print("deepseekv3-fp8-tiny: FP8 tensors", len(deq))
shutil.rmtree(tmp)
shutil.rmtree(d)
derive(out_root)

for n in sorted(os.listdir(out_root)):
    p = os.path.join(out_root, n)
    if os.path.isdir(p):
        print(n, sorted(os.listdir(p)), sum(os.path.getsize(os.path.join(p, x)) for x in os.listdir(p)))
    else:
        print(n, os.path.getsize(p))
print("transformers", transformers.__version__, "torch", torch.__version__)

#!/usr/bin/env python3
"""Cross-check a quantized checkpoint written by moeq against transformers (a manual check, run
where torch + transformers are installed; not part of ctest).

Reads CKPT_DIR (compressed-tensors nvfp4-pack-quantized / pack-quantized INT4, ModelOpt NVFP4 or
GPTQ v1), dequantizes every quantized Linear with its own, independent reading of the formats
(../shared/docs/formats.md §2, written from the spec, not from moeq's C code), writes the result as
a plain fp32 checkpoint with the hub's tensor names, lets transformers load that with its own
model code, and prints the log-likelihood of the token ids in IDS_JSON (one window, conditioned on
the prefix token). `moeq eval CKPT_DIR --task text --data FILE --dequantize --json` on the text
those ids came from must give the same log-likelihood to about 1e-6 relative.

usage: verify_with_transformers.py CKPT_DIR IDS_JSON [--prefix ID]   (no CKPT_DIR quantization:
       the unquantized model itself)
"""
import argparse
import json
import os
import shutil
import sys
import tempfile

import torch
from safetensors import safe_open
from safetensors.torch import save_file

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def load_tensors(d):
    names = {}
    index = os.path.join(d, "model.safetensors.index.json")
    files = sorted(set(json.load(open(index))["weight_map"].values())) if os.path.exists(index) \
        else ["model.safetensors"]
    for f in files:
        with safe_open(os.path.join(d, f), framework="pt") as h:
            for k in h.keys():
                names[k] = h.get_tensor(k)
    return names


def fp4_unpack(packed):
    """U8 [N, K/2] -> E2M1 values [N, K], the even column in the low nibble."""
    p = packed.to(torch.int64)
    codes = torch.stack([p & 15, p >> 4], dim=-1).reshape(p.shape[0], -1)
    mag = E2M1[codes & 7]
    return torch.where(codes >= 8, -mag, mag)


def nvfp4(packed, scale, mul):
    v = fp4_unpack(packed)
    s = scale.float().repeat_interleave(16, dim=1)
    return v * s * mul


def nibbles(words, n, dim):
    """The 8 4-bit fields of each int32 along dim, field j = bits [4j, 4j+4), as int64 in 0..15."""
    w = words.to(torch.int64)
    parts = [(w >> (4 * j)) & 15 for j in range(8)]
    out = torch.stack(parts, dim=dim + 1).flatten(dim, dim + 1)
    return out.narrow(dim, 0, n)


def ct_int4(t, p, wcfg):
    N, K = [int(x) for x in t[p + ".weight_shape"].tolist()]
    u = nibbles(t[p + ".weight_packed"], K, 1)                     # [N, K], q + 8
    scale = t[p + ".weight_scale"].float()                          # [N, G]
    G = scale.shape[1]
    gs = K // G
    g_idx = t.get(p + ".weight_g_idx")
    g = g_idx.to(torch.int64) if g_idx is not None else torch.arange(K) // gs
    if wcfg.get("symmetric", True):
        zu = torch.full((N, G), 8, dtype=torch.int64)
    else:
        zu = nibbles(t[p + ".weight_zero_point"], N, 0)             # [N, G], zp + 8
    return scale[:, g] * (u - zu[:, g]).float()


def gptq_v1(t, p):
    scales = t[p + ".scales"].float()                               # [G, N]
    G, N = scales.shape
    q = nibbles(t[p + ".qweight"], t[p + ".g_idx"].shape[0], 0)     # [K, N]
    z = nibbles(t[p + ".qzeros"], N, 1) + 1                         # [G, N], v1 stores zero - 1
    g = t[p + ".g_idx"].to(torch.int64)
    return (scales[g, :] * (q - z[g, :]).float()).t().contiguous()  # [N, K]


def dequantize(ckpt):
    cfg = json.load(open(os.path.join(ckpt, "config.json")))
    qc = cfg.pop("quantization_config", None)
    if qc is None and os.path.exists(os.path.join(ckpt, "hf_quant_config.json")):
        qc = {"quant_method": "modelopt"}
    t = load_tensors(ckpt)
    out = {}
    method = qc["quant_method"] if qc else None
    for k, v in t.items():
        if method == "compressed-tensors" and k.endswith(".weight_packed"):
            p = k[: -len(".weight_packed")]
            if qc["format"] == "nvfp4-pack-quantized":
                out[p + ".weight"] = nvfp4(v, t[p + ".weight_scale"], 1.0 / t[p + ".weight_global_scale"].float())
            else:
                wcfg = qc["config_groups"]["group_0"]["weights"]
                out[p + ".weight"] = ct_int4(t, p, wcfg)
        elif method == "modelopt" and k.endswith(".weight_scale_2"):
            p = k[: -len(".weight_scale_2")]
            out[p + ".weight"] = nvfp4(t[p + ".weight"], t[p + ".weight_scale"], v.float())
        elif method == "gptq" and k.endswith(".qweight"):
            p = k[: -len(".qweight")]
            out[p + ".weight"] = gptq_v1(t, p)
    for k, v in t.items():   # everything not part of a quantized Linear stays as it is
        p = k.rsplit(".", 1)[0]
        if p + ".weight" in out and k != p + ".bias":
            continue
        out[k] = v.float()
    return cfg, {k: v.float().contiguous() for k, v in out.items()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("ckpt")
    ap.add_argument("ids")
    ap.add_argument("--prefix", type=int, default=0)
    a = ap.parse_args()
    from transformers import AutoModelForCausalLM
    cfg, tensors = dequantize(a.ckpt)
    tmp = tempfile.mkdtemp()
    try:
        json.dump(cfg, open(os.path.join(tmp, "config.json"), "w"))
        save_file(tensors, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        model = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32)
    finally:
        shutil.rmtree(tmp)
    model.eval()
    ids = json.load(open(a.ids))
    x = torch.tensor([[a.prefix] + ids])
    with torch.no_grad():
        logits = model(x).logits[0, :-1].double()
    ll = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(ids).unsqueeze(1)).sum().item()
    print(json.dumps({"checkpoint": a.ckpt, "tokens": len(ids), "loglikelihood": ll}))


if __name__ == "__main__":
    sys.exit(main())

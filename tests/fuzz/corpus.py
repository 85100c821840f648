#!/usr/bin/env python3
"""Seed corpora of the libFuzzer targets (tests/fuzz/fuzz_*.c), made from the fixtures.

    python3 tests/fuzz/corpus.py --cli build/moeq --out CORPUS [TARGET ...]

writes CORPUS/<target>/<seed> for each target (all by default). Every seed is small (a few KiB:
the targets run with -max_len 8192 or so) and made from what the repository holds: the bundled
olmoe-tiny (its tokenizer, config), the configs and safetensors of tests/data, the Kimi tiktoken
fixture, data/demo-*.txt, and a one-layer model that `moeq bench gen-model` writes and `moeq
quantize` turns into each checkpoint layout (compressed-tensors NVFP4 and INT4 with zero points and
g_idx, ModelOpt, GPTQ v1, GGUF). The shared fixtures (../shared) are read where present (their
configs) but nothing of their text is written. Nothing here is committed: CI and the replay tests
make the corpus afresh.
"""
import argparse
import gzip
import json
import math
import os
import struct
import subprocess
import sys
import tempfile

SEP = b"\n--moeq-fuzz-next-file--\n"   # fuzz_common.h's FUZZ_SEP
HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))


def put(out, target, name, data):
    d = os.path.join(out, target)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "wb") as f:
        f.write(data if isinstance(data, bytes) else data.encode())


def read(path):
    with open(path, "rb") as f:
        return f.read()


# ---- safetensors ---------------------------------------------------------------------------------

def st_read(path):
    raw = read(path)
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    meta = header.pop("__metadata__", None)
    body = raw[8 + n:]
    tensors = {k: (v["dtype"], v["shape"], body[v["data_offsets"][0]:v["data_offsets"][1]])
               for k, v in header.items()}
    return meta, tensors


def st_write(tensors, meta=None):
    header, off, body = {}, 0, b""
    if meta is not None:
        header["__metadata__"] = meta
    for name, (dtype, shape, data) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [off, off + len(data)]}
        off += len(data)
        body += data
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    return struct.pack("<Q", len(h)) + h + body


def module_of(tensors, module):
    return {k: v for k, v in tensors.items() if k.startswith(module + ".")}


# ---- GGUF (v3; only what a seed needs: the header, KVs with arrays cut short, small tensors) ------

GGUF_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


def gguf_value(raw, at, t):
    if t in GGUF_SCALAR:
        fmt = GGUF_SCALAR[t]
        return struct.unpack_from(fmt, raw, at)[0], at + struct.calcsize(fmt)
    if t == 8:
        n = struct.unpack_from("<Q", raw, at)[0]
        return raw[at + 8:at + 8 + n], at + 8 + n
    if t == 9:
        et, n = struct.unpack_from("<IQ", raw, at)
        at += 12
        vals = []
        for _ in range(n):
            v, at = gguf_value(raw, at, et)
            vals.append(v)
        return (et, vals), at
    raise ValueError("GGUF type %d" % t)


def gguf_pack(t, v):
    if t in GGUF_SCALAR:
        return struct.pack(GGUF_SCALAR[t], v)
    if t == 8:
        return struct.pack("<Q", len(v)) + v
    et, vals = v
    return struct.pack("<IQ", et, len(vals)) + b"".join(gguf_pack(et, x) for x in vals)


def gguf_small(path, max_array=24, max_tensor_bytes=512):
    raw = read(path)
    magic, version, n_t, n_kv = struct.unpack_from("<4sIQQ", raw, 0)
    at = 24
    kvs = []
    align = 32
    for _ in range(n_kv):
        kl = struct.unpack_from("<Q", raw, at)[0]
        key = raw[at + 8:at + 8 + kl]
        at += 8 + kl
        t = struct.unpack_from("<I", raw, at)[0]
        v, at = gguf_value(raw, at + 4, t)
        if t == 9:
            v = (v[0], v[1][:max_array])
        if key == b"general.alignment":
            align = v
        kvs.append((key, t, v))
    infos = []
    for _ in range(n_t):
        nl = struct.unpack_from("<Q", raw, at)[0]
        name = raw[at + 8:at + 8 + nl]
        at += 8 + nl
        nd = struct.unpack_from("<I", raw, at)[0]
        dims = struct.unpack_from("<%dQ" % nd, raw, at + 4)
        at += 4 + 8 * nd
        gt, off = struct.unpack_from("<IQ", raw, at)
        at += 12
        infos.append((name, dims, gt, off))
    data0 = (at + align - 1) // align * align
    ends = sorted(off for _, _, _, off in infos) + [len(raw) - data0]
    keep = []
    for name, dims, gt, off in infos:
        size = min(e for e in ends if e > off) - off
        if size <= max_tensor_bytes:
            keep.append((name, dims, gt, raw[data0 + off:data0 + off + size]))
        if len(keep) == 3:
            break
    out = struct.pack("<4sIQQ", magic, version, len(keep), len(kvs))
    for key, t, v in kvs:
        out += struct.pack("<Q", len(key)) + key + struct.pack("<I", t) + gguf_pack(t, v)
    off = 0
    for name, dims, gt, data in keep:
        out += struct.pack("<Q", len(name)) + name + struct.pack("<I", len(dims))
        out += struct.pack("<%dQ" % len(dims), *dims) + struct.pack("<IQ", gt, off)
        off += (len(data) + align - 1) // align * align
    out += b"\0" * (-len(out) % align)
    for _, _, _, data in keep:
        out += data + b"\0" * (-len(data) % align)
    return out


# ---- the checkpoints a generated one-layer model quantizes into ------------------------------------

def checkpoints(cli, work):
    """{name: checkpoint dir}: a one-layer olmoe-like model and its quantized forms."""
    calib = os.path.join(REPO, "data", "demo-calib.txt")
    src = os.path.join(work, "src")
    run = lambda *a: subprocess.run([cli, *a], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    run("bench", "gen-model", "--like", "olmoe-1b-7b", "--out", src, "--layers", "1", "--experts", "2",
        "--hidden", "64", "--ffn", "32", "--vocab", "4096", "--quiet")
    forms = {
        "ct-nvfp4a16": ["--scheme", "nvfp4a16"],
        "ct-nvfp4": ["--scheme", "nvfp4", "--calib", calib, "--nsamples", "2", "--seqlen", "16"],
        "modelopt": ["--scheme", "nvfp4a16", "--format", "modelopt"],
        "ct-int4-asym": ["--scheme", "int4", "--group-size", "32", "--asym"],
        "ct-int4-gidx": ["--scheme", "int4", "--group-size", "16", "--method", "gptq", "--calib", calib,
                         "--nsamples", "2", "--seqlen", "16", "--act-order", "--groups", "gidx"],
        "gptq": ["--scheme", "int4", "--group-size", "32", "--format", "gptq"],
        "gptq-asym": ["--scheme", "int4", "--group-size", "-1", "--asym", "--format", "gptq"],
        "gguf": ["--scheme", "int4", "--group-size", "32", "--format", "gguf"],
    }
    dirs = {"src": src}
    for name, args in forms.items():
        out = os.path.join(work, name + (".gguf" if name == "gguf" else ""))
        run("quantize", src, "--out", out, "--quiet", *args)
        dirs[name] = out
    return dirs


def fixture_configs():
    found = [os.path.join(REPO, "models", "olmoe-tiny", "config.json")]
    data = os.path.join(REPO, "tests", "data")
    for d in sorted(os.listdir(data)):
        p = os.path.join(data, d, "config.json")
        if os.path.isfile(p):
            found.append(p)
    shared = os.environ.get("MOEQ_SHARED") or os.path.join(REPO, "..", "shared")
    models = os.path.join(shared, "fixtures", "models")
    if os.path.isdir(models):
        for d in sorted(os.listdir(models)):
            p = os.path.join(models, d, "config.json")
            if os.path.isfile(p):
                found.append(p)
    return found


# ---- the targets ------------------------------------------------------------------------------------

def seeds_config(out, cli, ck):
    for p in fixture_configs():
        put(out, "config", os.path.basename(os.path.dirname(p)) + ".json", read(p))
    for name, d in ck.items():
        if not name.startswith("gguf"):
            put(out, "config", "quantized-" + name + ".json", read(os.path.join(d, "config.json")))
    # every family gen-model knows, at its full size (the config alone)
    for like in ["olmoe-1b-7b", "qwen3-30b-a3b", "mixtral-8x7b", "qwen2-moe-a2.7b", "llama-3.2-1b", "deepseek-v3"]:
        r = subprocess.run([cli, "bench", "gen-model", "--like", like, "--dry-run"], check=True,
                           stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        text = r.stdout.decode()
        put(out, "config", "gen-" + like + ".json", text[:text.rindex("}") + 1])


def seeds_safetensors(out, ck):
    files = [os.path.join(REPO, "tests", "data", f) for f in sorted(os.listdir(os.path.join(REPO, "tests", "data")))
             if f.endswith(".safetensors")]
    files.append(os.path.join(ck["src"], "model.safetensors"))
    for i, p in enumerate(files):
        meta, tensors = st_read(p)
        small = {}
        for name, (dtype, shape, data) in sorted(tensors.items(), key=lambda kv: len(kv[1][2]))[:3]:
            if len(data) > 1024:   # the first values of a big one, as a vector
                esize = len(data) // math.prod(shape)
                shape, data = [1024 // esize], data[:1024 // esize * esize]
            small[name] = (dtype, shape, data)
        put(out, "safetensors", "%02d-%s" % (i, os.path.basename(p)), st_write(small, meta))


def seeds_layout(out, ck):
    picks = ["model.layers.0.mlp.experts.0.down_proj", "model.layers.0.self_attn.k_proj"]
    for name, d in ck.items():
        if name == "gguf":
            continue
        meta, tensors = st_read(os.path.join(d, "model.safetensors"))
        for i, m in enumerate(picks):
            put(out, "layout", "%s-%d" % (name, i), st_write(module_of(tensors, m), meta))


def seeds_gguf(out, ck):
    put(out, "gguf", "olmoe-1layer-q4_0", gguf_small(ck["gguf"]))


def small_tokenizer(path, keep_ids=300):
    """The tokenizer.json with its vocabulary cut to the first keep_ids ids (and the merges that
    stay inside them), ids renumbered densely, added tokens after them."""
    t = json.loads(read(path))
    vocab = {k: v for k, v in t["model"]["vocab"].items() if v < keep_ids}
    order = sorted(vocab, key=vocab.get)
    vocab = {k: i for i, k in enumerate(order)}
    merges = []
    for m in t["model"]["merges"]:
        a, b = m if isinstance(m, list) else m.split(" ", 1)
        if a in vocab and b in vocab and a + b in vocab:
            merges.append([a, b])
    t["model"]["vocab"], t["model"]["merges"] = vocab, merges
    added = []
    for a in t.get("added_tokens", []):
        a = dict(a)
        a["id"] = vocab.get(a["content"], len(vocab) + len(added))
        added.append(a)
    t["added_tokens"] = added
    return t


def seeds_tokenizer(out):
    tdir = os.path.join(REPO, "models", "olmoe-tiny")
    t = small_tokenizer(os.path.join(tdir, "tokenizer.json"))
    tcfg = read(os.path.join(tdir, "tokenizer_config.json"))
    cfg = json.dumps({"bos_token_id": 0, "eos_token_id": [0, 1]}).encode()
    text = read(os.path.join(REPO, "data", "demo-eval.txt"))[:200]
    dump = lambda o: json.dumps(o, ensure_ascii=False, separators=(",", ":")).encode()
    put(out, "tokenizer", "olmoe-small", dump(t))
    put(out, "tokenizer", "olmoe-small-configs", dump(t) + SEP + tcfg + SEP + cfg + SEP + text)
    # the Llama-3 / Qwen2 layout: NFC, a Sequence of Split pre-tokenizers ending in ByteLevel
    q = json.loads(json.dumps(t))
    q["normalizer"] = {"type": "NFC"}
    q["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": "\\p{N}{1,3}"}, "behavior": "Isolated", "invert": False},
        {"type": "Split", "pattern": {"Regex": "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"},
         "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]}
    q["added_tokens"].append({"id": len(q["model"]["vocab"]) + 5, "content": " <sep>", "single_word": True,
                              "lstrip": True, "rstrip": True, "normalized": True, "special": False})
    put(out, "tokenizer", "sequence-split", dump(q) + SEP + b'{"bos_token": {"content": "<|endoftext|>"}}')
    # legacy "a b" merges, byte fallback and unk
    m = json.loads(json.dumps(t))
    m["model"]["merges"] = [" ".join(x) for x in m["model"]["merges"][:40]]
    m["model"]["byte_fallback"], m["model"]["unk_token"] = True, "<|padding|>"
    put(out, "tokenizer", "legacy-merges", dump(m))


def seeds_tiktoken(out):
    kdir = os.path.join(REPO, "tests", "data", "kimi-tiny-tokenizer")
    lines = read(os.path.join(kdir, "tiktoken.model")).splitlines()
    cfg = json.loads(read(os.path.join(kdir, "tokenizer_config.json")))
    for keep in (260, len(lines)):
        cut = lines[:keep]
        c = json.loads(json.dumps(cfg))
        dec = {}
        for k, v in c.get("added_tokens_decoder", {}).items():
            dec[str(int(k) - len(lines) + keep)] = v
        c["added_tokens_decoder"] = dec
        body = b"\n".join(cut) + b"\n"
        put(out, "tiktoken", "kimi-%d" % keep, body + SEP + json.dumps(c, indent=1).encode() + SEP + b"[BOS]Hi \xe4\xb8\xad")


def seeds_calib(out):
    text = read(os.path.join(REPO, "data", "demo-calib.txt"))[:600].decode("utf-8", "ignore")
    paras = [p for p in text.split("\n") if p.strip()][:4] or [text]
    jsonl = "".join(json.dumps({"text": p}) + "\n" for p in paras).encode()
    chat = "".join(json.dumps({"messages": [{"role": "user", "content": p},
                                            {"role": "assistant", "content": [{"type": "text", "text": p[:40]}]}]}) + "\n"
                   for p in paras[:2]).encode()
    # first byte: the target's mode (fuzz_calib.c)
    put(out, "calib", "text", bytes([0]) + text.encode())
    put(out, "calib", "text-tokenized", bytes([16]) + text.encode())
    put(out, "calib", "text-docs-evaldocs", bytes([16 | 32 | 64]) + text.encode())
    put(out, "calib", "jsonl", bytes([1]) + jsonl)
    put(out, "calib", "jsonl-field-tokenized", bytes([1 | 4 | 16 | 128]) + jsonl)
    put(out, "calib", "chat", bytes([1 | 8 | 16 | 32]) + chat)
    put(out, "calib", "jsonl-gz-inner", bytes([2 | 16]) + jsonl)
    put(out, "calib", "jsonl-gz-raw", bytes([3]) + gzip.compress(jsonl, mtime=0))
    put(out, "calib", "evaldocs-wikitext", bytes([64]) + b" = Title = \n\n" + text.encode())


def seeds_model(out, cli, work):
    """A one-layer olmoe-like model of 48 ids (a tokenizer cut to them) in each layout; each seed
    is its config.json and model.safetensors."""
    tok = os.path.join(work, "model-tok")
    os.makedirs(tok, exist_ok=True)
    with open(os.path.join(tok, "tokenizer.json"), "w") as f:
        json.dump(small_tokenizer(os.path.join(REPO, "models", "olmoe-tiny", "tokenizer.json"), keep_ids=40), f)
    src = os.path.join(work, "model-src")
    run = lambda *a: subprocess.run([cli, *a], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    run("bench", "gen-model", "--like", "olmoe-1b-7b", "--out", src, "--layers", "1", "--experts", "2",
        "--hidden", "32", "--ffn", "32", "--vocab", "48", "--tokenizer", tok, "--quiet")
    forms = {"bf16": None, "ct-nvfp4a16": ["--scheme", "nvfp4a16"],
             "modelopt": ["--scheme", "nvfp4a16", "--format", "modelopt"],
             "ct-int4-asym": ["--scheme", "int4", "--group-size", "32", "--asym"],
             "gptq": ["--scheme", "int4", "--group-size", "32", "--format", "gptq"]}
    for name, args in forms.items():
        d = src
        if args:
            d = os.path.join(work, "model-" + name)
            run("quantize", src, "--out", d, "--quiet", *args)
        put(out, "model", name, read(os.path.join(d, "config.json")) + SEP + read(os.path.join(d, "model.safetensors")))


def seeds_workdir(out, cli, work):
    """Work directories of a one-layer-at-a-time GPTQ run killed after its first layer."""
    mk = os.path.join(HERE, "workdir_seeds.sh")
    if os.path.isfile(mk):
        subprocess.run(["bash", mk, cli, REPO, work, os.path.join(out, "workdir")], check=True,
                       stdout=subprocess.DEVNULL)


def seeds_chat_template(out):
    """Each template of tests/data/chat_templates with the variables of its first golden case,
    and an OpenAI chat request."""
    tdir = os.path.join(REPO, "tests", "data", "chat_templates")
    gold = json.loads(read(os.path.join(REPO, "tests", "data", "chat_goldens.json")))
    req = json.dumps({"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
                      "max_tokens": 8, "temperature": 0.5, "stop": ["\n"], "stream": True}).encode()
    for name in sorted(os.listdir(tdir)):
        case = next(c for c in gold["cases"] if c["template"] == name)
        put(out, "chat_template", name.replace(".jinja", ""),
            read(os.path.join(tdir, name)) + SEP + case["vars_json"].encode() + SEP + req)


TARGETS = ["config", "safetensors", "layout", "gguf", "tokenizer", "tiktoken", "calib", "workdir", "model",
           "chat_template"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cli", required=True, help="the moeq binary")
    ap.add_argument("--out", required=True)
    ap.add_argument("targets", nargs="*", default=TARGETS)
    a = ap.parse_args()
    for t in a.targets:
        if t not in TARGETS:
            sys.exit("corpus.py: unknown target %s (known: %s)" % (t, ", ".join(TARGETS)))
    with tempfile.TemporaryDirectory() as work:
        ck = checkpoints(a.cli, work) if {"config", "safetensors", "layout", "gguf"} & set(a.targets) else {}
        for t in a.targets:
            if t == "config": seeds_config(a.out, a.cli, ck)
            elif t == "safetensors": seeds_safetensors(a.out, ck)
            elif t == "layout": seeds_layout(a.out, ck)
            elif t == "gguf": seeds_gguf(a.out, ck)
            elif t == "tokenizer": seeds_tokenizer(a.out)
            elif t == "tiktoken": seeds_tiktoken(a.out)
            elif t == "calib": seeds_calib(a.out)
            elif t == "workdir": seeds_workdir(a.out, a.cli, work)
            elif t == "model": seeds_model(a.out, a.cli, work)
            elif t == "chat_template": seeds_chat_template(a.out)


if __name__ == "__main__":
    main()

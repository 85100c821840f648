#!/usr/bin/env python3
"""moeq's perplexity of a GGUF file on exactly the chunks llama.cpp's llama-perplexity scores.

    scripts/llama-ppl.py FILE.gguf BASE_LOGITS [--act-quant q8_0] [--chunks N] [--threads N]

BASE_LOGITS is the file `llama-perplexity --kl-divergence-base BASE_LOGITS` wrote (its header holds
the tokens llama.cpp's tokenizer gave: "_logits_", n_ctx, n_vocab, n_chunk, then n_chunk * n_ctx
int32 ids). Each chunk of n_ctx tokens runs from an empty KV cache, its first token replaced by BOS
when the file's tokenizer.ggml.add_bos_token is true, and the tokens after position n_ctx / 2 are
scored from the logits before them (tools/perplexity/perplexity.cpp: `first = n_ctx/2`, n_ctx - 1 -
first per chunk), so the figure is comparable with llama-perplexity's "Final estimate: PPL" (or
"Mean PPL(Q)" with --kl-divergence) on the same file. moeq runs the file through libmoeq's public
API (moeq_model_open, moeq_session_forward), with --act-quant q8_0 as `moeq eval --act-quant q8_0`
does: llama.cpp's Q8_0 activations for its Q4_0/Q8_0/... Linears and Q8_K for its K-quants.

Prints one line: "ppl P nll N count C". Environment: MOEQ_LIBRARY (default build/libmoeq.so).
"""
import argparse
import ctypes
import math
import os
import struct
import sys


class ModelOptions(ctypes.Structure):
    _fields_ = [("keep_packed", ctypes.c_int), ("no_tokenizer", ctypes.c_int),
                ("act_quant", ctypes.c_int), ("stream", ctypes.c_int)]


class Info(ctypes.Structure):   # the head of moeq_model_info
    _fields_ = [("model_type", ctypes.c_char_p), ("vocab_size", ctypes.c_int32)]


def gguf_kvs(path, wanted):
    """The scalar KVs named in wanted of a GGUF v3 file (a minimal header walk)."""
    sizes = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
    fmt = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
           11: "<q", 12: "<d"}
    out = {}
    with open(path, "rb") as f:
        magic, version, n_t, n_kv = struct.unpack("<4sIQQ", f.read(24))
        if magic != b"GGUF":
            raise SystemExit(f"{path}: not a GGUF file")

        def rd_str():
            (n,) = struct.unpack("<Q", f.read(8))
            return f.read(n).decode("utf-8", "replace")

        def skip(t):
            if t == 8:
                rd_str()
            elif t == 9:
                et, n = struct.unpack("<IQ", f.read(12))
                if et == 8:
                    for _ in range(n):
                        rd_str()
                else:
                    f.seek(sizes[et] * n, 1)
            else:
                f.seek(sizes[t], 1)

        for _ in range(n_kv):
            key = rd_str()
            (t,) = struct.unpack("<I", f.read(4))
            if key in wanted and t in fmt:
                out[key] = struct.unpack(fmt[t], f.read(sizes[t]))[0]
            else:
                skip(t)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("base_logits")
    ap.add_argument("--act-quant", choices=["none", "q8_0"], default="q8_0")
    ap.add_argument("--chunks", type=int, default=0, help="the first N chunks (0: all of the file's)")
    ap.add_argument("--threads", type=int, default=0)
    a = ap.parse_args()

    with open(a.base_logits, "rb") as f:
        if f.read(8) != b"_logits_":
            raise SystemExit(f"{a.base_logits}: not a llama-perplexity logits file")
        n_ctx, n_vocab, n_chunk = struct.unpack("<iii", f.read(12))
        if a.chunks:
            n_chunk = min(n_chunk, a.chunks)
        ids = struct.unpack(f"<{n_chunk * n_ctx}i", f.read(4 * n_chunk * n_ctx))
    kv = gguf_kvs(a.model, {"tokenizer.ggml.add_bos_token", "tokenizer.ggml.bos_token_id"})
    add_bos = bool(kv.get("tokenizer.ggml.add_bos_token", False))
    bos = kv.get("tokenizer.ggml.bos_token_id", -1)

    here = os.path.dirname(os.path.abspath(__file__))
    lib = ctypes.CDLL(os.environ.get("MOEQ_LIBRARY") or os.path.join(here, "..", "build", "libmoeq.so"))
    c_p = ctypes.c_void_p
    lib.moeq_last_error.restype = ctypes.c_char_p
    lib.moeq_model_open.argtypes = [ctypes.c_char_p, ctypes.POINTER(ModelOptions), ctypes.POINTER(c_p)]
    lib.moeq_session_create.argtypes = [c_p, ctypes.c_int32, ctypes.POINTER(c_p)]
    lib.moeq_session_reset.argtypes = [c_p]
    lib.moeq_session_free.argtypes = [c_p]
    lib.moeq_model_free.argtypes = [c_p]
    lib.moeq_session_forward.argtypes = [c_p, ctypes.POINTER(ctypes.c_int32), ctypes.c_int32,
                                         ctypes.POINTER(ctypes.c_float)]
    lib.moeq_set_threads.argtypes = [ctypes.c_int]
    if a.threads:
        lib.moeq_set_threads(a.threads)

    def check(st, what):
        if st:
            raise SystemExit(f"{what}: {lib.moeq_last_error().decode()}")

    m, s = c_p(), c_p()
    opts = ModelOptions(0, 1, 2 if a.act_quant == "q8_0" else 0, 0)
    check(lib.moeq_model_open(a.model.encode(), ctypes.byref(opts), ctypes.byref(m)), a.model)
    lib.moeq_model_get_info.argtypes = [c_p]
    lib.moeq_model_get_info.restype = ctypes.POINTER(Info)
    if lib.moeq_model_get_info(m).contents.vocab_size != n_vocab:
        raise SystemExit(f"{a.model}: vocabulary {lib.moeq_model_get_info(m).contents.vocab_size}, "
                         f"llama.cpp's {n_vocab}")
    check(lib.moeq_session_create(m, n_ctx, ctypes.byref(s)), "session")
    logits = (ctypes.c_float * (n_ctx * n_vocab))()
    first = n_ctx // 2
    nll, count = 0.0, 0
    for c in range(n_chunk):
        chunk = list(ids[c * n_ctx:(c + 1) * n_ctx])
        if add_bos:
            chunk[0] = bos
        lib.moeq_session_reset(s)
        check(lib.moeq_session_forward(s, (ctypes.c_int32 * n_ctx)(*chunk), n_ctx, logits), "forward")
        for j in range(first, n_ctx - 1):
            row = logits[j * n_vocab:(j + 1) * n_vocab]
            mx = max(row)
            lse = mx + math.log(math.fsum(math.exp(v - mx) for v in row))
            nll += lse - row[chunk[j + 1]]
            count += 1
    lib.moeq_session_free(s)
    lib.moeq_model_free(m)
    print(f"ppl {math.exp(nll / count):.6f} nll {nll:.6f} count {count}")


if __name__ == "__main__":
    sys.exit(main())

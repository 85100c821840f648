#!/usr/bin/env python3
"""A tiny Kimi-K2-style tiktoken tokenizer and its encodings (tests/data/kimi-tiny-tokenizer).

Kimi K2 ships `tiktoken.model` (one "base64(token bytes) rank" line per token), a
`tokenizer_config.json` whose `added_tokens_decoder` names some of the 256 special ids above the
ranks, and `tokenization_kimi.py`, which holds the split pattern in code. This script:

  1. trains a small byte-level BPE the tiktoken way (a token's rank is its id and its merge
     priority) on data/demo-calib.txt plus a few multilingual lines, split by Kimi's pattern; the
     256 single bytes get a shuffled rank order so a reader cannot assume rank == byte;
  2. writes tiktoken.model and a tokenizer_config.json laid out as Kimi K2's (same relative ids of
     the named specials, 256 reserved slots, bos "[BOS]", eos "[EOS]");
  3. encodes CASES (and the demo eval text) with tiktoken itself when it is installed
     (allowed_special="all", as tokenization_kimi.py's encode), else with the slow obvious
     rank-merging implementation below, and writes golden.json with the ids and which one made
     them. `--check` recomputes with tiktoken and fails on any difference from golden.json.

  python3 scripts/gen_tiktoken_fixture.py tests/data/kimi-tiny-tokenizer          # fixture + golden
  python3 scripts/gen_tiktoken_fixture.py tests/data/kimi-tiny-tokenizer --check  # tiktoken agrees
"""
import base64
import json
import random
import sys
from collections import Counter
from pathlib import Path

import regex

# tokenization_kimi.py's pat_str (as published with Kimi K2): Han runs, words (the letter classes
# minus Han), digits in threes, punctuation, newlines, spaces.
KIMI_PAT = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])
# Python's regex module takes class intersection (&&) in its version-1 syntax
SPLIT = regex.compile(KIMI_PAT, regex.V1)

# Kimi K2's named specials, at their offsets above the ranks (tokenizer_config.json there)
SPECIALS = {0: "[BOS]", 1: "[EOS]", 2: "<|im_end|>", 3: "<|im_user|>", 4: "<|im_assistant|>",
            6: "<|start_header_id|>", 7: "<|end_header_id|>", 9: "[EOT]", 10: "<|im_system|>",
            17: "<|im_middle|>", 254: "[UNK]", 255: "[PAD]"}
RESERVED = 256
MERGES = 700

EXTRA_TEXT = """\
Hello World! HELLO WORLD's THE END. They're here; we'll see, I'M sure it'D work.
中文分词测试：今天天气很好，我们去公园散步。机器学习和深度学习。
日本語のテキスト：ひらがなとカタカナ、漢字も混ざる。Ελληνικά κείμενα. Русский текст здесь.
café naïve über Ångström déjà-vu façade. 1234567890 3.14159 2026-12-03
def f(x):\n    return x * 2  # comment\n\tindent\r\nwindows line\n\n\nspaces   here
"""

CASES = [
    "",
    "Hello world",
    "Hello World! HELLO WORLD's THE END.",
    "They're here; we'll see, I'M sure it'D work. don't DON'T",
    "12345678 9 1000000 3.14159",
    "中文分词测试：今天天气很好。",
    "mixed中文and English混合words",
    "ひらがなとカタカナ、漢字",
    "Ελληνικά κείμενα and Русский текст",
    "café naïve über ÅNGSTRÖM déjà-vu",
    "a  b\n\n  c\t d   \n",
    "   leading and trailing   ",
    "line one\r\nline two\n\n\nthree",
    "def f(x):\n    return x*2  # comment\n",
    "🚀🎉 emoji 👍🏽 and symbols ©®™ → ∑",
    "[BOS]Hello<|im_end|>",
    "<|im_user|>user<|im_middle|>Hi there<|im_end|><|im_assistant|>assistant<|im_middle|>",
    "<|reserved_token_5|> and [EOS][EOT]",
    "\u00e9 vs e\u0301 (composed and decomposed)",
    "x" * 300,
    " " * 40 + "y",
]


def split(text):
    return [m.group(0) for m in SPLIT.finditer(text)]


def train(text):
    """Tiktoken-style BPE: ranks 0..255 are the bytes (shuffled), then each merge's product."""
    order = list(range(256))
    random.Random(1234).shuffle(order)
    ranks = {bytes([b]): r for r, b in enumerate(order)}
    words = Counter(tuple(bytes([c]) for c in p.encode()) for p in split(text))
    for _ in range(MERGES):
        pairs = Counter()
        for w, n in words.items():
            for a, b in zip(w, w[1:]):
                pairs[a, b] += n
        if not pairs:
            break
        # the most frequent pair; ties broken by the bytes so the result is deterministic
        (a, b), n = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))
        if n < 2:
            break
        if a + b in ranks:   # the same bytes reached by another split: already a token
            merged = a + b
        else:
            merged = a + b
            ranks[merged] = len(ranks)
        new = Counter()
        for w, c in words.items():
            out, i = [], 0
            while i < len(w):
                if i + 1 < len(w) and w[i] == a and w[i + 1] == b:
                    out.append(merged)
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            new[tuple(out)] += c
        words = new
    return ranks


def bpe(ranks, piece):
    """The slow obvious tiktoken merge: a whole-piece token wins, else merge the adjacent pair
    whose bytes have the lowest rank, leftmost first, until no pair is a token."""
    if piece in ranks:
        return [ranks[piece]]
    parts = [bytes([c]) for c in piece]
    while True:
        best = None
        for i in range(len(parts) - 1):
            r = ranks.get(parts[i] + parts[i + 1])
            if r is not None and (best is None or r < best[0]):
                best = (r, i)
        if best is None:
            break
        i = best[1]
        parts[i:i + 2] = [parts[i] + parts[i + 1]]
    return [ranks[p] for p in parts]


def special_table(n_base, named):
    return {named.get(i, f"<|reserved_token_{i}|>"): i for i in range(n_base, n_base + RESERVED)}


def encode_reference(ranks, specials, text):
    # specials are cut out first (leftmost; these names never overlap), then the split pattern
    pat = regex.compile("|".join(regex.escape(s) for s in sorted(specials, key=len, reverse=True)))
    ids, at = [], 0
    for m in pat.finditer(text):
        for p in split(text[at:m.start()]):
            ids += bpe(ranks, p.encode())
        ids.append(specials[m.group(0)])
        at = m.end()
    for p in split(text[at:]):
        ids += bpe(ranks, p.encode())
    return ids


def main():
    out = Path(sys.argv[1])
    check = "--check" in sys.argv[2:]
    repo = Path(__file__).resolve().parent.parent
    if not check:
        text = (repo / "data/demo-calib.txt").read_text() + EXTRA_TEXT
        ranks = train(text)
        out.mkdir(parents=True, exist_ok=True)
        with open(out / "tiktoken.model", "w") as f:
            for tok, r in sorted(ranks.items(), key=lambda kv: kv[1]):
                f.write(f"{base64.b64encode(tok).decode()} {r}\n")
        n_base = len(ranks)
        decoder = {str(n_base + k): {"content": v, "lstrip": False, "normalized": False, "rstrip": False,
                                     "single_word": False, "special": True} for k, v in SPECIALS.items()}
        config = {
            "added_tokens_decoder": decoder,
            "additional_special_tokens": ["<|im_end|>", "<|im_user|>", "<|im_assistant|>",
                                          "<|start_header_id|>", "<|end_header_id|>", "[EOT]",
                                          "<|im_system|>", "<|im_middle|>"],
            "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
            "bos_token": "[BOS]", "clean_up_tokenization_spaces": False, "eos_token": "[EOS]",
            "model_max_length": 1048576, "pad_token": "[PAD]", "tokenizer_class": "TikTokenTokenizer",
            "unk_token": "[UNK]"}
        (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    ranks = {}
    for line in (out / "tiktoken.model").read_text().splitlines():
        tok, r = line.split()
        ranks[base64.b64decode(tok)] = int(r)
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    named = {int(k): v["content"] for k, v in cfg["added_tokens_decoder"].items()}
    specials = special_table(len(ranks), named)
    texts = CASES + [(repo / "data/demo-eval.txt").read_text()]
    ref = [encode_reference(ranks, specials, t) for t in texts]
    try:
        import tiktoken
        enc = tiktoken.Encoding(name="kimi-tiny", pat_str=KIMI_PAT, mergeable_ranks=ranks,
                                special_tokens=specials)
        real = [enc.encode(t, allowed_special="all", disallowed_special=()) for t in texts]
        maker = f"tiktoken {tiktoken.__version__}"
        bad = [i for i in range(len(texts)) if real[i] != ref[i]]
        if bad:
            print(f"reference implementation differs from tiktoken on cases {bad}", file=sys.stderr)
            sys.exit(1)
    except ImportError:
        real, maker = ref, "the reference implementation in this script (tiktoken not installed)"
    golden = {"made_with": maker, "vocab_size": len(ranks) + RESERVED,
              "cases": [{"text": t, "ids": ids} for t, ids in zip(CASES, real)],
              "demo_eval_ids": real[-1]}
    if check:
        old = json.loads((out / "golden.json").read_text())
        same = old["cases"] == golden["cases"] and old["demo_eval_ids"] == golden["demo_eval_ids"]
        print(f"{maker}: golden.json {'agrees' if same else 'DIFFERS'} "
              f"({len(CASES)} cases, {len(real[-1])} demo-eval ids)")
        sys.exit(0 if same else 1)
    (out / "golden.json").write_text(json.dumps(golden, ensure_ascii=False, indent=1) + "\n")
    print(f"{out}: {len(ranks)} ranks, {len(CASES)} cases, {len(real[-1])} demo-eval ids ({maker})")


if __name__ == "__main__":
    main()

#!/usr/bin/env bash
# llama.cpp's K-quants from the command line on the bundled olmoe-tiny (8 experts, 4 layers):
# --scheme q4_k_m writes llama.cpp's Q4_K_M mixture tensor by tensor (its rules for an 8-expert
# model: attn_k/attn_v Q8_0, attn_output Q5_K, ffn_down Q6_K where use_more_bits, output Q6_K),
# q4_k every Linear Q4_K; eval reads the file in place and more bits give less KL; --target-bpw
# meets its budget, the report shows each tensor's type (token_embd and output among them) and the
# file holds them; the refusals exit 1 leaving nothing.
. "$(dirname "$0")/common.sh"

"$cli" quantize "$model" --out "$tmp/m.gguf" --scheme q4_k_m --format gguf --quiet || fail "q4_k_m exited $?"
out=$("$cli" inspect "$tmp/m.gguf" --tensors) || fail "inspect exited $?"
has() { printf '%s\n' "$out" | grep -q "$1" || fail "q4_k_m: no line matching '$1'"; }
# holds FILE "TENSOR=TYPE ...": the file's tensors have the types a --target-bpw report chose
holds() {
    local pick
    out=$("$cli" inspect "$1" --tensors) || fail "inspect $1 exited $?"
    for pick in $2; do
        has "^  ${pick%%=*}.weight  *${pick#*=} "
    done
}
has '^  general.file_type  *UINT32  *15$'
has '^  token_embd.weight  *q4_K '
has '^  output.weight  *q6_K '
for l in 0 1 2 3; do
    has "^  blk.$l.attn_q.weight  *q4_K "
    has "^  blk.$l.attn_k.weight  *q8_0 "
    has "^  blk.$l.attn_v.weight  *q8_0 "
    has "^  blk.$l.attn_output.weight  *q5_K "
    has "^  blk.$l.ffn_gate_exps.weight  *q4_K  *{256, 256, 8}"
done
# use_more_bits(i, 4): layers 2 and 3
has '^  blk.0.ffn_down_exps.weight  *q4_K '
has '^  blk.1.ffn_down_exps.weight  *q4_K '
has '^  blk.2.ffn_down_exps.weight  *q6_K '
has '^  blk.3.ffn_down_exps.weight  *q6_K '

# IQ4_XS, llama.cpp's file type 30: 8 experts, so attn_v/attn_k Q8_0 and attn_output Q5_K as
# its rules say; every other Linear and token_embd IQ4_XS, output Q6_K
"$cli" quantize "$model" --out "$tmp/iq4_xs.gguf" --scheme iq4_xs --format gguf --quiet || fail "iq4_xs exited $?"
out=$("$cli" inspect "$tmp/iq4_xs.gguf" --tensors) || fail "inspect iq4_xs exited $?"
has '^  general.file_type  *UINT32  *30$'
has '^  token_embd.weight  *iq4_xs '
has '^  output.weight  *q6_K '
has '^  blk.1.attn_q.weight  *iq4_xs '
has '^  blk.1.attn_v.weight  *q8_0 '
has '^  blk.1.attn_output.weight  *q5_K '
has '^  blk.2.ffn_down_exps.weight  *iq4_xs  *{256, 256, 8}'

for s in q4_k q3_k q6_k iq4_xs; do
    [ "$s" = iq4_xs ] && continue   # made above
    "$cli" quantize "$model" --out "$tmp/$s.gguf" --scheme "$s" --format gguf --quiet || fail "$s exited $?"
done
out=$("$cli" inspect "$tmp/q4_k.gguf" --tensors) || fail "inspect q4_k exited $?"
printf '%s\n' "$out" | grep -q '^  blk.3.attn_v.weight  *q4_K ' || fail "q4_k: attn_v not q4_K"
printf '%s\n' "$out" | grep -q '^  token_embd.weight  *bf16 ' || fail "q4_k: token_embd not in its source dtype"
printf '%s\n' "$out" | grep -q '^  blk.0.ffn_norm.weight  *f32 ' || fail "q4_k: norms not F32"

# read in place: less KL to the model with more bits
export TMPDIR="$tmp/gguf-tmp"
mkdir -p "$TMPDIR"
kl() {
    "$cli" eval "$1" --task text --data "$repo/data/demo-eval.txt" --kl-base "$model" --json 2>/dev/null |
        sed -n 's/^  "kl_mean": \([^,]*\),\{0,1\}$/\1/p'
}
k3=$(kl "$tmp/q3_k.gguf"); k4=$(kl "$tmp/q4_k.gguf"); k6=$(kl "$tmp/q6_k.gguf")
[ -n "$k3" ] && [ -n "$k4" ] && [ -n "$k6" ] || fail "eval on the K-quant files: KL '$k3' '$k4' '$k6'"
awk -v a="$k6" -v b="$k4" -v c="$k3" 'BEGIN { exit !(0 < a && a < b && b < c && c < 1) }' ||
    fail "KL not falling with the bits: q3_k $k3, q4_k $k4, q6_k $k6"
ki=$(kl "$tmp/iq4_xs.gguf")   # IQ4_XS (4.25 bits; attn_v/k Q8_0) read too, and far better than Q3_K
awk -v a="$ki" -v c="$k3" 'BEGIN { exit !(0 < a && a < c) }' || fail "iq4_xs KL '$ki' not below q3_k's $k3"
[ -z "$(ls -A "$TMPDIR")" ] || fail "eval left files in TMPDIR: $(ls "$TMPDIR")"

# --target-bpw: the budget met, each module's type in the report
"$cli" quantize "$model" --out "$tmp/b.gguf" --scheme q4_k_m --target-bpw 4.5 --method gptq \
    --calib "$repo/data/demo-calib.txt" --nsamples 4 --seqlen 128 --format gguf --quiet || fail "--target-bpw exited $?"
bpw=$("$cli" inspect "$tmp/b.gguf" | sed -n 's/^tensors: .*(\([0-9.]*\) bits per value)$/\1/p')
awk -v b="$bpw" 'BEGIN { exit !(b > 4.0 && b <= 4.5) }' || fail "--target-bpw 4.5: the tensors hold '$bpw' bits per value"
heads=$(python3 - "$tmp/b.gguf.gptq_report.json" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
b = r["kquant_budget"]
assert b["target_bpw"] == 4.5 and b["bpw"] <= 4.5, b
assert {t["tensor"] for t in b["tensors"]} >= {"attn_q", "attn_k", "attn_v", "attn_output", "ffn_down"}, b
for t in b["tensors"]:
    s = t["sensitivity"]
    assert s["q3_K"] >= s["q4_K"] >= s["q5_K"] >= s["q6_K"], t   # more bits, less loss
    assert s["q3_K"] >= s["iq4_xs"], t
# the output and olmoe-tiny's untied token_embd are chosen too, each once, with the params of
# a 4096 x 256 matrix
heads = [t for t in b["tensors"] if t["layer"] == -1]
assert sorted(t["tensor"] for t in heads) == ["output", "token_embd"], heads
assert all(t["params"] == 4096 * 256 for t in heads), heads
assert r["settings"]["gguf_recipe"] == "q4_k_m" and r["settings"]["target_bpw"] == 4.5
assert all(m.get("type") for m in r["modules"]), "a module without its type"
print(" ".join(t["tensor"] + "=" + t["type"] for t in heads))
EOF
) || fail "--target-bpw: the report"
holds "$tmp/b.gguf" "$heads"

# qwen2moe-tiny (a shared expert beside 8 routed ones of 128 columns): the Q4_K_M rules give the
# shared expert its role's type (ffn_down: Q6_K in use_more_bits' layers 2 and 3, the routed
# experts' rows falling back to Q8_0 there and from Q4_K to Q5_0 in layers 0 and 1); --target-bpw
# chooses the shared expert's gate, up and down apart from the routed experts' and the file holds
# the report's choice
q2src=${MOEQ_SHARED:-$repo/../shared}/fixtures/models/qwen2moe-tiny
if [ -d "$q2src" ]; then
    # as llama.cpp's qwen2moe graph computes it: the top-k router weights not renormalised
    q2=$tmp/qwen2moe-tiny
    mkdir -p "$q2"
    ln -s "$q2src"/* "$q2/"
    rm "$q2/config.json"
    python3 -c 'import json, sys; c = json.load(open(sys.argv[1])); c["norm_topk_prob"] = False; json.dump(c, open(sys.argv[2], "w"))' \
        "$q2src/config.json" "$q2/config.json" || fail "qwen2moe-tiny's config"
    "$cli" quantize "$q2" --out "$tmp/q2.gguf" --scheme q4_k_m --format gguf --quiet || fail "qwen2moe q4_k_m exited $?"
    out=$("$cli" inspect "$tmp/q2.gguf" --tensors) || fail "inspect q2.gguf exited $?"
    for l in 0 1; do
        has "^  blk.$l.ffn_down_shexp.weight  *q4_K "
        has "^  blk.$l.ffn_down_exps.weight  *q5_0 "
        has "^  blk.$l.ffn_up_shexp.weight  *q4_K "
    done
    for l in 2 3; do
        has "^  blk.$l.ffn_down_shexp.weight  *q6_K "
        has "^  blk.$l.ffn_down_exps.weight  *q8_0 "
    done
    "$cli" quantize "$q2" --out "$tmp/q2b.gguf" --scheme q4_k_m --target-bpw 4.5 --method gptq \
        --calib "$repo/data/demo-calib.txt" --nsamples 4 --seqlen 128 --format gguf --quiet || fail "qwen2moe --target-bpw exited $?"
    picks=$(python3 - "$tmp/q2b.gguf.gptq_report.json" <<'EOF'
import json, sys
b = json.load(open(sys.argv[1]))["kquant_budget"]
assert b["bpw"] <= 4.5, b
sh = [t for t in b["tensors"] if t["tensor"].endswith("_shexp")]
# one group per layer and role, the shared expert's 256 x 256
assert sorted((t["layer"], t["tensor"]) for t in sh) == \
    [(l, r + "_shexp") for l in range(4) for r in ("ffn_down", "ffn_gate", "ffn_up")], sh
assert all(t["params"] == 256 * 256 for t in sh), sh
# the routed experts' groups hold the 8 experts alone
assert all(t["params"] == 8 * 128 * 256 for t in b["tensors"] if t["tensor"] in ("ffn_gate", "ffn_up", "ffn_down")), b
print(" ".join("blk.%d.%s=%s" % (t["layer"], t["tensor"], t["type"]) for t in sh))
EOF
) || fail "qwen2moe --target-bpw: the report"
    holds "$tmp/q2b.gguf" "$picks"
fi

# refused before any work, nothing written: usage errors exit 2, the library's refusal 1
for args in "2 --scheme q4_k" "1 --scheme q4_k --format gguf --target-bpw 4.5" "2 --scheme int4 --format gguf --target-bpw 4.5" \
    "2 --scheme q4_k --format gguf --group-size 64" "2 --scheme q4_k --format gguf --asym"; do
    # shellcheck disable=SC2086
    "$cli" quantize "$model" --out "$tmp/r.gguf" ${args#? } --quiet 2>"$tmp/err"
    [ $? -eq "${args%% *}" ] || fail "quantize ${args#? } should exit ${args%% *}"
    [ ! -e "$tmp/r.gguf" ] || fail "quantize ${args#? } left $tmp/r.gguf"
    grep -q "K-quant\|target-bpw\|target_bpw" "$tmp/err" || fail "quantize ${args#? }: $(cat "$tmp/err")"
done

exit $((fails > 0))

#!/usr/bin/env bash
# The packed runtime and W4A4 emulation through the CLI, on the bundled olmoe-tiny quantized by
# `moeq quantize` (NVFP4 weight-only and INT4 g32): generate and eval run packed by default and
# agree with --dequantize (same greedy text; word perplexity within 1e-4 relative, derived below), stderr / the
# --json object report resident weights (packed < fp32) and peak RSS, --act-quant nvfp4 and q8_0
# run the dequantized path and move the perplexity (q8_0 by less, identically for 1 and 2
# threads) while --act-quant none changes nothing, and bad values are usage errors.
. "$(dirname "$0")/common.sh"
# rel_close A B TOL: |A - B| <= TOL * |B|

"$cli" quantize "$model" --out "$tmp/nv" --scheme nvfp4a16 --quiet || fail "quantize nvfp4a16 exited $?"
"$cli" quantize "$model" --out "$tmp/i4" --scheme int4 --group-size 32 --quiet || fail "quantize int4 exited $?"

for q in nv i4; do
    p=$("$cli" generate "$tmp/$q" --prompt "The history of the" -n 16 2>"$tmp/err.p") ||
        fail "$q: generate exited $?: $(cat "$tmp/err.p")"
    d=$("$cli" generate "$tmp/$q" --prompt "The history of the" -n 16 --dequantize 2>"$tmp/err.d") ||
        fail "$q: generate --dequantize exited $?: $(cat "$tmp/err.d")"
    [ "$p" = "$d" ] || fail "$q: packed and dequantized greedy text differ: [$p] vs [$d]"
    grep -q "generate: weights .* MiB resident (112 Linears packed, 0 dequantized; fp32 would take .* MiB); peak RSS .* MiB" "$tmp/err.p" ||
        fail "$q: no packed memory report: $(cat "$tmp/err.p")"
    grep -q "generate: weights .* MiB resident (fp32); peak RSS" "$tmp/err.d" ||
        fail "$q: no fp32 memory report: $(cat "$tmp/err.d")"
done

# A few documents of text in the wikitext layout.
for i in 1 2 3; do
    printf ' = Title %d = \n The cat sat on the mat , and the history of the world is long . He said " hello " to everyone in %d . \n' "$i" "$((1990 + i))"
done > "$tmp/wiki.txt"

ev() { # ev OUT ARGS...
    local out=$1
    shift
    "$cli" eval "$@" --data "$tmp/wiki.txt" --json > "$out" 2> "$out.err" || fail "eval $* exited $?: $(cat "$out.err")"
}
ev "$tmp/p.json" "$tmp/nv"
ev "$tmp/d.json" "$tmp/nv" --dequantize
[ ! -s "$tmp/p.json.err" ] || fail "eval --json wrote to stderr: $(cat "$tmp/p.json.err")"
for k in packed_linears fallback_linears weight_bytes weight_bytes_fp32 peak_rss_bytes cpu_seconds act_quant; do
    [ -n "$(json_get "$tmp/p.json" $k)" ] || fail "eval --json lacks $k"
done
[ "$(json_get "$tmp/p.json" packed_linears)" = 112 ] || fail "packed_linears $(json_get "$tmp/p.json" packed_linears)"
[ "$(json_get "$tmp/d.json" packed_linears)" = 0 ] || fail "--dequantize: packed_linears $(json_get "$tmp/d.json" packed_linears)"
wb=$(json_get "$tmp/p.json" weight_bytes)
wf=$(json_get "$tmp/p.json" weight_bytes_fp32)
rss=$(json_get "$tmp/p.json" peak_rss_bytes)
[ "$wb" -lt "$wf" ] || fail "packed weight_bytes $wb not below fp32 $wf"
[ "$(json_get "$tmp/d.json" weight_bytes)" = "$wf" ] || fail "dequantized weight_bytes $(json_get "$tmp/d.json" weight_bytes) != $wf"
[ "$rss" -gt "$wb" ] || fail "peak RSS $rss below the weights $wb"
pp=$(json_get "$tmp/p.json" word_perplexity)
pd=$(json_get "$tmp/d.json" word_perplexity)
# The two paths multiply the same dequantized weights and sum each dot product (K <= 256 here)
# in another order (the packed kernels by group, OpenBLAS by its own blocking, which differs
# between its AVX2 and AVX-512 kernels): a Linear's outputs differ by about sqrt(K) * 2^-24 =
# 1e-6 relative, and through 4 layers (about a dozen Linears deep, each stage amplifying what it
# is given) the logits by about 1e-5 relative, i.e. ~1e-4 nats for logits of ~10; the log word
# perplexity is a mean of log-probabilities, each moved by at most twice that. So 1e-4 relative;
# measured 2.7e-6 on an AVX2 host and 1.1e-5 on an AVX-512 Xeon. (Wrong codes are the kernel
# tests' business, bit for bit against the scalar twins.)
rel_close "$pp" "$pd" 1e-4 || fail "packed word perplexity $pp vs dequantized $pd"
[ "$pp" != "$pd" ] || fail "packed and dequantized perplexity are identical ($pp): not packed?"
"$cli" eval "$tmp/nv" --data "$tmp/wiki.txt" > /dev/null 2> "$tmp/txt.err" || fail "text eval exited $?"
grep -q "eval: weights .* MiB resident (112 Linears packed" "$tmp/txt.err" || fail "text eval: no memory report: $(cat "$tmp/txt.err")"

# W4A4 emulation on the unquantized model, and on the quantized one (dequantized path)
ev "$tmp/b.json" "$model"
ev "$tmp/b0.json" "$model" --act-quant none
ev "$tmp/ba.json" "$model" --act-quant nvfp4
ev "$tmp/qa.json" "$tmp/nv" --act-quant nvfp4
b=$(json_get "$tmp/b.json" loglikelihood)
[ "$(json_get "$tmp/b0.json" loglikelihood)" = "$b" ] || fail "--act-quant none changed the loglikelihood"
[ "$(json_get "$tmp/ba.json" act_quant)" = '"nvfp4"' ] || fail "act_quant key: $(json_get "$tmp/ba.json" act_quant)"
ba=$(json_get "$tmp/ba.json" word_perplexity)
bw=$(json_get "$tmp/b.json" word_perplexity)
rel_close "$ba" "$bw" 0.2 || fail "--act-quant nvfp4 perplexity $ba far from $bw"
[ "$ba" != "$bw" ] || fail "--act-quant nvfp4 changed nothing ($ba)"
[ "$(json_get "$tmp/qa.json" packed_linears)" = 0 ] || fail "--act-quant on a checkpoint still packed"

# llama.cpp's Q8_0 activations on the INT4 g32 checkpoint (its Q4_0 GGUF): a smaller move than
# NVFP4's, the same with any thread count; generate takes it too
ev "$tmp/i4d.json" "$tmp/i4" --dequantize
ev "$tmp/i4q.json" "$tmp/i4" --act-quant q8_0 --threads 1
ev "$tmp/i4q2.json" "$tmp/i4" --act-quant q8_0 --threads 2
[ "$(json_get "$tmp/i4q.json" act_quant)" = '"q8_0"' ] || fail "act_quant key: $(json_get "$tmp/i4q.json" act_quant)"
[ "$(json_get "$tmp/i4q.json" packed_linears)" = 0 ] || fail "--act-quant q8_0 on a checkpoint still packed"
iq=$(json_get "$tmp/i4q.json" word_perplexity)
id=$(json_get "$tmp/i4d.json" word_perplexity)
[ "$(json_get "$tmp/i4q2.json" loglikelihood)" = "$(json_get "$tmp/i4q.json" loglikelihood)" ] ||
    fail "--act-quant q8_0: 1 and 2 threads differ"
rel_close "$iq" "$id" 0.01 || fail "--act-quant q8_0 perplexity $iq far from $id"
[ "$iq" != "$id" ] || fail "--act-quant q8_0 changed nothing ($iq)"
"$cli" generate "$tmp/i4" --prompt "The history of the" -n 4 --act-quant q8_0 > /dev/null 2> "$tmp/err.g" ||
    fail "generate --act-quant q8_0 exited $?: $(cat "$tmp/err.g")"

# usage errors
"$cli" eval "$model" --data "$tmp/wiki.txt" --act-quant int8 > /dev/null 2> "$tmp/err"
[ $? -eq 2 ] || fail "--act-quant int8: exit code"
grep -q -- "--act-quant" "$tmp/err" || fail "--act-quant int8: message: $(cat "$tmp/err")"
"$cli" generate "$model" --prompt x -n 1 --act-quant fp8 > /dev/null 2>&1
[ $? -eq 2 ] || fail "generate --act-quant fp8: exit code"

[ $fails -eq 0 ] || exit 1
echo "ok"

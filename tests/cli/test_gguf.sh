#!/usr/bin/env bash
# GGUF from the command line on the bundled olmoe-tiny: quantize --format gguf writes one file and
# no work directory, inspect lists its KVs and tensors, export-gguf of the same codes gives the
# same bytes, eval (also --act-quant q8_0, streamed, and as a --kl-base) and tokenize read the .gguf in
# place (no temporary checkpoint), refused combinations exit 1 and leave nothing, bad usage exits 2,
# corrupt and truncated files are errors naming the file.
. "$(dirname "$0")/common.sh"

mkdir -p "$tmp/a" "$tmp/b"
"$cli" quantize "$model" --out "$tmp/a/olmoe.gguf" --scheme int4 --group-size 32 --format gguf --quiet ||
    fail "quantize --format gguf exited $?"
[ -f "$tmp/a/olmoe.gguf" ] || fail "no olmoe.gguf"
[ "$(ls "$tmp/a")" = olmoe.gguf ] || fail "left beside the file: $(ls "$tmp/a")"
head -c 4 "$tmp/a/olmoe.gguf" | grep -q GGUF || fail "no GGUF magic"
out=$("$cli" inspect "$tmp/a/olmoe.gguf" --tensors) || fail "inspect exited $?"
printf '%s\n' "$out" | grep -q '^  olmoe.expert_count  *UINT32  *8$' || fail "inspect: no expert_count"
printf '%s\n' "$out" | grep -q '^  olmoe.attention.layer_norm_rms_epsilon  *FLOAT32 ' || fail "inspect: eps"
printf '%s\n' "$out" | grep -q '^  tokenizer.ggml.pre  *STRING  *"gpt-2"$' || fail "inspect: pre"
printf '%s\n' "$out" | grep -q '^  blk.3.ffn_down_exps.weight  *q4_0  *{256, 256, 8}' || fail "inspect: stacked experts"
printf '%s\n' "$out" | grep -q 'q4_0  *28 tensors' || fail "inspect: q4_0 summary"

# the same codes through a GPTQ v1 checkpoint (f16 scales too) and export-gguf: the same bytes
"$cli" quantize "$model" --out "$tmp/gptq" --scheme int4 --group-size 32 --format gptq --quiet || fail "gptq exited $?"
"$cli" export-gguf "$tmp/gptq" "$tmp/b/olmoe.gguf" --quiet || fail "export-gguf exited $?"
cmp -s "$tmp/a/olmoe.gguf" "$tmp/b/olmoe.gguf" || fail "export-gguf of the GPTQ checkpoint differs"
"$cli" export-gguf "$tmp/gptq" "$tmp/b/olmoe.gguf" --quiet 2>/dev/null
[ $? -eq 1 ] || fail "export-gguf over an existing file without --force should exit 1"

# eval --dequantize on the .gguf equals eval --dequantize on the checkpoint of the same codes
# (a TMPDIR of this test alone: a .gguf MODEL is read in place, so nothing may appear there)
export TMPDIR="$tmp/gguf-tmp"
mkdir -p "$TMPDIR"
"$cli" eval "$tmp/a/olmoe.gguf" --task text --data "$repo/data/demo-eval.txt" --dequantize --json > "$tmp/e1.json" 2>/dev/null ||
    fail "eval on .gguf exited $?"
"$cli" eval "$tmp/gptq" --task text --data "$repo/data/demo-eval.txt" --dequantize --json > "$tmp/e2.json" 2>/dev/null ||
    fail "eval on the checkpoint exited $?"
a=$(json_get "$tmp/e1.json" loglikelihood); b=$(json_get "$tmp/e2.json" loglikelihood)
[ -n "$a" ] && [ "$a" = "$b" ] || fail "eval: .gguf loglikelihood '$a', checkpoint '$b'"
[ "$(json_get "$tmp/e1.json" model)" = "\"$tmp/a/olmoe.gguf\"" ] || fail "eval: model is $(json_get "$tmp/e1.json" model)"
# streamed layer by layer from the file: the same figure, one layer's weights resident
"$cli" eval "$tmp/a/olmoe.gguf" --task text --data "$repo/data/demo-eval.txt" --stream on --json > "$tmp/e5.json" 2>/dev/null ||
    fail "eval --stream on on .gguf exited $?"
c=$(json_get "$tmp/e5.json" loglikelihood)
[ "$c" = "$a" ] || fail "eval --stream on: .gguf loglikelihood '$c', whole '$a'"
# run packed in place (the default): within the packed kernels' rounding of the fp32 figure
"$cli" eval "$tmp/a/olmoe.gguf" --task text --data "$repo/data/demo-eval.txt" --json > "$tmp/e7.json" 2>/dev/null ||
    fail "eval packed on .gguf exited $?"
p=$(json_get "$tmp/e7.json" loglikelihood)
awk -v p="$p" -v a="$a" 'BEGIN { d = (p - a) / a; exit !(p != "" && d < 1e-4 && d > -1e-4) }' ||
    fail "eval packed on .gguf: loglikelihood '$p' against the fp32 '$a'"
w=$(json_get "$tmp/e5.json" weight_bytes); f=$(json_get "$tmp/e5.json" weight_bytes_fp32)
[ -n "$w" ] && [ $((w * 3)) -lt "$f" ] || fail "eval --stream on: $w bytes of weights resident of $f"
# the .gguf as the KL base, both streamed in lockstep: the same distributions
"$cli" eval "$tmp/gptq" --dequantize --kl-base "$tmp/a/olmoe.gguf" --stream on --task text \
    --data "$repo/data/demo-eval.txt" --json > "$tmp/e6.json" 2>/dev/null || fail "eval --kl-base .gguf exited $?"
[ "$(json_get "$tmp/e6.json" kl_mean)" = 0 ] || fail "eval --kl-base .gguf: kl_mean $(json_get "$tmp/e6.json" kl_mean)"
[ "$(json_get "$tmp/e6.json" top1_changed)" = 0 ] || fail "eval --kl-base .gguf: top1 changed"
# and with llama.cpp's Q8_0 activations emulated (every Q4_0 Linear of the file, the Linears stored
# quantized in the checkpoint): the same again, and not the fp32 figure
"$cli" eval "$tmp/a/olmoe.gguf" --task text --data "$repo/data/demo-eval.txt" --act-quant q8_0 --json > "$tmp/e3.json" 2>/dev/null ||
    fail "eval --act-quant q8_0 on .gguf exited $?"
"$cli" eval "$tmp/gptq" --task text --data "$repo/data/demo-eval.txt" --act-quant q8_0 --json > "$tmp/e4.json" 2>/dev/null ||
    fail "eval --act-quant q8_0 on the checkpoint exited $?"
c=$(json_get "$tmp/e3.json" loglikelihood); d=$(json_get "$tmp/e4.json" loglikelihood)
[ -n "$c" ] && [ "$c" = "$d" ] || fail "eval --act-quant q8_0: .gguf loglikelihood '$c', checkpoint '$d'"
[ "$c" != "$a" ] || fail "eval --act-quant q8_0 on .gguf changed nothing ($c)"
t1=$("$cli" tokenize "$tmp/a/olmoe.gguf" --text "The tower is 324 metres tall." --json) || fail "tokenize .gguf"
t2=$("$cli" tokenize "$model" --text "The tower is 324 metres tall." --json)
[ "$t1" = "$t2" ] || fail "tokenize: .gguf $t1, model $t2"
[ -z "$(ls -A "$TMPDIR")" ] || fail "something was left in $TMPDIR: $(ls -A "$TMPDIR")"
# killed by SIGPIPE (its reader gone after one byte): nothing is left either
"$cli" generate "$tmp/a/olmoe.gguf" --prompt "The" -n 500 --greedy 2>/dev/null | head -c 1 >/dev/null
rc=${PIPESTATUS[0]}
[ "$rc" -eq 141 ] || fail "generate | head -c 1: exit $rc (expected death by SIGPIPE, 141)"
[ -z "$(ls -A "$TMPDIR")" ] || fail "killed by SIGPIPE, it left $TMPDIR: $(ls -A "$TMPDIR")"
unset TMPDIR

# the Mixtral and Qwen3-MoE layouts (random weights, small): the .gguf evaluates as the checkpoint
for like in mixtral-8x7b qwen3-30b-a3b; do
    "$cli" bench gen-model --like $like --out "$tmp/$like" --layers 2 --experts 4 --top-k 2 --hidden 256 \
        --ffn 128 --vocab 4096 >/dev/null 2>&1 || fail "gen-model $like"
    "$cli" quantize "$tmp/$like" --out "$tmp/$like-gptq" --scheme int4 --group-size 32 --format gptq --quiet ||
        fail "$like: gptq exited $?"
    "$cli" export-gguf "$tmp/$like-gptq" "$tmp/$like.gguf" --quiet || fail "$like: export-gguf exited $?"
    "$cli" eval "$tmp/$like.gguf" --task text --data "$repo/data/demo-eval.txt" --max-length 256 --dequantize --json > "$tmp/m1.json" 2>/dev/null ||
        fail "$like: eval on .gguf exited $?"
    "$cli" eval "$tmp/$like-gptq" --task text --data "$repo/data/demo-eval.txt" --max-length 256 --dequantize --json > "$tmp/m2.json" 2>/dev/null ||
        fail "$like: eval exited $?"
    a=$(json_get "$tmp/m1.json" loglikelihood); b=$(json_get "$tmp/m2.json" loglikelihood)
    [ -n "$a" ] && [ "$a" = "$b" ] || fail "$like: .gguf loglikelihood '$a', checkpoint '$b'"
done

# refused before any work: NVFP4 for olmoe (llama.cpp's graph drops the experts' global scale)
"$cli" quantize "$model" --out "$tmp/a/nv.gguf" --scheme nvfp4a16 --format gguf --quiet 2> "$tmp/err"
[ $? -eq 1 ] || fail "olmoe NVFP4 GGUF should exit 1"
grep -q "global scale" "$tmp/err" || fail "olmoe NVFP4: message: $(cat "$tmp/err")"
[ ! -e "$tmp/a/nv.gguf" ] && [ ! -e "$tmp/a/nv.gguf.moeq-work" ] || fail "olmoe NVFP4: something was written"
# W4A4 is refused too
"$cli" quantize "$model" --out "$tmp/a/w4a4.gguf" --scheme nvfp4 --calib "$repo/data/demo-calib.txt" --format gguf --quiet 2>/dev/null
[ $? -eq 1 ] || fail "W4A4 GGUF should exit 1"

# usage errors
"$cli" quantize "$model" --out "$tmp/x" --scheme int4 --gguf-rest q8_0 --quiet 2>/dev/null
[ $? -eq 2 ] || fail "--gguf-rest without --format gguf should exit 2"
"$cli" export-gguf "$model" 2>/dev/null
[ $? -eq 2 ] || fail "export-gguf without OUT should exit 2"
"$cli" export-gguf "$model" "$tmp/c.gguf" --gguf-rest q4 2>/dev/null
[ $? -eq 2 ] || fail "a bad --gguf-rest should exit 2"
# a corrupt file is a clear error
head -c 1000 "$tmp/a/olmoe.gguf" > "$tmp/cut.gguf"
"$cli" inspect "$tmp/cut.gguf" 2> "$tmp/err" >/dev/null
[ $? -eq 1 ] || fail "inspect of a truncated file should exit 1"
grep -q "truncated" "$tmp/err" || fail "truncated: message: $(cat "$tmp/err")"
# ... and for eval and tokenize, naming the file: cut short, cut in its tensors' data, bad magic
size=$(wc -c < "$tmp/a/olmoe.gguf")
head -c $((size / 2)) "$tmp/a/olmoe.gguf" > "$tmp/half.gguf"
{ printf 'GGUX'; tail -c +5 "$tmp/a/olmoe.gguf"; } > "$tmp/magic.gguf"
for bad in cut half magic; do
    for st in on off; do
        "$cli" eval "$tmp/$bad.gguf" --task text --data "$repo/data/demo-eval.txt" --stream $st 2> "$tmp/err" >/dev/null
        [ $? -eq 1 ] || fail "eval --stream $st of $bad.gguf should exit 1"
        grep -q "$tmp/$bad.gguf" "$tmp/err" || fail "eval of $bad.gguf: message does not name it: $(cat "$tmp/err")"
    done
    "$cli" tokenize "$tmp/$bad.gguf" --text "x" 2> "$tmp/err" >/dev/null
    [ $? -eq 1 ] || fail "tokenize of $bad.gguf should exit 1"
    grep -q "$tmp/$bad.gguf" "$tmp/err" || fail "tokenize of $bad.gguf: message does not name it: $(cat "$tmp/err")"
done
grep -q "not a GGUF file" "$tmp/err" || fail "bad magic: message: $(cat "$tmp/err")"
exit $((fails > 0))

#!/usr/bin/env bash
# moeq quantize on the bundled olmoe-tiny: each format writes its tensors and config block, an
# existing OUT_DIR is refused without --force, bad usage exits 2, a failing job exits 1 and leaves
# nothing behind, W4A4 calibrates input scales.
. "$(dirname "$0")/common.sh"

# header_has FILE NAME DTYPE: the safetensors header lists tensor NAME with DTYPE
header_has() {
    local n
    n=$(od -An -t u8 -N 8 "$1" | tr -d ' ')
    head -c $((8 + n)) "$1" | tail -c "$n" | grep -q "\"$2\":{\"dtype\":\"$3\"" ||
        fail "$1: no tensor $2 of dtype $3"
}

# compressed-tensors NVFP4 (weight-only)
"$cli" quantize "$model" --out "$tmp/ct" --scheme nvfp4a16 --quiet || fail "nvfp4a16 exited $?"
header_has "$tmp/ct/model.safetensors" model.layers.0.self_attn.q_proj.weight_packed U8
header_has "$tmp/ct/model.safetensors" model.layers.0.self_attn.q_proj.weight_scale F8_E4M3
header_has "$tmp/ct/model.safetensors" model.layers.3.mlp.experts.7.down_proj.weight_global_scale F32
header_has "$tmp/ct/model.safetensors" model.layers.0.mlp.gate.weight BF16
grep -q '"nvfp4-pack-quantized"' "$tmp/ct/config.json" || fail "ct: config lacks the format"
grep -q '"model.layers.2.mlp.gate"' "$tmp/ct/config.json" || fail "ct: router not in ignore"
[ -f "$tmp/ct/tokenizer.json" ] || fail "ct: tokenizer.json not copied"
# inspect: storage and bits per weight, per kind and per weight
out=$("$cli" inspect "$tmp/ct" --weights) || fail "inspect exited $?"
printf '%s\n' "$out" | grep -q 'nvfp4 (compressed-tensors) *112 weights.*4.500 bits per weight' ||
    fail "inspect: no NVFP4 summary"
printf '%s\n' "$out" | grep -q '^  model.layers.0.mlp.experts.3.up_proj  *nvfp4 (compressed-tensors) *16  *4.500$' ||
    fail "inspect: no per-weight line"
printf '%s\n' "$out" | grep -q '^  model.layers.0.mlp.gate  *dense .*16.000$' || fail "inspect: router line"

# INT4 group 64 asymmetric, sharded
"$cli" quantize "$model" --out "$tmp/int4" --scheme int4 --group-size 64 --asym \
    --max-shard-size 2MB --quiet || fail "int4 exited $?"
[ -f "$tmp/int4/model.safetensors.index.json" ] || fail "int4: no shard index"
ls "$tmp"/int4/model-0000*-of-0000*.safetensors >/dev/null 2>&1 || fail "int4: no shards"
grep -q '"pack-quantized"' "$tmp/int4/config.json" || fail "int4: config lacks the format"
grep -q 'weight_zero_point' "$tmp/int4/model.safetensors.index.json" || fail "int4: no zero points"

# GPTQ v1 and ModelOpt
"$cli" quantize "$model" --out "$tmp/gptq" --scheme int4 --format gptq --quiet || fail "gptq exited $?"
header_has "$tmp/gptq/model.safetensors" model.layers.1.self_attn.o_proj.qweight I32
header_has "$tmp/gptq/model.safetensors" model.layers.1.self_attn.o_proj.scales F16
[ -f "$tmp/gptq/quantize_config.json" ] || fail "gptq: no quantize_config.json"
"$cli" inspect "$tmp/gptq" | grep -q 'int4 (gptq) *112 weights.*4.281 bits per weight' ||
    fail "inspect gptq: 4 + 16/128 (scales) + 4/128 (zeros) + 32/256 (g_idx) bits per weight"
out=$("$cli" quantize "$model" --out "$tmp/mo" --scheme nvfp4a16 --format modelopt --mse) ||
    fail "modelopt exited $?"
printf '%s' "$out" | grep -q '112 Linears quantized' || fail "modelopt summary: $out"
header_has "$tmp/mo/model.safetensors" model.layers.1.self_attn.o_proj.weight_scale_2 F32
grep -q '"W4A16_NVFP4"' "$tmp/mo/hf_quant_config.json" || fail "modelopt: hf_quant_config.json"

# W4A4 needs calibration text; with it, input scales are written
"$cli" quantize "$model" --out "$tmp/w4a4" --scheme nvfp4 >/dev/null 2>&1
[ $? -eq 2 ] || fail "nvfp4 without --calib: expected exit 2"
printf 'The quick brown fox jumps over the lazy dog. It was a bright cold day in April.\n' > "$tmp/calib.txt"
"$cli" quantize "$model" --out "$tmp/w4a4" --scheme nvfp4 --calib "$tmp/calib.txt" --quiet \
    2>/dev/null || fail "w4a4 exited $?"
header_has "$tmp/w4a4/model.safetensors" model.layers.0.self_attn.v_proj.input_global_scale F32
grep -q '"input_activations":[[:space:]]*{' "$tmp/w4a4/config.json" || fail "w4a4: no input_activations"

# existing OUT_DIR: refused (exit 1) without --force, replaced with it
"$cli" quantize "$model" --out "$tmp/ct" --scheme int4 --quiet 2>"$tmp/err"
[ $? -eq 1 ] || fail "existing OUT_DIR: expected exit 1"
grep -q -- "--force" "$tmp/err" || fail "existing OUT_DIR: message does not mention --force"
grep -q '"nvfp4-pack-quantized"' "$tmp/ct/config.json" || fail "existing OUT_DIR was modified"
"$cli" quantize "$model" --out "$tmp/ct" --scheme int4 --force --quiet || fail "--force exited $?"
grep -q '"pack-quantized"' "$tmp/ct/config.json" || fail "--force did not replace OUT_DIR"

# usage errors exit 2
calib=$repo/data/demo-calib.txt
for args in "--scheme nvfp4a16" "--out $tmp/u --scheme fp8" "--out $tmp/u --scheme nvfp4a16 --format gptq" \
            "--out $tmp/u --scheme int4 --sym --asym" "--out $tmp/u --scheme nvfp4a16 --group-size 32" \
            "--out $tmp/u --scheme int4 --max-shard-size lots" \
            "--out $tmp/u --scheme nvfp4a16 --int4-scale-sign positive" "--out $tmp/u --scheme int4 --asym --int4-scale-sign signed" \
            "--out $tmp/u --scheme int4 --reference --int4-scale-sign signed" "--out $tmp/u --scheme int4 --int4-scale-sign both" \
            "--out $tmp/u --scheme int4 --method gptq --calib $calib --calib-balance all" \
            "--out $tmp/u --scheme int4 --method gptq --calib $calib --calib-balance experts --calib-pool 0" \
            "--out $tmp/u --scheme int4 --method gptq --calib $calib --calib-balance experts --calib-pool 100" \
            "--out $tmp/u --scheme int4 --method gptq --calib $calib --calib-pool 512"; do
    "$cli" quantize "$model" $args >/dev/null 2>&1
    [ $? -eq 2 ] || fail "'$args': expected exit 2"
done
# a failing job exits 1 and leaves nothing
"$cli" quantize "$model" --out "$tmp/bad" --scheme int4 --ignore 'experts.(' 2>"$tmp/err"
[ $? -eq 1 ] || fail "bad regex: expected exit 1"
grep -q 'experts.(' "$tmp/err" || fail "bad regex: message does not name it"
"$cli" quantize "$tmp/nowhere" --out "$tmp/bad" --scheme int4 >/dev/null 2>&1
[ $? -eq 1 ] || fail "missing model: expected exit 1"
[ ! -e "$tmp/bad" ] || fail "a failed job left $tmp/bad"
ls -a "$tmp" | grep -q '\.tmp-' && fail "a temporary directory was left behind"
"$cli" quantize --help >/dev/null || fail "--help: expected exit 0"

[ $fails -eq 0 ] && echo "all quantize CLI checks passed"
exit $((fails > 0))

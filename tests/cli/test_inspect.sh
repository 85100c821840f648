#!/usr/bin/env bash
# moeq inspect: the bundled olmoe-tiny's layout and counts (hand-checked: 9,449,728 bf16 values in
# 135 tensors; active = total less 6 of 8 experts' 3*256*256 weights in each of 4 layers), the
# --tensors listing, a quantization_config, and usage/exit codes.
. "$(dirname "$0")/common.sh"
has() { printf '%s\n' "$1" | grep -q -- "$2" || fail "output lacks '$2'"; }

out=$("$cli" inspect "$model") || fail "inspect exited $?"
has "$out" "architecture *olmoe"
has "$out" "layers *4 (4 MoE, 0 dense)"
has "$out" "8 per MoE layer, top-2, expert ffn 256"
has "$out" "(9449728)"
has "$out" "(4731136)"   # 9449728 - 4 * 6 * 3 * 256 * 256
has "$out" "tensors *135"
has "$out" "BF16 *9449728 values, 18.90 MB"
has "$out" "quantization *none"

out=$("$cli" inspect "$model" --tensors) || fail "--tensors exited $?"
has "$out" "model.layers.3.mlp.experts.7.down_proj.weight *BF16 *\[256, 256\] *131072"
has "$out" "lm_head.weight *BF16 *\[4096, 256\] *2097152"
[ "$(printf '%s\n' "$out" | grep -c '^model\.\|^lm_head')" -eq 135 ] || fail "--tensors does not list 135 tensors"
# layers in numeric order
printf '%s\n' "$out" | grep -o 'model.layers.[0-9]*' | uniq | tr '\n' ' ' | grep -q "^model.layers.0 model.layers.1 model.layers.2 model.layers.3 $" ||
    fail "layers not in numeric order"

if [ -d "$repo/tests/data/qwen2moe-dense-tiny-fused" ]; then
    out=$("$cli" inspect "$repo/tests/data/qwen2moe-dense-tiny-fused") || fail "fused exited $?"
    has "$out" "layers *2 (1 MoE, 1 dense)"
    has "$out" "shared expert *ffn 64, sigmoid gate"
    has "$out" "tied embeddings *yes"
fi

# a quantization_config is reported
mkdir "$tmp/q"
ln -s "$model/model.safetensors" "$tmp/q/model.safetensors"
sed 's/"model_type": "olmoe",/"model_type": "olmoe", "quantization_config": {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized", "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16, "symmetric": true}}}, "ignore": ["lm_head"]},/' \
    "$model/config.json" > "$tmp/q/config.json"
out=$("$cli" inspect "$tmp/q") || fail "quantized config exited $?"
has "$out" "quantization *compressed-tensors, format nvfp4-pack-quantized"
has "$out" "group_0 .*weights: float4 tensor_group g16 sym"
has "$out" 'ignore *\["lm_head"\]'

"$cli" inspect "$model" --bogus >/dev/null 2>"$tmp/err"
[ $? -eq 2 ] || fail "bad flag: expected exit 2"
grep -q -- "--bogus" "$tmp/err" || fail "bad flag not named"
"$cli" inspect >/dev/null 2>&1
[ $? -eq 2 ] || fail "no MODEL_DIR: expected exit 2"
"$cli" inspect --help | grep -q -- "--tensors" || fail "--help does not list --tensors"
"$cli" inspect "$tmp/none" >/dev/null 2>"$tmp/err"
[ $? -eq 1 ] || fail "missing dir: expected exit 1"
grep -q "$tmp/none" "$tmp/err" || fail "missing dir not named"
mkdir "$tmp/bad"
echo '{"model_type": "gpt2"}' > "$tmp/bad/config.json"
"$cli" inspect "$tmp/bad" >/dev/null 2>"$tmp/err"
[ $? -eq 1 ] || fail "unknown model_type: expected exit 1"
grep -q "gpt2" "$tmp/err" || fail "unknown model_type not named: $(cat "$tmp/err")"

[ $fails -eq 0 ] || exit 1
echo "test_inspect: all checks passed"

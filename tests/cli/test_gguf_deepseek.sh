#!/usr/bin/env bash
# DeepSeek-V3 GGUF (llama.cpp's deepseek2) from the command line, on tests/data/deepseekv3-tiny (q
# LoRA, YaRN, expert groups, an MTP layer) and deepseekv3-noqlora-tiny (plain q_proj, halves RoPE),
# with the bundled tokenizer: quantize --format gguf writes one file (the MTP layer left out, and
# said where the checkpoint has it), inspect shows the deepseek2 KVs and the split latent tensors,
# export-gguf of a GPTQ
# checkpoint of the same codes gives the same bytes, eval on the .gguf gives the checkpoint's
# loglikelihood to the last digit (INT4 g32 -> Q4_0, unquantized -> F32, an FP8 source -> F32), NVFP4
# is refused.
. "$(dirname "$0")/common.sh"
data=$repo/tests/data
export TMPDIR="$tmp/gguf-tmp"   # the temporary checkpoints of a .gguf MODEL: this test's alone
mkdir -p "$TMPDIR"
# layer 0's dense down_proj has 80 inputs: no whole 32-value Q4_0 blocks, so it stays float
ign=(--ignore 'model\.layers\.0\.mlp\.down_proj')
ev=(--task text --data "$repo/data/demo-eval.txt" --json)
for fx in deepseekv3-tiny deepseekv3-noqlora-tiny; do
    src=$tmp/$fx
    mkdir -p "$src" && cp "$data/$fx"/* "$src"/ && cp "$model"/tokenizer*.json "$src"/
    mkdir -p "$tmp/$fx-a"
    "$cli" quantize "$src" --out "$tmp/$fx-a/q.gguf" --scheme int4 --group-size 32 --method rtn --format gguf \
        "${ign[@]}" 2>"$tmp/q.log" || fail "$fx: quantize --format gguf exited $?"
    [ "$(ls "$tmp/$fx-a")" = q.gguf ] || fail "$fx: left beside the file: $(ls "$tmp/$fx-a")"
    # deepseekv3-tiny has its MTP layer's tensors; the other fixture only the config's count
    if [ $fx = deepseekv3-tiny ]; then
        grep -q "multi-token-prediction layer (model.layers.3, num_nextn_predict_layers) is not written" "$tmp/q.log" ||
            fail "$fx: quantize does not say the MTP layer is left out: $(cat "$tmp/q.log")"
    elif grep -q "multi-token-prediction" "$tmp/q.log"; then
        fail "$fx: an MTP layer it does not have is said to be left out"
    fi
    out=$("$cli" inspect "$tmp/$fx-a/q.gguf" --tensors) || fail "$fx: inspect exited $?"
    for want in '^  general.architecture  *STRING  *"deepseek2"$' '^  deepseek2.attention.head_count_kv  *UINT32  *1$' \
        '^  deepseek2.attention.kv_lora_rank  *UINT32  *32$' '^  deepseek2.attention.key_length_mla  *UINT32  *24$' \
        '^  deepseek2.expert_gating_func  *UINT32  *2$' '^  deepseek2.leading_dense_block_count  *UINT32  *1$' \
        '^  blk.1.attn_k_b.weight  *f32  *{16, 32, 4}' '^  blk.1.attn_v_b.weight  *q4_0  *{32, 16, 4}' \
        '^  blk.1.exp_probs_b.bias  *f32 '; do
        printf '%s\n' "$out" | grep -q "$want" || fail "$fx: inspect lacks $want"
    done
    if [ $fx = deepseekv3-tiny ]; then
        printf '%s\n' "$out" | grep -q '^  deepseek2.rope.scaling.type  *STRING  *"yarn"$' || fail "$fx: no yarn"
        printf '%s\n' "$out" | grep -q '^  blk.2.ffn_gate_exps.weight  *q4_0  *{64, 32, 16}' || fail "$fx: experts"
        printf '%s\n' "$out" | grep -q 'blk.3\.' && fail "$fx: the MTP layer was written"
    else
        printf '%s\n' "$out" | grep -q '^  blk.0.attn_q.weight  *q4_0  *{64, 96}' || fail "$fx: no attn_q"
        printf '%s\n' "$out" | grep -q 'attn_q_a' && fail "$fx: attn_q_a without q LoRA"
    fi

    # the same codes through a GPTQ checkpoint and export-gguf: the same bytes; eval equal to the
    # checkpoint's (dequantized) to the last digit
    "$cli" quantize "$src" --out "$tmp/$fx-gptq" --scheme int4 --group-size 32 --method rtn --format gptq \
        "${ign[@]}" --quiet 2>/dev/null || fail "$fx: gptq exited $?"
    mkdir -p "$tmp/$fx-b"   # the same base name: general.name
    "$cli" export-gguf "$tmp/$fx-gptq" "$tmp/$fx-b/q.gguf" --quiet 2>/dev/null || fail "$fx: export-gguf exited $?"
    cmp -s "$tmp/$fx-a/q.gguf" "$tmp/$fx-b/q.gguf" || fail "$fx: export-gguf of the GPTQ checkpoint differs"
    "$cli" eval "$tmp/$fx-a/q.gguf" "${ev[@]}" --dequantize >"$tmp/e1.json" 2>/dev/null || fail "$fx: eval on .gguf exited $?"
    "$cli" eval "$tmp/$fx-gptq" "${ev[@]}" --dequantize >"$tmp/e2.json" 2>/dev/null || fail "$fx: eval exited $?"
    a=$(json_get "$tmp/e1.json" loglikelihood); b=$(json_get "$tmp/e2.json" loglikelihood)
    [ -n "$a" ] && [ "$a" = "$b" ] || fail "$fx: .gguf loglikelihood '$a', checkpoint '$b'"
    # llama.cpp's activation rounding emulated: runs, and moves the figure
    "$cli" eval "$tmp/$fx-a/q.gguf" "${ev[@]}" --act-quant q8_0 >"$tmp/e3.json" 2>/dev/null ||
        fail "$fx: eval --act-quant q8_0 on .gguf exited $?"
    c=$(json_get "$tmp/e3.json" loglikelihood)
    [ -n "$c" ] && [ "$c" != "$a" ] || fail "$fx: --act-quant q8_0 gave '$c' (fp32 '$a')"

    # unquantized, every tensor F32: the source model's loglikelihood
    "$cli" export-gguf "$src" "$tmp/$fx-f32.gguf" --gguf-rest f32 --quiet 2>/dev/null || fail "$fx: f32 export exited $?"
    "$cli" eval "$tmp/$fx-f32.gguf" "${ev[@]}" >"$tmp/e4.json" 2>/dev/null || fail "$fx: eval of the F32 .gguf exited $?"
    "$cli" eval "$src" "${ev[@]}" >"$tmp/e5.json" 2>/dev/null || fail "$fx: eval of the source exited $?"
    a=$(json_get "$tmp/e4.json" loglikelihood); b=$(json_get "$tmp/e5.json" loglikelihood)
    [ -n "$a" ] && [ "$a" = "$b" ] || fail "$fx: F32 .gguf loglikelihood '$a', source '$b'"
done
# an FP8 block-quantized source (the FP8 copy of deepseekv3-tiny): its Linears dequantized one at a
# time into F32 (exact), the .gguf evaluates as the FP8 checkpoint itself
src=$tmp/fp8
mkdir -p "$src" && cp "$data/deepseekv3-fp8-tiny"/* "$src"/ && cp "$model"/tokenizer*.json "$src"/
"$cli" export-gguf "$src" "$tmp/fp8.gguf" --quiet 2>/dev/null || fail "FP8 source: export-gguf exited $?"
"$cli" inspect "$tmp/fp8.gguf" --tensors | grep -q '^  blk.1.attn_q_b.weight  *f32  *{64, 96}' ||
    fail "FP8 source: attn_q_b is not F32"
"$cli" eval "$tmp/fp8.gguf" "${ev[@]}" --dequantize >"$tmp/e6.json" 2>/dev/null || fail "FP8 source: eval of the .gguf exited $?"
"$cli" eval "$src" "${ev[@]}" >"$tmp/e7.json" 2>/dev/null || fail "FP8 source: eval exited $?"
a=$(json_get "$tmp/e6.json" loglikelihood); b=$(json_get "$tmp/e7.json" loglikelihood)
[ -n "$a" ] && [ "$a" = "$b" ] || fail "FP8 source: .gguf loglikelihood '$a', FP8 checkpoint '$b'"
[ -z "$(ls -A "$TMPDIR")" ] || fail "a temporary checkpoint was left in $TMPDIR: $(ls -A "$TMPDIR")"

# NVFP4: llama.cpp's deepseek2 graph applies no global scales; refused before any work
"$cli" quantize "$tmp/deepseekv3-tiny" --out "$tmp/nv.gguf" --scheme nvfp4a16 --format gguf --quiet 2>"$tmp/err"
[ $? -eq 1 ] || fail "NVFP4 deepseek2 GGUF should exit 1"
grep -q "deepseek2" "$tmp/err" || fail "NVFP4: message: $(cat "$tmp/err")"
[ ! -e "$tmp/nv.gguf" ] && [ ! -e "$tmp/nv.gguf.moeq-work" ] || fail "NVFP4: something was written"
exit $((fails > 0))

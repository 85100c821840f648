#!/usr/bin/env bash
# DeepSeek-V3 through the command line, on tests/data/deepseekv3-tiny (with the bundled model's
# tokenizer): inspect reports the latent attention, the routing and the MTP layer; quantize keeps
# the MTP layer's tensors (inspect counts them in the output too) or drops them with --drop-mtp;
# --format gguf is refused before any work (exit 1, naming llama.cpp's deepseek2); eval of the
# FP8 copy against its dequantized twin gives a KL of exactly 0; the quantized checkpoint
# generates on the packed kernels; ModelOpt, GPTQ and INT4 compressed-tensors checkpoints read back.
. "$(dirname "$0")/common.sh"
data=$repo/tests/data
mk() { # mk NAME: tests/data/NAME with the bundled tokenizer, in $tmp
    mkdir -p "$tmp/$1" && cp "$data/$1"/* "$tmp/$1"/ && cp "$model"/tokenizer*.json "$tmp/$1"/
}
mk deepseekv3-tiny
mk deepseekv3-fp8-tiny
src=$tmp/deepseekv3-tiny

out=$("$cli" inspect "$src") || fail "inspect exited $?"
for want in "deepseek_v3 (MoE, multi-head latent attention" "3 (2 MoE, 1 dense)" \
    "q_lora_rank 64, kv_lora_rank 32, q/k head 16 + 8 rope, v head 16, interleaved rope" \
    "YaRN factor 4 (original context 256)" "softmax scale 0.251911" \
    "sigmoid scores + e_score_correction_bias for the choice, 4 groups (top 2 eligible), weights x 2.5" \
    "MTP layers            1 (num_nextn_predict_layers): 68 tensors"; do
    printf '%s\n' "$out" | grep -qF "$want" || fail "inspect lacks '$want'"
done

"$cli" quantize "$src" --out "$tmp/q" --scheme nvfp4a16 --method rtn 2>"$tmp/q.log" || fail "quantize exited $?"
grep -q "68 tensors of the multi-token-prediction layers passed through unchanged" "$tmp/q.log" ||
    fail "quantize does not say the MTP tensors passed through: $(cat "$tmp/q.log")"
"$cli" inspect "$tmp/q" | grep -qF "MTP layers            1 (num_nextn_predict_layers): 68 tensors" ||
    fail "the MTP layer is not in the quantized checkpoint"
"$cli" generate "$tmp/q" --prompt "The" -n 4 --greedy >"$tmp/gen.txt" 2>"$tmp/gen.log" ||
    fail "generate on the quantized checkpoint exited $?"
grep -q "packed" "$tmp/gen.log" || fail "generate did not report packed weights: $(cat "$tmp/gen.log")"

"$cli" quantize "$src" --out "$tmp/qd" --scheme nvfp4a16 --method rtn --drop-mtp 2>/dev/null || fail "--drop-mtp exited $?"
"$cli" inspect "$tmp/qd" | grep -qF "MTP layers            0 (num_nextn_predict_layers): 0 tensors" ||
    fail "--drop-mtp left MTP tensors or the config's count"

"$cli" quantize "$src" --out "$tmp/x.gguf" --scheme int4 --group-size 32 --format gguf 2>"$tmp/g.log"
rc=$?
[ $rc -eq 1 ] || fail "--format gguf: exit $rc, expected 1"
grep -q "deepseek2" "$tmp/g.log" || fail "--format gguf: the message does not name deepseek2: $(cat "$tmp/g.log")"
[ -e "$tmp/x.gguf" ] && fail "--format gguf left a file"

"$cli" eval "$tmp/deepseekv3-fp8-tiny" --task text --data "$repo/data/demo-eval.txt" --kl-base "$src" \
    --json >"$tmp/e.json" 2>/dev/null || fail "eval of the FP8 copy exited $?"
kl=$(json_get "$tmp/e.json" kl_mean)
[ "$kl" = "0" ] || fail "FP8 copy vs its dequantized twin: kl_mean $kl, expected 0"

# every checkpoint format holds it and reads back (KL to the unquantized model on held-out text,
# measured 0.053-0.058 nats per token for these RTN runs)
for f in "modelopt nvfp4a16" "gptq int4 --group-size 16" "compressed-tensors int4 --group-size 16"; do
    set -- $f
    fmt=$1 scheme=$2
    shift 2
    "$cli" quantize "$src" --out "$tmp/f-$fmt" --scheme "$scheme" --method rtn --format "$fmt" "$@" \
        2>/dev/null || { fail "--format $fmt exited $?"; continue; }
    "$cli" eval "$tmp/f-$fmt" --task text --data "$repo/data/demo-eval.txt" --kl-base "$src" --json \
        >"$tmp/f-$fmt.json" 2>/dev/null || { fail "eval of --format $fmt exited $?"; continue; }
    kl=$(json_get "$tmp/f-$fmt.json" kl_mean)
    awk -v k="$kl" 'BEGIN { exit !(k > 0.01 && k < 0.1) }' || fail "--format $fmt: kl_mean $kl"
done

[ $fails -eq 0 ] || exit 1
echo "test_deepseek: all checks passed"

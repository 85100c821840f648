#!/usr/bin/env bash
# DeepSeek-V3 through the command line, on tests/data/deepseekv3-tiny (with the bundled model's
# tokenizer): inspect reports the latent attention, the routing and the MTP layer; quantize keeps
# the MTP layer's tensors (inspect counts them in the output too) or drops them with --drop-mtp;
# NVFP4 --format gguf is refused before any work (exit 1, naming llama.cpp's deepseek2); eval of the
# FP8 copy against its dequantized twin gives a KL of exactly 0; the quantized checkpoint
# generates on the packed kernels; ModelOpt, GPTQ and INT4 compressed-tensors checkpoints read back;
# an FP8 source's MTP layer passes through as FP8; a killed and resumed GPTQ run and mpirun give
# the single process's bytes.
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

"$cli" quantize "$src" --out "$tmp/x.gguf" --scheme nvfp4a16 --format gguf 2>"$tmp/g.log"
rc=$?
[ $rc -eq 1 ] || fail "--format gguf: exit $rc, expected 1"
grep -q "deepseek2" "$tmp/g.log" || fail "--format gguf: the message does not name deepseek2: $(cat "$tmp/g.log")"
[ -e "$tmp/x.gguf" ] && fail "--format gguf left a file"

"$cli" eval "$tmp/deepseekv3-fp8-tiny" --task text --data "$repo/data/demo-eval.txt" --kl-base "$src" \
    --json >"$tmp/e.json" 2>/dev/null || fail "eval of the FP8 copy exited $?"
kl=$(json_get "$tmp/e.json" kl_mean)
[ "$kl" = "0" ] || fail "FP8 copy vs its dequantized twin: kl_mean $kl, expected 0"

# an FP8 source's MTP layer passes through as it is: F8_E4M3 weights and their scales (made here
# by giving the FP8 copy a layer 3 of its layer 2's bytes)
if command -v python3 >/dev/null; then
    mkdir -p "$tmp/fp8mtp" && cp "$model"/tokenizer*.json "$tmp/fp8mtp"/
    python3 - "$data/deepseekv3-fp8-tiny" "$tmp/fp8mtp" <<'PY'
import json, struct, sys
src, dst = sys.argv[1], sys.argv[2]
raw = open(src + "/model.safetensors", "rb").read()
n = struct.unpack("<Q", raw[:8])[0]
head = json.loads(raw[8:8 + n]); head.pop("__metadata__", None)
data = {k: (v["dtype"], v["shape"], raw[8 + n + v["data_offsets"][0]:8 + n + v["data_offsets"][1]])
        for k, v in head.items()}
for k in list(data):
    if k.startswith("model.layers.2."):
        data[k.replace("model.layers.2.", "model.layers.3.", 1)] = data[k]
h, off, blobs = {}, 0, []
for k in sorted(data):
    dt, shp, b = data[k]
    h[k] = {"dtype": dt, "shape": shp, "data_offsets": [off, off + len(b)]}
    blobs.append(b); off += len(b)
hj = json.dumps(h).encode(); hj += b" " * (-len(hj) % 8)
open(dst + "/model.safetensors", "wb").write(struct.pack("<Q", len(hj)) + hj + b"".join(blobs))
c = json.load(open(src + "/config.json")); c["num_nextn_predict_layers"] = 1
json.dump(c, open(dst + "/config.json", "w"))
PY
    "$cli" quantize "$tmp/fp8mtp" --out "$tmp/fp8mtp-q" --scheme nvfp4a16 --method rtn 2>/dev/null ||
        fail "quantize of the FP8 source with an MTP layer exited $?"
    t=$("$cli" inspect "$tmp/fp8mtp-q" --tensors)
    printf '%s\n' "$t" | grep -q "model.layers.3.self_attn.q_a_proj.weight  *F8_E4M3  *\[64, 64\]" ||
        fail "the FP8 MTP weight is not passed through as F8_E4M3"
    printf '%s\n' "$t" | grep -q "model.layers.3.self_attn.q_a_proj.weight_scale_inv  *F32  *\[2, 2\]" ||
        fail "the FP8 MTP weight's scale is not passed through"
    cp "$model"/tokenizer*.json "$tmp/fp8mtp-q"/
    "$cli" eval "$tmp/fp8mtp-q" --task text --data "$repo/data/demo-eval.txt" >/dev/null 2>&1 ||
        fail "the quantized checkpoint with FP8 MTP tensors does not evaluate"
fi

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

# GPTQ killed in layer 1's experts, then --resume (with the MTP layer): the same bytes
g=(--scheme nvfp4a16 --method gptq --calib "$repo/data/demo-calib.txt" --nsamples 8 --seqlen 64 --quiet)
"$cli" quantize "$src" --out "$tmp/g1" "${g[@]}" || fail "GPTQ exited $?"
MOEQ_FAULT=chunk:1:1 "$cli" quantize "$src" --out "$tmp/gr" "${g[@]}" --expert-chunk 4 2>/dev/null
rc=$?
[ $rc -eq 137 ] || fail "the killed run exited $rc, expected 137"
"$cli" quantize "$src" --out "$tmp/gr" "${g[@]}" --expert-chunk 4 --resume || fail "--resume exited $?"
same_checkpoint "$tmp/g1" "$tmp/gr" "the resumed run" "the uninterrupted run"

# under mpirun (2 and 3 ranks: the latent attention's four slots calibrated on different ranks)
# the checkpoint is byte-identical to one process's
if command -v mpirun >/dev/null && "$cli" --version | grep -q "^MPI: Open MPI"; then
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
    export OMPI_MCA_btl=self,vader OMPI_MCA_btl_vader_single_copy_mechanism=none OMPI_MCA_plm_rsh_agent=false
    for np in 2 3; do
        timeout 300 mpirun --oversubscribe -np $np "$cli" quantize "$src" --out "$tmp/g$np" "${g[@]}" ||
            fail "mpirun -np $np exited $?"
        same_checkpoint "$tmp/g1" "$tmp/g$np" "mpirun -np $np" "the single-process run"
    done
fi

[ $fails -eq 0 ] || exit 1
echo "test_deepseek: all checks passed"

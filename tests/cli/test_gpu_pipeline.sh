#!/usr/bin/env bash
# moeq quantize --device cuda through the whole pipeline (skipped where no GPU answers). The
# chunk's experts stay on the GPU for both calibration passes and GPTQ, the Hessians are read
# where they were summed and GPTQ leaves the dequantized weights in place of the device's for
# the quantized pass. What must hold: the checkpoint is the same bytes whatever the expert
# chunk, the thread count and the batches (the device's, the default: all samples at once, or a
# few at a time with MOEQ_GPU_BATCH_ROWS; the CPU plan's with MOEQ_GPU_BATCH=plan), whether the
# first experts go up during the attention and the FFN's outputs join the boundary on the device
# or not (MOEQ_EXPERTS_AHEAD=0, MOEQ_GPU_RESIDUAL=0), whether the attention's results come
# back to the host where only the device reads them (MOEQ_GPU_HOST_COPIES=1), and after a
# kill and --resume (whose replay dequantizes the finished layers on the host, so the device's
# dequantized weights must be the host's bits); experts rounded to nearest as a fallback (their
# dequantized weights go up from the host) likewise, and without sequential calibration; the
# report shows the experts' rows, inputs and outputs on the device; and the GPU checkpoint's KL
# to the base model is within 2% of the CPU checkpoint's (both with the refinement off: it is
# CPU only).
. "$(dirname "$0")/common.sh"
native_only "GPU runs"

calib=$repo/data/demo-calib.txt
args=(--scheme nvfp4a16 --method gptq --calib "$calib" --nsamples 16 --seqlen 128 --quiet)
if ! "$cli" quantize "$model" --out "$tmp/probe" "${args[@]}" --nsamples 1 --seqlen 8 --device cuda 2>"$tmp/err"; then
    echo "SKIP: no GPU run possible here: $(head -c 300 "$tmp/err")"
    exit 77
fi
rm -rf "$tmp/probe"

"$cli" quantize "$model" --out "$tmp/a" "${args[@]}" --device cuda || fail "the GPU run exited $?"
"$cli" quantize "$model" --out "$tmp/b" "${args[@]}" --device cuda --expert-chunk 1 --threads 3 ||
    fail "the GPU run with --expert-chunk 1 --threads 3 exited $?"
same_checkpoint "$tmp/a" "$tmp/b" "--expert-chunk 1 --threads 3" "the default chunk"
# in each of the 4 layers the routed experts' rows stayed on the device, read their inputs where
# the GPU attention left them, and their outputs were combined there (the report says so; a
# decision that looked at the weights before they were read once kept all of it on the host,
# the same bytes, unnoticed)
rep=$tmp/a/gptq_report.json
for key in expert_batches_on_device batches_with_inputs_from_attention; do
    n=$(grep -c "\"$key\":[[:space:]]*[1-9]" "$rep")
    [ "$n" = 4 ] || fail "$key: at least one in $n of 4 layers ($rep)"
done
n=$(grep -c '"outputs_combined_on_device":[[:space:]]*true' "$rep")
[ "$n" = 4 ] || fail "outputs combined on the device in $n of 4 layers ($rep)"
# flagged KEY FILE: how many layers of the report have KEY true
flagged() { grep -c "\"$1\":[[:space:]]*true" "$2"; }
# switched_off VAR=VALUE KEY DIR: the run with the variable set has KEY in no layer and gives the
# default run's bytes
switched_off() {
    env "$1" "$cli" quantize "$model" --out "$3" "${args[@]}" --device cuda || fail "the GPU run with $1 exited $?"
    local n
    n=$(flagged "$2" "$3/gptq_report.json")
    [ "$n" = 0 ] || fail "$1: $2 still in $n layers"
    same_checkpoint "$tmp/a" "$3" "$1" "the default"
}
# each layer's first expert chunk went up while its attention ran (else after it); the FFN's
# outputs were added to the boundary on the device (else on the host); the boundary did not come
# back to the host, as only the device read it (else copied back as before): each the same bytes
for key in first_experts_sent_during_attention residual_added_on_device boundary_only_on_device; do
    n=$(flagged $key "$rep")
    [ "$n" = 4 ] || fail "$key in $n of 4 layers ($rep)"
done
switched_off MOEQ_EXPERTS_AHEAD=0 first_experts_sent_during_attention "$tmp/after"
switched_off MOEQ_GPU_RESIDUAL=0 residual_added_on_device "$tmp/host_add"
# each layer's input went up once, for its first attention pass, which kept it there for the
# second; each later layer took it from the device, where the layer before left its boundary
n1=$(grep -c '"attention_inputs_from_device":[[:space:]]*1[,}]*$' "$rep")
n2=$(grep -c '"attention_inputs_from_device":[[:space:]]*2[,}]*$' "$rep")
[ "$n1" = 1 ] && [ "$n2" = 3 ] || fail "attention passes with X from the device: 1 in $n1 layers, 2 in $n2 ($rep)"
switched_off MOEQ_GPU_HOST_COPIES=1 boundary_only_on_device "$tmp/copies"
# nor did the kept FFN input where no expert falls back to the shared Hessian (16 x 128 tokens
# leave some below the default 32, whose Hessian is summed from it on the host)
"$cli" quantize "$model" --out "$tmp/x0" "${args[@]}" --device cuda --min-expert-tokens 0 ||
    fail "the GPU run with --min-expert-tokens 0 exited $?"
n=$(flagged ffn_input_only_on_device "$tmp/x0/gptq_report.json")
[ "$n" = 4 ] || fail "--min-expert-tokens 0: ffn_input_only_on_device in $n of 4 layers"
MOEQ_GPU_HOST_COPIES=1 "$cli" quantize "$model" --out "$tmp/x1" "${args[@]}" --device cuda --min-expert-tokens 0 ||
    fail "the GPU run with --min-expert-tokens 0 and MOEQ_GPU_HOST_COPIES=1 exited $?"
same_checkpoint "$tmp/x0" "$tmp/x1" "--min-expert-tokens 0, MOEQ_GPU_HOST_COPIES=1" "the default"
# the CPU plan's batches (MOEQ_GPU_BATCH=plan: about a sample at a time), and device batches of
# 700 rows (two samples of 128 tokens routed to 2 experts each), give the default's values
MOEQ_GPU_BATCH=plan "$cli" quantize "$model" --out "$tmp/plan" "${args[@]}" --device cuda ||
    fail "the GPU run with MOEQ_GPU_BATCH=plan exited $?"
same_checkpoint "$tmp/a" "$tmp/plan" "MOEQ_GPU_BATCH=plan" "the default batches"
MOEQ_GPU_BATCH_ROWS=700 "$cli" quantize "$model" --out "$tmp/small" "${args[@]}" --device cuda ||
    fail "the GPU run with MOEQ_GPU_BATCH_ROWS=700 exited $?"
same_checkpoint "$tmp/a" "$tmp/small" "MOEQ_GPU_BATCH_ROWS=700" "the default batches"

# without sequential calibration one pass gives each layer's Hessians and its output, its rows,
# inputs and outputs on the device too: the CPU plan's batches give the same bytes, and the
# report shows the experts there in every layer
ns=(--gptq-mode nonsequential)
"$cli" quantize "$model" --out "$tmp/ns" "${args[@]}" "${ns[@]}" --device cuda || fail "the nonsequential GPU run exited $?"
MOEQ_GPU_BATCH=plan "$cli" quantize "$model" --out "$tmp/ns_plan" "${args[@]}" "${ns[@]}" --device cuda ||
    fail "the nonsequential GPU run with MOEQ_GPU_BATCH=plan exited $?"
same_checkpoint "$tmp/ns" "$tmp/ns_plan" "nonsequential, MOEQ_GPU_BATCH=plan" "nonsequential, the default batches"
n=$(grep -c '"outputs_combined_on_device":[[:space:]]*true' "$tmp/ns/gptq_report.json")
[ "$n" = 4 ] || fail "nonsequential: outputs combined on the device in $n of 4 layers"
for key in first_experts_sent_during_attention residual_added_on_device; do
    n=$(flagged $key "$tmp/ns/gptq_report.json")
    [ "$n" = 4 ] || fail "nonsequential: $key in $n of 4 layers"
done
n=$(grep -c '"attention_inputs_from_device":[[:space:]]*1[,}]*$' "$tmp/ns/gptq_report.json")
[ "$n" = 3 ] || fail "nonsequential: X from the device in $n of the 3 layers after the first"

# killed inside the second layer's expert chunks, then resumed
MOEQ_FAULT=chunk:1:1 "$cli" quantize "$model" --out "$tmp/r" "${args[@]}" --device cuda --expert-chunk 3 2>/dev/null
[ $? -eq 137 ] || fail "the killed GPU run did not exit 137"
"$cli" quantize "$model" --out "$tmp/r" "${args[@]}" --device cuda --expert-chunk 3 --resume ||
    fail "the resumed GPU run exited $?"
same_checkpoint "$tmp/a" "$tmp/r" "killed and resumed"

# every expert below --min-expert-tokens, rounded to nearest on the host
fb=(--min-expert-tokens 1000000 --expert-fallback rtn)
"$cli" quantize "$model" --out "$tmp/f1" "${args[@]}" --device cuda "${fb[@]}" || fail "the fallback run exited $?"
"$cli" quantize "$model" --out "$tmp/f2" "${args[@]}" --device cuda "${fb[@]}" --expert-chunk 2 ||
    fail "the fallback run with --expert-chunk 2 exited $?"
same_checkpoint "$tmp/f1" "$tmp/f2" "RTN fallback experts, --expert-chunk 2" "the default chunk"
# ... or quantized with the layer's shared Hessian, summed on the host from the kept FFN input,
# which must come back from the device first (else the host's copy is stale): the same bytes as
# with every copy made
fb=(--min-expert-tokens 1000000)
"$cli" quantize "$model" --out "$tmp/b1" "${args[@]}" --device cuda "${fb[@]}" || fail "the block-Hessian fallback run exited $?"
n=$(flagged ffn_input_only_on_device "$tmp/b1/gptq_report.json")
[ "$n" = 0 ] || fail "block-Hessian fallback: the kept FFN input never came to the host in $n layers"
MOEQ_GPU_HOST_COPIES=1 "$cli" quantize "$model" --out "$tmp/b2" "${args[@]}" --device cuda "${fb[@]}" ||
    fail "the block-Hessian fallback run with MOEQ_GPU_HOST_COPIES=1 exited $?"
same_checkpoint "$tmp/b1" "$tmp/b2" "block-Hessian fallback experts" "the same with every copy made"

# quality against the CPU's checkpoint
"$cli" quantize "$model" --out "$tmp/cpu" "${args[@]}" --refine 0 --target quantized || fail "the CPU run exited $?"
kl() { "$cli" eval "$1" --task text --data "$calib" --kl-base "$model" --json | json_get /dev/stdin kl_mean; }
kg=$(kl "$tmp/a")
kc=$(kl "$tmp/cpu")
echo "KL to the base: GPU $kg, CPU $kc"
[ -n "$kg" ] && [ -n "$kc" ] || fail "no KL from eval"
rel_close "$kg" "$kc" 0.02 || fail "GPU KL $kg is not within 2% of the CPU's $kc"

# the TF32 modes (--gpu-precision tf32x3, --gpu-tf32): the products and Hessian sums on TF32
# tensor cores. The same bytes from run to run, the report says which, and the KL to the base
# within the same 2% of the fp32 GPU run's (the fixture's parity bound; the issue's 1% is judged
# on the fixture protocol, docs/gptq.md)
for mode in tf32x3 tf32; do
    flag=(--gpu-precision tf32x3)
    [ $mode = tf32 ] && flag=(--gpu-tf32)
    "$cli" quantize "$model" --out "$tmp/$mode-1" "${args[@]}" --device cuda "${flag[@]}" || fail "the $mode run exited $?"
    "$cli" quantize "$model" --out "$tmp/$mode-2" "${args[@]}" --device cuda "${flag[@]}" ||
        fail "the second $mode run exited $?"
    same_checkpoint "$tmp/$mode-1" "$tmp/$mode-2" "${flag[*]}, run again" "${flag[*]}"
    grep -q "\"gpu_precision\":[[:space:]]*\"$mode\"" "$tmp/$mode-1/gptq_report.json" ||
        fail "the report does not say $mode"
    kt=$(kl "$tmp/$mode-1")
    echo "KL to the base: GPU $mode $kt, GPU fp32 $kg"
    rel_close "$kt" "$kg" 0.02 || fail "$mode KL $kt is not within 2% of the fp32 GPU run's $kg"
done

[ $fails -eq 0 ] || exit 1
echo "ok"

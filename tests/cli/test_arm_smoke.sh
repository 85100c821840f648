#!/usr/bin/env bash
# The Arm64 build under qemu-aarch64 (scripts/test-arm64.sh), against this machine's native
# build (MOEQ_NATIVE_CLI, e.g. build/moeq): the kernel set is NEON (with SDOT on qemu's default
# CPU, without under QEMU_CPU=cortex-a72); RTN checkpoints (NVFP4, INT4) are byte-identical to the
# native ones (the twins are bit-exact and RTN uses no BLAS); the packed evaluation's word
# perplexity agrees within the runtime's 1e-4 (OpenBLAS's kernels sum the attention in another
# order: the bound is derived in test_runtime.sh); a small GPTQ run completes. Skips outside a
# cross build.
. "$(dirname "$0")/common.sh"
[ -n "${MOEQ_CROSS:-}" ] || { echo "SKIP: not a cross build (scripts/test-arm64.sh runs it)"; exit 77; }
native=${MOEQ_NATIVE_CLI:-$repo/build/moeq}
[ -x "$native" ] || { echo "SKIP: no native build at $native (set MOEQ_NATIVE_CLI)"; exit 77; }

"$cli" --version > "$tmp/v" || fail "--version exited $?"
grep -qxE "CPU kernels: neon(\+dotprod)?" "$tmp/v" || fail "arm64: kernel set: $(cat "$tmp/v")"

for spec in "nvfp4a16" "int4 --group-size 32"; do
    tag=${spec%% *}
    # shellcheck disable=SC2086
    "$cli" quantize "$model" --out "$tmp/arm-$tag" --scheme $spec --quiet || fail "arm64: quantize $spec exited $?"
    # shellcheck disable=SC2086
    "$native" quantize "$model" --out "$tmp/nat-$tag" --scheme $spec --quiet || fail "native: quantize $spec exited $?"
    cmp -s "$tmp/arm-$tag/model.safetensors" "$tmp/nat-$tag/model.safetensors" ||
        fail "RTN $spec: the arm64 checkpoint differs from the native one"
done

for i in 1 2; do
    printf ' = Title %d = \n The cat sat on the mat , and the history of the world is long . \n' "$i"
done > "$tmp/wiki.txt"
"$cli" eval "$tmp/arm-nvfp4a16" --data "$tmp/wiki.txt" --json > "$tmp/e.arm" || fail "arm64: eval exited $?"
"$native" eval "$tmp/arm-nvfp4a16" --data "$tmp/wiki.txt" --json > "$tmp/e.nat" || fail "native: eval exited $?"
pa=$(json_get "$tmp/e.arm" word_perplexity)
pn=$(json_get "$tmp/e.nat" word_perplexity)
[ "$(json_get "$tmp/e.arm" packed_linears)" = 112 ] || fail "arm64: eval did not run packed"
rel_close "$pa" "$pn" 1e-4 || fail "arm64 word perplexity $pa vs native $pn"

"$cli" quantize "$model" --out "$tmp/gq" --scheme nvfp4a16 --method gptq --calib "$repo/data/demo-calib.txt" \
    --nsamples 2 --seqlen 16 --no-mse --ignore mlp --quiet || fail "arm64: gptq exited $?"
grep -q '"gptq"' "$tmp/gq/gptq_report.json" || fail "arm64: no GPTQ modules in the report"

[ $fails -eq 0 ] && echo "all arm64 checks passed"
exit $((fails > 0))

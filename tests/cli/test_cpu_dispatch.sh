#!/usr/bin/env bash
# Runtime dispatch: one binary, kernels chosen by CPUID. Under qemu-x86_64 -cpu Nehalem (no AVX
# at all; Debian's qemu-user) the CLI must take the scalar twins and never execute an
# instruction that CPU lacks (qemu stops the process with SIGILL if it does), and give what the
# native run gives:
#   --version names the kernel set ("scalar" there, "avx512+vnni", "avx512", "avx2+fma" or "scalar"
#   here; with MOEQ_NO_AVX512=1 an AVX-512 host says "avx2+fma (avx512 off)");
#   RTN checkpoints are byte-identical (the SIMD quantizers are bit-exact twins of the scalar
#   ones, and RTN uses nothing else);
#   eval of the packed NVFP4 checkpoint within 1e-4 relative word perplexity (the packed kernels
#   are bit-exact twins, but OpenBLAS picks its Nehalem kernels for the attention there, which
#   sum in another order: the bound is derived in test_runtime.sh);
#   a small GPTQ run (LAPACK, the GPTQ loop's scalar twins) completes.
. "$(dirname "$0")/common.sh"
native_only "qemu-x86_64 runs x86-64 binaries"
qemu=$(command -v qemu-x86_64 || true)
if [ "$(uname -m)" != x86_64 ] || [ -z "$qemu" ]; then
    echo "SKIP: needs qemu-x86_64 (Debian: apt install qemu-user) on an x86-64 host"
    exit 77
fi
# OpenBLAS picks its kernels by its own CPUID reading, which under qemu-user can name another core
# than the emulated one (an AMD EPYC host with Debian's qemu 7.2: "Haswell", whose AVX2 kernels
# the emulated Nehalem stops with SIGILL); its documented override names the emulated core
old() { OPENBLAS_CORETYPE=Nehalem "$qemu" -cpu Nehalem "$cli" "$@"; }

old --version > "$tmp/v.old" || fail "--version under Nehalem exited $?"
grep -qx "CPU kernels: scalar" "$tmp/v.old" || fail "Nehalem: kernel set: $(cat "$tmp/v.old")"
"$cli" --version > "$tmp/v.new" || fail "--version exited $?"
grep -qE "^CPU kernels: (avx512\+vnni|avx512|avx2\+fma|scalar|avx2\+fma \(avx512 off\))$" "$tmp/v.new" ||
    fail "native kernel set: $(cat "$tmp/v.new")"
# the note only when asked for (a suite run with MOEQ_NO_AVX512=1 is how an AVX2-only host is tried)
if grep -q "(avx512 off)" "$tmp/v.new" && [ "${MOEQ_NO_AVX512:-0}" = 0 ]; then
    fail "native kernel set says avx512 off without MOEQ_NO_AVX512=1: $(cat "$tmp/v.new")"
fi
if grep -q avx512 "$tmp/v.new"; then
    MOEQ_NO_AVX512=1 "$cli" --version | grep -qx "CPU kernels: avx2+fma (avx512 off)" || fail "MOEQ_NO_AVX512 not named"
fi
MOEQ_FORCE_REF=1 "$cli" --version | grep -qx "CPU kernels: scalar (forced)" || fail "MOEQ_FORCE_REF not named"

for spec in "nvfp4a16" "int4 --group-size 32"; do
    tag=${spec%% *}
    # shellcheck disable=SC2086
    old quantize "$model" --out "$tmp/old-$tag" --scheme $spec --quiet || fail "Nehalem: quantize $spec exited $?"
    # shellcheck disable=SC2086
    "$cli" quantize "$model" --out "$tmp/new-$tag" --scheme $spec --quiet || fail "quantize $spec exited $?"
    cmp -s "$tmp/old-$tag/model.safetensors" "$tmp/new-$tag/model.safetensors" ||
        fail "RTN $spec: the Nehalem checkpoint differs from the native one"
done

for i in 1 2; do
    printf ' = Title %d = \n The cat sat on the mat , and the history of the world is long . \n' "$i"
done > "$tmp/wiki.txt"
old eval "$tmp/old-nvfp4a16" --data "$tmp/wiki.txt" --json > "$tmp/e.old" || fail "Nehalem: eval exited $?"
"$cli" eval "$tmp/old-nvfp4a16" --data "$tmp/wiki.txt" --json > "$tmp/e.new" || fail "eval exited $?"
po=$(json_get "$tmp/e.old" word_perplexity)
pn=$(json_get "$tmp/e.new" word_perplexity)
[ "$(json_get "$tmp/e.old" packed_linears)" = 112 ] || fail "Nehalem: eval did not run packed"
rel_close "$po" "$pn" 1e-4 || fail "Nehalem word perplexity $po vs native $pn"
# the AVX2 set on an AVX-512 host: the same figures to the last digit (bit-exact twins, the
# same OpenBLAS kernels)
MOEQ_NO_AVX512=1 "$cli" eval "$tmp/old-nvfp4a16" --data "$tmp/wiki.txt" --json > "$tmp/e.avx2" || fail "MOEQ_NO_AVX512 eval exited $?"
pa=$(json_get "$tmp/e.avx2" word_perplexity)
[ "$pa" = "$pn" ] || fail "MOEQ_NO_AVX512 word perplexity $pa vs native $pn"

calib=$repo/data/demo-calib.txt
# (the attention only, few tokens: emulation is ~500x slower than the native AVX2 run)
old quantize "$model" --out "$tmp/gq" --scheme nvfp4a16 --method gptq --calib "$calib" \
    --nsamples 2 --seqlen 16 --no-mse --ignore mlp --quiet || fail "Nehalem: gptq exited $?"
[ -f "$tmp/gq/model.safetensors" ] || fail "Nehalem: gptq wrote no checkpoint"
grep -q '"gptq"' "$tmp/gq/gptq_report.json" || fail "Nehalem: no GPTQ modules in the report"

[ $fails -eq 0 ] && echo "all CPU dispatch checks passed"
exit $((fails > 0))

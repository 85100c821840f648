#!/usr/bin/env bash
# Packs this build's test_gpu_moe and moeq (stripped) with the Debian libraries they load into one
# tar.xz that a GPU machine of the same distribution family can run (CUDA's own libraries are
# expected there), and prints the command that runs the GPU MoE op's tests and its benchmark
# (moeq bench moe-ffn --device cuda) from the repository root of that machine's checkout.
#   scripts/gpu-moe-bundle.sh BUILD_DIR OUT_DIR      e.g. build .dev-moegpu (an ignored folder)
# The tests find their fixtures (tests/data, models/olmoe-tiny) under the source directory the
# build was configured in; the printed command links that path to the checkout it runs in.
set -euo pipefail
build=${1:?BUILD_DIR}
out=${2:?OUT_DIR}
src=$(cd "$(dirname "$0")/.." && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/lib" "$out"
strip -o "$tmp/moeq" "$build/moeq"
strip -o "$tmp/test_gpu_moe" "$build/test_gpu_moe"
# every library ldd resolves outside CUDA's own folders and the C/C++ runtime
for bin in "$build/moeq" "$build/test_gpu_moe"; do
    ldd "$bin" | awk '$3 ~ /^\// {print $3}'
done | sort -u | grep -vE '/cuda|libc\.so|libm\.so|libpthread|libdl\.so|librt\.so|ld-linux|libstdc\+\+|libgcc_s' |
    while read -r lib; do cp -L "$lib" "$tmp/lib/"; done
tar -C "$tmp" -cf - moeq test_gpu_moe lib | xz -T2 -6 >"$out/bundle.tar.xz"
du -h "$out/bundle.tar.xz"
cat <<CMD
# on the GPU machine, from the checkout's root (OUT_DIR carried there):
set -o pipefail; mkdir -p /tmp/mg && tar xJf $out/bundle.tar.xz -C /tmp/mg && mkdir -p "$(dirname "$src")" && { [ -e "$src" ] || ln -s "\$PWD" "$src"; } && export LD_LIBRARY_PATH=/tmp/mg/lib && nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader; timeout 200 /tmp/mg/test_gpu_moe > \$OUT/test.log 2>&1; echo "test rc=\$?"; grep -vE "^\[ (RUN|  OK) " \$OUT/test.log | tail -80; timeout 200 /tmp/mg/moeq bench moe-ffn --device cuda > \$OUT/bench.log 2>&1; echo "bench rc=\$?"; cat \$OUT/bench.log
CMD

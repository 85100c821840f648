#!/usr/bin/env bash
# The Arm64 build: cross-compiled with Debian's gcc-aarch64-linux-gnu against the :arm64 -dev
# packages (cmake/aarch64-linux-gnu.cmake), its tests run under qemu-aarch64, where the CPU has no
# AVX2 and every kernel is its scalar twin. "quick" runs the unit tests of the number formats,
# kernels, GPTQ, Hessians, readers and layouts; "smoke" the CLI against the native build
# (MOEQ_NATIVE_CLI, default build/moeq); "all" the whole suite (hours under emulation).
set -euo pipefail
cd "$(dirname "$0")/.."
what=${1:-quick}
bash scripts/install-deps.sh arm64
build=${MOEQ_ARM_BUILD:-build-arm64}
cmake -S . -B "$build" -DCMAKE_TOOLCHAIN_FILE=cmake/aarch64-linux-gnu.cmake -DCMAKE_BUILD_TYPE=Release \
    -DMOEQ_CUDA=OFF -DMOEQ_MPI=OFF ${MOEQ_CMAKE_FLAGS:-} >/dev/null
cmake --build "$build" -j "$(nproc)"
# about 5 minutes on 2 cores; the CLI checks against the native build (cli_test_arm_smoke) and
# the rest take far longer under emulation
quick='^test_(config|dist|core|formats|gemm_det|hessian|gptq|vec_kernels|moe_ffn_kernels|moe_ffn_check|safetensors|export_layout|eval_kl|eval_text|eval_windows)$'
case $what in
    quick) ctest --test-dir "$build" --output-on-failure -j "$(nproc)" -R "$quick" ;;
    smoke) ctest --test-dir "$build" --output-on-failure -R '^cli_test_arm_smoke$' ;;
    all) ctest --test-dir "$build" --output-on-failure -j "$(nproc)" --timeout 7200 ;;
    *) echo "usage: scripts/test-arm64.sh [quick|smoke|all]" >&2; exit 2 ;;
esac

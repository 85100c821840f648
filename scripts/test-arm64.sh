#!/usr/bin/env bash
# The Arm64 build: cross-compiled with Debian's gcc-aarch64-linux-gnu against the :arm64 -dev
# packages (cmake/aarch64-linux-gnu.cmake), its tests run under qemu-aarch64. qemu's default CPU
# ("max") has the dot-product extension, so the kernels are NEON with SDOT; QEMU_CPU=cortex-a72
# gives a CPU without it (plain NEON). "kernels" builds only the kernel tests and runs them on both
# CPUs, with the CLI's kernel set name (CI's arm64 job, a few minutes on 2 cores); "quick" runs the
# unit tests of the number formats, kernels, GPTQ, Hessians, readers and layouts; "smoke" the CLI
# against the native build (MOEQ_NATIVE_CLI, default build/moeq); "all" the whole suite (hours
# under emulation; the binaries run on the :arm64 glibc, cmake/aarch64-linux-gnu.cmake says why).
set -euo pipefail
cd "$(dirname "$0")/.."
what=${1:-quick}
case $what in
    kernels | quick | smoke | all) ;;
    *) echo "usage: scripts/test-arm64.sh [kernels|quick|smoke|all]" >&2; exit 2 ;;
esac
bash scripts/install-deps.sh arm64
build=${MOEQ_ARM_BUILD:-build-arm64}
# shellcheck disable=SC2086
cmake -S . -B "$build" -DCMAKE_TOOLCHAIN_FILE=cmake/aarch64-linux-gnu.cmake -DCMAKE_BUILD_TYPE=Release \
    -DMOEQ_CUDA=OFF -DMOEQ_MPI=OFF ${MOEQ_CMAKE_FLAGS:-} >/dev/null
kernel_tests=(test_vec_kernels test_moe_ffn_kernels test_moe_ffn test_moe_ffn_check test_gemm_det)
if [ "$what" = kernels ]; then
    cmake --build "$build" -j "$(nproc)" --target moeq_cli "${kernel_tests[@]}"
else
    cmake --build "$build" -j "$(nproc)"
fi
# about 5 minutes on 2 cores; the CLI checks against the native build (cli_test_arm_smoke) and
# the rest take far longer under emulation
quick='^test_(config|dist|core|formats|gemm_det|hessian|gptq|vec_kernels|moe_ffn_kernels|moe_ffn|moe_ffn_check|safetensors|export_layout|eval_kl|eval_text|eval_windows)$'
case $what in
    kernels)
        re="^($(IFS='|'; echo "${kernel_tests[*]}"))\$"
        # OpenBLAS starts its threads when it loads; under emulation they only share the cores
        export OPENBLAS_NUM_THREADS=1 MOEQ_THREADS=1
        for cpu in max:neon+dotprod cortex-a72:neon; do
            name=${cpu#*:}
            export QEMU_CPU=${cpu%%:*}
            echo "== arm64 kernels on qemu -cpu $QEMU_CPU (expect: $name)"
            v=$("$build/moeq-emulated" --version)
            grep -qx "CPU kernels: $name" <<< "$v" || { echo "arm64: kernel set: $v" >&2; exit 1; }
            ctest --test-dir "$build" --output-on-failure -j "$(nproc)" -R "$re"
        done ;;
    # one thread each (tests that vary the count set it themselves): emulated threads only share
    # the host's cores
    quick) OPENBLAS_NUM_THREADS=1 MOEQ_THREADS=1 ctest --test-dir "$build" --output-on-failure -j "$(nproc)" -R "$quick" ;;
    smoke) ctest --test-dir "$build" --output-on-failure -R '^cli_test_arm_smoke$' ;;
    all) OPENBLAS_NUM_THREADS=1 MOEQ_THREADS=1 ctest --test-dir "$build" --output-on-failure -j "$(nproc)" ;;   # 2 h per test (CMakeLists.txt)
esac

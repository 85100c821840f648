#!/usr/bin/env bash
# The sanitizer job (.ci/run sanitize): builds with -DMOEQ_SANITIZE=ON (AddressSanitizer, its leak
# checker, UndefinedBehaviorSanitizer with float-cast-overflow; the first error ends the program)
# into build-asan ($MOEQ_ASAN_BUILD) and runs the named subset of the suite below with ctest: the
# readers of outside input and their tests, the fuzz targets' regression files and seeds, the CLI
# on a damaged work directory and on every output it prints, and the fast unit tests of the number
# formats, kernels and Hessians. A leak, an out-of-bounds access or undefined behaviour fails the
# test that ran into it, and so the job. About 6 minutes on 2 cores (the build is most of it).
#   scripts/test-sanitize.sh [CTEST_ARGS...]
set -euo pipefail
cd "$(dirname "$0")/.."
build=${MOEQ_ASAN_BUILD:-build-asan}
jobs=$(nproc)
tests=(
    test_core test_formats test_safetensors test_gguf test_tokenizer test_tiktoken test_config
    test_export_layout test_hessian test_eval_text test_eval_windows test_sampler test_vec_kernels
    test_gemm_det test_chat_template
    fuzz_calib fuzz_config fuzz_gguf fuzz_layout fuzz_model fuzz_safetensors fuzz_tiktoken fuzz_tokenizer
    fuzz_workdir fuzz_chat_template
    cli_test_resume_damaged cli_test_printed_paths
)
targets=(moeq_cli)
for t in "${tests[@]}"; do
    case $t in
        test_*) targets+=("$t") ;;
        fuzz_*) targets+=("replay_${t#fuzz_}") ;;
    esac
done
# shellcheck disable=SC2086
cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DMOEQ_SANITIZE=ON -DMOEQ_CUDA=OFF ${MOEQ_CMAKE_FLAGS:-} >/dev/null
cmake --build "$build" -j "$jobs" --target "${targets[@]}"
regex="^($(IFS='|'; echo "${tests[*]}"))\$"
# every name above is a test of this build (a renamed test must not drop out unnoticed)
listed=$(ctest --test-dir "$build" -N -R "$regex" | sed -n 's/^Total Tests: //p')
[ "$listed" = "${#tests[@]}" ] || { echo "sanitize: ${#tests[@]} tests named, ctest knows $listed of them" >&2; exit 1; }
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:detect_stack_use_after_return=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1}
ctest --test-dir "$build" --output-on-failure -j "$jobs" -R "$regex" "$@"

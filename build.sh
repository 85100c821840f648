#!/usr/bin/env bash
# The quick start and the test entry point, on a fresh Debian 12 machine:
#   ./build.sh demo    install the build dependencies, build, run the demo job (scripts/demo.sh)
#   ./build.sh test    install the build dependencies, build, run the test suite (ctest)
#   ./build.sh         only install and build
# MOEQ_CMAKE_FLAGS adds CMake options (CI: -DMOEQ_WERROR=ON).
set -euo pipefail
cd "$(dirname "$0")"
what=${1:-build}
case $what in
    demo | test | build) ;;
    *) echo "usage: ./build.sh [demo|test|build]" >&2; exit 2 ;;
esac
bash scripts/install-deps.sh "$what"
jobs=$(nproc)
# shellcheck disable=SC2086
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release ${MOEQ_CMAKE_FLAGS:-} >/dev/null
cmake --build build -j "$jobs"
case $what in
    demo) bash scripts/demo.sh build/moeq ;;
    test) ctest --test-dir build --output-on-failure -j "$jobs" ;;
esac

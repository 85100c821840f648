#!/usr/bin/env bash
# Installs the Debian packages moeq builds against, if any is missing (Debian 12). With "test":
# also what some tests use when present, best effort: qemu-user (the CLI under an AVX-less CPU)
# chromium (rendering the HTML reports headless) and python3-pytest (the Python package's tests;
# without it they run as a script); those tests skip that part without them. With "arm64": the
# cross toolchain and the :arm64 -dev packages for cmake/aarch64-linux-gnu.cmake, and qemu-user. With
# "fuzz": Debian's clang and the compiler-rt package that holds libFuzzer (tests/fuzz, .ci/run fuzz).
set -euo pipefail
pkgs=(build-essential cmake pkg-config python3 libopenblas-dev liblapacke-dev libcjson-dev libpcre2-dev zlib1g-dev
      libopenmpi-dev openmpi-bin libmicrohttpd-dev)
optional=()
[ "${1:-}" = test ] && optional=(qemu-user chromium python3-pytest)
[ "${1:-}" = fuzz ] && pkgs+=(clang)
missing() {
  for p in "$@"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || echo "$p"
  done
}
SUDO=""
[ "$(id -u)" -ne 0 ] && SUDO="sudo"
export DEBIAN_FRONTEND=noninteractive
install() {
  $SUDO apt-get install -y --no-install-recommends "$@" ||
    { $SUDO apt-get update && $SUDO apt-get install -y --no-install-recommends "$@"; }
}
if [ "${1:-}" = arm64 ]; then
  pkgs=(gcc-aarch64-linux-gnu libc6-dev-arm64-cross libc6:arm64 qemu-user libopenblas-dev:arm64 liblapacke-dev:arm64
        libcjson-dev:arm64 libpcre2-dev:arm64 zlib1g-dev:arm64)
  if ! dpkg --print-foreign-architectures | grep -qx arm64; then
    $SUDO dpkg --add-architecture arm64
    $SUDO apt-get update
  fi
fi
mapfile -t need < <(missing "${pkgs[@]}")
if [ ${#need[@]} -gt 0 ]; then
  echo "moeq: installing ${need[*]}" >&2
  install "${need[@]}"
fi
# libFuzzer ships in libclang-rt-<version>-dev, which clang only recommends
if [ "${1:-}" = fuzz ] && [ "$(clang -print-file-name=libclang_rt.fuzzer-x86_64.a)" = libclang_rt.fuzzer-x86_64.a ]; then
  rt=libclang-rt-$(clang -dumpversion | cut -d. -f1)-dev
  echo "moeq: installing $rt (libFuzzer)" >&2
  install "$rt"
fi
if [ ${#optional[@]} -gt 0 ]; then
  mapfile -t opt < <(missing "${optional[@]}")
  if [ ${#opt[@]} -gt 0 ]; then
    echo "moeq: installing for the tests ${opt[*]}" >&2
    install "${opt[@]}" || echo "moeq: warning: could not install ${opt[*]}; the tests that use them skip that part" >&2
  fi
fi
exit 0

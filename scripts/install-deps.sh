#!/usr/bin/env bash
# Installs the Debian packages moeq builds against, if any is missing (Debian 12). With "test":
# also qemu-user, which the CPU-dispatch test runs the CLI under (it skips without it).
set -euo pipefail
pkgs=(build-essential cmake pkg-config python3 libopenblas-dev liblapacke-dev libcjson-dev libpcre2-dev zlib1g-dev)
[ "${1:-}" = test ] && pkgs+=(qemu-user)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0
echo "moeq: installing ${missing[*]}" >&2
SUDO=""
[ "$(id -u)" -ne 0 ] && SUDO="sudo"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get install -y --no-install-recommends "${missing[@]}" ||
  { $SUDO apt-get update && $SUDO apt-get install -y --no-install-recommends "${missing[@]}"; }

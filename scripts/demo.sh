#!/usr/bin/env bash
# The quick-start job on the bundled model (models/olmoe-tiny).
set -euo pipefail
moeq=${1:-build/moeq}
here=$(cd "$(dirname "$0")/.." && pwd)
model=$here/models/olmoe-tiny
echo "== moeq inspect $model"
"$moeq" inspect "$model"
echo "== moeq generate"
"$moeq" generate "$model" --prompt "The history of the" -n 32 --greedy

#!/usr/bin/env bash
# The quick-start job on the bundled model (models/olmoe-tiny): what the checkpoint holds, how a
# prompt tokenizes, and greedy generation with the fp32 forward pass (tokens/s on stderr).
set -euo pipefail
moeq=${1:-build/moeq}
here=$(cd "$(dirname "$0")/.." && pwd)
model=$here/models/olmoe-tiny
prompt="The history of the"
echo "== moeq inspect $model"
"$moeq" inspect "$model"
echo
echo "== moeq tokenize --text \"$prompt\""
"$moeq" tokenize "$model" --text "$prompt"
echo
echo "== moeq generate --prompt \"$prompt\" -n 32 --greedy"
"$moeq" generate "$model" --prompt "$prompt" -n 32 --greedy

# Shared set-up of the CLI tests (tests/cli/test_*.sh source it): the binary under test, the
# bundled model, a scratch folder removed on exit, and failure counting that lets every check run.
set -u
cli=${MOEQ_CLI:?MOEQ_CLI is not set}
repo=${MOEQ_REPO:?MOEQ_REPO is not set}
model=$repo/models/olmoe-tiny
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fails=0
# native_only WHY: skip (77) in a cross build run under an emulator (MOEQ_CROSS)
native_only() {
    if [ -n "${MOEQ_CROSS:-}" ]; then echo "SKIP: $1 (a cross build, run under ${MOEQ_CROSS})"; exit 77; fi
}
fail() { echo "FAIL: $*" >&2; fails=$((fails + 1)); }
# json_get FILE KEY: the value of a top-level scalar key of our (one key per line) JSON output.
json_get() { sed -n "s/^  \"$2\": \([^,]*\),\{0,1\}$/\1/p" "$1"; }

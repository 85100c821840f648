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
# rel_close A B T: |A - B| <= T |B|
rel_close() { awk -v a="$1" -v b="$2" -v t="$3" 'BEGIN { d = a - b; if (d < 0) d = -d; m = b < 0 ? -b : b; exit !(d <= t * m) }'; }
# same_checkpoint REF DIR WHAT [REF_NAME]: every file of checkpoint REF but its report (which holds
# timings) is byte-identical in DIR
same_checkpoint() {
    local f
    for f in "$1"/*; do
        f=${f##*/}
        [ "$f" = gptq_report.json ] && continue
        cmp -s "$1/$f" "$2/$f" || fail "$3: $f differs from ${4:-the reference run}"
    done
}
# json_get FILE KEY: the value of a top-level scalar key of our (one key per line) JSON output.
json_get() { sed -n "s/^  \"$2\": \([^,]*\),\{0,1\}$/\1/p" "$1"; }

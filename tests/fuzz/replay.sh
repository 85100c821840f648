#!/usr/bin/env bash
# ctest's fuzz_<target>: replay_<target> (a fuzz target without libFuzzer, tests/fuzz/replay.c) over
# the target's regression files (tests/fuzz/regressions/<target>/: inputs that crashed or hung it
# once) and a seed corpus made from the fixtures (tests/fuzz/corpus.py). Each file must run through
# the target's checks; in a -DMOEQ_SANITIZE=ON build ASan and UBSan watch every run.
#   replay.sh REPLAY_BINARY TARGET    (MOEQ_CLI, MOEQ_REPO: as for the CLI tests)
set -u
bin=$1 target=$2
repo=${MOEQ_REPO:?MOEQ_REPO is not set}
cli=${MOEQ_CLI:?MOEQ_CLI is not set}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
export TMPDIR=$tmp
inputs=()
[ -d "$repo/tests/fuzz/regressions/$target" ] && inputs+=("$repo/tests/fuzz/regressions/$target")
if command -v python3 >/dev/null; then
    python3 "$repo/tests/fuzz/corpus.py" --cli "$cli" --out "$tmp/seeds" "$target" || { echo "FAIL: corpus.py $target"; exit 1; }
    [ -d "$tmp/seeds/$target" ] && inputs+=("$tmp/seeds/$target")
else
    echo "note: no python3: the seed corpus is not replayed"
fi
[ ${#inputs[@]} -gt 0 ] || { echo "SKIP: no regression files and no seeds for $target"; exit 77; }
out=$("$bin" "${inputs[@]}" 2>"$tmp/log")
rc=$?
echo "$out"
if [ $rc -ne 0 ]; then
    tail -n 40 "$tmp/log"
    echo "FAIL: replay_$target exited $rc (the last file named above brought it down)"
    exit 1
fi
case $out in "replayed 0 file(s)"*) echo "FAIL: nothing was replayed"; exit 1 ;; esac
exit 0

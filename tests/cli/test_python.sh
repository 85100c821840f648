#!/usr/bin/env bash
# The Python package (python/): its tests (python/tests/test_moeq.py, with pytest when it is
# installed, else as a script) against libmoeq.so from this build, and `pip install ./python`
# offline into a scratch folder, then imported from there with its own copy of the library.
. "$(dirname "$0")/common.sh"
native_only "the host's python cannot load this build's libmoeq.so"
lib=$(dirname "$cli")/libmoeq.so
[ -f "$lib" ] || { fail "no $lib (the moeq_shared target)"; exit 1; }
export MOEQ_CLI="$cli" MOEQ_REPO="$repo" MOEQ_LIBRARY="$lib" PYTHONPATH="$repo/python"
py=python3
for p in python3 /usr/bin/python3; do
    if "$p" -c "import pytest" 2>/dev/null; then py=$p; break; fi
done
if "$py" -c "import pytest" 2>/dev/null; then
    (cd "$tmp" && "$py" -m pytest -q -p no:cacheprovider "$repo/python/tests" > "$tmp/pytest.log" 2>&1) ||
        fail "pytest: $(tail -20 "$tmp/pytest.log")"
    grep -q " passed" "$tmp/pytest.log" || fail "pytest ran nothing: $(tail -5 "$tmp/pytest.log")"
else
    echo "note: pytest not installed (apt install python3-pytest): running the tests as a script"
    "$py" "$repo/python/tests/test_moeq.py" > "$tmp/py.log" 2>&1 || fail "python tests: $(grep -v '^moeq:' "$tmp/py.log" | tail -20)"
fi

if python3 -m pip --version > /dev/null 2>&1; then
    # offline: the in-tree backend needs nothing from an index
    python3 -m pip install --quiet --no-index --target "$tmp/site" "$repo/python" \
        > "$tmp/pip.log" 2>&1 || fail "pip install ./python: $(tail -5 "$tmp/pip.log")"
    [ -f "$tmp/site/moeq/libmoeq.so" ] || fail "pip install ./python did not ship libmoeq.so"
    out=$(cd "$tmp" && env -u MOEQ_LIBRARY PYTHONPATH="$tmp/site" python3 -c \
        "import moeq; print(moeq.__file__); print(moeq.inspect('$model')['layers'])") || fail "the installed package: $out"
    case "$out" in "$tmp/site/moeq/"*"
4") ;; *) fail "the installed package: $out" ;; esac
else
    echo "note: no pip: the install check was skipped"
fi

[ $fails -eq 0 ] && echo "all Python package checks passed"
exit $((fails > 0))

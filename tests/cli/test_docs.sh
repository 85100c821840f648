#!/usr/bin/env bash
# The documentation's shape (issue 57): README.md stays a ten-minute read (at most 250 lines) with
# a quick start of exactly `./build.sh demo` and `./build.sh test`; every relative Markdown link in
# README.md and docs/**/*.md points at a file that exists, and every #anchor at a heading of its
# file (GitHub's slugs); the README and the guides (docs/*.md, not the logs in docs/results/) carry
# no dates; and every `moeq ...` example in the README uses flags its command's --help lists.
set -u
repo=${MOEQ_REPO:?MOEQ_REPO is not set}
cli=${MOEQ_CLI:-}
fails=0
fail() { echo "FAIL: $*" >&2; fails=$((fails + 1)); }

python3 - "$repo" <<'PY' || fail "documentation checks (above)"
import os, re, sys

repo = sys.argv[1]
bad = []
FENCE = re.compile(r'^\s*(```|~~~)')
LINK = re.compile(r'!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^()\s]+)(?:\s+"[^"]*")?\)')
DATE = re.compile(r'\b20\d\d-[01]\d-[0-3]\d\b')

def lines_outside_fences(path):
    """(line number, text) of the lines outside fenced code blocks."""
    out, fenced = [], False
    with open(path, encoding='utf-8') as f:
        for n, line in enumerate(f, 1):
            if FENCE.match(line):
                fenced = not fenced
                continue
            if not fenced:
                out.append((n, line.rstrip('\n')))
    return out

def slug(text):
    """GitHub's heading anchor: the rendered text, lower case, punctuation dropped, spaces -> -."""
    text = re.sub(r'!?\[([^\]]*)\]\([^)]*\)', r'\1', text)   # links keep their text
    text = re.sub(r'<[^>]+>', '', text)                       # inline HTML
    text = text.replace('`', '').replace('*', '')
    text = text.strip().lower()
    text = re.sub(r'[^\w\- ]', '', text)
    return text.replace(' ', '-')

anchors_cache = {}
def anchors(path):
    if path not in anchors_cache:
        seen, result = {}, set()
        for _, line in lines_outside_fences(path):
            m = re.match(r'^(#{1,6})\s+(.*?)\s*#*\s*$', line)
            if not m:
                continue
            s = slug(m.group(2))
            k = seen.get(s, 0)
            result.add(s if k == 0 else f'{s}-{k}')
            seen[s] = k + 1
        anchors_cache[path] = result
    return anchors_cache[path]

md = [os.path.join(repo, 'README.md')]
for root, dirs, files in os.walk(os.path.join(repo, 'docs')):
    dirs.sort()
    md += [os.path.join(root, f) for f in sorted(files) if f.endswith('.md')]

for path in md:
    rel = os.path.relpath(path, repo)
    for n, line in lines_outside_fences(path):
        code_free = re.sub(r'`[^`]*`', '', line)
        for m in LINK.finditer(code_free):
            target = m.group(1)
            if re.match(r'^[a-z][a-z0-9+.-]*:', target):      # http:, https:, mailto:
                continue
            file_part, _, anchor = target.partition('#')
            dest = os.path.normpath(os.path.join(os.path.dirname(path), file_part)) if file_part else path
            if not os.path.exists(dest):
                bad.append(f'{rel}:{n}: link to {target}: {os.path.relpath(dest, repo)} does not exist')
                continue
            if anchor:
                if not dest.endswith('.md'):
                    bad.append(f'{rel}:{n}: link to {target}: an anchor into a file that is not Markdown')
                elif anchor not in anchors(dest):
                    bad.append(f'{rel}:{n}: link to {target}: no heading of {os.path.relpath(dest, repo)} has the anchor #{anchor}')

# README: at most 250 lines; the quick start is exactly the two commands.
readme = os.path.join(repo, 'README.md')
text = open(readme, encoding='utf-8').read()
count = text.count('\n') + (0 if text.endswith('\n') else 1)
if count > 250:
    bad.append(f'README.md: {count} lines (at most 250)')
m = re.search(r'^## Quick start[^\n]*\n(.*?)(?=^## )', text, re.M | re.S)
if not m:
    bad.append('README.md: no "## Quick start" section')
else:
    # shell blocks (```sh, ```bash, ```shell or unmarked); output may follow in a ```text block
    blocks = re.findall(r'^```(sh|bash|shell|)\n(.*?)^```', m.group(1), re.M | re.S)
    cmds = [] if not blocks else [l.split('#')[0].strip() for l in blocks[0][1].splitlines()]
    cmds = [c for c in cmds if c]
    if len(blocks) != 1 or cmds != ['./build.sh demo', './build.sh test']:
        bad.append(f'README.md: the quick start must be one shell block of exactly "./build.sh demo" '
                   f'and "./build.sh test"; it has {len(blocks)} shell block(s), the first: {cmds}')

# No dates in the README and the guides: measurements with dates belong in docs/results/.
for path in md:
    rel = os.path.relpath(path, repo)
    if rel.startswith('docs' + os.sep + 'results' + os.sep):
        continue
    with open(path, encoding='utf-8') as f:
        for n, line in enumerate(f, 1):
            if DATE.search(line):
                bad.append(f'{rel}:{n}: a date in the README or a guide (dated results go to docs/results/)')

for b in bad:
    print('  ' + b, file=sys.stderr)
sys.exit(1 if bad else 0)
PY

# Every `moeq CMD ...` line of the README's code blocks: CMD (or `bench WHAT`) exists and each of
# its --flags is one the command's --help lists.
if [ -n "$cli" ] && [ -x "$cli" ]; then
    examples=$(awk '/^```/ { f = !f; next } f' "$repo/README.md" |
        sed -n 's/^\(mpirun[^m]*\)\{0,1\}moeq \([a-z].*\)$/\2/p' | sed 's/ *#.*$//')
    checked=0
    while IFS= read -r ex; do
        [ -z "$ex" ] && continue
        checked=$((checked + 1))
        set -- $ex
        cmd=$1
        [ "$cmd" = bench ] && cmd="bench $2"
        help=$("$cli" $cmd --help 2>&1) || { fail "README example 'moeq $ex': 'moeq $cmd --help' failed"; continue; }
        for flag in $(printf '%s\n' "$ex" | grep -o -- '--[a-z][a-z0-9-]*' | sort -u); do
            printf '%s\n' "$help" | grep -qE -- "(^|[^a-z-])$flag([^a-z0-9-]|\$)" || fail "README example 'moeq $ex': $flag is not in 'moeq $cmd --help'"
        done
    done <<< "$examples"
    echo "README examples checked against --help: $checked"
    [ "$checked" -gt 0 ] || fail "no 'moeq ...' example found in the README's code blocks"
else
    echo "note: MOEQ_CLI not set: the README's examples were not checked against --help"
fi

[ "$fails" -eq 0 ] || { echo "$fails failure(s)" >&2; exit 1; }
echo "docs: OK"

#!/usr/bin/env bash
# moeq serve, moeq chat and generate --messages on the bundled model with a chat template (a copy
# of olmoe-tiny whose tokenizer_config.json carries OLMoE-Instruct's template). Real clients: curl
# and Python's standard library (urllib, http.client). Checks: the server's completions equal
# `moeq generate` (greedy, and sampled with a seed), chat equals generate --messages, the SSE
# framing and that streamed pieces add up to the whole answer, stop strings, the error codes
# (400 bad JSON / bad field / too long prompt, 404, 405, 503 beyond the queue), that a streaming
# client that disconnects frees its slot, and a clean stop on SIGTERM and SIGINT. moeq chat (not
# a terminal): the second turn reuses the first's KV cache and still answers as generate does.
. "$(dirname "$0")/common.sh"
native_only "starts a server"
if "$cli" serve --help 2>&1 | grep -q "not built"; then
    echo "SKIP: moeq serve is not built (libmicrohttpd-dev was missing)"
    exit 77
fi
command -v curl >/dev/null || { echo "SKIP: curl is missing"; exit 77; }
command -v python3 >/dev/null || { echo "SKIP: python3 is missing"; exit 77; }

m=$tmp/m
mkdir "$m"
for f in config.json model.safetensors tokenizer.json; do ln -s "$model/$f" "$m/$f"; done
python3 - "$model/tokenizer_config.json" "$repo/tests/data/chat_templates/olmoe.jinja" "$m/tokenizer_config.json" <<'EOF'
import json, sys
c = json.load(open(sys.argv[1]))
c["chat_template"] = open(sys.argv[2]).read()
json.dump(c, open(sys.argv[3], "w"), indent=2)
EOF

# ---- generate --messages and chat ----------------------------------------------------------
printf '%s' '[{"role": "user", "content": "The history of the"}]' > "$tmp/m1.json"
want1=$("$cli" generate "$m" --messages "$tmp/m1.json" -n 16 2>"$tmp/err") || fail "generate --messages exited $?: $(cat "$tmp/err")"
[ -n "$want1" ] || fail "generate --messages printed nothing"
"$cli" generate "$m" --messages "$tmp/m1.json" -n 4 --json > "$tmp/g.json" 2>/dev/null
python3 -c 'import json,sys; p=json.load(open(sys.argv[1]))["prompt"]; sys.exit(p != "<|endoftext|><|user|>\nThe history of the\n<|assistant|>\n")' "$tmp/g.json" ||
    fail "generate --messages did not render the template: $(cat "$tmp/g.json")"
"$cli" generate "$m" --messages "$tmp/m1.json" --prompt x -n 4 >/dev/null 2>&1
[ $? -eq 2 ] || fail "--messages with --prompt is not a usage error"
"$cli" generate "$model" --messages "$tmp/m1.json" -n 4 >/dev/null 2>"$tmp/err" && fail "a model without a template accepted --messages"
grep -q "chat template" "$tmp/err" || fail "no template: the message does not say so: $(cat "$tmp/err")"

printf 'The history of the\nTell me more.\n/reset\nThe history of the\n/exit\nnot read\n' |
    "$cli" chat "$m" -n 16 > "$tmp/chat.out" 2>"$tmp/chat.err" || fail "chat exited $?: $(cat "$tmp/chat.err")"
[ "$(wc -l < "$tmp/chat.out")" -eq 3 ] || fail "chat: expected 3 replies, got: $(cat "$tmp/chat.out")"
r1=$(sed -n 1p "$tmp/chat.out")
r2=$(sed -n 2p "$tmp/chat.out")
r3=$(sed -n 3p "$tmp/chat.out")
[ "$r1" = "$want1" ] || fail "chat turn 1 [$r1] differs from generate --messages [$want1]"
[ "$r3" = "$want1" ] || fail "chat after /reset [$r3] differs from generate --messages [$want1]"
python3 - "$r1" "$tmp/m2.json" <<'EOF'
import json, sys
json.dump([{"role": "user", "content": "The history of the"}, {"role": "assistant", "content": sys.argv[1]},
           {"role": "user", "content": "Tell me more."}], open(sys.argv[2], "w"))
EOF
want2=$("$cli" generate "$m" --messages "$tmp/m2.json" -n 16 2>/dev/null)
[ "$r2" = "$want2" ] || fail "chat turn 2 (on the kept KV cache) [$r2] differs from generate --messages [$want2]"
reused2=$(sed -n 's/^chat: turn 2: [0-9]* prompt tokens (\([0-9]*\) reused).*/\1/p' "$tmp/chat.err")
reused3=$(sed -n 's/^chat: turn 3: [0-9]* prompt tokens (\([0-9]*\) reused).*/\1/p' "$tmp/chat.err")
[ "${reused2:-0}" -gt 10 ] || fail "chat turn 2 reused ${reused2:-no} tokens of the cache: $(cat "$tmp/chat.err")"
[ "${reused3:-x}" = 0 ] || fail "chat after /reset reused ${reused3:-?} tokens"

# ---- the server ------------------------------------------------------------------------------
# start_server LOG ARGS...: starts it on a free port; sets pid and port
start_server() {
    local log=$1
    shift
    "$cli" serve "$m" --port 0 "$@" 2>"$log" &
    pid=$!
    port=
    for _ in $(seq 1 300); do
        port=$(sed -n 's|.*on http://127.0.0.1:\([0-9]*\) .*|\1|p' "$log")
        [ -n "$port" ] && return 0
        kill -0 $pid 2>/dev/null || break
        sleep 0.1
    done
    fail "the server did not start: $(cat "$log")"
    return 1
}
# stop_server SIGNAL LOG: the server must exit 0 within 20 s, saying so
stop_server() {
    kill -"$1" $pid
    for _ in $(seq 1 200); do kill -0 $pid 2>/dev/null || break; sleep 0.1; done
    if kill -0 $pid 2>/dev/null; then
        fail "SIG$1: the server still runs after 20 s"
        kill -9 $pid
    fi
    wait $pid
    local rc=$?
    [ $rc -eq 0 ] || fail "SIG$1: the server exited $rc: $(tail -3 "$2")"
    grep -q "moeq serve: stopped" "$2" || fail "SIG$1: no clean stop in the log: $(tail -3 "$2")"
}

start_server "$tmp/serve.log" --parallel 1 --queue 0 || exit 1
url=http://127.0.0.1:$port

# curl: health, models, a greedy completion equal to generate's continuation
curl -sf "$url/health" | grep -q '"status":"ok","slots":1,"slots_idle":1' || fail "/health: $(curl -s "$url/health")"
curl -sf "$url/v1/models" | grep -q '"id":"m"' || fail "/v1/models: $(curl -s "$url/v1/models")"
gen=$("$cli" generate "$model" --prompt "The history of the" -n 20 --greedy 2>/dev/null)
curl -sf "$url/v1/completions" -H 'Content-Type: application/json' \
    -d '{"prompt": "The history of the", "max_tokens": 20, "temperature": 0}' > "$tmp/c.json" || fail "completion failed"
text=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["choices"][0]["text"], end="")' "$tmp/c.json")
[ "The history of the$text" = "$gen" ] || fail "greedy completion [$text] differs from generate [$gen]"
genS=$("$cli" generate "$model" --prompt "Once upon a time" -n 24 --temp 0.8 --top-p 0.9 --seed 7 2>/dev/null)
curl -sf "$url/v1/completions" -d '{"prompt": "Once upon a time", "max_tokens": 24, "temperature": 0.8, "top_p": 0.9, "seed": 7}' > "$tmp/c.json"
text=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["choices"][0]["text"], end="")' "$tmp/c.json")
[ "Once upon a time$text" = "$genS" ] || fail "sampled completion (seed 7) [$text] differs from generate [$genS]"
genStop=$("$cli" generate "$model" --prompt "The history of the" -n 20 --greedy --stop "most" 2>/dev/null)

# Python's standard library as the client: chat, streaming, stop strings, errors, busy, disconnect
cat > "$tmp/client.py" <<'EOF'
import http.client, json, socket, sys, time, urllib.error, urllib.request

url, port = sys.argv[1], int(sys.argv[2])
want1, want2, gen_stop = sys.argv[3], sys.argv[4], sys.argv[5]
fails = []

def check(ok, what):
    if not ok:
        fails.append(what)
        print("FAIL:", what, file=sys.stderr)

def post(path, body, raw=None):
    data = raw if raw is not None else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()

msgs = [{"role": "user", "content": "The history of the"}]
st, b = post("/v1/chat/completions", {"messages": msgs, "max_tokens": 16, "temperature": 0})
check(st == 200, f"chat status {st}: {b!r}")
j = json.loads(b)
check(j["object"] == "chat.completion" and j["choices"][0]["message"]["role"] == "assistant", f"chat shape: {j}")
check(j["choices"][0]["message"]["content"] == want1, f"chat [{j['choices'][0]['message']['content']}] != generate --messages [{want1}]")
check(j["usage"]["completion_tokens"] == 16 and j["choices"][0]["finish_reason"] == "length", f"chat usage: {j}")
msgs2 = msgs + [{"role": "assistant", "content": want1}, {"role": "user", "content": "Tell me more."}]
st, b = post("/v1/chat/completions", {"messages": msgs2, "max_tokens": 16, "temperature": 0})
j = json.loads(b)
check(j["choices"][0]["message"]["content"] == want2, f"chat turn 2 [{j['choices'][0]['message']['content']}] != [{want2}]")
check(j["usage"]["prompt_tokens_details"]["cached_tokens"] > 10, f"turn 2 did not reuse the slot's cache: {j['usage']}")

# streaming: raw SSE framing over http.client
def stream(path, body):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    c.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    r = c.getresponse()
    return r.status, r.getheader("Content-Type"), r.read().decode(), c

st, ctype, raw, c = stream("/v1/chat/completions", {"messages": msgs, "max_tokens": 16, "temperature": 0, "stream": True,
                                                     "stream_options": {"include_usage": True}})
c.close()
check(st == 200 and ctype.startswith("text/event-stream"), f"stream status {st} {ctype}")
check(raw.endswith("data: [DONE]\n\n"), f"stream does not end with [DONE]: {raw[-80:]!r}")
events = raw.split("\n\n")
check(events[-1] == "", "stream: trailing bytes after the last event")
events = events[:-1]
check(all(e.startswith("data: ") and "\n" not in e for e in events), f"an event is not one 'data: ' line: {events}")
objs = [json.loads(e[6:]) for e in events[:-1]]
check(objs[0]["choices"][0]["delta"].get("role") == "assistant", f"first chunk has no role: {objs[0]}")
content = "".join(o["choices"][0]["delta"].get("content", "") for o in objs if o["choices"])
check(content == want1, f"streamed pieces [{content}] != [{want1}]")
fin = [o["choices"][0]["finish_reason"] for o in objs if o["choices"] and o["choices"][0]["finish_reason"]]
check(fin == ["length"], f"finish reasons {fin}")
check("usage" in objs[-1] and objs[-1]["usage"]["completion_tokens"] == 16, f"no usage chunk: {objs[-1]}")
check(all(o["object"] == "chat.completion.chunk" for o in objs), "chunk object names")
st, ctype, raw, c = stream("/v1/completions", {"prompt": "The history of the", "max_tokens": 20, "temperature": 0,
                                                "stream": True, "stop": ["most"]})
c.close()
objs = [json.loads(e[6:]) for e in raw.split("\n\n")[:-2]]
text = "".join(o["choices"][0]["text"] for o in objs)
check("The history of the" + text == gen_stop, f"streamed with stop [{text}] != generate --stop [{gen_stop}]")
check(objs[-1]["choices"][0]["finish_reason"] == "stop", f"stop: finish {objs[-1]}")

# errors, each an OpenAI error object
def err(path, body=None, raw=None, method="POST"):
    if method != "POST":
        req = urllib.request.Request(url + path, method=method, data=raw)
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())
    st, b = post(path, body, raw)
    return st, json.loads(b)

for (what, args, code) in [
    ("bad JSON", dict(path="/v1/completions", raw=b"{not json"), 400),
    ("not an object", dict(path="/v1/completions", raw=b"[1, 2]"), 400),
    ("no prompt", dict(path="/v1/completions", body={"max_tokens": 3}), 400),
    ("bad temperature", dict(path="/v1/completions", body={"prompt": "a", "temperature": -1}), 400),
    ("bad top_p", dict(path="/v1/completions", body={"prompt": "a", "top_p": 0}), 400),
    ("n=2", dict(path="/v1/chat/completions", body={"messages": msgs, "n": 2}), 400),
    ("bad messages", dict(path="/v1/chat/completions", body={"messages": [{"content": "x"}]}), 400),
    ("too long prompt", dict(path="/v1/completions", body={"prompt": "the history " * 400}), 400),
    ("unknown path", dict(path="/v1/embeddings", body={"input": "x"}), 404),
    ("GET on a POST route", dict(path="/v1/completions", method="GET"), 405),
    ("POST on a GET route", dict(path="/health", raw=b"{}"), 405),
]:
    st, j = err(**args)
    check(st == code, f"{what}: status {st}, expected {code}: {j}")
    check(isinstance(j.get("error"), dict) and j["error"].get("message") and j["error"].get("type"), f"{what}: not an error object: {j}")
st, j = err("/v1/completions", {"prompt": "the history " * 400})
check(j["error"].get("code") == "context_length_exceeded", f"too long: {j}")

# a streaming client holds the only slot; the queue is 0, so another request gets 503; then it
# disconnects, and its slot comes back
s = socket.create_connection(("127.0.0.1", port))
body = json.dumps({"prompt": "The history of the", "max_tokens": 500, "temperature": 0, "ignore_eos": True, "stream": True}).encode()
s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
got = b""
while b"data: " not in got:
    got += s.recv(4096)
check(got.startswith(b"HTTP/1.1 200"), f"long stream: {got[:60]!r}")
st, j = err("/v1/completions", {"prompt": "a", "max_tokens": 1})
check(st == 503, f"busy: status {st}, expected 503: {j}")
s.close()
idle = 0
for _ in range(200):
    with urllib.request.urlopen(url + "/health", timeout=10) as r:
        idle = json.loads(r.read())["slots_idle"]
    if idle == 1:
        break
    time.sleep(0.05)
check(idle == 1, "the disconnected client's slot is still busy")
st, b = post("/v1/completions", {"prompt": "a", "max_tokens": 2, "temperature": 0})
check(st == 200, f"after the disconnect: status {st}")
sys.exit(1 if fails else 0)
EOF
python3 "$tmp/client.py" "$url" "$port" "$want1" "$want2" "$genStop" || fail "the Python client's checks failed (above)"
# the disconnected stream stopped early (cancelled), not after its 500 tokens
line=$(grep "generated, cancelled" "$tmp/serve.log" | head -1)
n=$(printf '%s\n' "$line" | sed -n 's/.*reused), \([0-9]*\) generated.*/\1/p')
[ -n "$n" ] && [ "$n" -lt 500 ] || fail "the disconnected stream was not cancelled early: [$line]"
grep -q "POST /v1/completions 503" "$tmp/serve.log" || fail "the 503 is not in the log"
stop_server TERM "$tmp/serve.log"

# SIGINT while a stream runs: the server still stops cleanly
start_server "$tmp/serve2.log" --parallel 2 || exit 1
curl -sN "http://127.0.0.1:$port/v1/completions" \
    -d '{"prompt": "The history of the", "max_tokens": 500, "ignore_eos": true, "stream": true}' > "$tmp/s2.out" 2>/dev/null &
cpid=$!
for _ in $(seq 1 100); do grep -q "data: " "$tmp/s2.out" && break; sleep 0.05; done
stop_server INT "$tmp/serve2.log"
wait $cpid 2>/dev/null

[ $fails -eq 0 ] && echo "serve: completions and chat equal generate, SSE, errors, busy, disconnect, SIGTERM/SIGINT"
exit $((fails > 0))

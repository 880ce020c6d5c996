#!/usr/bin/env bash
# The wheel as a user gets it: built from this tree, installed WITHOUT extras into a fresh venv, and run
# from outside the repository (so the source tree cannot be imported). Checks that
#   (a) `import specdec` comes from that venv;
#   (b) `specdec generate` runs in an int4 mode: the CPU kernels compiled from the wheel's own sources
#       (a fresh kernels/ folder; the models and weight caches of $SPECDEC_HOME are shared, nothing is pulled);
#   (c) `specdec serve MODEL` (vLLM's form) answers /health and one completion, then exits on SIGTERM;
#   (d) commands that need the missing `bench` extra say so in one line and exit 2.
# Run by `make wheel-smoke` after `make setup test-models` (which pull the models).
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
python=${PYTHON:-python3}
model=smollm2-135m-instruct
home=${SPECDEC_HOME:-$HOME/.cache/specdec}

say() { echo "wheel-smoke: $*" >&2; }
fail() { say "FAIL: $*"; exit 1; }

[[ -f $home/models/$model.gguf ]] || fail "$home/models/$model.gguf is missing: run \`make test-models\` first"

work=$(mktemp -d)
server_pid=
cleanup() {
  if [[ -n $server_pid ]] && kill -0 "$server_pid" 2>/dev/null; then
    kill -KILL "$server_pid" 2>/dev/null || true
    wait "$server_pid" 2>/dev/null || true
  fi
  rm -rf "$work"
}
trap cleanup EXIT

say "building the wheel"
make -C "$repo" -s wheel >/dev/null
wheels=("$repo"/dist/specdec-*.whl)
[[ ${#wheels[@]} -eq 1 && -f ${wheels[0]} ]] || fail "expected one wheel in dist/, found: ${wheels[*]}"
wheel=${wheels[0]}

say "installing $(basename "$wheel") into a fresh venv (no extras)"
"$python" -m venv "$work/venv"
venv=$work/venv/bin
# torch first, pinned: the CPU wheel on local disk; an unpinned torch pulls a several-GB CUDA build
"$venv/pip" install --disable-pip-version-check -q torch==2.13.0
"$venv/pip" install --disable-pip-version-check -q "$wheel"

# the same models and weight caches, a kernels/ folder of its own: the kernels must build from the wheel
export SPECDEC_HOME=$work/home
mkdir -p "$SPECDEC_HOME"
ln -s "$home/models" "$SPECDEC_HOME/models"
ln -s "$home/cache" "$SPECDEC_HOME/cache"
if [[ -f $home/sha256.json ]]; then cp "$home/sha256.json" "$SPECDEC_HOME/"; fi
unset PYTHONPATH
cd "$work"

say "(a) import specdec resolves to the venv"
"$venv/python" - <<'EOF'
import sysconfig
import specdec
site = sysconfig.get_paths()["purelib"]
assert specdec.__file__.startswith(site), f"specdec imported from {specdec.__file__}, not {site}"
for module in ("matplotlib", "rouge_score", "sacrebleu", "jsonschema"):  # the bench extra: not installed
    try:
        __import__(module)
    except ImportError:
        continue
    raise SystemExit(f"{module} is installed without the bench extra: a core dependency pulls it in")
EOF

say "(b) specdec generate (builds the CPU kernels from the wheel's sources)"
"$venv/specdec" generate --model "$model" --max-tokens 8 "Hello" >"$work/generate.out" 2>"$work/generate.err" \
  || { cat "$work/generate.err" >&2; fail "specdec generate exited non-zero"; }
grep -q "building the CPU kernels" "$work/generate.err" \
  || { cat "$work/generate.err" >&2; fail "specdec generate did not build the CPU kernels in a fresh kernels/"; }
grep -qE "\((int4-a8|int4-a16), cpu\)" "$work/generate.err" \
  || { cat "$work/generate.err" >&2; fail "specdec generate did not run an int4 mode (did the kernels build?)"; }
say "    $(grep -E "\((int4-a8|int4-a16), cpu\)" "$work/generate.err" | head -1)"

say "(c) specdec serve: /health, one completion, SIGTERM"
port=$("$venv/python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
"$venv/specdec" serve "$model" --host 127.0.0.1 --port "$port" >"$work/serve.log" 2>&1 &
server_pid=$!
deadline=$((SECONDS + 120))
until "$venv/python" -c "import sys, urllib.request as u; sys.exit(u.urlopen('http://127.0.0.1:$port/health', timeout=5).status != 200)" 2>/dev/null; do
  kill -0 "$server_pid" 2>/dev/null || { cat "$work/serve.log" >&2; fail "the server exited before /health answered 200"; }
  ((SECONDS < deadline)) || { cat "$work/serve.log" >&2; fail "no 200 from /health within 120 s"; }
  sleep 1
done
"$venv/python" - "$port" "$model" <<'EOF'
import json, sys, urllib.request
port, model = sys.argv[1:]
body = json.dumps({"model": model, "prompt": "Hello", "max_tokens": 8}).encode()
req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                             headers={"Content-Type": "application/json"})
with urllib.request.urlopen(req, timeout=120) as r:
    assert r.status == 200, r.status
    reply = json.load(r)
text = reply["choices"][0]["text"]
assert text, f"an empty completion: {reply}"
print(f"wheel-smoke:     completion: {text!r}", file=sys.stderr)
EOF
kill -TERM "$server_pid"
for _ in $(seq 60); do kill -0 "$server_pid" 2>/dev/null || break; sleep 0.5; done
kill -0 "$server_pid" 2>/dev/null && { cat "$work/serve.log" >&2; fail "the server did not exit within 30 s of SIGTERM"; }
server_rc=0
wait "$server_pid" || server_rc=$?
server_pid=
[[ $server_rc -eq 0 ]] || { cat "$work/serve.log" >&2; fail "the server exited with $server_rc after SIGTERM"; }

say "(d) a missing extra: one line naming specdec[bench], exit 2"
"$venv/specdec" bench --help >/dev/null
missing_extra() {  # the command (its arguments) must fail at once, before loading any model
  local rc=0
  "$venv/specdec" "$@" >/dev/null 2>"$work/extra.err" || rc=$?
  [[ $rc -eq 2 && $(wc -l <"$work/extra.err") -eq 1 ]] && grep -q "specdec\[bench\]" "$work/extra.err" \
    || { cat "$work/extra.err" >&2; fail "specdec $* exited $rc; expected one line naming specdec[bench] and exit 2"; }
  say "    specdec $*: $(cat "$work/extra.err")"
}
missing_extra bench steps --rows 1 --repeats 1
missing_extra eval --model "$model" --num-prompts 1 --max-tokens 4

say "OK"

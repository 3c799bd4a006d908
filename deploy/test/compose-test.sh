#!/usr/bin/env bash
# End-to-end test of deploy/compose.yaml's CPU variant, without pulling any image:
#   1. a Debian base image made locally (deploy/docker/make-base-image.sh: debootstrap + docker
#      import; cached between runs under a content-based tag)
#   2. the CPU image (and, as a build check, the CUDA Dockerfile) from the `baton` binary built on
#      the host (BATON_BIN; default target/release/baton, built if missing)
#   3. `docker compose --profile cpu up`: coordinator + two worker containers; /ready must turn 200
#   4. a greedy completion through the coordinator must equal `baton generate` on the host
#   5. stop one worker container: /ready must turn 503 within a bound, then 200 again once the
#      pipeline is rebuilt on the worker left (one stage), serving the same completion; start it
#      again: the pipeline grows back to two stages and serves the same completion again
# Everything it created (containers, network, volumes, test images, temp files) is removed on exit;
# the cached base image `baton-base:*` is kept (BATON_TEST_DROP_BASE=1 removes it too).
#
# Prints `N passed, M failed` last; exits 0 only if nothing failed. Without a Docker engine,
# compose or debootstrap it tests nothing, and says so: with BATON_SKIP_REPORT set (as .ci/run
# does) it records `SKIPPED compose-test: <why>` there and exits 0, so the skip is counted (CI
# fails on it); without, it exits 1. Never a pass.
#
# Environment: BATON_BIN, BATON_TEST_MODEL (a .gguf; default the default model in $BATON_HOME),
# BATON_TEST_READY_S (default 180), BATON_TEST_DOWN_S (default 60).
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$ROOT"

PASSED=0
FAILED=0
RUN_ID="$(date +%s)-$$"
PROJECT="baton-test-${RUN_ID//-/}"
IMAGE="baton-test:cpu-$RUN_ID"
CUDA_IMAGE="baton-test:cuda-$RUN_ID"
READY_S="${BATON_TEST_READY_S:-180}"
DOWN_S="${BATON_TEST_DOWN_S:-60}"
PROMPT="The capital of France is"
TMP=""
COMPOSE=()
STARTED=0
BASE=""

log() { echo "[compose-test $(date -u +%H:%M:%S)] $*"; }
pass() { PASSED=$((PASSED + 1)); echo "PASS: $*"; }
fail() { FAILED=$((FAILED + 1)); echo "FAIL: $*"; }
summary() { echo "$PASSED passed, $FAILED failed"; }
not_run() {
  echo "NOT RUN: compose test skipped: $*"
  if [ -n "${BATON_SKIP_REPORT:-}" ]; then
    echo "SKIPPED compose-test: $*" >>"$BATON_SKIP_REPORT"
    echo "recorded in the skip report $BATON_SKIP_REPORT"
    echo "0 passed, 0 failed, 1 skipped"
    exit 0
  fi
  echo "0 passed, 1 failed (nothing was tested; set BATON_SKIP_REPORT=FILE to record this as a skip)"
  exit 1
}

cleanup() {
  local rc=$?
  trap - EXIT INT TERM
  if [ "$STARTED" = 1 ]; then
    if [ "$FAILED" -gt 0 ]; then
      log "container logs (last 40 lines each):"
      timeout 30 "${COMPOSE[@]}" logs --no-color --tail 40 2>&1 | sed 's/^/  | /'
    fi
    log "cleanup: compose down"
    timeout 90 "${COMPOSE[@]}" down --volumes --remove-orphans --timeout 5 >/dev/null 2>&1 \
      || log "compose down failed"
  fi
  docker image rm -f "$IMAGE" "$CUDA_IMAGE" >/dev/null 2>&1 || true
  # build-stage images the classic builder leaves behind (labelled with this run's id)
  local stage
  for stage in $(docker images -q --filter "label=org.baton.build-id=$RUN_ID" 2>/dev/null | sort -u); do
    docker image rm -f "$stage" >/dev/null 2>&1 || true
  done
  if [ "${BATON_TEST_DROP_BASE:-0}" = 1 ] && [ -n "$BASE" ]; then
    docker image rm -f "$BASE" >/dev/null 2>&1 || true
  fi
  [ -n "$TMP" ] && rm -rf "$TMP"
  summary
  if [ "$FAILED" -gt 0 ] || [ "$rc" -ne 0 ]; then exit 1; fi
  exit 0
}

# --- prerequisites ------------------------------------------------------------------------------
command -v docker >/dev/null 2>&1 || not_run "no docker CLI"
timeout 20 docker info >/dev/null 2>&1 || not_run "no reachable Docker engine"
if timeout 20 docker compose version >/dev/null 2>&1; then
  COMPOSE=(docker compose)
elif command -v docker-compose >/dev/null 2>&1; then
  COMPOSE=(docker-compose)
else
  not_run "neither 'docker compose' nor 'docker-compose' is installed"
fi
for tool in curl python3 sha256sum; do
  command -v "$tool" >/dev/null 2>&1 || not_run "$tool is missing"
done
if ! command -v debootstrap >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    log "installing debootstrap"
    (apt-get update -qq && apt-get install -y -qq debootstrap) >/dev/null 2>&1 || true
  fi
  command -v debootstrap >/dev/null 2>&1 || not_run "debootstrap is missing (apt-get install debootstrap)"
fi

trap cleanup EXIT
trap 'fail "interrupted (INT/TERM, e.g. the CI time limit) before finishing"; exit 1' INT TERM
TMP=$(mktemp -d /tmp/baton-compose-test.XXXXXX)
chmod 755 "$TMP"
log "compose: ${COMPOSE[*]} ($("${COMPOSE[@]}" version --short 2>/dev/null || echo '?')), project $PROJECT"

# --- host binary and model ----------------------------------------------------------------------
BIN="${BATON_BIN:-${CARGO_TARGET_DIR:-$ROOT/target}/release/baton}"
if [ ! -x "$BIN" ]; then
  log "building $BIN"
  timeout 900 cargo build --release -p baton-coordinator --bin baton || { fail "cargo build"; exit 1; }
fi
MODEL="${BATON_TEST_MODEL:-${BATON_HOME:-$HOME/.cache/baton}/models/SmolLM2-135M-Instruct.Q4_1.gguf}"
if [ ! -f "$MODEL" ]; then
  log "fetching the default model"
  timeout 300 "$BIN" fetch >/dev/null || { fail "baton fetch"; exit 1; }
fi
[ -f "$MODEL" ] || { fail "model $MODEL not found"; exit 1; }
# The containers get their own BATON_HOME holding just this model (read by uid 10001).
mkdir -p "$TMP/home/models"
cp "$MODEL" "$TMP/home/models/model.gguf"
chmod -R a+rX "$TMP/home"
IN_MODEL=/var/lib/baton/models/model.gguf

# --- images -------------------------------------------------------------------------------------
t0=$SECONDS
if BASE=$(timeout 300 "$ROOT/deploy/docker/make-base-image.sh"); then
  pass "base image $BASE from debootstrap ($((SECONDS - t0)) s)"
else
  fail "base image (debootstrap + docker import)"; exit 1
fi

mkdir -p "$TMP/ctx/deploy/docker"
cp "$BIN" "$TMP/ctx/baton"
strip "$TMP/ctx/baton" 2>/dev/null || true
cp deploy/docker/healthcheck.sh "$TMP/ctx/deploy/docker/"
build_image() { # dockerfile tag
  timeout 300 docker build -q -f "$ROOT/deploy/docker/$1" \
    --build-arg BASE_IMAGE="$BASE" --build-arg BUILD_IMAGE="$BASE" --build-arg BATON_PREBUILT=baton \
    --build-arg BATON_BUILD_ID="$RUN_ID" -t "$2" "$TMP/ctx" >"$TMP/build-$1.log" 2>&1
}
t0=$SECONDS
if build_image Dockerfile.cpu "$IMAGE"; then
  pass "CPU image $IMAGE built from the host binary ($((SECONDS - t0)) s)"
else
  sed 's/^/  | /' "$TMP/build-Dockerfile.cpu.log"; fail "CPU image build"; exit 1
fi
if build_image Dockerfile.cuda "$CUDA_IMAGE"; then
  pass "Dockerfile.cuda builds (on the local base here, not nvidia/cuda)"
else
  sed 's/^/  | /' "$TMP/build-Dockerfile.cuda.log"; fail "Dockerfile.cuda build"
fi
uid=$(timeout 30 docker run --rm --entrypoint id "$IMAGE" -u 2>&1)
if [ "$uid" = 10001 ]; then pass "image runs as non-root uid 10001"; else fail "image user is '$uid', expected 10001"; fi

# --- reference: the single-process engine on the host -------------------------------------------
if ! timeout 300 "$BIN" generate --model "$MODEL" --prompt "$PROMPT" --max-tokens 8 --temperature 0 \
    --format json >"$TMP/reference.json" 2>"$TMP/reference.err"; then
  sed 's/^/  | /' "$TMP/reference.err"; fail "host 'baton generate'"; exit 1
fi
REF=$(python3 -c 'import json,sys; print(json.dumps(json.load(open(sys.argv[1]))["text"]))' "$TMP/reference.json")
log "host engine: $REF"

# --- compose up ---------------------------------------------------------------------------------
PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
echo "BATON_CLUSTER_TOKEN=$(head -c 24 /dev/urandom | sha256sum | cut -c1-48)" >"$TMP/env"
chmod 644 "$TMP/env"
export BATON_IMAGE="$IMAGE" BATON_CUDA_IMAGE="$CUDA_IMAGE" BATON_MODELS="$TMP/home" \
  BATON_MODEL="$IN_MODEL" BATON_ENV_FILE="$TMP/env" BATON_HTTP_PORT="127.0.0.1:$PORT"
COMPOSE+=(-f "$ROOT/deploy/compose.yaml" -p "$PROJECT" --profile cpu)
API="http://127.0.0.1:$PORT"
STARTED=1
# The worker plane's certificates first (a one-shot service; the full `up` runs it again and
# reuses the CA).
if timeout 60 "${COMPOSE[@]}" run --rm --no-deps certs >"$TMP/certs.log" 2>&1; then
  pass "certs: a development CA and node certificates in the baton-certs volume"
else
  sed 's/^/  | /' "$TMP/certs.log"; fail "compose run certs"; exit 1
fi
# Workers next, alone: the name `coordinator` does not resolve yet, so they must keep retrying
# registration (not exit) until it does.
if ! timeout 120 "${COMPOSE[@]}" up -d --no-build --no-deps cpu-worker-0 cpu-worker-1 >"$TMP/up.log" 2>&1; then
  sed 's/^/  | /' "$TMP/up.log"; fail "compose up (workers)"; exit 1
fi
deadline=$((SECONDS + 30))
until timeout 10 "${COMPOSE[@]}" logs --no-color cpu-worker-0 cpu-worker-1 2>/dev/null \
    | grep -c 'cannot register' | grep -qv '^[01]$'; do
  [ $SECONDS -lt $deadline ] || break
  sleep 1
done
if timeout 120 "${COMPOSE[@]}" up -d --no-build >>"$TMP/up.log" 2>&1; then
  pass "compose --profile cpu up (coordinator started after cpu-worker-0, cpu-worker-1)"
else
  sed 's/^/  | /' "$TMP/up.log"; fail "compose up"; exit 1
fi

status() { curl -s -o /dev/null -w '%{http_code}' --max-time 3 "$API/$1" 2>/dev/null; }
wait_status() { # path code seconds
  local deadline=$((SECONDS + $3)) code
  while [ $SECONDS -lt $deadline ]; do
    code=$(status "$1")
    [ "$code" = "$2" ] && return 0
    sleep 1
  done
  return 1
}
complete() { # prints the JSON-encoded text, or HTTP:<code>
  local code
  code=$(curl -s -o "$TMP/completion.json" -w '%{http_code}' --max-time 120 "$API/v1/completions" \
    -H 'content-type: application/json' \
    -d "{\"prompt\": \"$PROMPT\", \"max_tokens\": 8, \"temperature\": 0}")
  if [ "$code" = 200 ]; then
    python3 -c 'import json,sys; print(json.dumps(json.load(open(sys.argv[1]))["choices"][0]["text"]))' \
      "$TMP/completion.json"
  else
    echo "HTTP:$code"
  fi
}
check_completion() { # label
  local got
  got=$(complete)
  if [ "$got" = "$REF" ]; then pass "$1: completion $got equals the host engine's"
  else fail "$1: completion $got != host engine $REF"; fi
}

t0=$SECONDS
if wait_status ready 200 "$READY_S"; then
  pass "/ready 200 after $((SECONDS - t0)) s"
else
  fail "/ready not 200 within $READY_S s (last: $(status ready))"; exit 1
fi
restarts=""
for w in cpu-worker-0 cpu-worker-1; do
  restarts+="$(docker inspect -f '{{.RestartCount}}' "$(timeout 20 "${COMPOSE[@]}" ps -q "$w")" 2>/dev/null)"
done
retries=$(timeout 10 "${COMPOSE[@]}" logs --no-color cpu-worker-0 cpu-worker-1 2>/dev/null | grep -c 'cannot register')
if [ "$restarts" = 00 ] && [ "$retries" -ge 2 ]; then
  pass "workers retried registration ($retries times) until 'coordinator' resolved, no restarts"
else
  fail "DNS retry: restart counts '$restarts', 'cannot register' lines $retries"
fi
[ "$(status health)" = 200 ] && pass "/health 200" || fail "/health not 200"
check_completion "two worker containers"
# Read whole bodies before grepping: with pipefail, `grep -q` closing the pipe early would fail
# the producer (SIGPIPE) on a large metrics page.
metrics=$(curl -s --max-time 5 "$API/metrics")
if grep -Eq '^baton_pipeline_stages(\{[^}]*\})? 2(\.0)?$' <<<"$metrics"; then
  pass "/metrics reports baton_pipeline_stages 2"
else
  fail "/metrics does not report baton_pipeline_stages 2"
fi
for w in cpu-worker-0 cpu-worker-1; do
  worker_metrics=$(timeout 10 "${COMPOSE[@]}" exec -T "$w" curl -fsS --max-time 3 http://127.0.0.1:9100/metrics 2>/dev/null)
  if grep -q '^baton_stage_forward_seconds' <<<"$worker_metrics"; then
    pass "$w serves stage metrics on :9100"
  else
    fail "$w has no baton_stage_forward_seconds on :9100/metrics"
  fi
done

# The worker plane is mutual TLS: a client without a cluster certificate, or in plain text, is
# refused by a worker (curl inside the coordinator's container, which has the CA but is not
# given a certificate), and one with the coordinator's certificate gets through the handshake.
in_coord() { timeout 10 "${COMPOSE[@]}" exec -T coordinator "$@" >/dev/null 2>&1; }
if in_coord curl -s --max-time 3 --cacert /etc/baton/certs/ca.pem -o /dev/null https://cpu-worker-0:50052/; then
  fail "cpu-worker-0 completed a TLS handshake with a client that has no certificate"
elif in_coord curl -s --max-time 3 --http2-prior-knowledge -o /dev/null http://cpu-worker-0:50052/; then
  fail "cpu-worker-0 answered plain-text HTTP/2"
elif in_coord curl -s --max-time 3 --cacert /etc/baton/certs/ca.pem --cert /etc/baton/certs/coordinator.pem \
    --key /etc/baton/certs/coordinator.key -o /dev/null https://cpu-worker-0:50052/; then
  pass "worker plane is mutual TLS: no certificate and plain text refused, a cluster certificate accepted"
else
  fail "cpu-worker-0 refused the coordinator's own certificate (curl)"
fi

# Docker's own view: every container's healthcheck (curl /ready, bash /dev/tcp) reports healthy.
wait_healthy() { # service seconds
  local id deadline=$((SECONDS + $2)) st=""
  id=$(timeout 20 "${COMPOSE[@]}" ps -q "$1" 2>/dev/null)
  while [ -n "$id" ] && [ $SECONDS -lt $deadline ]; do
    st=$(docker inspect -f '{{.State.Health.Status}}' "$id" 2>/dev/null)
    [ "$st" = healthy ] && return 0
    sleep 1
  done
  echo "${st:-no container}"
  return 1
}
for svc in coordinator cpu-worker-0 cpu-worker-1; do
  if st=$(wait_healthy "$svc" 40); then pass "docker healthcheck: $svc healthy"
  else fail "docker healthcheck: $svc is '$st' after 40 s"; fi
done

# --- a worker goes away -------------------------------------------------------------------------
timeout 60 "${COMPOSE[@]}" stop -t 10 cpu-worker-1 >/dev/null 2>&1 || log "compose stop returned non-zero"
# The coordinator notices: /ready is 503 until the pipeline is rebuilt on the worker left. That
# rebuild (staged beside the old pipeline) can take less than a poll, so a pipeline of one
# stage shows it noticed too.
stages_now() { awk '$1 == "baton_pipeline_stages" {print $2}' <<<"$(curl -s --max-time 3 "$API/metrics")"; }
t0=$SECONDS
noticed=""
while [ -z "$noticed" ] && [ $((SECONDS - t0)) -lt "$DOWN_S" ]; do
  if [ "$(status ready)" = 503 ]; then noticed="/ready 503"
  elif [ "$(stages_now)" = 1 ]; then noticed="a pipeline of one stage"
  else sleep 0.2; fi
done
if [ -n "$noticed" ]; then
  pass "$noticed $((SECONDS - t0)) s after cpu-worker-1 stopped"
else
  fail "neither /ready 503 nor a one-stage pipeline within $DOWN_S s of stopping cpu-worker-1 (last: $(status ready), $(stages_now) stages)"
fi
# No cuts fix the stage count, so the pipeline is rebuilt on the worker left.
t0=$SECONDS
if wait_status ready 200 "$READY_S"; then
  pass "/ready 200 again $((SECONDS - t0)) s later: rebuilt on cpu-worker-0 alone"
  check_completion "one worker left"
else
  fail "/ready not 200 within $READY_S s with one worker left (last: $(status ready))"
fi

# --- it comes back ------------------------------------------------------------------------------
timeout 60 "${COMPOSE[@]}" start cpu-worker-1 >/dev/null 2>&1 || log "compose start returned non-zero"
t0=$SECONDS
if wait_status ready 200 "$READY_S"; then
  pass "/ready 200 $((SECONDS - t0)) s after cpu-worker-1 restarted"
  stages=""
  for _ in $(seq 1 "$READY_S"); do
    metrics=$(curl -s --max-time 5 "$API/metrics")
    stages=$(awk '$1 == "baton_pipeline_stages" {print $2}' <<<"$metrics")
    [ "$stages" = 2 ] && break
    sleep 1
  done
  if [ "$stages" = 2 ]; then pass "the pipeline grew back to two stages"
  else fail "the pipeline has ${stages:-no} stages after cpu-worker-1 returned (expected 2)"; fi
  check_completion "after recovery"
else
  fail "/ready not 200 within $READY_S s of restarting cpu-worker-1 (last: $(status ready))"
fi
exit 0

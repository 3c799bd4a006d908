#!/usr/bin/env bash
# Container healthcheck for the baton image (no arguments; compose/k8s may use their own checks).
#   BATON_HEALTHCHECK_URL   HTTP URL that must answer 2xx (e.g. http://127.0.0.1:8000/ready)
#   BATON_HEALTHCHECK_TCP   host:port that must accept a TCP connection (e.g. 127.0.0.1:50052)
# Neither set: healthy if the coordinator's /health or a worker's gRPC port (50052) answers.
set -u
tcp_ok() { timeout 2 bash -c "exec 3<>/dev/tcp/${1%:*}/${1##*:}" 2>/dev/null; }
if [ -n "${BATON_HEALTHCHECK_URL:-}" ]; then
  exec curl -fsS -o /dev/null --max-time 2 "$BATON_HEALTHCHECK_URL"
elif [ -n "${BATON_HEALTHCHECK_TCP:-}" ]; then
  tcp_ok "$BATON_HEALTHCHECK_TCP"
else
  curl -fsS -o /dev/null --max-time 2 http://127.0.0.1:8000/health || tcp_ok 127.0.0.1:50052
fi

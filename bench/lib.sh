# Shared by the bench scripts that start `baton serve` themselves: source it, then
#   PID=...; wait_ready URL LOG NAME   (exits with a message if the server dies or is not ready)
#   stop                               (stops $PID; also installed as the EXIT trap)

PID=
stop() { [[ -n "$PID" ]] && kill "$PID" 2>/dev/null && wait "$PID" 2>/dev/null; PID=; }
trap stop EXIT

# Wait up to 120 s for URL/ready while the server $PID lives; LOG is named in the error.
wait_ready() {
    local url=$1 log=$2 name=$3
    for _ in $(seq 600); do
        curl -sf "$url/ready" >/dev/null && return 0
        kill -0 "$PID" 2>/dev/null || { echo "$name: server exited; see $log" >&2; exit 1; }
        sleep 0.2
    done
    echo "$name: server not ready after 120 s; see $log" >&2
    exit 1
}

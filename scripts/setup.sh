#!/usr/bin/env bash
# Set up everything LuWu's demo and tests need on a fresh machine (idempotent).
#  - a virtual environment in .venv (LUWU_VENV to change) with torch==2.13.0 installed FIRST
#    (a bare "torch" requirement resolved by pip pulls a multi-GB CUDA build), then luwu-runtime[test]
#  - Debian packages for the tests that use real outside programs: prometheus (the Prometheus
#    server test), shellcheck (deploy scripts), iproute2 (emulated cluster); skipped tests say so
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${LUWU_VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
stamp="$VENV/.luwu-installed"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check torch==2.13.0
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check -e '.[test]'
  touch "$stamp"
fi
if [ "${LUWU_SKIP_APT:-0}" != 1 ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  missing=()
  command -v prometheus >/dev/null || missing+=(prometheus)
  command -v shellcheck >/dev/null || missing+=(shellcheck)
  command -v ip >/dev/null || missing+=(iproute2)
  if [ ${#missing[@]} -gt 0 ]; then
    echo "setup: installing ${missing[*]} (Debian packages used by tests)"
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null) \
      || echo "setup: could not install ${missing[*]}; the tests that need them will skip and say so"
  fi
fi

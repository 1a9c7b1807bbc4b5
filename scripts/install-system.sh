#!/usr/bin/env bash
# System packages the test suite needs beyond the Python venv: Debian's chromium, which drives the
# live dashboard's browser test headless, and bubblewrap (`bwrap`), which the terminal sandbox's
# rootless backend runs commands under. Safe to re-run: it returns at once when both are there.
set -euo pipefail

missing=()
command -v chromium >/dev/null 2>&1 || missing+=(chromium)
command -v bwrap >/dev/null 2>&1 || missing+=(bubblewrap)
if [ ${#missing[@]} -eq 0 ]; then
  echo "chromium and bwrap already installed: $(command -v chromium) $(command -v bwrap)"
  exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "install-system.sh: no apt-get here; install ${missing[*]} with your package manager and put" \
       "'chromium' (or set MILES_CHROMIUM=/path/to/chrome) and 'bwrap' on PATH" >&2
  exit 1
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null 2>&1; then
    SUDO="sudo"
  else
    echo "install-system.sh: needs root (or sudo) to apt-get install ${missing[*]}" >&2
    exit 1
  fi
fi
export DEBIAN_FRONTEND=noninteractive
# Refresh the package lists only when they are missing; a fresh container often has none.
if [ -z "$(ls -A /var/lib/apt/lists 2>/dev/null | grep -v -e '^lock$' -e '^partial$' || true)" ]; then
  $SUDO apt-get update -qq
fi
if ! $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"; then
  # Stale lists point at package versions the mirror no longer has: refresh once and retry.
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
echo "installed ${missing[*]}: $(command -v chromium) $(command -v bwrap)"

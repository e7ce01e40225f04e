#!/usr/bin/env bash
# Stops and removes the units of install-linux.sh. Keeps the cache directory, the config and
# the logs (delete them yourself); with --prefix DIR also removes the installed binaries.
set -euo pipefail
unit_dir="${XDG_CONFIG_HOME:-$HOME/.config}/systemd/user"
prefix=""
while [ $# -gt 0 ]; do
  case "$1" in
    --unit-dir) unit_dir="$2"; shift 2 ;;
    --prefix) prefix="$2"; shift 2 ;;
    *) echo "usage: deploy/uninstall-linux.sh [--unit-dir DIR] [--prefix DIR]" >&2; exit 1 ;;
  esac
done
units=(strata-gateway.service strata-kvcache.service strata-jaeger.service)
if systemctl --user show-environment >/dev/null 2>&1; then
  systemctl --user disable --now "${units[@]}" 2>/dev/null || true
fi
for u in "${units[@]}"; do rm -f "$unit_dir/$u"; done
if systemctl --user show-environment >/dev/null 2>&1; then systemctl --user daemon-reload; fi
if [ -n "$prefix" ]; then
  rm -f "$prefix"/bin/{strata,strata-worker,strata-kvcache,strata-mlx-env}
  rm -rf "$prefix/lib/strata" "$prefix/share/doc/strata"
fi
echo "removed the Strata units"

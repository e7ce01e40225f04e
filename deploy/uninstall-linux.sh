#!/usr/bin/env bash
# Stops and removes the units of install-linux.sh. Keeps the cache directory, the config and
# the logs (delete them yourself); with --prefix DIR also removes the installed binaries.
set -euo pipefail
target_flag=--unit-dir
target_dir="${XDG_CONFIG_HOME:-$HOME/.config}/systemd/user"
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
parse_uninstall_options "$@"
units=(strata-gateway.service strata-kvcache.service strata-jaeger.service)
manager=0
systemctl --user show-environment >/dev/null 2>&1 && manager=1
[ "$manager" = 1 ] && { systemctl --user disable --now "${units[@]}" 2>/dev/null || true; }
for u in "${units[@]}"; do rm -f "$target_dir/$u"; done
[ "$manager" = 1 ] && systemctl --user daemon-reload
remove_installed_files
echo "removed the Strata units"

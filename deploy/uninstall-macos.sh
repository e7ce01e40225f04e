#!/usr/bin/env bash
# Unloads and removes the agents of install-macos.sh. Keeps the cache directory, the config
# and the logs (delete them yourself); with --prefix DIR also removes the installed binaries.
set -euo pipefail
target_flag=--agent-dir
target_dir="$HOME/Library/LaunchAgents"
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
parse_uninstall_options "$@"
for l in dev.strata.gateway dev.strata.kvcache dev.strata.jaeger; do
  if command -v launchctl >/dev/null; then
    launchctl bootout "gui/$(id -u)/$l" 2>/dev/null || true
  fi
  rm -f "$target_dir/$l.plist"
done
remove_installed_files
echo "removed the Strata agents"

#!/usr/bin/env bash
# Unloads and removes the agents of install-macos.sh. Keeps the cache directory, the config
# and the logs (delete them yourself); with --prefix DIR also removes the installed binaries.
set -euo pipefail
agent_dir="$HOME/Library/LaunchAgents"
prefix=""
while [ $# -gt 0 ]; do
  case "$1" in
    --agent-dir) agent_dir="$2"; shift 2 ;;
    --prefix) prefix="$2"; shift 2 ;;
    *) echo "usage: deploy/uninstall-macos.sh [--agent-dir DIR] [--prefix DIR]" >&2; exit 1 ;;
  esac
done
for l in dev.strata.gateway dev.strata.kvcache dev.strata.jaeger; do
  if command -v launchctl >/dev/null; then
    launchctl bootout "gui/$(id -u)/$l" 2>/dev/null || true
  fi
  rm -f "$agent_dir/$l.plist"
done
if [ -n "$prefix" ]; then
  rm -f "$prefix"/bin/{strata,strata-worker,strata-kvcache,strata-mlx-env}
  rm -rf "$prefix/lib/strata" "$prefix/share/doc/strata"
fi
echo "removed the Strata agents"

#!/usr/bin/env bash
# Installs Strata as launchd agents of the logged-in user: the cache service
# (dev.strata.kvcache), the gateway that runs the model workers (dev.strata.gateway),
# optionally Jaeger (dev.strata.jaeger), and loads them with `launchctl bootstrap`.
# Re-running it updates binaries and plists and keeps an existing strata.toml.
set -euo pipefail
target_flag=--agent-dir
target_dir="$HOME/Library/LaunchAgents"
target_help="where the plists go [default: ~/Library/LaunchAgents]"
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
parse_options "$@"
: "${log_dir:=$HOME/Library/Logs/Strata}"
log_dir="$(absolute "$log_dir")"
finish_options
agent_dir="$(absolute "$target_dir")"

install_files
mkdir -p "$agent_dir"
labels=(dev.strata.kvcache dev.strata.gateway)
[ -n "$jaeger" ] && labels=(dev.strata.jaeger "${labels[@]}")
for l in "${labels[@]}"; do
  render "$here/macos/$l.plist.in" "$agent_dir/$l.plist"
  if command -v plutil >/dev/null; then plutil -lint "$agent_dir/$l.plist" >/dev/null; fi
  echo "wrote $agent_dir/$l.plist"
done

if [ "$start" = 1 ]; then
  command -v launchctl >/dev/null || die "launchctl not found (not macOS?); the plists are written"
  domain="gui/$(id -u)"
  for l in "${labels[@]}"; do
    # Replace a loaded older version.
    launchctl bootout "$domain/$l" 2>/dev/null || true
    launchctl bootstrap "$domain" "$agent_dir/$l.plist"
  done
  echo "loaded: ${labels[*]} (logs in $log_dir)"
fi

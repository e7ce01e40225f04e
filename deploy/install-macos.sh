#!/usr/bin/env bash
# Installs Strata as launchd agents of the logged-in user: the cache service
# (dev.strata.kvcache), the gateway that runs the model workers (dev.strata.gateway),
# optionally Jaeger (dev.strata.jaeger), and loads them with `launchctl bootstrap`.
# Re-running it updates binaries and plists and keeps an existing strata.toml.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

agent_dir="$HOME/Library/LaunchAgents"
usage() {
  echo "usage: deploy/install-macos.sh [options]"
  common_usage
  echo "  --agent-dir DIR   where the plists go [default: ~/Library/LaunchAgents]"
}
while [ $# -gt 0 ]; do
  case "$1" in
    --agent-dir) agent_dir="$2"; shift 2 ;;
    --no-start) start=0; shift ;;
    -h|--help) usage; exit 0 ;;
    *) [ $# -ge 2 ] && common_option "$1" "$2" && shift 2 && continue
       usage >&2; die "unknown option $1" ;;
  esac
done
: "${log_dir:=$HOME/Library/Logs/Strata}"
log_dir="$(absolute "$log_dir")"
finish_options
agent_dir="$(absolute "$agent_dir")"

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

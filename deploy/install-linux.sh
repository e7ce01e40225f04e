#!/usr/bin/env bash
# Installs Strata as systemd user services: the cache service (strata-kvcache.service), the
# gateway that runs the model workers (strata-gateway.service), optionally Jaeger. Re-running
# it updates binaries and units and keeps an existing strata.toml. See deploy/README.md.
set -euo pipefail
target_flag=--unit-dir
target_dir="${XDG_CONFIG_HOME:-$HOME/.config}/systemd/user"
target_help="where the units go [default: ~/.config/systemd/user]"
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
parse_options "$@"
: "${log_dir:=${XDG_STATE_HOME:-$HOME/.local/state}/strata}"
log_dir="$(absolute "$log_dir")"
finish_options
unit_dir="$(absolute "$target_dir")"

install_files
mkdir -p "$unit_dir"
units=(strata-kvcache.service strata-gateway.service)
[ -n "$jaeger" ] && units+=(strata-jaeger.service)
for u in "${units[@]}"; do
  render "$here/linux/$u.in" "$unit_dir/$u"
  echo "wrote $unit_dir/$u"
done

if [ "$start" = 1 ]; then
  if ! systemctl --user show-environment >/dev/null 2>&1; then
    die "no systemd user manager to start the units with (not PID 1 here?); they are written, start them with --no-start's command lines or on a systemd host"
  fi
  systemctl --user daemon-reload
  systemctl --user enable --now "${units[@]}"
  echo "started: ${units[*]} (logs in $log_dir; to start at boot without a login: loginctl enable-linger $USER)"
fi

# Shared by install-linux.sh and install-macos.sh (sourced, not run): the options both take,
# copying Strata into a prefix, the default strata.toml, and filling in the service templates.
# Plain sed over @NAME@ placeholders: the templates stay valid-looking unit and plist files.

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/.." && pwd)"
# STRATA_CACHE, STRATA_MLX_DIR: where setup put MLX and the models.
source "$repo/scripts/paths.sh"
prefix="$HOME/.local"
from="${CARGO_TARGET_DIR:-$repo/target}/release"
kv_dir="$STRATA_CACHE/kv"
kv_ram="1GiB"
kv_disk="20GiB"
run_dir=""
log_dir=""
config=""
model="$STRATA_CACHE/models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf"
jaeger=""
bind="127.0.0.1:8080"
start=1

die() { echo "install: $*" >&2; exit 1; }

common_usage() {
  cat <<USAGE
  --prefix DIR      where bin/, lib/strata/, etc/strata/ go [default: ~/.local]
  --from DIR        the built binaries [default: target/release; build with make build]
  --kv-dir DIR      the cache service's disk tier: put it on the SSD you chose (an external
                    one too); it must exist or be creatable [default: \$STRATA_CACHE/kv]
  --kv-ram SIZE     RAM tier [default: 1GiB]
  --kv-disk SIZE    disk tier limit [default: 20GiB]
  --run-dir DIR     Unix sockets (mode 0700) [default: \$XDG_RUNTIME_DIR/strata or /tmp/strata-UID]
  --log-dir DIR     service logs
  --config FILE     strata.toml for the gateway; written with the defaults when missing
                    [default: PREFIX/etc/strata/strata.toml]
  --model PATH      the model of a newly written config [default: the SmolLM2 of setup]
  --bind ADDR       HTTP address of a newly written config [default: 127.0.0.1:8080]
  --jaeger BIN      also install a Jaeger service running BIN (OTLP on 127.0.0.1:4317)
  --no-start        write everything, start nothing
USAGE
}

# The install scripts set target_flag (--unit-dir or --agent-dir), target_dir (its default)
# and target_help before sourcing this file.
usage() {
  echo "usage: deploy/$(basename "$0") [options]"
  common_usage
  echo "  $target_flag DIR  $target_help"
}

parse_options() {
  while [ $# -gt 0 ]; do
    case "$1" in
      "$target_flag") target_dir="$2"; shift 2 ;;
      --no-start) start=0; shift ;;
      -h|--help) usage; exit 0 ;;
      *) [ $# -ge 2 ] && common_option "$1" "$2" && shift 2 && continue
         usage >&2; die "unknown option $1" ;;
    esac
  done
}

# Uninstall: the services' directory, and with --prefix the installed files too.
remove_prefix=""
parse_uninstall_options() {
  while [ $# -gt 0 ]; do
    case "$1" in
      "$target_flag") target_dir="$2"; shift 2 ;;
      --prefix) remove_prefix="$2"; shift 2 ;;
      *) die "usage: deploy/$(basename "$0") [$target_flag DIR] [--prefix DIR]" ;;
    esac
  done
}

remove_installed_files() {
  [ -n "$remove_prefix" ] || return 0
  rm -f "$remove_prefix"/bin/{strata,strata-worker,strata-kvcache,strata-mlx-env}
  rm -rf "$remove_prefix/lib/strata" "$remove_prefix/share/doc/strata"
}

# Parses one option; returns 1 when it is not a common one.
common_option() {
  case "$1" in
    --prefix) prefix="$2" ;;
    --from) from="$2" ;;
    --kv-dir) kv_dir="$2" ;;
    --kv-ram) kv_ram="$2" ;;
    --kv-disk) kv_disk="$2" ;;
    --run-dir) run_dir="$2" ;;
    --log-dir) log_dir="$2" ;;
    --config) config="$2" ;;
    --model) model="$2" ;;
    --bind) bind="$2" ;;
    --jaeger) jaeger="$2" ;;
    *) return 1 ;;
  esac
}

# Absolute paths only: the service managers run with another working directory.
absolute() { case "$1" in /*) echo "$1" ;; *) echo "$PWD/$1" ;; esac; }

finish_options() {
  prefix="$(absolute "$prefix")"
  kv_dir="$(absolute "$kv_dir")"
  : "${run_dir:=${XDG_RUNTIME_DIR:+$XDG_RUNTIME_DIR/strata}}"
  : "${run_dir:=/tmp/strata-$(id -u)}"
  run_dir="$(absolute "$run_dir")"
  : "${config:=$prefix/etc/strata/strata.toml}"
  config="$(absolute "$config")"
  if [ -n "$jaeger" ]; then
    jaeger="$(absolute "$jaeger")"
    [ -x "$jaeger" ] || die "--jaeger $jaeger is not an executable"
  fi
}

# Binaries, the BLAS launcher and libmlx into the prefix; the directories the services use.
install_files() {
  for b in strata strata-worker strata-kvcache; do
    [ -x "$from/$b" ] || die "$from/$b missing: build first (make build), or pass --from"
  done
  mkdir -p "$prefix/bin" "$prefix/lib/strata" "$(dirname "$config")" "$log_dir"
  for b in strata strata-worker strata-kvcache; do
    install -m 0755 "$from/$b" "$prefix/bin/$b"
  done
  install -m 0755 "$repo/scripts/mlx-env" "$prefix/bin/strata-mlx-env"
  mkdir -p "$prefix/share/doc/strata"
  install -m 0644 "$repo/README.md" "$prefix/share/doc/strata/README.md"
  install -m 0644 "$here/README.md" "$prefix/share/doc/strata/DEPLOY.md"
  # The worker links libmlx (and on macOS loads mlx.metallib next to it); keep a copy in the
  # prefix so that the install does not depend on the build cache staying where it is.
  if [ -d "$STRATA_MLX_DIR/lib" ]; then
    cp -R "$STRATA_MLX_DIR/lib/." "$prefix/lib/strata/"
  else
    echo "install: $STRATA_MLX_DIR/lib missing; the worker will look for libmlx where it was built" >&2
  fi
  mkdir -p "$kv_dir" || die "cannot create the cache directory $kv_dir (is the SSD mounted?)"
  mkdir -p -m 0700 "$run_dir"
  if [ ! -e "$config" ]; then
    cat > "$config" <<TOML
# Written by deploy/install; see README.md for every key.
bind = "$bind"
run_dir = "$run_dir"

[cache]
dir = "$kv_dir"
ram = "$kv_ram"
disk = "$kv_disk"
socket = "$run_dir/kvcache.sock"
# launchd/systemd runs the cache service: the gateway never starts its own.
external = true

[[models]]
id = "default"
path = "$model"
pinned = true
TOML
    echo "wrote $config"
  fi
}

# Copies a template to $2 with every @NAME@ replaced.
render() {
  local esc
  esc() { printf '%s' "$1" | sed -e 's/[|&\\]/\\&/g'; }
  sed -e "s|@PREFIX@|$(esc "$prefix")|g" \
      -e "s|@RUN_DIR@|$(esc "$run_dir")|g" \
      -e "s|@KV_DIR@|$(esc "$kv_dir")|g" \
      -e "s|@KV_RAM@|$(esc "$kv_ram")|g" \
      -e "s|@KV_DISK@|$(esc "$kv_disk")|g" \
      -e "s|@CONFIG@|$(esc "$config")|g" \
      -e "s|@LOG_DIR@|$(esc "$log_dir")|g" \
      -e "s|@STRATA_CACHE@|$(esc "$STRATA_CACHE")|g" \
      -e "s|@JAEGER@|$(esc "$jaeger")|g" \
      "$1" > "$2"
  if grep -q '@[A-Z_]*@' "$2"; then
    die "$2: a placeholder was left unfilled"
  fi
}

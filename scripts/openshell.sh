#!/usr/bin/env bash
# OpenShell's own CLI, the `openshell` binary NVIDIA ships in PyPI's openshell 0.0.111, for the
# OpenShell manifest (examples/drivers/openshell.yaml) and its stand-in gateway
# (openshell_standin/):
#
#   scripts/openshell.sh install   fetch the wheel (pip download, pinned by its sha256) and
#                                  unpack its binary and its generated gRPC code
#                                  (openshell/_proto) into the cache; where the host's glibc
#                                  is older than the binary's 2.39 (Debian 12 has 2.36),
#                                  Debian 13's libc6 and libgcc-s1 beside it (apt-get download
#                                  through a private apt state, unpacked with dpkg -x, never
#                                  installed); only what is missing
#   scripts/openshell.sh dir       print the cache directory of this version
#   scripts/openshell.sh status    say what is installed, and run `openshell --version`
#
# scripts/openshell (the launcher) runs the binary: as it is where glibc is new enough,
# otherwise through that libc6's loader (ld-linux-x86-64.so.2 --library-path ...).
# The cache is $GPU_SANDBOX_OPENSHELL_CACHE (default /var/cache/gpu-sandbox/openshell):
# <version>/bin/openshell, <version>/python/openshell/_proto/, <version>/glibc/ when needed.
# Later versions of the PyPI package carry no CLI (0.0.113 on is a Python SDK alone).
set -euo pipefail

VERSION=0.0.111
WHEEL=openshell-$VERSION-py3-none-manylinux_2_39_x86_64.whl
WHEEL_SHA256=5ed0484beb2a725e5acce42046007ca6b140fdc74d0416ca8eac3fb73c8b0fcf
GLIBC_NEEDED=2.39
GLIBC_PACKAGES=(libc6 libgcc-s1)
CACHE=${GPU_SANDBOX_OPENSHELL_CACHE:-/var/cache/gpu-sandbox/openshell}
DIR=$CACHE/$VERSION
ROOT=$(cd "$(dirname "$0")/.." && pwd)
# The venv's pip, which the Makefile made; any Python with pip will do.
PYTHON=${PYTHON:-$ROOT/.venv/bin/python}
[ -x "$PYTHON" ] || PYTHON=python3

log() { echo "openshell: $*" >&2; }
die() { log "$*"; exit 1; }

host_glibc() { getconf GNU_LIBC_VERSION 2>/dev/null | sed -n 's/^glibc //p'; }

glibc_new_enough() {
  local have
  have=$(host_glibc)
  [ -n "$have" ] && [ "$(printf '%s\n%s\n' "$GLIBC_NEEDED" "$have" | sort -V | head -1)" = "$GLIBC_NEEDED" ]
}

installed() {
  [ -x "$DIR/bin/openshell" ] && [ -f "$DIR/python/openshell/_proto/openshell_pb2_grpc.py" ] \
    && { glibc_new_enough || [ -x "$DIR/glibc/usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2" ]; }
}

fetch_wheel() {
  local work=$1
  log "fetching $WHEEL (pip download)"
  "$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: \
    --platform manylinux_2_39_x86_64 --python-version 3.11 --dest "$work" "openshell==$VERSION" >&2
  [ -f "$work/$WHEEL" ] || die "pip download gave no $WHEEL: $(ls "$work")"
  echo "$WHEEL_SHA256  $work/$WHEEL" | sha256sum --check --quiet \
    || die "$WHEEL does not have the pinned sha256 $WHEEL_SHA256"
}

fetch_glibc() {
  # Debian 13's, through a private apt state: the system's sources stay untouched. apt checks
  # each package against the signed index. The mirror is the one the machine already uses.
  local work=$1 mirror apt
  mirror=$(sed -n 's/^URIs: *//p' /etc/apt/sources.list.d/debian.sources 2>/dev/null | head -1)
  mirror=${mirror:-http://deb.debian.org/debian}
  apt="$work/apt"
  mkdir -p "$apt/lists/partial" "$apt/cache/archives/partial"
  echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] $mirror trixie main" \
    >"$apt/sources.list"
  local opts=(-o "Dir::Etc::SourceList=$apt/sources.list" -o Dir::Etc::SourceParts=/dev/null
    -o "Dir::State::Lists=$apt/lists" -o "Dir::Cache=$apt/cache" -o APT::Sandbox::User=root)
  log "fetching ${GLIBC_PACKAGES[*]} from Debian trixie ($mirror): this host's glibc is $(host_glibc)"
  apt-get "${opts[@]}" update -qq
  (cd "$apt" && apt-get "${opts[@]}" download -qq "${GLIBC_PACKAGES[@]}")
  mkdir -p "$work/image/glibc"
  for deb in "$apt"/*.deb; do
    dpkg-deb -x "$deb" "$work/image/glibc"
  done
}

install_cli() {
  installed && return 0
  [ "$(uname -m)" = x86_64 ] || die "the pinned wheel is x86_64's; this machine is $(uname -m)"
  if ! glibc_new_enough; then
    [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null && command -v dpkg-deb >/dev/null \
      || die "glibc $(host_glibc) is older than the binary's $GLIBC_NEEDED: run this as root on Debian, or on a host with glibc $GLIBC_NEEDED (Ubuntu 24.04, Debian 13)"
  fi
  umask 022
  mkdir -p "$CACHE"
  # Two set-ups at once (two checkouts' make test): the second waits, then finds it done.
  exec 9>"$CACHE/.lock"
  flock 9
  installed && return 0
  work=$(mktemp -d "$CACHE/.install.XXXXXX")
  trap 'rm -rf "${work:-}"' EXIT
  fetch_wheel "$work"
  mkdir -p "$work/wheel" "$work/image/bin" "$work/image/python/openshell"
  "$PYTHON" -m zipfile -e "$work/$WHEEL" "$work/wheel"
  install -m 755 "$work/wheel/openshell-$VERSION.data/scripts/openshell" "$work/image/bin/openshell"
  # The generated code alone, without the SDK's __init__ (which needs httpx): `openshell` is a
  # namespace package there, and openshell._proto the wheel's own.
  cp -r "$work/wheel/openshell/_proto" "$work/image/python/openshell/_proto"
  glibc_new_enough || fetch_glibc "$work"
  local run=("$work/image/bin/openshell")
  if [ -d "$work/image/glibc" ]; then
    local lib=$work/image/glibc/usr/lib/x86_64-linux-gnu
    if "$lib/ld-linux-x86-64.so.2" --library-path "$lib" --list "$work/image/bin/openshell" | grep -q 'not found'; then
      die "the binary needs libraries that neither ${GLIBC_PACKAGES[*]} nor the host give: $("$lib/ld-linux-x86-64.so.2" --library-path "$lib" --list "$work/image/bin/openshell")"
    fi
    run=("$lib/ld-linux-x86-64.so.2" --library-path "$lib" "$work/image/bin/openshell")
  fi
  local version
  version=$("${run[@]}" --version) || die "the binary does not run: ${run[*]} --version failed"
  [ "$version" = "openshell $VERSION" ] || die "the binary says '$version', not 'openshell $VERSION'"
  rm -rf "$DIR"
  mv "$work/image" "$DIR"
  log "installed $version in $DIR"
}

status() {
  if ! installed; then
    echo "openshell $VERSION: not installed in $DIR (scripts/openshell.sh install)"
    return 1
  fi
  local how="as it is (glibc $(host_glibc))"
  [ -d "$DIR/glibc" ] && how="through Debian 13's loader in $DIR/glibc (this host's glibc is $(host_glibc))"
  echo "$("$ROOT/scripts/openshell" --version) in $DIR, run $how"
}

case "${1:-}" in
  install) install_cli ;;
  dir) echo "$DIR" ;;
  status) status ;;
  *) die "usage: $0 install|dir|status" ;;
esac

#!/usr/bin/env bash
# The container engines of the docker and podman lanes, on a Debian 12 machine (root):
#
#   scripts/engines.sh install   podman + runc from Debian; docker.io 26 (CDI) from Debian
#                                trixie, through a private apt state (the system's sources
#                                stay untouched); only what is missing
#   scripts/engines.sh start     write containers.conf and daemon.json under $STATE, start
#                                the podman REST service and dockerd in the background unless
#                                they already answer, wait until they do, import the busybox
#                                base image; prints the names of the services it started
#   scripts/engines.sh stop [NAME...]   stop services this script started, by pid
#   scripts/engines.sh status
#
# Nothing here needs a registry: the base image is a busybox rootfs imported with
# `import`. GPUs reach containers as CDI devices; the simulated GPU host registers its CDI
# spec with `python -m gpuhost.simulated setup --cdi-dir /var/run/cdi`.
set -euo pipefail

STATE=${GPU_SANDBOX_ENGINES_STATE:-/run/gpu-sandbox-engines}
PODMAN_SOCK=/run/podman/podman.sock
DOCKER_SOCK=/var/run/docker.sock
IMAGE=gpu-sandbox-busybox:latest
IMAGE_PATH=/usr/local/bin:/usr/bin:/bin
WAIT_S=60
# A fresh machine's own package runs (cloud-init, unattended upgrades) may hold dpkg's lock.
APT_LOCK=(-o DPkg::Lock::Timeout=300)

log() { echo "engines: $*" >&2; }
die() { log "$*"; exit 1; }

podman_cli() { CONTAINERS_CONF="$STATE/containers.conf" podman "$@"; }
podman_answers() { podman --url "unix://$PODMAN_SOCK" version >/dev/null 2>&1; }
docker_answers() { docker --host "unix://$DOCKER_SOCK" version >/dev/null 2>&1; }

static_busybox() {
  # The base image holds busybox alone, with no libc: Debian's dynamic `busybox` cannot run there.
  [ -x /bin/busybox ] && ! ldd /bin/busybox >/dev/null 2>&1
}

dockerd_has_cdi() {
  # CDI injection came with docker 25.
  command -v dockerd >/dev/null || return 1
  local major
  major=$(dockerd --version | sed -E 's/^Docker version ([0-9]+).*/\1/')
  [ "${major:-0}" -ge 25 ]
}

install() {
  local debian=() trixie=()
  command -v podman >/dev/null || debian+=(podman)
  command -v runc >/dev/null || debian+=(runc)
  static_busybox || debian+=(busybox-static)
  dockerd_has_cdi || trixie+=(docker.io)
  command -v docker >/dev/null || trixie+=(docker-cli)
  if [ ${#debian[@]} -eq 0 ] && [ ${#trixie[@]} -eq 0 ]; then
    return 0
  fi
  [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null \
    || die "missing ${debian[*]} ${trixie[*]}: run this as root on Debian/Ubuntu, or install them"
  export DEBIAN_FRONTEND=noninteractive
  if [ ${#debian[@]} -gt 0 ]; then
    log "installing ${debian[*]} from Debian"
    apt-get "${APT_LOCK[@]}" update -qq
    apt-get "${APT_LOCK[@]}" install -y -qq "${debian[@]}" >/dev/null
  fi
  if [ ${#trixie[@]} -gt 0 ]; then
    install_from_trixie "${trixie[@]}"
  fi
}

install_from_trixie() {
  # Debian 12's docker.io is 20.10, without CDI; trixie's 26.1 installs on bookworm with
  # bookworm's own dependencies. The mirror is the one the machine already uses.
  local mirror tmp
  mirror=$(sed -n 's/^URIs: *//p' /etc/apt/sources.list.d/debian.sources 2>/dev/null | head -1)
  mirror=${mirror:-http://deb.debian.org/debian}
  tmp=$(mktemp -d)
  mkdir -p "$tmp/lists/partial" "$tmp/cache/archives/partial"
  echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] $mirror trixie main" \
    >"$tmp/sources.list"
  local opts=(-o "Dir::Etc::SourceList=$tmp/sources.list" -o Dir::Etc::SourceParts=/dev/null
    -o "Dir::State::Lists=$tmp/lists" -o "Dir::Cache=$tmp/cache" -o APT::Sandbox::User=root)
  log "installing $* from Debian trixie ($mirror)"
  apt-get "${opts[@]}" update -qq
  (cd "$tmp" && apt-get "${opts[@]}" download -qq "$@")
  apt-get "${APT_LOCK[@]}" install -y -qq --no-install-recommends "$tmp"/*.deb >/dev/null
  rm -rf "$tmp"
}

write_configs() {
  mkdir -p "$STATE" /var/run/cdi /etc/cdi
  # podman's default ulimits (1048576) exceed the hard limits of machines without
  # CAP_SYS_RESOURCE, and podman clamps nproc to kernel.pid_max.
  local nofile nproc pid_max
  nofile=$(ulimit -Hn)
  nproc=$(ulimit -Hu)
  pid_max=$(cat /proc/sys/kernel/pid_max)
  if [ "$nproc" = unlimited ] || [ "$nproc" -gt "$pid_max" ]; then nproc=$pid_max; fi
  if [ "$nofile" = unlimited ]; then nofile=1048576; fi
  # crun 1.8 fails on hybrid cgroup layouts: runc. No systemd: cgroupfs, file events.
  # Every exec keeps a conmon process for exit_command_delay after it ends, so that API
  # clients can still ask for its exit code (300 s by default: a catalogue run's execs left
  # 700 of them behind); the drivers ask at once.
  cat >"$STATE/containers.conf" <<EOF
[containers]
default_ulimits = ["nofile=$nofile:$nofile", "nproc=$nproc:$nproc"]

[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
exit_command_delay = 30
EOF
  cat >"$STATE/daemon.json" <<EOF
{
  "hosts": ["unix://$DOCKER_SOCK"],
  "storage-driver": "overlay2",
  "iptables": false,
  "ip6tables": false,
  "bridge": "none",
  "features": {"cdi": true},
  "cdi-spec-dirs": ["/etc/cdi", "/var/run/cdi"]
}
EOF
}

wait_for() {
  local name=$1 check=$2 pid=$3 waited=0
  until $check; do
    if ! kill -0 "$pid" 2>/dev/null; then
      tail -20 "$STATE/$name.log" >&2 || true
      die "$name exited while starting (log: $STATE/$name.log)"
    fi
    if [ "$waited" -ge $((WAIT_S * 10)) ]; then
      die "$name did not answer within ${WAIT_S} s (log: $STATE/$name.log)"
    fi
    if [ $((waited % 20)) -eq 19 ]; then log "waiting for $name to answer ($((waited / 10 + 1)) s)"; fi
    sleep 0.1
    waited=$((waited + 1))
  done
}

start_podman() {
  podman_answers && return 0
  mkdir -p "$(dirname "$PODMAN_SOCK")"
  CONTAINERS_CONF="$STATE/containers.conf" setsid podman system service --time=0 \
    "unix://$PODMAN_SOCK" >"$STATE/podman.log" 2>&1 </dev/null &
  echo $! >"$STATE/podman.pid"
  wait_for podman podman_answers "$!"
  echo podman
}

start_docker() {
  docker_answers && return 0
  setsid dockerd --config-file "$STATE/daemon.json" --pidfile "$STATE/dockerd.run.pid" \
    >"$STATE/dockerd.log" 2>&1 </dev/null &
  echo $! >"$STATE/dockerd.pid"
  wait_for dockerd docker_answers "$!"
  echo dockerd
}

busybox_rootfs() {
  # A rootfs with busybox and a link per applet (not `busybox` itself).
  static_busybox || die "/bin/busybox is not statically linked: install busybox-static"
  local tar
  tar=$STATE/busybox-rootfs-$(sha256sum /bin/busybox | cut -c1-12).tar
  if [ ! -f "$tar" ]; then
    local root
    root=$(mktemp -d)
    mkdir -p "$root/bin" "$root/tmp" "$root/usr/bin"
    cp /bin/busybox "$root/bin/busybox"
    for applet in $(/bin/busybox --list); do
      [ "$applet" = busybox ] || ln -sf busybox "$root/bin/$applet"
    done
    tar -C "$root" -cf "$tar" .
    rm -rf "$root"
  fi
  echo "$tar"
}

import_images() {
  if ! docker --host "unix://$DOCKER_SOCK" image inspect "$IMAGE" >/dev/null 2>&1; then
    log "importing $IMAGE into docker"
    docker --host "unix://$DOCKER_SOCK" import --change "ENV PATH=$IMAGE_PATH" \
      "$(busybox_rootfs)" "$IMAGE" >/dev/null
  fi
  if ! podman --url "unix://$PODMAN_SOCK" image exists "$IMAGE"; then
    log "importing $IMAGE into podman"
    podman_cli import --change "ENV PATH=$IMAGE_PATH" "$(busybox_rootfs)" "$IMAGE" >/dev/null
  fi
}

start() {
  write_configs
  start_podman
  start_docker
  import_images
}

stop() {
  local names=("$@")
  [ ${#names[@]} -gt 0 ] || names=(podman dockerd)
  for name in "${names[@]}"; do
    local pidfile=$STATE/$name.pid
    [ -f "$pidfile" ] || continue
    local pid
    pid=$(cat "$pidfile")
    if kill -TERM "$pid" 2>/dev/null; then
      for _ in $(seq 1 200); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
      kill -KILL "$pid" 2>/dev/null || true
      log "stopped $name (pid $pid)"
    fi
    rm -f "$pidfile"
  done
}

status() {
  local rc=0
  if podman_answers; then echo "podman: answering at unix://$PODMAN_SOCK"; else echo "podman: not answering"; rc=1; fi
  if docker_answers; then echo "docker: answering at unix://$DOCKER_SOCK"; else echo "docker: not answering"; rc=1; fi
  return $rc
}

case "${1:-}" in
  install) install ;;
  start) start ;;
  stop) shift; stop "$@" ;;
  status) status ;;
  *) die "usage: $0 install|start|stop [NAME...]|status" ;;
esac

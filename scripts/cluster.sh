#!/usr/bin/env bash
# A single-node Kubernetes of the kubernetes lane, on a Debian 12 machine (root), with no
# registry and no Go module proxy:
#
#   scripts/cluster.sh install   etcd, containerd, runc, CNI plugins, Go, ... from Debian
#                                when missing; Debian bookworm's `kubernetes` *source*
#                                package (the full upstream tree with vendor/) through a
#                                private apt state, built in GOPATH mode into
#                                $CACHE/<k8s>-go<go>/bin (apiserver, controller-manager,
#                                scheduler, kubelet, kubectl, a static pause); the device
#                                plugin API's Python gRPC code under $CACHE/<k8s>/deviceplugin
#   scripts/cluster.sh start     etcd, kube-apiserver, controller-manager, scheduler, a
#                                containerd of its own, kubelet, two simulated GPU hosts and
#                                their device plugins, all under $STATE; waits for the node to
#                                be Ready with its GPUs allocatable. Does nothing if the
#                                cluster already answers.
#   scripts/cluster.sh stop      stop what start started, by pid, and undo what kubelet and
#                                containerd changed on the host (mounts, netns, bridge, cgroups)
#   scripts/cluster.sh status    whether the cluster answers (exit 0/1)
#   scripts/cluster.sh import-image ARCHIVE
#                                an OCI image archive (make job-image's) into every node's
#                                containerd: there is no registry (a node added later: again)
#   scripts/cluster.sh add-node NAME GPUS [--leaky]
#                                a node more, on this machine: a kubelet named by a loopback
#                                address of its own (127.0.0.2, ...), with a containerd, a
#                                simulated host of GPUS GPUs and a device plugin of its own
#                                (--leaky: a planted one that injects every GPU)
#   scripts/cluster.sh remove-node NAME, nodes
#                                take it away again (stop takes them all); list them
#
# The admin kubeconfig is $STATE/kubeconfig; kubectl is $STATE/bin/kubectl (the `kubectl` on
# PATH may be something else entirely).
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(dirname "$HERE")
STATE=${GPU_SANDBOX_CLUSTER_STATE:-/run/gpu-sandbox-cluster}
CACHE=${GPU_SANDBOX_CLUSTER_CACHE:-/var/cache/gpu-sandbox/kubernetes}
PYTHON=${GPU_SANDBOX_CLUSTER_PYTHON:-$REPO/.venv/bin/python}

# Debian 12 ships no kubelet or apiserver; its source package is upstream 1.20.2 with vendor/.
# (Trixie's `kubernetes` source, 1.32, covers kubectl only.)
K8S_VERSION=1.20.2
K8S_DEB_VERSION=1.20.5+really1.20.2-1.1+deb12u1
K8S_GIT_COMMIT=faecb196815e248d3ecfb03c680a4507229c2a56
K8S_BINARIES=(kube-apiserver kube-controller-manager kube-scheduler kubelet kubectl)

NODE=localhost
SERVICE_CIDR=10.96.0.0/16
# Not 10.88.0.0/16: podman's default network.
POD_CIDR=10.234.0.0/16
BRIDGE=gpusbx0
GPUS=8
LEAKY_GPUS=4
IMAGE=gpu-sandbox-busybox:latest
IMAGE_PATH=/usr/local/bin:/usr/bin:/bin
PAUSE_IMAGE=gpu-sandbox-pause:$K8S_VERSION
WAIT_S=120
# A fresh machine's own package runs (cloud-init, unattended upgrades) may hold dpkg's lock.
APT_LOCK=(-o DPkg::Lock::Timeout=300)

log() { echo "cluster: $*" >&2; }
die() { log "$*"; exit 1; }
now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }

go_version() { go env GOVERSION 2>/dev/null | sed 's/^go//'; }
build_dir() { echo "$CACHE/$K8S_VERSION-go$(go_version)"; }
src_dir() { echo "$CACHE/src/kubernetes-$K8S_VERSION"; }
proto_dir() { echo "$CACHE/$K8S_VERSION/deviceplugin"; }

static_busybox() {
  [ -x /bin/busybox ] && ! ldd /bin/busybox >/dev/null 2>&1
}

# ---------------------------------------------------------------------------- install

install_packages() {
  local need=() pair
  for pair in etcd:etcd-server containerd:containerd ctr:containerd runc:runc \
    /usr/lib/cni/bridge:containernetworking-plugins go:golang-go openssl:openssl \
    iptables:iptables dpkg-source:dpkg-dev gcc:gcc ip:iproute2 mount:mount \
    /usr/lib/x86_64-linux-gnu/libc.a:libc6-dev; do
    local cmd=${pair%%:*} pkg=${pair#*:}
    if [[ $cmd == /* ]]; then [ -e "$cmd" ] && continue; else command -v "$cmd" >/dev/null && continue; fi
    [[ " ${need[*]} " == *" $pkg "* ]] || need+=("$pkg")
  done
  static_busybox || need+=(busybox-static)
  [ ${#need[@]} -gt 0 ] || return 0
  if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
    die "missing ${need[*]}: run this as root on Debian, or install them"
  fi
  log "installing ${need[*]} from Debian"
  export DEBIAN_FRONTEND=noninteractive
  apt-get "${APT_LOCK[@]}" update -qq
  # Where systemd runs, Debian's containerd unit starts a system containerd too: the
  # cluster's own (socket, root and state under $STATE) leaves it alone.
  apt-get "${APT_LOCK[@]}" install -y -qq --no-install-recommends "${need[@]}" >/dev/null
}

fetch_source() {
  # The source package through a private apt state holding only deb-src lines: the
  # system's sources stay untouched. The mirror is the one the machine already uses.
  local src
  src=$(src_dir)
  [ -f "$src/.extracted" ] && return 0
  local mirror tmp
  mirror=$(sed -n 's/^URIs: *//p' /etc/apt/sources.list.d/debian.sources 2>/dev/null | head -1)
  mirror=${mirror:-http://deb.debian.org/debian}
  tmp=$(mktemp -d)
  mkdir -p "$tmp/lists/partial" "$tmp/cache/archives/partial"
  local keyring=/usr/share/keyrings/debian-archive-keyring.gpg
  {
    echo "deb-src [signed-by=$keyring] $mirror bookworm main"
    echo "deb-src [signed-by=$keyring] $mirror bookworm-updates main"
    echo "deb-src [signed-by=$keyring] ${mirror%/debian}/debian-security bookworm-security main"
  } >"$tmp/sources.list"
  local opts=(-o "Dir::Etc::SourceList=$tmp/sources.list" -o Dir::Etc::SourceParts=/dev/null
    -o "Dir::State::Lists=$tmp/lists" -o "Dir::Cache=$tmp/cache" -o APT::Sandbox::User=root)
  log "fetching the source package kubernetes=$K8S_DEB_VERSION ($mirror)"
  apt-get "${opts[@]}" update -qq
  (cd "$tmp" && apt-get "${opts[@]}" source --download-only -qq "kubernetes=$K8S_DEB_VERSION")
  rm -rf "$src" "$src.tmp"
  mkdir -p "$(dirname "$src")"
  # apt checked the files against the signed Sources index; dpkg-source cannot check the
  # uploader's signature without Debian's developer keyring: its warnings only on failure.
  local out
  out=$(cd "$tmp" && dpkg-source -x --skip-debianization ./*.dsc "$src.tmp" 2>&1) \
    || die "dpkg-source -x failed: $out"
  mv "$src.tmp" "$src"
  touch "$src/.extracted"
  rm -rf "$tmp"
}

go_env() {
  # Module mode fails on this tree (`updates to go.mod needed, disabled by -mod=vendor`):
  # GOPATH mode, the tree linked at $GOPATH/src/k8s.io/kubernetes. No proxy is reachable.
  local gopath=$CACHE/gopath
  mkdir -p "$gopath/src/k8s.io"
  ln -sfn "$(src_dir)" "$gopath/src/k8s.io/kubernetes"
  export GOPATH=$gopath GO111MODULE=off GOPROXY=off GOFLAGS='' CGO_ENABLED=0
  export GOCACHE=$CACHE/gocache
}

gen_openapi() {
  # kube-apiserver needs generated OpenAPI definitions that the tarball lacks, over exactly
  # the package list of Makefile.generated_files' gen_openapi (a shorter list builds an
  # apiserver that exits with `cannot find model definition for ...`). The Makefile target
  # itself writes at the filesystem root: run the tree's own openapi-gen directly.
  local src=$1 out=pkg/generated/openapi/zz_generated.openapi.go
  [ -s "$src/$out" ] && return 0
  local t0
  t0=$(now)
  log "generating OpenAPI definitions"
  (cd "$GOPATH/src/k8s.io/kubernetes" \
    && go build -o "$CACHE/gopath/bin/openapi-gen" ./vendor/k8s.io/kube-openapi/cmd/openapi-gen)
  # Makefile.generated_files' KUBE_OPENAPI_TAG_FILES: every .go file outside vendor/ (with
  # staging/src named as vendor/), less code-generator and sample-apiserver, whose `+k8s:`
  # tags include `+k8s:openapi-gen=`; their directories, sorted.
  local pkgs
  pkgs=$(cd "$src" \
    && find -H . \( -path './_*' -o -path './.*' -o -path ./vendor \) -prune \
      -o -type f -name '*.go' -print \
    | sed -e 's|^\./staging/src|vendor|' -e 's|^\./||' \
    | grep -v -e '^vendor/k8s.io/code-generator/' -e '^vendor/k8s.io/sample-apiserver/' \
    | xargs grep -l '^// *+k8s:' | xargs grep -l '+k8s:openapi-gen=' \
    | xargs -n1 dirname | LC_ALL=C sort -u | sed 's|^|k8s.io/kubernetes/|' | paste -sd, -)
  (cd "$GOPATH/src/k8s.io/kubernetes" && "$CACHE/gopath/bin/openapi-gen" \
    -i "$pkgs" -p k8s.io/kubernetes/pkg/generated/openapi -O zz_generated.openapi \
    -h vendor/k8s.io/code-generator/hack/boilerplate.go.txt \
    -r "$CACHE/gopath/openapi-violations.report" -o "$GOPATH/src")
  [ -s "$src/$out" ] || die "openapi-gen wrote no $out"
  log "OpenAPI definitions generated in $(since "$t0") s"
}

build_binaries() {
  local src bin
  src=$(src_dir)
  bin=$(build_dir)/bin
  local missing=0 b
  for b in "${K8S_BINARIES[@]}" pause; do [ -x "$bin/$b" ] || missing=1; done
  [ $missing = 1 ] || return 0
  go_env
  gen_openapi "$src"
  local t0
  t0=$(now)
  log "building ${K8S_BINARIES[*]} $K8S_VERSION with go $(go_version) (cold: ~5 min on 2 cores)"
  mkdir -p "$bin.tmp"
  # GOPATH mode stamps the vendored packages' paths.
  local v=k8s.io/kubernetes/vendor/k8s.io/component-base/version
  local c=k8s.io/kubernetes/vendor/k8s.io/client-go/pkg/version
  local ldflags="-s -w" pkg
  for pkg in $v $c; do
    ldflags+=" -X $pkg.gitVersion=v$K8S_VERSION -X $pkg.gitMajor=${K8S_VERSION%%.*}"
    ldflags+=" -X $pkg.gitMinor=$(cut -d. -f2 <<<"$K8S_VERSION") -X $pkg.gitCommit=$K8S_GIT_COMMIT"
    ldflags+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=$(date -u +%Y-%m-%dT%H:%M:%SZ)"
  done
  local targets=()
  for b in "${K8S_BINARIES[@]}"; do targets+=("k8s.io/kubernetes/cmd/$b"); done
  (cd "$GOPATH/src/k8s.io/kubernetes" && go build -trimpath -ldflags "$ldflags" -o "$bin.tmp/" "${targets[@]}")
  # The pod sandbox's pause process, static: the image has nothing else.
  gcc -Os -static -o "$bin.tmp/pause" "$src/build/pause/linux/pause.c"
  strip "$bin.tmp/pause"
  rm -rf "$bin"
  mv "$bin.tmp" "$bin"
  log "built the binaries in $(since "$t0") s ($(du -sh "$bin" | cut -f1))"
}

gen_deviceplugin_api() {
  # The kubelet's device plugin API (v1beta1) as Python gRPC code, compiled by grpcio-tools
  # from the tree's api.proto less its gogoproto import and options.
  local src out stamp tools
  src=$(src_dir)
  out=$(proto_dir)
  tools=$("$PYTHON" -c 'import importlib.metadata as m; print(m.version("grpcio-tools"))') \
    || die "$PYTHON lacks grpcio-tools: run make venv"
  stamp="grpcio-tools $tools"
  [ "$(cat "$out/.generated" 2>/dev/null)" = "$stamp" ] && return 0
  local tmp
  tmp=$(mktemp -d)
  mkdir -p "$tmp/in/v1beta1" "$tmp/out"
  sed -e '/import "github.com\/gogo\/protobuf\/gogoproto\/gogo.proto";/d' \
    -e '/^option (gogoproto\./d' \
    -e 's/ *\[(gogoproto\.[^]]*\]//g' \
    "$src/vendor/k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1/api.proto" >"$tmp/in/v1beta1/api.proto"
  "$PYTHON" -m grpc_tools.protoc -I "$tmp/in" --python_out="$tmp/out" \
    --grpc_python_out="$tmp/out" "$tmp/in/v1beta1/api.proto"
  rm -rf "$out"
  mkdir -p "$(dirname "$out")"
  mv "$tmp/out" "$out"
  echo "$stamp" >"$out/.generated"
  rm -rf "$tmp"
  log "generated the device plugin API in $out/v1beta1"
}

install_all() {
  install_packages
  fetch_source
  build_binaries
  gen_deviceplugin_api
}

# ---------------------------------------------------------------------------- start

ETCD_PORT=12379
APISERVER_PORT=6443
CTR_DIR=$STATE/containerd
CTR_SOCK=$CTR_DIR/containerd.sock
CNI_DIR=$STATE/cni
RUNC_ROOT=$STATE/runc
# The kubelet of 1.20 keeps its device plugin sockets here whatever its --root-dir.
PLUGIN_DIR=/var/lib/kubelet/device-plugins
# Host paths the kubelet or containerd create when missing; `stop` removes those that
# were not there before `start` (listed in $STATE/created-paths).
HOST_PATHS=(/var/lib/kubelet /var/log/pods /var/log/containers /var/lib/cni /var/run/netns)
NET_NAME=gpu-sandbox-cluster

kubectl() { "$STATE/bin/kubectl" --kubeconfig "$STATE/kubeconfig" "$@"; }
answers() {
  [ -x "$STATE/bin/kubectl" ] && [ -f "$STATE/kubeconfig" ] \
    && kubectl get --raw /readyz --request-timeout=5s >/dev/null 2>&1
}
ctr_() { ctr --address "$CTR_SOCK" -n k8s.io "$@"; }

wait_for() {
  # wait_for NAME CHECK [PID]: poll CHECK every 0.2 s until it succeeds; fail if PID exits.
  local name=$1 check=$2 pid=${3:-} waited=0
  until $check; do
    if [ -n "$pid" ] && ! kill -0 "$pid" 2>/dev/null; then
      tail -20 "$STATE/$name.log" >&2 || true
      die "$name exited while starting (log: $STATE/$name.log)"
    fi
    if [ "$waited" -ge $((WAIT_S * 5)) ]; then
      tail -20 "$STATE/$name.log" >&2 || true
      die "$name: not ready within ${WAIT_S} s (log: $STATE/$name.log)"
    fi
    if [ $((waited % 50)) -eq 49 ]; then log "waiting for $name ($((waited / 5 + 1)) s)"; fi
    sleep 0.2
    waited=$((waited + 1))
  done
}

spawn() {
  # spawn NAME COMMAND...: in the background, in a session of its own, logged and pidfiled.
  local name=$1
  shift
  setsid "$@" >"$STATE/$name.log" 2>&1 </dev/null &
  echo $! >"$STATE/$name.pid"
  echo $!
}

make_certs() {
  local pki=$STATE/pki
  [ -f "$pki/etcd-client.crt" ] && return 0
  mkdir -p "$pki"
  chmod 700 "$pki"
  (
    cd "$pki"
    openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.crt -days 30 \
      -subj "/CN=gpu-sandbox-cluster-ca" 2>/dev/null
    cert() { # cert NAME SUBJECT [SAN]
      openssl req -newkey rsa:2048 -nodes -keyout "$1.key" -out "$1.csr" -subj "$2" 2>/dev/null
      local ext=()
      if [ -n "${3:-}" ]; then
        printf 'subjectAltName=%s\nextendedKeyUsage=serverAuth,clientAuth\n' "$3" >"$1.ext"
        ext=(-extfile "$1.ext")
      fi
      chmod 600 "$1.key"
      openssl x509 -req -in "$1.csr" -CA ca.crt -CAkey ca.key -CAcreateserial -days 30 \
        -out "$1.crt" "${ext[@]}" 2>/dev/null
      rm -f "$1.csr" "$1.ext"
    }
    cert apiserver "/CN=kube-apiserver" \
      "DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local,IP:127.0.0.1,IP:${SERVICE_CIDR%.0/*}.1"
    # One client identity in system:masters for the admin, the controllers and the kubelet:
    # a test cluster of one node, reachable from this machine only.
    cert admin "/O=system:masters/CN=admin"
    # etcd answers only a client with a certificate of this CA (the apiserver's), over TLS:
    # on plain http any local user could read every secret of the cluster.
    cert etcd "/CN=etcd" "DNS:localhost,IP:127.0.0.1"
    cert etcd-client "/CN=kube-apiserver-etcd-client" "DNS:kube-apiserver-etcd-client"
    openssl genrsa -out sa.key 2048 2>/dev/null
    openssl rsa -in sa.key -pubout -out sa.pub 2>/dev/null
  )
  cat >"$STATE/kubeconfig" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: gpu-sandbox
  cluster:
    server: https://127.0.0.1:$APISERVER_PORT
    certificate-authority: $pki/ca.crt
users:
- name: admin
  user:
    client-certificate: $pki/admin.crt
    client-key: $pki/admin.key
contexts:
- name: gpu-sandbox
  context: {cluster: gpu-sandbox, user: admin, namespace: default}
current-context: gpu-sandbox
EOF
}

etcd_ready() {
  local pki=$STATE/pki
  curl -sf --cacert "$pki/ca.crt" --cert "$pki/etcd-client.crt" --key "$pki/etcd-client.key" \
    "https://127.0.0.1:$ETCD_PORT/health" 2>/dev/null | grep -q '"health":"true"'
}
apiserver_ready() { kubectl get --raw /readyz --request-timeout=2s >/dev/null 2>&1; }
containerd_ready() { ctr_ version >/dev/null 2>&1; }

start_control_plane() {
  local bin=$STATE/bin pki=$STATE/pki pid
  pid=$(spawn etcd etcd --name gpu-sandbox --data-dir "$STATE/etcd" \
    --listen-client-urls "https://127.0.0.1:$ETCD_PORT" \
    --advertise-client-urls "https://127.0.0.1:$ETCD_PORT" \
    --cert-file "$pki/etcd.crt" --key-file "$pki/etcd.key" \
    --client-cert-auth --trusted-ca-file "$pki/ca.crt" \
    --listen-peer-urls https://127.0.0.1:12380 --initial-advertise-peer-urls https://127.0.0.1:12380 \
    --peer-cert-file "$pki/etcd.crt" --peer-key-file "$pki/etcd.key" \
    --peer-client-cert-auth --peer-trusted-ca-file "$pki/ca.crt" \
    --initial-cluster gpu-sandbox=https://127.0.0.1:12380 --unsafe-no-fsync)
  wait_for etcd etcd_ready "$pid"
  pid=$(spawn kube-apiserver "$bin/kube-apiserver" \
    --etcd-servers "https://127.0.0.1:$ETCD_PORT" --etcd-cafile "$pki/ca.crt" \
    --etcd-certfile "$pki/etcd-client.crt" --etcd-keyfile "$pki/etcd-client.key" \
    --bind-address 127.0.0.1 --secure-port "$APISERVER_PORT" --insecure-port 0 \
    --service-cluster-ip-range "$SERVICE_CIDR" \
    --client-ca-file "$pki/ca.crt" \
    --tls-cert-file "$pki/apiserver.crt" --tls-private-key-file "$pki/apiserver.key" \
    --kubelet-client-certificate "$pki/admin.crt" --kubelet-client-key "$pki/admin.key" \
    --kubelet-preferred-address-types Hostname,InternalIP \
    --authorization-mode Node,RBAC --allow-privileged \
    --service-account-key-file "$pki/sa.pub" \
    --service-account-signing-key-file "$pki/sa.key" \
    --service-account-issuer https://kubernetes.default.svc.cluster.local \
    --v 1)
  wait_for kube-apiserver apiserver_ready "$pid"
  spawn kube-controller-manager "$bin/kube-controller-manager" \
    --kubeconfig "$STATE/kubeconfig" --leader-elect=false --controllers '*,-nodeipam' \
    --service-account-private-key-file "$pki/sa.key" --root-ca-file "$pki/ca.crt" \
    --cluster-signing-cert-file "$pki/ca.crt" --cluster-signing-key-file "$pki/ca.key" \
    --bind-address 127.0.0.1 --port 0 --v 1 >/dev/null
  spawn kube-scheduler "$bin/kube-scheduler" \
    --kubeconfig "$STATE/kubeconfig" --leader-elect=false \
    --bind-address 127.0.0.1 --port 0 --v 1 >/dev/null
}

write_containerd_config() {
  # A containerd of its own, its CNI network and runc state under CTR_DIR, CNI_DIR, RUNC_ROOT.
  mkdir -p "$CTR_DIR" "$CNI_DIR/net.d" "$RUNC_ROOT"
  # restrict_oom_score_adj: runc cannot lower oom_score_adj on a machine without
  # CAP_SYS_RESOURCE (every sandbox failed with `failed to update /proc/self/oom_score_adj`).
  cat >"$CTR_DIR/config.toml" <<EOF
version = 2
root = "$CTR_DIR/root"
state = "$CTR_DIR/state"
disabled_plugins = ["io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs",
  "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.aufs"]

[grpc]
  address = "$CTR_SOCK"

[plugins."io.containerd.internal.v1.opt"]
  path = "$CTR_DIR/opt"

[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "docker.io/library/$PAUSE_IMAGE"
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
        Root = "$RUNC_ROOT"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "$CNI_DIR/net.d"
EOF
  # A bridge of its own on a private range, with no address on the host's side and no
  # route: a pod reaches neither the host nor anything beyond it (the runtime needs an eth0;
  # exec and logs go through the kubelet, not the pod's network).
  cat >"$CNI_DIR/net.d/10-$NET_NAME.conflist" <<EOF
{
  "cniVersion": "0.4.0",
  "name": "$NET_NAME",
  "plugins": [
    {
      "type": "bridge",
      "bridge": "$BRIDGE",
      "isGateway": false,
      "ipMasq": false,
      "hairpinMode": false,
      "ipam": {
        "type": "host-local",
        "ranges": [[{"subnet": "$POD_CIDR"}]],
        "dataDir": "$CNI_DIR/ipam"
      }
    }
  ]
}
EOF
}

busybox_rootfs() {
  # As scripts/engines.sh builds it: busybox and a link per applet, nothing else.
  static_busybox || die "/bin/busybox is not statically linked: install busybox-static"
  local tar=$1 root
  root=$(mktemp -d)
  chmod 0755 "$root"
  mkdir -p "$root/bin" "$root/tmp" "$root/usr/bin" "$root/dev" "$root/proc" "$root/sys" "$root/etc"
  cp /bin/busybox "$root/bin/busybox"
  for applet in $(/bin/busybox --list); do
    [ "$applet" = busybox ] || ln -sf busybox "$root/bin/$applet"
  done
  chmod 1777 "$root/tmp"
  tar -C "$root" --owner=0 --group=0 -cf "$tar" .
  rm -rf "$root"
}

import_images() {
  # The OCI archives are cached by what they hold: busybox's hash, the pause binary's.
  local images=$CACHE/images bin
  bin=$(build_dir)/bin
  mkdir -p "$images"
  local bb pause
  bb=$images/busybox-$(sha256sum /bin/busybox | cut -c1-12).oci.tar
  pause=$images/pause-$(sha256sum "$bin/pause" | cut -c1-12).oci.tar
  if [ ! -f "$bb" ]; then
    busybox_rootfs "$images/busybox.layer.tar"
    python3 "$HERE/cluster/oci_image.py" --name "docker.io/library/$IMAGE" \
      --layer "$images/busybox.layer.tar" --env "PATH=$IMAGE_PATH" --cmd sh --out "$bb"
    rm -f "$images/busybox.layer.tar"
  fi
  if [ ! -f "$pause" ]; then
    local root
    root=$(mktemp -d)
    chmod 0755 "$root"
    cp "$bin/pause" "$root/pause"
    chmod 0755 "$root/pause"
    tar -C "$root" --owner=0 --group=0 -cf "$images/pause.layer.tar" .
    rm -rf "$root"
    python3 "$HERE/cluster/oci_image.py" --name "docker.io/library/$PAUSE_IMAGE" \
      --layer "$images/pause.layer.tar" --entrypoint /pause --out "$pause"
    rm -f "$images/pause.layer.tar"
  fi
  ctr_ images import "$pause" >/dev/null
  ctr_ images import "$bb" >/dev/null
}

start_containerd() {
  write_containerd_config
  local pid
  pid=$(spawn containerd containerd --config "$CTR_DIR/config.toml")
  wait_for containerd containerd_ready "$pid"
  import_images
}

kubelet_config() {
  # kubelet_config ADDRESS: a kubelet's configuration, serving on ADDRESS alone.
  cat <<EOF
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: $1
readOnlyPort: 0
healthzBindAddress: $1
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: false}
  x509: {clientCAFile: $STATE/pki/ca.crt}
authorization: {mode: AlwaysAllow}
cgroupDriver: cgroupfs
failSwapOn: false
makeIPTablesUtilChains: false
# GPUs appear in ~2 s instead of ~10 s.
nodeStatusUpdateFrequency: 2s
nodeStatusReportFrequency: 10s
clusterDomain: cluster.local
resolvConf: /etc/resolv.conf
serializeImagePulls: false
# The images were imported, not pulled: garbage collection could never get them back.
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
evictionHard: {memory.available: 50Mi, nodefs.available: 1%, imagefs.available: 1%}
EOF
}

start_kubelet() {
  mkdir -p "$STATE/kubelet"
  kubelet_config 127.0.0.1 >"$STATE/kubelet.yaml"
  local pid
  pid=$(spawn kubelet "$STATE/bin/kubelet" --config "$STATE/kubelet.yaml" \
    --kubeconfig "$STATE/kubeconfig" --root-dir "$STATE/kubelet" \
    --cert-dir "$STATE/kubelet/pki" \
    --container-runtime remote --container-runtime-endpoint "unix://$CTR_SOCK" \
    --hostname-override "$NODE" --v 1)
  echo "$pid"
}

start_plugins() {
  local proto
  proto=$(proto_dir)
  "$PYTHON" -m gpuhost.simulated setup --root "$STATE/sim" --count "$GPUS" >/dev/null
  "$PYTHON" -m gpuhost.simulated setup --root "$STATE/sim-leaky" --count "$LEAKY_GPUS" >/dev/null
  spawn device-plugin "$PYTHON" -m gpuhost.simulated.device_plugin --sim-root "$STATE/sim" \
    --resource nvidia.com/gpu --proto-dir "$proto" --socket-dir "$PLUGIN_DIR" >/dev/null
  # Deliberately broken: injects every GPU of its host, for the planted conformance test.
  spawn device-plugin-leaky "$PYTHON" -m gpuhost.simulated.device_plugin \
    --sim-root "$STATE/sim-leaky" --resource gpu-sandbox.test/leaky-gpu --proto-dir "$proto" \
    --inject all --socket-dir "$PLUGIN_DIR" >/dev/null
}

publish_gpus() {
  # The GPUs the node's device plugins serve, by UUID, index, PCI address and device node:
  # the kubernetes driver reads them from this annotation (drivers/kubernetes/driver.py),
  # since the API says only how many a node has.
  local gpus leaky
  gpus=$("$PYTHON" -m gpuhost.simulated show --json --root "$STATE/sim")
  leaky=$("$PYTHON" -m gpuhost.simulated show --json --root "$STATE/sim-leaky")
  kubectl annotate node "$NODE" --overwrite \
    "gpu-sandbox.dev/gpus={\"nvidia.com/gpu\": $gpus, \"gpu-sandbox.test/leaky-gpu\": $leaky}" >/dev/null
  kubectl label node "$NODE" --overwrite gpu-sandbox.dev/simulated=true >/dev/null
}

node_ready() {
  local got
  got=$(kubectl get node "$NODE" -o jsonpath='{.status.conditions[?(@.type=="Ready")].status} {.status.allocatable.nvidia\.com/gpu} {.status.allocatable.gpu-sandbox\.test/leaky-gpu}' 2>/dev/null) || return 1
  [ "$got" = "True $GPUS $LEAKY_GPUS" ] && kubectl get serviceaccount default >/dev/null 2>&1
}

start() {
  local t0 t
  t0=$(now)
  if answers; then
    log "already running (kubeconfig: $STATE/kubeconfig)"
    return 0
  fi
  [ "$(id -u)" = 0 ] || die "start needs root"
  local bin
  bin=$(build_dir)/bin
  for b in "${K8S_BINARIES[@]}" pause; do
    [ -x "$bin/$b" ] || die "no $bin/$b: run \`scripts/cluster.sh install\` (make cluster)"
  done
  [ -f "$(proto_dir)/v1beta1/api_pb2.py" ] || die "no device plugin API: run \`scripts/cluster.sh install\`"
  if ls "$STATE"/*.pid >/dev/null 2>&1; then
    log "a previous cluster did not answer: stopping what is left of it"
    stop
  fi
  mkdir -p "$STATE/bin"
  : >"$STATE/created-paths"
  for p in "${HOST_PATHS[@]}"; do [ -e "$p" ] || echo "$p" >>"$STATE/created-paths"; done
  for b in "${K8S_BINARIES[@]}"; do ln -sfn "$bin/$b" "$STATE/bin/$b"; done
  make_certs
  t=$(now)
  start_control_plane
  log "control plane ready in $(since "$t") s"
  t=$(now)
  start_containerd
  log "containerd ready, images imported in $(since "$t") s"
  t=$(now)
  local kubelet_pid
  kubelet_pid=$(start_kubelet)
  start_plugins
  wait_for kubelet node_ready "$kubelet_pid"
  publish_gpus
  log "node $NODE Ready with nvidia.com/gpu: $GPUS, gpu-sandbox.test/leaky-gpu: $LEAKY_GPUS in $(since "$t") s"
  log "cluster up in $(since "$t0") s; kubectl: $STATE/bin/kubectl --kubeconfig $STATE/kubeconfig"
}

# ------------------------------------------------------------------- more nodes
# A node more on this machine: a kubelet, a containerd and a device plugin of its own, with a
# simulated GPU host of its own. The kubelet of 1.20 keeps its device plugin sockets in
# /var/lib/kubelet/device-plugins whatever its --root-dir, and reads container logs from
# /var/log/pods: the node's kubelet and containerd run in a mount namespace of their own in
# which those are the node's directories. Its name is a loopback address of its own
# (127.0.0.2, ...): the apiserver reaches a kubelet at its node's name, and the kubelet
# serves there alone. Its pods' cgroups are under a cgroup root of its own, so that neither
# kubelet takes the other's pods for orphans.

node_dir() { echo "$STATE/nodes/$1"; }
node_cgroup() { echo "gpu-sandbox-node-$1"; }
node_number() { echo "${1##*.}"; }

node_gpus_ready() {
  # node_gpus_ready NAME GPUS: the node is Ready with GPUS nvidia.com/gpu allocatable.
  local got
  got=$(kubectl get node "$1" -o jsonpath='{.status.conditions[?(@.type=="Ready")].status} {.status.allocatable.nvidia\.com/gpu}' 2>/dev/null) || return 1
  [ "$got" = "True $2" ]
}

adding_containerd_ready() { ctr --address "$ADDING_SOCK" version >/dev/null 2>&1; }
adding_node_ready() { node_gpus_ready "$ADDING_NODE" "$ADDING_GPUS"; }

add_node() {
  # add_node NAME GPUS [--leaky]: --leaky plants a device plugin that injects every GPU of
  # the node's host, whatever the pod was given.
  local name=${1:-} gpus=${2:-} leaky=${3:-} t
  t=$(now)
  [[ $name =~ ^127\.0\.0\.([2-9]|[1-9][0-9])$ ]] || die "add-node: NAME is a loopback address 127.0.0.2 to 127.0.0.99 (got '$name')"
  [[ $gpus =~ ^[1-9][0-9]?$ ]] || die "add-node: GPUS is a number of GPUs, 1 to 99 (got '$gpus')"
  case "$leaky" in "" | --leaky) ;; *) die "add-node: unknown option '$leaky' (--leaky)" ;; esac
  answers || die "add-node: the cluster does not answer: start it first (scripts/cluster.sh start)"
  local dir number cgroup proto
  dir=$(node_dir "$name")
  number=$(node_number "$name")
  cgroup=$(node_cgroup "$name")
  [ ! -e "$dir" ] || die "add-node: node $name is there already (scripts/cluster.sh remove-node $name)"
  mkdir -p "$dir"/{kubelet,device-plugins,log/pods,log/containers} /var/lib/kubelet/device-plugins /var/log/pods /var/log/containers
  # The node's cgroup root, in each v1 hierarchy: cpuset's needs its CPUs and memory nodes.
  local hierarchy
  for hierarchy in /sys/fs/cgroup/*/; do
    [ -f "$hierarchy/cgroup.procs" ] || continue
    mkdir -p "$hierarchy$cgroup"
    if [ -f "$hierarchy/cpuset.cpus" ]; then
      cat "$hierarchy/cpuset.cpus" >"$hierarchy$cgroup/cpuset.cpus"
      cat "$hierarchy/cpuset.mems" >"$hierarchy$cgroup/cpuset.mems"
    fi
  done
  (
    CTR_DIR=$dir/containerd CTR_SOCK=$dir/containerd/containerd.sock CNI_DIR=$dir/cni
    RUNC_ROOT=$dir/runc NET_NAME=$NET_NAME-$number BRIDGE=gpusbx$number
    POD_CIDR=10.$((234 + number)).0.0/16
    write_containerd_config
  )
  {
    kubelet_config "$name"
    echo "port: $((10250 + 10 * number))"
    echo "healthzPort: $((10248 + 10 * number))"
    echo "cgroupRoot: /$cgroup"
  } >"$dir/kubelet.yaml"
  # In the node's own mount namespace: its directories over the kubelet's fixed paths, its
  # containerd, then its kubelet (the namespace goes with them).
  cat >"$dir/run.sh" <<EOF
set -e
mount --bind "$dir/device-plugins" /var/lib/kubelet/device-plugins
mount --bind "$dir/log/pods" /var/log/pods
mount --bind "$dir/log/containers" /var/log/containers
containerd --config "$dir/containerd/config.toml" >"$STATE/node-$name-containerd.log" 2>&1 </dev/null &
echo \$! >"$STATE/node-$name-containerd.pid"
exec "$STATE/bin/kubelet" --config "$dir/kubelet.yaml" --kubeconfig "$STATE/kubeconfig" \
  --root-dir "$dir/kubelet" --cert-dir "$dir/kubelet/pki" \
  --container-runtime remote --container-runtime-endpoint "unix://$dir/containerd/containerd.sock" \
  --hostname-override "$name" --node-labels gpu-sandbox.dev/node="$name" --v 1
EOF
  local pid
  pid=$(spawn "node-$name-kubelet" unshare --mount --propagation private bash "$dir/run.sh")
  # wait_for's checks take no arguments, and its locals hide the caller's: globals, then.
  ADDING_SOCK=$dir/containerd/containerd.sock ADDING_NODE=$name ADDING_GPUS=$gpus
  wait_for "node-$name-kubelet" adding_containerd_ready "$pid"
  CTR_SOCK=$ADDING_SOCK import_images
  proto=$(proto_dir)
  "$PYTHON" -m gpuhost.simulated setup --root "$dir/sim" --count "$gpus" >/dev/null
  local inject=()
  [ -z "$leaky" ] || inject=(--inject all)
  spawn "node-$name-device-plugin" "$PYTHON" -m gpuhost.simulated.device_plugin \
    --sim-root "$dir/sim" --resource nvidia.com/gpu --proto-dir "$proto" "${inject[@]}" \
    --socket-dir "$dir/device-plugins" >/dev/null
  wait_for "node-$name-kubelet" adding_node_ready "$pid"
  local published
  published=$("$PYTHON" -m gpuhost.simulated show --json --root "$dir/sim")
  kubectl annotate node "$name" --overwrite "gpu-sandbox.dev/gpus={\"nvidia.com/gpu\": $published}" >/dev/null
  kubectl label node "$name" --overwrite gpu-sandbox.dev/simulated=true >/dev/null
  log "node $name Ready with nvidia.com/gpu: $gpus${leaky:+ (a planted device plugin: it injects every GPU)} in $(since "$t") s"
}

remove_node() {
  # remove_node NAME: stop the node, remove its pods' containers, undo what it changed.
  local name=$1 dir number cgroup
  dir=$(node_dir "$name")
  [ -d "$dir" ] || die "remove-node: no node $name (scripts/cluster.sh nodes)"
  number=$(node_number "$name")
  cgroup=$(node_cgroup "$name")
  stop_pids "node-$name-device-plugin" "node-$name-kubelet"
  CTR_SOCK=$dir/containerd/containerd.sock remove_containers
  stop_pids "node-$name-containerd"
  local ns
  while read -r ns; do
    [ -e "$ns" ] && { rm -f "$ns" 2>/dev/null || log "could not remove $ns"; }
  done < <(sort -u "$STATE/netns" 2>/dev/null)
  ip link delete "gpusbx$number" 2>/dev/null || true
  rm -f /var/lib/cni/results/"$NET_NAME-$number"-* 2>/dev/null || true
  local hierarchy
  for hierarchy in /sys/fs/cgroup/*/; do
    [ -d "$hierarchy$cgroup" ] || continue
    find "$hierarchy$cgroup" -depth -type d -exec rmdir {} + 2>/dev/null || log "cgroups left in $hierarchy$cgroup"
  done
  answers && kubectl delete node "$name" --wait=false >/dev/null 2>&1 || true
  [ -d "$dir/sim" ] && "$PYTHON" -m gpuhost.simulated teardown --root "$dir/sim" >/dev/null
  rm -rf "$dir" "$STATE/node-$name"-*.log
  log "node $name removed"
}

import_image() {
  # import_image ARCHIVE: into the first node's containerd and each added node's.
  local archive=${1:-} dir
  [ -f "$archive" ] || die "import-image: no image archive '$archive'"
  answers || die "import-image: the cluster does not answer: start it first (scripts/cluster.sh start)"
  ctr_ images import "$archive" >/dev/null
  for dir in "$STATE"/nodes/*/; do
    [ -d "$dir" ] || continue
    CTR_SOCK=$dir/containerd/containerd.sock ctr_ images import "$archive" >/dev/null
  done
  log "imported $archive into each node: $(($(nodes | wc -l) + 1))"
}

nodes() {
  local dir
  for dir in "$STATE"/nodes/*/; do
    [ -d "$dir" ] && basename "$dir"
  done
  return 0
}

# ---------------------------------------------------------------------------- stop

alive() {
  # Not `kill -0`: an exited child stays a zombie until init reaps it, which can take a while.
  local state
  state=$(sed 's/.*) //' "/proc/$1/stat" 2>/dev/null | cut -d' ' -f1) || return 1
  [ -n "$state" ] && [ "$state" != Z ]
}

stop_pids() {
  # stop_pids NAME...: TERM to all of them at once, KILL to any left after 10 s.
  local name pid t0 names=() pids=()
  t0=$(now)
  for name in "$@"; do
    [ -f "$STATE/$name.pid" ] || continue
    pid=$(cat "$STATE/$name.pid")
    rm -f "$STATE/$name.pid"
    kill -TERM "$pid" 2>/dev/null || continue
    names+=("$name") pids+=("$pid")
  done
  [ ${#pids[@]} -gt 0 ] || return 0
  local left
  for _ in $(seq 1 100); do
    left=0
    for pid in "${pids[@]}"; do alive "$pid" && left=1; done
    [ $left = 1 ] || break
    sleep 0.1
  done
  for pid in "${pids[@]}"; do alive "$pid" && kill -KILL "$pid" 2>/dev/null; done
  log "stopped ${names[*]} in $(since "$t0") s"
}

remove_containers() {
  # Every container of this containerd, with its shim; the pod sandboxes' network
  # namespaces (read from their specs) go afterwards. Only when this containerd answers.
  containerd_ready || return 0
  local ids id
  ids=$(ctr_ containers ls -q 2>/dev/null) || return 0
  [ -n "$ids" ] || return 0
  for id in $ids; do
    ctr_ containers info "$id" 2>/dev/null \
      | grep -o '"path": *"/var/run/netns/[^"]*"' | sed 's/.*"\(\/var[^"]*\)"/\1/' \
      >>"$STATE/netns" || true
  done
  for id in $ids; do ctr_ tasks kill -s KILL "$id" >/dev/null 2>&1 || true; done
  for id in $ids; do
    for _ in $(seq 1 50); do
      ctr_ tasks delete "$id" >/dev/null 2>&1 && break
      ctr_ tasks ls -q 2>/dev/null | grep -qx "$id" || break
      sleep 0.1
    done
    ctr_ containers delete "$id" >/dev/null 2>&1 || true
  done
}

undo_host_changes() {
  # Mounts under the state dir (the kubelet root bind-mounted onto itself, pod volumes,
  # rootfs and shm of sandboxes), deepest first.
  local m
  while read -r m; do
    umount "$m" 2>/dev/null || umount -l "$m" 2>/dev/null || log "could not unmount $m"
  done < <(awk -v s="$STATE" '$5 == s || index($5, s "/") == 1 { print $5 }' /proc/self/mountinfo | sort -r)
  local ns
  while read -r ns; do
    [ -e "$ns" ] || continue
    umount "$ns" 2>/dev/null || umount -l "$ns" 2>/dev/null || true
    # Still a mount point in another mount namespace (a shim that outlived its task): the
    # kernel frees it with that namespace; a stop must not fail on it.
    rm -f "$ns" 2>/dev/null || log "could not remove $ns (busy: still mounted elsewhere)"
  done < <(sort -u "$STATE/netns" 2>/dev/null)
  ip link delete "$BRIDGE" 2>/dev/null || true
  rm -f /var/lib/cni/results/"$NET_NAME"-* 2>/dev/null || true
  # The kubelet's pod cgroups (cgroupfs driver), leaves first; empty once the shims are gone.
  local dir
  for dir in /sys/fs/cgroup/*/kubepods /sys/fs/cgroup/kubepods; do
    [ -d "$dir" ] || continue
    find "$dir" -depth -type d -exec rmdir {} + 2>/dev/null || log "cgroups left in $dir"
  done
  local tables
  for tables in iptables ip6tables; do
    command -v "$tables" >/dev/null || continue
    if "$tables" -t mangle -L KUBE-KUBELET-CANARY -n >/dev/null 2>&1; then
      "$tables" -t mangle -F KUBE-KUBELET-CANARY 2>/dev/null || true
      "$tables" -t mangle -X KUBE-KUBELET-CANARY 2>/dev/null || true
    fi
  done
  rm -f "$PLUGIN_DIR"/gpu-sandbox-*.sock "$PLUGIN_DIR/kubelet.sock" "$PLUGIN_DIR/kubelet_internal_checkpoint"
  local p
  while read -r p; do
    [ -n "$p" ] && { rm -rf "$p" 2>/dev/null || log "could not remove all of $p (busy)"; }
  done <"$STATE/created-paths" 2>/dev/null || true
}

stop() {
  [ -d "$STATE" ] || return 0
  local name
  for name in $(nodes); do remove_node "$name"; done
  stop_pids device-plugin device-plugin-leaky kubelet kube-scheduler kube-controller-manager
  remove_containers
  stop_pids containerd kube-apiserver
  stop_pids etcd
  undo_host_changes
  local sim
  for sim in "$STATE/sim" "$STATE/sim-leaky"; do
    [ -d "$sim" ] && "$PYTHON" -m gpuhost.simulated teardown --root "$sim" >/dev/null
  done
  rm -rf "$STATE"
  log "stopped; $STATE removed"
}

status() {
  if answers; then
    echo "cluster: answering at https://127.0.0.1:$APISERVER_PORT (kubeconfig: $STATE/kubeconfig)"
    kubectl get nodes
  else
    echo "cluster: not answering"
    return 1
  fi
}

case "${1:-}" in
  install) install_all ;;
  start) start ;;
  stop) stop ;;
  status) status ;;
  add-node) shift; add_node "$@" ;;
  remove-node) shift; remove_node "${1:-}" ;;
  nodes) nodes ;;
  import-image) shift; import_image "${1:-}" ;;
  *) die "usage: $0 install|start|stop|status|import-image ARCHIVE|add-node NAME GPUS [--leaky]|remove-node NAME|nodes" ;;
esac

#!/usr/bin/env bash
# The guest image of the vm lane (drivers/vm/), on a Debian machine:
#
#   scripts/vm-image.sh install   qemu-system-x86, cpio and busybox-static from Debian, when
#                                 missing (root)
#   scripts/vm-image.sh build     fetch Debian's cloud kernel package (extracted with
#                                 dpkg-deb -x, never installed into the host's /boot) and
#                                 build a busybox initramfs around scripts/vm-guest/; cached
#                                 by versions, so a warm build takes a moment
#   scripts/vm-image.sh path      print the image directory the driver uses
#
# The image lives outside the repository, in $GPU_SANDBOX_VM_CACHE (default
# /var/cache/gpu-sandbox/vm): <key>/vmlinuz, <key>/initramfs.cpio, <key>/image.json, and
# image.json naming the current one. The key is the kernel package's version, busybox's and a
# hash of the guest's files.
set -euo pipefail

CACHE=${GPU_SANDBOX_VM_CACHE:-/var/cache/gpu-sandbox/vm}
KERNEL_PACKAGE=${GPU_SANDBOX_VM_KERNEL_PACKAGE:-linux-image-cloud-amd64}
GUEST_DIR=$(cd "$(dirname "$0")/vm-guest" && pwd)
# The modules that virtio-serial (the exec channel) needs, in load order: the cloud kernel
# builds them as modules.
MODULES=(
  kernel/drivers/virtio/virtio_ring.ko
  kernel/drivers/virtio/virtio.ko
  kernel/drivers/virtio/virtio_pci_legacy_dev.ko
  kernel/drivers/virtio/virtio_pci_modern_dev.ko
  kernel/drivers/virtio/virtio_pci.ko
  kernel/drivers/char/virtio_console.ko
)
APT_LOCK=(-o DPkg::Lock::Timeout=300)

log() { echo "vm-image: $*" >&2; }
die() { log "$*"; exit 1; }

static_busybox() { [ -x /bin/busybox ] && ! ldd /bin/busybox >/dev/null 2>&1; }

install_packages() {
  local missing=()
  command -v qemu-system-x86_64 >/dev/null || missing+=(qemu-system-x86)
  command -v cpio >/dev/null || missing+=(cpio)
  static_busybox || missing+=(busybox-static)
  command -v lz4 >/dev/null || missing+=(lz4)
  [ ${#missing[@]} -eq 0 ] && return 0
  [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null \
    || die "missing ${missing[*]}: run this as root on Debian/Ubuntu, or: sudo apt-get install ${missing[*]}"
  log "installing ${missing[*]} from Debian"
  apt-get "${APT_LOCK[@]}" update -qq
  DEBIAN_FRONTEND=noninteractive apt-get "${APT_LOCK[@]}" install -y -qq --no-install-recommends \
    "${missing[@]}" >/dev/null
}

extract_vmlinux() {
  # The ELF kernel inside a bzImage: QEMU boots it straight into its PVH entry point, so
  # the guest neither runs the real-mode setup nor decompresses itself (slow under TCG).
  # Debian's kernels are LZ4; others fall back to the bzImage.
  local bzimage=$1 out=$2 offset
  command -v lz4 >/dev/null || return 1
  offset=$(grep -aboP '\x02\x21\x4c\x18' "$bzimage" | head -1 | cut -d: -f1)
  [ -n "$offset" ] || return 1
  tail -c +$((offset + 1)) "$bzimage" | lz4 -dc 2>/dev/null > "$out" || true
  [ "$(head -c 4 "$out" | od -An -c | tr -d ' ')" = "177ELF" ]
}

kernel_package() {
  # The versioned package the meta-package points at, e.g. linux-image-6.1.0-56-cloud-amd64.
  apt-cache depends "$KERNEL_PACKAGE" 2>/dev/null | sed -n 's/^ *Depends: \(linux-image-[0-9].*\)/\1/p' | head -1
}

build() {
  command -v cpio >/dev/null || die "cpio is missing: run scripts/vm-image.sh install"
  static_busybox || die "a static /bin/busybox is missing: run scripts/vm-image.sh install"
  local package version busybox_version guest_hash key dir
  package=$(kernel_package)
  if [ -z "$package" ]; then
    apt-get "${APT_LOCK[@]}" update -qq || true
    package=$(kernel_package)
  fi
  [ -n "$package" ] || die "apt knows no $KERNEL_PACKAGE: run apt-get update"
  version=$(apt-cache policy "$package" | sed -n 's/^ *Candidate: //p')
  busybox_version=$(dpkg-query -W -f '${Version}' busybox-static 2>/dev/null || busybox | head -1)
  guest_hash=$( (cd "$GUEST_DIR" && cat init gpu-sandbox-agent gpu-sandbox-gpus; echo "${MODULES[*]}"; declare -f build extract_vmlinux) | sha256sum | cut -c1-12)
  key="$package-$version-busybox-$busybox_version-$guest_hash"
  key=${key//[^A-Za-z0-9._-]/_}
  dir="$CACHE/$key"
  if [ -f "$dir/image.json" ]; then
    ln -sfn "$key" "$CACHE/current"
    echo "$dir"
    return 0
  fi
  mkdir -p "$CACHE"
  work=$(mktemp -d "$CACHE/.build.XXXXXX")
  trap 'rm -rf "${work:-}"' EXIT
  log "fetching $package $version"
  # Its progress to stderr: stdout is the image's path alone (make keeps it in .vm-image).
  (cd "$work" && apt-get download "$package=$version" 2>/dev/null >&2) \
    || (cd "$work" && apt-get download "$package=$version" >&2)
  dpkg-deb -x "$work"/"$package"_*.deb "$work/kernel"
  local release
  release=$(ls "$work/kernel/lib/modules")

  log "building the initramfs (busybox $busybox_version, guest $guest_hash)"
  local root="$work/root"
  mkdir -p "$root"/{bin,sbin,usr/bin,usr/sbin,proc,sys,dev,tmp,etc/gpu-sandbox,lib/modules,run/gpu-sandbox-agent,run/gpu-sim}
  cp /bin/busybox "$root/bin/busybox"
  for applet in $(/bin/busybox --list); do
    [ "$applet" = busybox ] || ln -s busybox "$root/bin/$applet"
  done
  install -m 755 "$GUEST_DIR/init" "$root/init"
  install -m 755 "$GUEST_DIR/gpu-sandbox-agent" "$root/sbin/gpu-sandbox-agent"
  install -m 755 "$GUEST_DIR/gpu-sandbox-gpus" "$root/sbin/gpu-sandbox-gpus"
  : > "$root/etc/gpu-sandbox/modules"
  for module in "${MODULES[@]}"; do
    cp "$work/kernel/lib/modules/$release/$module" "$root/lib/modules/"
    basename "$module" >> "$root/etc/gpu-sandbox/modules"
  done
  echo "root:x:0:0:root:/tmp:/bin/sh" > "$root/etc/passwd"
  # Uncompressed: unpacking a compressed archive under TCG costs more than reading it.
  (cd "$root" && find . | LC_ALL=C sort | cpio --quiet -o -H newc -R 0:0) > "$work/initramfs.cpio"

  mkdir -p "$work/image"
  local kernel=vmlinuz
  cp "$work/kernel/boot/vmlinuz-$release" "$work/image/vmlinuz"
  if extract_vmlinux "$work/image/vmlinuz" "$work/image/vmlinux"; then
    kernel=vmlinux
  else
    log "booting the bzImage: its ELF kernel could not be extracted"
    rm -f "$work/image/vmlinux"
  fi
  mv "$work/initramfs.cpio" "$work/image/initramfs.cpio"
  cat > "$work/image/image.json" <<JSON
{"kernel": "$kernel", "initramfs": "initramfs.cpio", "kernel_package": "$package",
 "kernel_version": "$version", "kernel_release": "$release", "busybox": "$busybox_version",
 "guest": "$guest_hash"}
JSON
  rm -rf "$dir"
  mv "$work/image" "$dir"
  ln -sfn "$key" "$CACHE/current"
  echo "$dir"
}

case "${1:-}" in
  install) install_packages ;;
  build) build ;;
  path) echo "$CACHE/current" ;;
  *) die "usage: $0 install|build|path" ;;
esac

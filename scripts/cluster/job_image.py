"""Build the catalogue's own image, for running it as a Kubernetes Job (``conformance.job``).

    .venv/bin/python scripts/cluster/job_image.py --name NAME:TAG --out IMAGE.oci.tar

No registry and no base image: the image is assembled from this machine, as the cluster's
busybox image is. busybox's applets, this Python (the interpreter, its standard library and
the shared libraries they load), the distributions the project needs to run the kubernetes
lane (its requirements with the ``kubernetes`` extra, as installed in the interpreter running
this script), the project's own files (not its tests), and the host tools the catalogue's
holders call (setpriv, flock, jq). The OCI archive it writes is imported with ``ctr images
import`` (``scripts/cluster.sh import-image``) or copied to a registry (``skopeo copy
oci-archive:IMAGE.oci.tar docker://REGISTRY/NAME:TAG``). Same machine type only: the
libraries are this machine's.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement

sys.path.insert(0, str(Path(__file__).parent))
from oci_image import pack

ROOT = Path(__file__).resolve().parents[2]
PROJECT = "gpu-sandbox-conformance"
EXTRAS = ("kubernetes",)
WORKDIR = "/opt/gpu-sandbox"
TOOLS = ("setpriv", "flock", "jq")
LOADED_BY_NAME = ("seccomp",)
"""Libraries ctypes loads by name (pyseccomp's): no ``ldd`` finds them."""
LEFT_OUT = ("tests/", "bench/", ".github/", ".ci/")
"""Of the project's files: what a run of the catalogue never reads."""
STDLIB_LEFT_OUT = {"test", "idlelib", "tkinter", "turtledemo", "ensurepip", "lib2to3"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--name", required=True, help="docker.io/library/NAME:TAG")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch) / "rootfs"
        build(root)
        layer = Path(scratch) / "layer.tar"
        with tarfile.open(layer, "w") as tar:
            tar.add(root, arcname=".", filter=_owned_by_root)
        pack(
            args.name, layer,
            ["PATH=/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin", "HOME=/tmp"],
            [], ["python3", "-m", "conformance.job", "pod"], args.out, workdir=WORKDIR,
        )  # fmt: skip


def build(root: Path) -> None:
    """The image's files under ``root``."""
    for directory in ("bin", "usr/bin", "usr/sbin", "tmp", "etc", "dev", "proc", "sys"):
        (root / directory).mkdir(parents=True, exist_ok=True)
    (root / "tmp").chmod(0o1777)
    shutil.copy2("/bin/busybox", root / "bin/busybox")
    applets = subprocess.run(["/bin/busybox", "--list"], capture_output=True, text=True).stdout
    for applet in applets.split():
        if applet != "busybox":
            (root / "bin" / applet).symlink_to("busybox")
    (root / "etc/passwd").write_text("root:x:0:0:root:/tmp:/bin/sh\nnobody:x:65534:65534::/:\n")
    (root / "etc/group").write_text("root:x:0:\nnogroup:x:65534:\n")
    binaries = [_copy(Path(sys.executable).resolve(), root)]
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    (root / "usr/bin/python3").symlink_to(version)
    binaries += _copy_stdlib(Path(sysconfig.get_paths()["stdlib"]), root)
    site = root / "usr/local/lib" / version / "dist-packages"
    for dist in _closure():
        if _normal(dist.metadata["Name"]) == _normal(PROJECT):
            _install_project(dist, site, root)
        else:
            binaries += _copy_distribution(dist, site)
    binaries += [_copy(Path(found), root) for tool in TOOLS if (found := shutil.which(tool))]
    ldconfig = Path(shutil.which("ldconfig") or "/sbin/ldconfig")
    binaries.append(_copy(ldconfig, root))
    (root / "sbin").mkdir(exist_ok=True)
    (root / "sbin/ldconfig").symlink_to(f"/{ldconfig.relative_to('/')}")  # ctypes runs this one
    binaries += [_copy(library, root) for library in _by_name(LOADED_BY_NAME)]
    for library in sorted(_libraries(binaries)):
        _copy(library, root)
    # ctypes.util.find_library (pyseccomp's libseccomp) reads the loader's cache.
    multiarch = sysconfig.get_config_var("MULTIARCH") or "x86_64-linux-gnu"
    (root / "etc/ld.so.conf").write_text(f"/lib/{multiarch}\n/usr/lib/{multiarch}\n")
    subprocess.run(["ldconfig", "-r", str(root)], check=True)


def _closure() -> list[metadata.Distribution]:
    """The project's distributions to run the kubernetes lane, each once."""
    wanted: list[tuple[str, tuple[str, ...]]] = [(PROJECT, EXTRAS)]
    seen: dict[str, metadata.Distribution] = {}
    expanded: set[tuple[str, tuple[str, ...]]] = set()
    while wanted:
        name, extras = wanted.pop()
        dist = metadata.distribution(name)
        key = _normal(dist.metadata["Name"])
        if (key, extras) in expanded:
            continue  # requirements may name each other, with extras or without
        expanded.add((key, extras))
        seen[key] = dist
        for line in dist.requires or []:
            requirement = Requirement(line)
            marker = requirement.marker
            if marker is None or any(marker.evaluate({"extra": e}) for e in extras or ("",)):
                wanted.append((requirement.name, tuple(requirement.extras)))
    return list(seen.values())


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _by_name(names: tuple[str, ...]) -> list[Path]:
    listing = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True).stdout
    return [
        Path(match.group(1))
        for name in names
        if (match := re.search(rf"\slib{name}\.so\.\d+ \(libc6,x86-64\) => (\S+)", listing))
    ]


def _copy_distribution(dist: metadata.Distribution, site: Path) -> list[Path]:
    """A distribution's files as its RECORD lists them; its shared objects."""
    base = Path(str(dist.locate_file("")))
    objects = []
    for file in dist.files or []:
        source = Path(str(dist.locate_file(file)))
        if ".." in file.parts or not source.is_file():
            continue  # scripts installed outside site-packages; nothing a run imports
        target = site / source.relative_to(base)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, target)
        if ".so" in source.suffixes:
            objects.append(source)
    return objects


def _copy_stdlib(stdlib: Path, root: Path) -> list[Path]:
    objects = []
    for source in stdlib.rglob("*"):
        parts = source.relative_to(stdlib).parts
        if parts[0] in STDLIB_LEFT_OUT or "__pycache__" in parts or "-packages" in parts[0]:
            continue
        if source.is_file():
            _copy(source, root, resolve=False)
            if source.suffix == ".so":
                objects.append(source)
    return objects


def _install_project(dist: metadata.Distribution, site: Path, root: Path) -> None:
    """The project as installed: its metadata and a path file naming its files' place.

    pytest's plugins and the lease kinds are the project's entry points.
    """
    target = site / f"{_normal(PROJECT).replace('-', '_')}-{dist.version}.dist-info"
    target.mkdir(parents=True)
    for name in ("METADATA", "entry_points.txt", "top_level.txt"):
        (target / name).write_text(dist.read_text(name) or "")
    (site / f"{target.stem}.pth").write_text(f"{WORKDIR}\n")
    _copy_project(root / WORKDIR.lstrip("/"))


def _copy_project(target: Path) -> None:
    tracked = subprocess.run(
        ["git", "-C", str(ROOT), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        capture_output=True,
        check=True,
        text=True,
    ).stdout.split("\0")
    for name in tracked:
        source = ROOT / name
        if name and not name.startswith(LEFT_OUT) and source.is_file():
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target / name)


def _libraries(objects: list[Path]) -> set[Path]:
    """The system's shared libraries ``objects`` load, as ``ldd`` finds them."""
    found: set[Path] = set()
    for path in objects:
        listing = subprocess.run(["ldd", str(path)], capture_output=True, text=True).stdout
        for match in re.finditer(r"(/\S+) \(0x", listing):
            library = Path(match.group(1))
            if not str(library).startswith(sys.prefix):
                found.add(library)
    return found


def _copy(source: Path, root: Path, *, resolve: bool = True) -> Path:
    """``source`` at its own path under ``root``, its content followed through links."""
    target = root / str(source).lstrip("/")
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(source.resolve() if resolve else source, target)
    return source


def _owned_by_root(info: tarfile.TarInfo) -> tarfile.TarInfo:
    info.uid = info.gid = 0
    info.uname = info.gname = "root"
    return info


if __name__ == "__main__":
    os.umask(0o022)
    main()

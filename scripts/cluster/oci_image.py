"""Pack a rootfs tarball as a one-layer OCI image archive for `ctr images import`.

    python3 oci_image.py --name docker.io/library/NAME:TAG --layer ROOTFS.tar \
        [--env K=V ...] [--entrypoint ARG ...] [--cmd ARG ...] --out IMAGE.tar

Standard library only: it runs before the project's virtual environment is needed. The
name must be the fully qualified one (the CRI plugin looks `busybox:latest` up as
`docker.io/library/busybox:latest`).
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import json
import sys
import tarfile
from pathlib import Path

MANIFEST = "application/vnd.oci.image.manifest.v1+json"
CONFIG = "application/vnd.oci.image.config.v1+json"
LAYER = "application/vnd.oci.image.layer.v1.tar+gzip"


def _blob(out: tarfile.TarFile, data: bytes, media_type: str) -> dict[str, object]:
    digest = hashlib.sha256(data).hexdigest()
    info = tarfile.TarInfo(f"blobs/sha256/{digest}")
    info.size = len(data)
    out.addfile(info, io.BytesIO(data))
    return {"mediaType": media_type, "digest": f"sha256:{digest}", "size": len(data)}


def _file(out: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    out.addfile(info, io.BytesIO(data))


def pack(
    name: str,
    layer: Path,
    env: list[str],
    entrypoint: list[str],
    cmd: list[str],
    dest: Path,
    workdir: str = "",
) -> None:
    raw = layer.read_bytes()
    compressed = gzip.compress(raw, compresslevel=6, mtime=0)
    config = {
        "architecture": "amd64",
        "os": "linux",
        "config": {
            "Env": env,
            "Entrypoint": entrypoint or None,
            "Cmd": cmd or None,
            "WorkingDir": workdir,
        },
        "rootfs": {"type": "layers", "diff_ids": [f"sha256:{hashlib.sha256(raw).hexdigest()}"]},
        "history": [{"created_by": f"scripts/cluster/{Path(sys.argv[0]).name}"}],
    }
    tmp = dest.with_suffix(".tmp")
    with tarfile.open(tmp, "w") as out:
        layer_desc = _blob(out, compressed, LAYER)
        config_desc = _blob(out, json.dumps(config).encode(), CONFIG)
        manifest = {
            "schemaVersion": 2,
            "mediaType": MANIFEST,
            "config": config_desc,
            "layers": [layer_desc],
        }
        manifest_desc = _blob(out, json.dumps(manifest).encode(), MANIFEST)
        manifest_desc["platform"] = {"architecture": "amd64", "os": "linux"}
        manifest_desc["annotations"] = {
            "io.containerd.image.name": name,
            "org.opencontainers.image.ref.name": name.rpartition(":")[2],
        }
        index = {"schemaVersion": 2, "manifests": [manifest_desc]}
        _file(out, "oci-layout", json.dumps({"imageLayoutVersion": "1.0.0"}).encode())
        _file(out, "index.json", json.dumps(index).encode())
    tmp.rename(dest)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--name", required=True)
    parser.add_argument("--layer", type=Path, required=True)
    parser.add_argument("--env", action="append", default=[])
    parser.add_argument("--entrypoint", action="append", default=[])
    parser.add_argument("--cmd", action="append", default=[])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    pack(args.name, args.layer, args.env, args.entrypoint, args.cmd, args.out)


if __name__ == "__main__":
    main()

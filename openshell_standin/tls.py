"""Mutual TLS between OpenShell's CLI and the stand-in gateway, as OpenShell's local gateway has.

The gateway listens on 127.0.0.1, where every local user can connect: only a client holding
the certificate made for this gateway's run may (its key readable by the gateway's user
alone). A CA, a server certificate for 127.0.0.1 and a client certificate are made afresh
for each run with ``openssl``, in the run's private directory, laid out as the CLI reads them
for a gateway of a given name: ``$XDG_CONFIG_HOME/openshell/gateways/<name>/mtls/`` holding
``ca.crt``, ``tls.crt``, ``tls.key`` (crates/openshell-cli/src/tls.rs:81-125 at v0.0.111).
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

from drivers.host_process import HOST_ENV, tool

DAYS = "2"
"""A run's certificates are good for two days: a run is hours at most."""
OPENSSL_TIMEOUT_S = 30.0
HOST = "127.0.0.1"


class TlsSetupError(RuntimeError):
    """openssl could not make the run's certificates."""


@dataclass(frozen=True)
class Materials:
    """The server's credentials and where the CLI's configuration (its client's) is."""

    ca: bytes
    server_cert: bytes
    server_key: bytes
    config_home: Path
    """What the CLI's ``XDG_CONFIG_HOME`` must be."""


def _openssl(*args: str, cwd: Path) -> None:
    try:
        subprocess.run(
            [tool("openssl"), *args],
            cwd=cwd,
            env=HOST_ENV,
            capture_output=True,
            check=True,
            timeout=OPENSSL_TIMEOUT_S,
        )
    except FileNotFoundError as exc:
        raise TlsSetupError("needed openssl (apt-get install openssl)") from exc
    except subprocess.CalledProcessError as exc:
        raise TlsSetupError(
            f"openssl {' '.join(args[:2])} failed: {exc.stderr.decode(errors='replace').strip()}"
        ) from exc


def _key(path: str, cwd: Path) -> None:
    _openssl("genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out", path,
             cwd=cwd)  # fmt: skip


def _signed(name: str, subject: str, extensions: str, cwd: Path) -> None:
    """``<name>.crt`` for ``<name>.key``, signed by the CA, with ``extensions``."""
    _key(f"{name}.key", cwd)
    _openssl("req", "-new", "-key", f"{name}.key", "-subj", subject, "-out", f"{name}.csr", cwd=cwd)
    (cwd / f"{name}.ext").write_text(extensions)
    _openssl(
        "x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
        "-CAcreateserial", "-days", DAYS, "-sha256", "-extfile", f"{name}.ext",
        "-out", f"{name}.crt", cwd=cwd,
    )  # fmt: skip


def make(state: Path, gateway: str) -> Materials:
    """Make the run's CA and certificates under ``state`` (a directory only its user reads)."""
    pki = state / "pki"
    pki.mkdir(mode=0o700)
    _key("ca.key", pki)
    _openssl(
        "req", "-x509", "-new", "-key", "ca.key", "-subj", "/CN=gpu-sandbox openshell stand-in CA",
        "-days", DAYS, "-sha256",
        "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign",
        "-out", "ca.crt", cwd=pki,
    )  # fmt: skip
    leaf = "basicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature\n"
    _signed(
        "server",
        f"/CN={HOST}",
        leaf + f"extendedKeyUsage=serverAuth\nsubjectAltName=IP:{HOST}\n",
        pki,
    )
    _signed("client", "/CN=gpu-sandbox", leaf + "extendedKeyUsage=clientAuth\n", pki)
    config_home = state / "config"
    mtls = config_home / "openshell" / "gateways" / gateway / "mtls"
    mtls.mkdir(parents=True, mode=0o700)
    copies = (("ca.crt", "ca.crt"), ("client.crt", "tls.crt"), ("client.key", "tls.key"))
    for source, target in copies:
        fd = os.open(mtls / target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "wb") as out:
            out.write((pki / source).read_bytes())
    return Materials(
        ca=(pki / "ca.crt").read_bytes(),
        server_cert=(pki / "server.crt").read_bytes(),
        server_key=(pki / "server.key").read_bytes(),
        config_home=config_home,
    )

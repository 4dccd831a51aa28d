"""A throwaway PKI made with openssl: a CA, a server certificate for 127.0.0.1 and localhost, a
client certificate (for mutual TLS)."""

from __future__ import annotations

import subprocess
from pathlib import Path


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _key_and_csr(name: str, cwd: Path) -> None:
    _openssl(
        "req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}",
        cwd=cwd,
    )  # fmt: skip


def _sign(name: str, extensions: str, cwd: Path) -> None:
    (cwd / f"{name}.ext").write_text(extensions)
    _openssl(
        "x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
        "-CAcreateserial", "-days", "2", "-sha256", "-extfile", f"{name}.ext",
        "-out", f"{name}.pem",
        cwd=cwd,
    )  # fmt: skip


def make_pki(d: Path) -> Path:
    """ca.pem, server.pem/.key (SAN 127.0.0.1, localhost), client.pem/.key in ``d``."""
    _openssl(
        "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", "ca.key", "-out", "ca.pem", "-days", "2", "-subj", "/CN=plugserve test CA",
        "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign",
        cwd=d,
    )  # fmt: skip
    _key_and_csr("server", d)
    _sign(
        "server",
        "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n"
        "basicConstraints=CA:FALSE\n",
        d,
    )
    _key_and_csr("client", d)
    _sign("client", "extendedKeyUsage=clientAuth\nbasicConstraints=CA:FALSE\n", d)
    return d

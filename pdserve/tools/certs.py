"""Throwaway certificates for a local mTLS cluster and for tests, made with the `openssl` command.

    pki = make_pki("/tmp/pki", ["prefill-0", "decode-0", "router", "client"], hosts=["127.0.0.1"])
    pki.ca        # ca.pem: the CA every process trusts
    pki["decode-0"].cert, pki["decode-0"].key

Each name gets an EC P-256 key and a certificate signed by a fresh CA, valid for DAYS days, with the
name as its common name and as a DNS subject alternative name, plus `hosts` (IP addresses or DNS
names clients dial), and both serverAuth and clientAuth usage (a decode node serves the router and
calls prefill nodes with the same certificate). The CA's key is deleted once every certificate is
signed, so nobody can sign more with it. For production, use certificates from your own CA.

Blocking waits: each `openssl` run, at most OPENSSL_TIMEOUT_S.
"""

from __future__ import annotations

import ipaddress
import os
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

DAYS = 2
OPENSSL_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class CertPair:
    cert: str   # PEM certificate path
    key: str    # PEM private key path


@dataclass(frozen=True)
class Pki:
    ca: str                          # the CA certificate (PEM) every process trusts
    pairs: dict[str, CertPair]       # name -> its certificate and key

    def __getitem__(self, name: str) -> CertPair:
        return self.pairs[name]


def _openssl(*args: str, cwd: Path) -> None:
    exe = shutil.which("openssl")
    if exe is None:
        raise RuntimeError("the `openssl` command is needed to make test certificates (apt-get install openssl)")
    done = subprocess.run([exe, *args], cwd=cwd, capture_output=True, text=True, timeout=OPENSSL_TIMEOUT_S)
    if done.returncode != 0:
        raise RuntimeError(f"openssl {' '.join(args[:2])} failed ({done.returncode}): {done.stderr.strip()[-500:]}")


def _san(name: str, hosts: Sequence[str]) -> str:
    entries = [f"DNS:{name}"]
    for h in hosts:
        try:
            entries.append(f"IP:{ipaddress.ip_address(h)}")
        except ValueError:
            entries.append(f"DNS:{h}")
    return ",".join(dict.fromkeys(entries))


def make_pki(directory: str | Path, names: Sequence[str], hosts: Sequence[str] = ("127.0.0.1", "localhost"),
             ca_name: str = "pdserve-local-ca") -> Pki:
    """A fresh CA and one certificate per name in `directory` (created; keys readable by the owner only)."""
    if not names or len(set(names)) != len(names):
        raise ValueError(f"names must be distinct and at least one, got {list(names)}")
    bad = [n for n in names if not n or "/" in n or "," in n or n.startswith(".")]
    if bad:
        raise ValueError(f"certificate names must be plain node ids, got {bad}")
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    os.chmod(d, 0o700)
    key_opts = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes")
    _openssl("req", "-x509", *key_opts, "-keyout", "ca.key", "-out", "ca.pem", "-days", str(DAYS),
             "-subj", f"/CN={ca_name}", "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign", cwd=d)
    pairs: dict[str, CertPair] = {}
    try:
        for name in names:
            ext = d / f"{name}.ext"
            ext.write_text(f"subjectAltName={_san(name, hosts)}\nextendedKeyUsage=serverAuth,clientAuth\n"
                           "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\n")
            _openssl("req", *key_opts, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=d)
            _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                     "-out", f"{name}.pem", "-days", str(DAYS), "-extfile", ext.name, cwd=d)
            (d / f"{name}.csr").unlink()
            ext.unlink()
            os.chmod(d / f"{name}.key", 0o600)
            pairs[name] = CertPair(str(d / f"{name}.pem"), str(d / f"{name}.key"))
    finally:
        (d / "ca.key").unlink(missing_ok=True)
        (d / "ca.srl").unlink(missing_ok=True)
    return Pki(str(d / "ca.pem"), pairs)

"""`shardline keygen`: a cluster's CA and one credentials folder per node.

    OUT/ca.pem, OUT/ca-key.pem      the cluster CA (keep ca-key.pem off the nodes)
    OUT/node-0/ ... node-(N-1)/     ca.pem, cert.pem, key.pem: one per node (wire/tls.py)

node-0 is meant for the coordinator, node-1.. for workers; any node folder works anywhere, as
every certificate is for "a node of this cluster". Keys are EC P-256, certificates valid for
VALID_DAYS. Each file is written to a temporary name and renamed; an existing OUT with a CA in
it is refused rather than overwritten (its nodes would no longer be trusted).
"""

from __future__ import annotations

import datetime as dt
import os
import secrets
from pathlib import Path

from shardline.errors import ShardlineError

VALID_DAYS = 3650


def keygen(out: Path, nodes: int) -> list[Path]:
    """Make the CA and `nodes` node folders under `out`; their paths."""
    from cryptography import x509  # only this command needs it
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    if not 1 <= nodes <= 1000:
        raise ShardlineError(f"--nodes must be 1-1000, got {nodes}")
    if (out / "ca.pem").exists():
        raise ShardlineError(f"{out} already holds a cluster CA; choose another --out")
    cluster = secrets.token_hex(4)
    now = dt.datetime.now(dt.UTC)

    def cert(name: str, key: ec.EllipticCurvePrivateKey, issuer: x509.Name, signer: ec.EllipticCurvePrivateKey,
             ca: bool) -> x509.Certificate:
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name),
                             x509.NameAttribute(NameOID.ORGANIZATION_NAME, f"shardline cluster {cluster}")])
        b = (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer or subject)
             .public_key(key.public_key()).serial_number(x509.random_serial_number())
             .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=VALID_DAYS))
             .add_extension(x509.BasicConstraints(ca=ca, path_length=0 if ca else None), critical=True))
        if ca:
            signs = x509.KeyUsage(False, False, False, False, False, True, True, False, False)  # certs, CRLs
            b = b.add_extension(signs, critical=True)
        else:
            b = b.add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                       ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
        return b.sign(signer, hashes.SHA256())

    def pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
        return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                 serialization.NoEncryption())

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_cert = cert(f"shardline CA {cluster}", ca_key, x509.Name([]), ca_key, ca=True)
    ca_pem = ca_cert.public_bytes(serialization.Encoding.PEM)
    folders = []
    for i in range(nodes):
        key = ec.generate_private_key(ec.SECP256R1())
        node = cert(f"node-{i}", key, ca_cert.subject, ca_key, ca=False)
        folder = out / f"node-{i}"
        _write(folder / "ca.pem", ca_pem)
        _write(folder / "cert.pem", node.public_bytes(serialization.Encoding.PEM))
        _write(folder / "key.pem", pem_key(key), private=True)
        folders.append(folder)
    _write(out / "ca-key.pem", pem_key(ca_key), private=True)
    _write(out / "ca.pem", ca_pem)  # last: its presence means the folder is complete
    return folders


def node_folders(out: Path) -> list[Path]:
    """The node folders keygen made under `out`, node-0 first."""
    found = sorted((p for p in out.glob("node-*") if p.name[5:].isdigit()), key=lambda p: int(p.name[5:]))
    if not found:
        raise ShardlineError(f"{out} holds no node-N credential folders (made by `shardline keygen --out {out}`)")
    return found


def _write(path: Path, data: bytes, private: bool = False) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600 if private else 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)

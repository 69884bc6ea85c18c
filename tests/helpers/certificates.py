"""Certificates for TLS tests, made with `cryptography`: a CA, server certificates for 127.0.0.1 and
localhost, client certificates; all PEM files in one folder.

    pki = make_pki(tmp_path)            # our CA, server + client certs, and a stranger CA's client cert
    ClusterTLS(pki.ca, pki.server_cert, pki.server_key, pki.client_cert, pki.client_key)
"""
from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class Authority:
    name: str
    key: ec.EllipticCurvePrivateKey
    cert: x509.Certificate


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _validity(builder: x509.CertificateBuilder) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.timezone.utc)
    return builder.not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))


def make_authority(name: str) -> Authority:
    key = ec.generate_private_key(ec.SECP256R1())  # P-256: fast to make, accepted by gRPC and OpenSSL
    builder = _validity(x509.CertificateBuilder().subject_name(_name(name)).issuer_name(_name(name))
                        .public_key(key.public_key()).serial_number(x509.random_serial_number()))
    builder = builder.add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True) \
        .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
                                     key_encipherment=False, data_encipherment=False, key_agreement=False,
                                     encipher_only=False, decipher_only=False), critical=True)
    return Authority(name, key, builder.sign(key, hashes.SHA256()))


def issue(authority: Authority, common_name: str, *, server: bool, dns_names: list[str] | None = None,
          roles: tuple[str, ...] = ()) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """A leaf certificate signed by authority: for a server (SAN 127.0.0.1, ::1, localhost, or only
    dns_names when given) or a client, naming roles as SAN URIs spiffe://tokenmill/<role>
    (plumbing.peer_roles)."""
    key = ec.generate_private_key(ec.SECP256R1())
    builder = _validity(x509.CertificateBuilder().subject_name(_name(common_name)).issuer_name(authority.cert.subject)
                        .public_key(key.public_key()).serial_number(x509.random_serial_number()))
    builder = builder.add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
    usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
    builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    if server:
        names = [x509.DNSName(name) for name in dns_names] if dns_names else [
            x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
            x509.IPAddress(ipaddress.ip_address("::1"))]
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    elif roles:
        uris = [x509.UniformResourceIdentifier(f"spiffe://tokenmill/{role}") for role in roles]
        builder = builder.add_extension(x509.SubjectAlternativeName(uris), critical=False)
    return builder.sign(authority.key, hashes.SHA256()), key


def write_pem(folder: Path, stem: str, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey | None) -> tuple[str, str]:
    cert_path = folder / f"{stem}.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path = folder / f"{stem}.key"
    if key is not None:
        key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                               serialization.NoEncryption()))
        key_path.chmod(0o600)
    return str(cert_path), str(key_path)


@dataclass(frozen=True)
class CertificateSet:
    ca: str  # our CA's certificate
    server_cert: str
    server_key: str
    client_cert: str  # signed by our CA
    client_key: str
    stranger_ca: str  # another CA, trusted by nobody in the cluster
    stranger_client_cert: str  # a client certificate that CA signed
    stranger_client_key: str
    stranger_server_cert: str  # a server certificate that CA signed (for 127.0.0.1 too)
    stranger_server_key: str
    gateway_cert: str = ""  # signed by our CA, naming only the gateway role
    gateway_key: str = ""
    scheduler_cert: str = ""  # only the scheduler role
    scheduler_key: str = ""
    roleless_cert: str = ""  # no role at all: admitted by the handshake, refused past health and reflection
    roleless_key: str = ""


def make_pki(folder: Path) -> CertificateSet:
    folder.mkdir(parents=True, exist_ok=True)
    ours, stranger = make_authority("tokenmill test CA"), make_authority("stranger CA")
    ca, _ = write_pem(folder, "ca", ours.cert, None)
    stranger_ca, _ = write_pem(folder, "stranger-ca", stranger.cert, None)
    server = write_pem(folder, "server", *issue(ours, "tokenmill server", server=True))
    # one client certificate for every link of a local cluster: it names both internal callers' roles
    client = write_pem(folder, "client", *issue(ours, "tokenmill client", server=False, roles=("gateway", "scheduler")))
    gateway = write_pem(folder, "gateway", *issue(ours, "tokenmill gateway", server=False, roles=("gateway",)))
    scheduler = write_pem(folder, "scheduler", *issue(ours, "tokenmill scheduler", server=False, roles=("scheduler",)))
    roleless = write_pem(folder, "roleless", *issue(ours, "tokenmill roleless", server=False))
    stranger_client = write_pem(folder, "stranger-client", *issue(stranger, "stranger client", server=False))
    stranger_server = write_pem(folder, "stranger-server", *issue(stranger, "stranger server", server=True))
    return CertificateSet(ca, *server, *client, stranger_ca, *stranger_client, *stranger_server, *gateway, *scheduler,
                          *roleless)

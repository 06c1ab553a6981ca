"""TLS for the generated server config: a client with the CA connects, one without it is refused.
`cryptography` (the test extra) makes the certificates; nothing here may skip."""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from relax_bus.connection import connect
from relax_bus.errors import NatsUnreachable
from relax_bus.ops.credentials import write_bundle
from relax_bus.provision import provision
from relax_bus.settings import ConnectionSettings
from tests.bus.test_auth import server_from
from tests.conftest import run_config

pytestmark = pytest.mark.bus


def self_signed(tmp_path: Path) -> tuple[Path, Path, Path]:
    """A CA and a server certificate for 127.0.0.1 signed by it: (ca, cert, key) PEM files."""
    now = datetime.datetime.now(datetime.UTC)

    def build(subject: str, issuer: str, key: Any, signer: Any, ca: bool) -> x509.Certificate:
        b = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
            .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(signer.public_key()), critical=False)
        )
        if ca:
            usage = dict.fromkeys(("content_commitment", "key_encipherment", "data_encipherment"), False)
            b = b.add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    key_cert_sign=True,
                    crl_sign=True,
                    key_agreement=False,
                    encipher_only=False,
                    decipher_only=False,
                    **usage,
                ),
                critical=True,
            )
        else:
            b = b.add_extension(
                x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False
            ).add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        return b.sign(signer, hashes.SHA256())

    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca = build("relax test CA", "relax test CA", ca_key, ca_key, ca=True)
    cert = build("127.0.0.1", "relax test CA", key, ca_key, ca=False)
    paths = tmp_path / "ca.pem", tmp_path / "server.pem", tmp_path / "server-key.pem"
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return paths


async def test_tls_with_the_ca_connects_and_without_it_is_refused(tmp_path):
    ca, cert, key = self_signed(tmp_path)
    config = run_config()
    bundle = write_bundle(config, tmp_path / "auth", store_dir=None, tls=(cert, key), tls_ca_file=ca)
    assert bundle.nats_url.startswith("tls://")
    server = server_from(bundle, tmp_path / "nats")
    try:
        settings = ConnectionSettings(  # type: ignore[call-arg]
            _env_file=bundle.env_files["admin"], nats_url=[f"tls://127.0.0.1:{server.port}"]
        )
        assert settings.tls_ca_file == ca.resolve()
        nc = await connect(settings, name="tls-admin")
        try:
            report = await provision(nc.jetstream(timeout=10.0), config)
            assert len(report.created) == 19
        finally:
            await nc.close()
        without_ca = settings.model_copy(update={"tls_ca_file": None, "connect_timeout_s": 1.0})
        with pytest.raises(NatsUnreachable, match="certificate verify failed"):
            await connect(without_ca, name="tls-no-ca")
    finally:
        server.cleanup()

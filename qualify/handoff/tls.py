"""TLS for a producer on another host: the certificate set ``qualify keys tls`` issues, and the
server and client contexts both sides build from it (the standard ``ssl`` module, TLS 1.3 only).

One set is a private CA and two leaves it signs: the producer's (server authentication, its host
names and addresses as subject alternative names) and the consumer's (client authentication).
The CA's private key is never written: a set is issued whole and cannot be extended, so exactly
these two certificates chain to it; a new set replaces both. Each side trusts that CA alone, never
a system store: the consumer checks the producer's certificate against it and the host it dialled,
the producer requires the consumer's certificate (mutual TLS), so nothing on the network reaches
the handoff protocol without a certificate of the set. The run key's MAC handshake and manifest
MACs run inside, unchanged (``docs/transport.md`` says why both).
"""

from __future__ import annotations

import datetime as _dt
import ipaddress
import os
import secrets
import ssl
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from qualify.core.arguments import require_private_file
from qualify.core.errors import Refused, one_line
from qualify.handoff.wire import mint_run_key

CA_CERT = "ca.crt"
PRODUCER_CERT = "producer.crt"
PRODUCER_KEY = "producer.key"
CONSUMER_CERT = "consumer.crt"
CONSUMER_KEY = "consumer.key"
RUN_KEY = "run.key"
"""The run key both sides read (hex, 0600): the producer's ``--key-file``, the consumer's."""
SET_FILES = (CA_CERT, PRODUCER_CERT, PRODUCER_KEY, CONSUMER_CERT, CONSUMER_KEY, RUN_KEY)
DEFAULT_VALID_DAYS = 365
MAX_VALID_DAYS = 3650
_MAX_PEM_BYTES = 64 << 10


# --------------------------------------------------------------------------------------------
# issuing a set


def _subject_alternative_name(names: Sequence[str]) -> x509.SubjectAlternativeName:
    """Each name as an IP address when it parses as one, else as a DNS name; refused when empty
    or when a DNS name is not a host name (letters, digits, '-', '.')."""
    if not names:
        raise Refused("tls set: give at least one --producer-host (the name or address consumers dial)")
    entries: list[x509.GeneralName] = []
    for name in names:
        try:
            entries.append(x509.IPAddress(ipaddress.ip_address(name)))
            continue
        except ValueError:
            pass
        labels = name.split(".")
        if not (0 < len(name) <= 253 and all(0 < len(label) <= 63 and label.replace("-", "").isalnum()
                                             and label.isascii() for label in labels)):
            raise Refused(f"--producer-host: found {name!r}, expected a host name or an IP address")
        entries.append(x509.DNSName(name.lower()))
    return x509.SubjectAlternativeName(entries)


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "trust-ladder"),
                      x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _leaf(ca_key: ec.EllipticCurvePrivateKey, ca_name: x509.Name, common_name: str, usage: x509.ObjectIdentifier,
          valid_days: int, alternative: x509.SubjectAlternativeName | None) -> tuple[x509.Certificate,
                                                                                    ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = _dt.datetime.now(_dt.UTC)
    builder = (x509.CertificateBuilder()
               .subject_name(_name(common_name)).issuer_name(ca_name)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - _dt.timedelta(minutes=5))
               .not_valid_after(now + _dt.timedelta(days=valid_days))
               .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
               .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                                            data_encipherment=False, key_agreement=False, key_cert_sign=False,
                                            crl_sign=False, encipher_only=False, decipher_only=False), critical=True)
               .add_extension(x509.ExtendedKeyUsage([usage]), critical=True))
    if alternative is not None:
        builder = builder.add_extension(alternative, critical=False)
    return builder.sign(ca_key, hashes.SHA256()), key


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _write_whole(path: Path, data: bytes, mode: int) -> None:
    """Write ``path`` whole or not at all: a temporary file in the same directory (``mode`` from its
    creation), fsynced, then renamed into place."""
    temporary = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), mode)
    try:
        with os.fdopen(descriptor, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(temporary, mode)
        os.replace(temporary, path)
    except BaseException:
        try:
            os.unlink(temporary)
        except FileNotFoundError:
            pass
        raise


@dataclass(frozen=True)
class IssuedSet:
    """Where a set was written and the SHA-256 fingerprints of its certificates (hex)."""

    directory: Path
    ca_sha256: str
    producer_sha256: str
    consumer_sha256: str


def issue_tls_set(directory: Path, producer_hosts: Sequence[str], *,
                  valid_days: int = DEFAULT_VALID_DAYS) -> IssuedSet:
    """Issue a CA and the producer's and consumer's certificates into ``directory`` (made 0700 if
    absent), with a fresh run key for both sides' ``--key-file``; private keys 0600, certificates
    0644. Refused when any file of a set is already there (a set is replaced by a new directory,
    never file by file)."""
    if type(valid_days) is not int or not 1 <= valid_days <= MAX_VALID_DAYS:
        raise Refused(f"--valid-days: found {valid_days!r}, expected 1 to {MAX_VALID_DAYS}")
    alternative = _subject_alternative_name(producer_hosts)
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        raise Refused(f"tls set {directory}: cannot create it ({exc.strerror or type(exc).__name__})") from None
    present = [name for name in SET_FILES if os.path.lexists(directory / name)]
    if present:
        raise Refused(f"tls set {directory}: {', '.join(present)} already there; issue a new set into an empty "
                      f"directory")
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = _name(f"trust-ladder handoff CA {secrets.token_hex(4)}")
    now = _dt.datetime.now(_dt.UTC)
    ca = (x509.CertificateBuilder()
          .subject_name(ca_name).issuer_name(ca_name)
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - _dt.timedelta(minutes=5))
          .not_valid_after(now + _dt.timedelta(days=valid_days))
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                       data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                       crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
          .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
          .sign(ca_key, hashes.SHA256()))
    producer, producer_key = _leaf(ca_key, ca_name, "trust-ladder producer", ExtendedKeyUsageOID.SERVER_AUTH,
                                   valid_days, alternative)
    consumer, consumer_key = _leaf(ca_key, ca_name, "trust-ladder consumer", ExtendedKeyUsageOID.CLIENT_AUTH,
                                   valid_days, None)
    del ca_key  # never written: no further certificate can chain to this CA
    pem = serialization.Encoding.PEM
    try:
        # Keys first, the CA last: a directory without ca.crt is an interrupted issue, never a set.
        _write_whole(directory / PRODUCER_KEY, _pem_key(producer_key), 0o600)
        _write_whole(directory / CONSUMER_KEY, _pem_key(consumer_key), 0o600)
        _write_whole(directory / RUN_KEY, mint_run_key().hex().encode("ascii") + b"\n", 0o600)
        _write_whole(directory / PRODUCER_CERT, producer.public_bytes(pem), 0o644)
        _write_whole(directory / CONSUMER_CERT, consumer.public_bytes(pem), 0o644)
        _write_whole(directory / CA_CERT, ca.public_bytes(pem), 0o644)
    except OSError as exc:
        raise Refused(f"tls set {directory}: cannot write it ({exc.strerror or type(exc).__name__})") from None
    return IssuedSet(directory, *(certificate.fingerprint(hashes.SHA256()).hex()
                                  for certificate in (ca, producer, consumer)))


# --------------------------------------------------------------------------------------------
# contexts


def _readable_certificate(option: str, path: Path) -> None:
    """A PEM certificate file, refused in one line naming ``option`` and the file otherwise."""
    try:
        data = path.read_bytes()[:_MAX_PEM_BYTES + 1]
    except OSError as exc:
        raise Refused(f"{option} {path}: cannot read it ({exc.strerror or type(exc).__name__})") from None
    if len(data) > _MAX_PEM_BYTES:
        raise Refused(f"{option} {path}: larger than {_MAX_PEM_BYTES} bytes, expected a PEM certificate")
    try:
        x509.load_pem_x509_certificates(data)
    except ValueError:
        raise Refused(f"{option} {path}: not a PEM certificate") from None


def _private_key_file(option: str, path: Path) -> None:
    require_private_file(f"{option} {path}", path, "no such file")


def _tls13(context: ssl.SSLContext) -> ssl.SSLContext:
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    context.maximum_version = ssl.TLSVersion.TLSv1_3
    return context


def _load_chain(context: ssl.SSLContext, cert_option: str, cert: Path, key_option: str, key: Path) -> None:
    _readable_certificate(cert_option, cert)
    _private_key_file(key_option, key)
    try:
        context.load_cert_chain(str(cert), str(key))
    except (ssl.SSLError, OSError) as exc:
        raise Refused(one_line(f"{cert_option} {cert} / {key_option} {key}: not a certificate and its private key "
                               f"({getattr(exc, 'reason', None) or type(exc).__name__})")) from None


def _load_trust(context: ssl.SSLContext, option: str, ca: Path) -> None:
    _readable_certificate(option, ca)
    try:
        context.load_verify_locations(cafile=str(ca))
    except (ssl.SSLError, OSError) as exc:
        raise Refused(one_line(f"{option} {ca}: cannot load it ({type(exc).__name__})")) from None


def server_context(*, cert: Path, key: Path, client_ca: Path) -> ssl.SSLContext:
    """The producer's context: its certificate, TLS 1.3 only, a client certificate required and
    verified against ``client_ca`` alone (no system store)."""
    context = _tls13(ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER))
    _load_chain(context, "--tls-cert", cert, "--tls-key", key)
    _load_trust(context, "--tls-client-ca", client_ca)
    context.verify_mode = ssl.CERT_REQUIRED
    return context


def client_context(*, ca: Path, cert: Path, key: Path) -> ssl.SSLContext:
    """The consumer's context: TLS 1.3 only, the producer's certificate verified against ``ca``
    alone and the host dialled (check_hostname), our own certificate presented for mutual TLS."""
    context = _tls13(ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT))  # CERT_REQUIRED, check_hostname on
    _load_trust(context, "--tls-ca", ca)
    _load_chain(context, "--tls-cert", cert, "--tls-key", key)
    return context


def peer_certificate_sha256(sock: ssl.SSLSocket) -> str | None:
    """The SHA-256 fingerprint (hex) of the peer's certificate, for the record; None without one."""
    der = sock.getpeercert(binary_form=True)
    if not der:
        return None
    return x509.load_der_x509_certificate(der).fingerprint(hashes.SHA256()).hex()

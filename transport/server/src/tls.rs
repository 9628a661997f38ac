//! The server's TLS 1.3 on rustls' `ring` provider, always chosen explicitly
//! so that a second provider elsewhere in a build can never make rustls
//! panic: its certificate (or a generated development one), its config and
//! its session tickets. A client's config is `greendot_client::tls`.

use greendot_proto::ALPN;
use quinn::crypto::rustls::{NoInitialCipherSuite, QuicServerConfig};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use std::sync::Arc;

/// A certificate chain and its private key.
#[derive(Debug)]
pub struct Identity {
    pub certs: Vec<CertificateDer<'static>>,
    pub key: PrivateKeyDer<'static>,
}

impl Clone for Identity {
    fn clone(&self) -> Identity {
        Identity {
            certs: self.certs.clone(),
            key: self.key.clone_key(),
        }
    }
}

impl Identity {
    /// A self-signed development certificate for these names, one that
    /// browsers accept for WebTransport (see [`browser_certificate`]).
    pub fn self_signed(names: &[&str]) -> Result<Identity, TlsError> {
        let (cert, key) = browser_certificate(names)?;
        Ok(Identity {
            certs: vec![cert.der().clone()],
            key: PrivatePkcs8KeyDer::from(key.serialize_der()).into(),
        })
    }
}

/// How long a development certificate is valid: a browser accepts a
/// self-signed certificate for WebTransport (`serverCertificateHashes`) only
/// if it is valid for at most 14 days.
pub const DEV_CERT_DAYS: i64 = 13;

/// A self-signed certificate browsers accept through
/// `serverCertificateHashes`: ECDSA P-256, valid from an hour ago for
/// [`DEV_CERT_DAYS`] in all, with the names as subject alternative names
/// (an IP address becomes an IP SAN). Renew it before it expires.
pub fn browser_certificate(
    names: &[&str],
) -> Result<(rcgen::Certificate, rcgen::KeyPair), TlsError> {
    let names: Vec<String> = names.iter().map(|n| n.to_string()).collect();
    let mut params = rcgen::CertificateParams::new(names)?;
    let now = time::OffsetDateTime::now_utc();
    // Clocks differ a little; the whole span stays within the 14 days.
    params.not_before = now - time::Duration::hours(1);
    params.not_after = now - time::Duration::hours(1) + time::Duration::days(DEV_CERT_DAYS);
    let key = rcgen::KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256)?;
    let cert = params.self_signed(&key)?;
    Ok((cert, key))
}

/// The SHA-256 of a certificate's DER as 64 lowercase hex digits: the
/// value browsers take in `serverCertificateHashes`.
pub fn certificate_hash(der: &[u8]) -> String {
    let digest = ring::digest::digest(&ring::digest::SHA256, der);
    digest.as_ref().iter().map(|b| format!("{b:02x}")).collect()
}

/// Why the server's TLS could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// A development certificate could not be generated.
    #[error("tls: cannot generate a certificate: {0}")]
    Certificate(#[from] rcgen::Error),
    /// rustls refused the certificate, its key or the protocol versions.
    #[error("tls: {0}")]
    Rustls(#[from] rustls::Error),
    /// The provider offers no cipher suite QUIC can start with.
    #[error("tls: {0}")]
    Quic(#[from] NoInitialCipherSuite),
    /// Session tickets need a secret to derive their keys from.
    #[error("tls: the ticket secret is empty")]
    EmptyTicketSecret,
}

/// The server's provider: AES-128-GCM with SHA-256 first. Its key schedule
/// (SHA-256) and packet protection use the CPU's instructions, where the
/// default first choice, AES-256-GCM with SHA-384, runs SHA-384 in software
/// (measured: most of a handshake's symmetric crypto under load).
fn server_provider() -> Arc<rustls::crypto::CryptoProvider> {
    let mut provider = rustls::crypto::ring::default_provider();
    provider
        .cipher_suites
        .sort_by_key(|s| s.suite() != rustls::CipherSuite::TLS13_AES_128_GCM_SHA256);
    Arc::new(provider)
}

/// The server's QUIC crypto: TLS 1.3 only, ALPN `greendot/1` or `h3`, no client
/// certs, its own cipher suite order, and stateless session tickets.
pub fn server_crypto(
    identity: &Identity,
    ticket_secret: &[u8],
) -> Result<QuicServerConfig, TlsError> {
    let mut tls = rustls::ServerConfig::builder_with_provider(server_provider())
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .with_no_client_auth()
        .with_single_cert(identity.certs.clone(), identity.key.clone_key())?;
    // Raw QUIC, and WebTransport over HTTP/3 on the same port.
    tls.alpn_protocols = vec![ALPN.to_vec(), crate::webtransport::H3_ALPN.to_vec()];
    tls.ignore_client_order = true;
    // Stateless tickets: every client that was served may resume, not only
    // the last 256 as with the default in-memory cache, and the server keeps
    // nothing per client. A resumption skips the certificate signature. The
    // ticket keys derive from `ticket_secret`, so tickets survive a restart
    // (the readmission herd after a drain resumes too).
    tls.ticketer = Arc::new(SecretTickets::new(ticket_secret)?);
    Ok(QuicServerConfig::try_from(tls)?)
}

/// The TLS config of the WebSocket listener: the same certificate and
/// tickets as QUIC, TLS 1.3, HTTP/1.1 for the upgrade.
pub fn websocket_crypto(
    identity: &Identity,
    ticket_secret: &[u8],
) -> Result<Arc<rustls::ServerConfig>, TlsError> {
    let mut tls = rustls::ServerConfig::builder_with_provider(server_provider())
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .with_no_client_auth()
        .with_single_cert(identity.certs.clone(), identity.key.clone_key())?;
    tls.alpn_protocols = vec![b"http/1.1".to_vec()];
    tls.ticketer = Arc::new(SecretTickets::new(ticket_secret)?);
    Ok(Arc::new(tls))
}

/// The key of QUIC stateless resets (RFC 9000 §10.3), derived from the
/// secret: a process restarted after a crash (or whose Draining close a
/// client missed) answers a packet of its predecessor's connection with a
/// reset the client accepts, so the client reconnects at once instead of
/// after its idle timeout.
pub(crate) fn stateless_reset_key(secret: &[u8]) -> Result<ring::hmac::Key, TlsError> {
    if secret.is_empty() {
        return Err(TlsError::EmptyTicketSecret);
    }
    let salt = ring::hkdf::Salt::new(ring::hkdf::HKDF_SHA256, b"greendot/1 quic stateless reset");
    salt.extract(secret)
        .expand(&[], ring::hmac::HMAC_SHA256)
        .map(ring::hmac::Key::from)
        // HKDF refuses only outputs over 255 hashes; this is one.
        .map_err(|_| TlsError::EmptyTicketSecret)
}

/// Session tickets sealed (AES-256-GCM) with a key derived from a secret by
/// HKDF-SHA256 for each 12-hour period; a ticket of the current or the
/// previous period opens. Every process given the same secret (a restarted
/// one, another node) opens the others' tickets, with no key file to keep.
/// Layout: period (u32 BE) | nonce (12) | ciphertext and tag.
pub(crate) struct SecretTickets {
    prk: ring::hkdf::Prk,
    random: ring::rand::SystemRandom,
}

impl std::fmt::Debug for SecretTickets {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SecretTickets(..)")
    }
}

const TICKET_PERIOD_SECS: u64 = 12 * 3600;

impl SecretTickets {
    pub(crate) fn new(secret: &[u8]) -> Result<SecretTickets, TlsError> {
        if secret.is_empty() {
            return Err(TlsError::EmptyTicketSecret);
        }
        let salt =
            ring::hkdf::Salt::new(ring::hkdf::HKDF_SHA256, b"greendot/1 tls session tickets");
        Ok(SecretTickets {
            prk: salt.extract(secret),
            random: ring::rand::SystemRandom::new(),
        })
    }

    fn period_now() -> u32 {
        let secs = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        u32::try_from(secs / TICKET_PERIOD_SECS).unwrap_or(u32::MAX)
    }

    fn key(&self, period: u32) -> Option<ring::aead::LessSafeKey> {
        let info = period.to_be_bytes();
        let info = [&info[..]];
        let okm = self.prk.expand(&info, &ring::aead::AES_256_GCM).ok()?;
        let mut bytes = [0u8; 32];
        okm.fill(&mut bytes).ok()?;
        let key = ring::aead::UnboundKey::new(&ring::aead::AES_256_GCM, &bytes).ok()?;
        Some(ring::aead::LessSafeKey::new(key))
    }

    fn seal(&self, period: u32, plain: &[u8]) -> Option<Vec<u8>> {
        use ring::rand::SecureRandom;
        let mut nonce = [0u8; 12];
        self.random.fill(&mut nonce).ok()?;
        let mut out = Vec::with_capacity(4 + 12 + plain.len() + 16);
        out.extend_from_slice(&period.to_be_bytes());
        out.extend_from_slice(&nonce);
        let mut body = plain.to_vec();
        self.key(period)?
            .seal_in_place_append_tag(
                ring::aead::Nonce::assume_unique_for_key(nonce),
                ring::aead::Aad::from(period.to_be_bytes()),
                &mut body,
            )
            .ok()?;
        out.extend_from_slice(&body);
        Some(out)
    }

    fn open(&self, now: u32, sealed: &[u8]) -> Option<Vec<u8>> {
        let period = u32::from_be_bytes(sealed.get(..4)?.try_into().ok()?);
        if period != now && period.checked_add(1) != Some(now) {
            return None;
        }
        let nonce: [u8; 12] = sealed.get(4..16)?.try_into().ok()?;
        let mut body = sealed.get(16..)?.to_vec();
        let plain = self
            .key(period)?
            .open_in_place(
                ring::aead::Nonce::assume_unique_for_key(nonce),
                ring::aead::Aad::from(period.to_be_bytes()),
                &mut body,
            )
            .ok()?;
        Some(plain.to_vec())
    }
}

impl rustls::server::ProducesTickets for SecretTickets {
    fn enabled(&self) -> bool {
        true
    }

    /// Seconds a client may keep a ticket: one period, so it still opens.
    fn lifetime(&self) -> u32 {
        TICKET_PERIOD_SECS as u32
    }

    fn encrypt(&self, plain: &[u8]) -> Option<Vec<u8>> {
        self.seal(Self::period_now(), plain)
    }

    fn decrypt(&self, cipher: &[u8]) -> Option<Vec<u8>> {
        self.open(Self::period_now(), cipher)
    }
}

#[cfg(test)]
mod ticket_tests {
    use super::SecretTickets;

    #[test]
    fn tickets_open_with_the_same_secret_in_this_or_the_next_period_only() {
        let a = SecretTickets::new(b"secret").unwrap();
        let restarted = SecretTickets::new(b"secret").unwrap();
        let other = SecretTickets::new(b"another secret").unwrap();
        let sealed = a.seal(100, b"session state").unwrap();
        assert_eq!(
            restarted.open(100, &sealed).as_deref(),
            Some(&b"session state"[..])
        );
        assert_eq!(
            restarted.open(101, &sealed).as_deref(),
            Some(&b"session state"[..])
        );
        assert_eq!(restarted.open(102, &sealed), None);
        assert_eq!(other.open(100, &sealed), None);
        let mut forged = sealed.clone();
        forged[3] = 101; // claims a later period: the tag no longer matches
        assert_eq!(restarted.open(101, &forged), None);
        let mut flipped = sealed;
        let last = flipped.len() - 1;
        flipped[last] ^= 1;
        assert_eq!(restarted.open(100, &flipped), None);
        assert_eq!(restarted.open(100, &[1, 2, 3]), None);
    }
}

#[cfg(test)]
mod dev_cert_tests {
    use super::{browser_certificate, DEV_CERT_DAYS};
    use rustls::client::danger::ServerCertVerifier;
    use rustls::pki_types::{PrivatePkcs8KeyDer, ServerName, UnixTime};
    use std::time::{Duration, SystemTime, UNIX_EPOCH};

    /// What WebTransport's `serverCertificateHashes` demands: ECDSA P-256,
    /// valid now for these names, and at most 14 days in all.
    #[test]
    fn the_dev_certificate_qualifies_for_browsers() {
        let (cert, key) = browser_certificate(&["localhost", "127.0.0.1"]).unwrap();
        let der = cert.der().clone();
        let key = PrivatePkcs8KeyDer::from(key.serialize_der());
        let signer = rustls::crypto::ring::sign::any_ecdsa_type(&key.into()).unwrap();
        assert_eq!(signer.algorithm(), rustls::SignatureAlgorithm::ECDSA);
        assert!(key_is_p256(&der), "the key is not on P-256 (secp256r1)");

        let mut roots = rustls::RootCertStore::empty();
        roots.add(der.clone()).unwrap();
        let verifier = rustls::client::WebPkiServerVerifier::builder_with_provider(
            std::sync::Arc::new(roots),
            std::sync::Arc::new(rustls::crypto::ring::default_provider()),
        )
        .build()
        .unwrap();
        let at = |offset: Duration| {
            let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap();
            UnixTime::since_unix_epoch(now + offset)
        };
        let day = Duration::from_secs(86_400);
        for name in ["localhost", "127.0.0.1"] {
            let name = ServerName::try_from(name).unwrap();
            verifier
                .verify_server_cert(&der, &[], &name, &[], at(Duration::ZERO))
                .unwrap_or_else(|e| panic!("not valid now for {name:?}: {e}"));
            let last = day * u32::try_from(DEV_CERT_DAYS - 1).unwrap();
            verifier
                .verify_server_cert(&der, &[], &name, &[], at(last))
                .unwrap_or_else(|e| panic!("not valid for {DEV_CERT_DAYS} days: {e}"));
            // Expired within 14 days of now (so its span is under 14 days,
            // as it started at most an hour ago).
            assert!(verifier
                .verify_server_cert(&der, &[], &name, &[], at(day * 14))
                .is_err());
        }
    }

    /// The certificate's public key names the P-256 curve (its OID).
    fn key_is_p256(der: &[u8]) -> bool {
        const SECP256R1: [u8; 10] = [0x06, 0x08, 0x2a, 0x86, 0x48, 0xce, 0x3d, 0x03, 0x01, 0x07];
        der.windows(SECP256R1.len()).any(|w| w == SECP256R1)
    }
}

//! TLS 1.3 on rustls' `ring` provider, always chosen explicitly so that a
//! second provider elsewhere in a build can never make rustls panic.

use crate::proto::ALPN;
use quinn::crypto::rustls::{QuicClientConfig, QuicServerConfig};
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
    /// A self-signed development certificate for these names.
    pub fn self_signed(names: &[&str]) -> Result<Identity, TlsError> {
        let names: Vec<String> = names.iter().map(|n| n.to_string()).collect();
        let ck = rcgen::generate_simple_self_signed(names)
            .map_err(|e| TlsError(format!("cannot generate a certificate: {e}")))?;
        Ok(Identity {
            certs: vec![ck.cert.der().clone()],
            key: PrivatePkcs8KeyDer::from(ck.signing_key.serialize_der()).into(),
        })
    }
}

/// A TLS setup error.
#[derive(Debug, Clone, thiserror::Error)]
#[error("tls: {0}")]
pub struct TlsError(pub String);

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
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

/// The server's QUIC crypto: TLS 1.3 only, ALPN `greendot/1`, no client
/// certs, its own cipher suite order, and stateless session tickets.
pub fn server_crypto(identity: &Identity) -> Result<QuicServerConfig, TlsError> {
    let mut tls = rustls::ServerConfig::builder_with_provider(server_provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(|e| TlsError(e.to_string()))?
        .with_no_client_auth()
        .with_single_cert(identity.certs.clone(), identity.key.clone_key())
        .map_err(|e| TlsError(e.to_string()))?;
    tls.alpn_protocols = vec![ALPN.to_vec()];
    tls.ignore_client_order = true;
    // Stateless tickets (encrypted with a key that rotates every 6 hours):
    // every client that was served may resume, not only the last 256 as
    // with the default in-memory cache, and the server keeps nothing per
    // client. A resumption skips the certificate signature. The key lives
    // in memory: after a restart clients do one full handshake again.
    tls.ticketer = rustls::crypto::ring::Ticketer::new().map_err(|e| TlsError(e.to_string()))?;
    QuicServerConfig::try_from(tls).map_err(|e| TlsError(e.to_string()))
}

/// A client's QUIC crypto trusting exactly `roots`, offering `alpn`.
pub fn client_crypto(
    roots: &[CertificateDer<'static>],
    alpn: &[u8],
) -> Result<QuicClientConfig, TlsError> {
    let mut store = rustls::RootCertStore::empty();
    for root in roots {
        store
            .add(root.clone())
            .map_err(|e| TlsError(e.to_string()))?;
    }
    let mut tls = rustls::ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(|e| TlsError(e.to_string()))?
        .with_root_certificates(store)
        .with_no_client_auth();
    tls.alpn_protocols = vec![alpn.to_vec()];
    QuicClientConfig::try_from(tls).map_err(|e| TlsError(e.to_string()))
}

//! The client's TLS 1.3 configuration on rustls' `ring` provider, always
//! chosen explicitly so that a second provider elsewhere in a build can never
//! make rustls panic. (Certificates and the server's config are the server
//! crate's: a client never generates either.)

use quinn::crypto::rustls::{NoInitialCipherSuite, QuicClientConfig};
use rustls::pki_types::CertificateDer;
use std::sync::Arc;

/// Why a client's TLS configuration could not be built.
#[derive(Debug, Clone, thiserror::Error)]
pub enum TlsError {
    /// rustls refused a root certificate or the protocol versions.
    #[error("tls: {0}")]
    Rustls(#[from] rustls::Error),
    /// The provider offers no cipher suite QUIC can start with.
    #[error("tls: {0}")]
    Quic(#[from] NoInitialCipherSuite),
}

/// A client's QUIC crypto trusting exactly `roots`, offering `alpn`.
pub fn client_crypto(
    roots: &[CertificateDer<'static>],
    alpn: &[u8],
) -> Result<QuicClientConfig, TlsError> {
    let mut tls = client_tls(roots)?;
    tls.alpn_protocols = vec![alpn.to_vec()];
    Ok(QuicClientConfig::try_from(tls)?)
}

/// TLS 1.3 trusting exactly `roots`, no ALPN yet (the QUIC and the
/// WebSocket carriers each set their own).
pub fn client_tls(roots: &[CertificateDer<'static>]) -> Result<rustls::ClientConfig, TlsError> {
    let mut store = rustls::RootCertStore::empty();
    for root in roots {
        store.add(root.clone())?;
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    Ok(rustls::ClientConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .with_root_certificates(store)
        .with_no_client_auth())
}

//! The client's TLS and QUIC configurations, built the client's way (TLS
//! 1.3 on rustls' `ring` provider), for tools that open raw QUIC or TLS
//! connections next to a [`crate::Client`]. Behind the
//! `unstable-internals` feature: these are quinn's and rustls' types.

use crate::error::TlsError;
use quinn::crypto::rustls::QuicClientConfig;
use rustls::pki_types::CertificateDer;

/// A client's QUIC crypto trusting exactly `roots`, offering `alpn`.
pub fn client_crypto(
    roots: &[CertificateDer<'static>],
    alpn: &[u8],
) -> Result<QuicClientConfig, TlsError> {
    let mut tls = client_tls(roots)?;
    tls.alpn_protocols = vec![alpn.to_vec()];
    crate::trust::quic_crypto(tls)
}

/// TLS 1.3 trusting exactly `roots`, no ALPN yet.
pub fn client_tls(roots: &[CertificateDer<'static>]) -> Result<rustls::ClientConfig, TlsError> {
    crate::trust::tls_with_roots(roots)
}

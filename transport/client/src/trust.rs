//! Which servers the client trusts ([`Trust`]) and the certificates it is
//! given ([`Certificate`]), turned into a TLS 1.3 configuration on rustls'
//! `ring` provider, always chosen explicitly so that a second provider
//! elsewhere in a build can never make rustls panic.

use crate::error::{Cause, ConfigError, TlsError};
use quinn::crypto::rustls::QuicClientConfig;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::CryptoProvider;
use rustls::{DigitallySignedStruct, SignatureScheme};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, ServerName, UnixTime};
use std::fmt;
use std::sync::Arc;

/// A certificate (DER), to trust as a root.
#[derive(Clone, PartialEq, Eq)]
pub struct Certificate(CertificateDer<'static>);

impl Certificate {
    /// A certificate from its DER bytes (checked when the client connects).
    pub fn from_der(der: impl Into<Vec<u8>>) -> Certificate {
        Certificate(CertificateDer::from(der.into()))
    }

    /// Every `BEGIN CERTIFICATE` block of a PEM text (other blocks are
    /// skipped); an error if there is none or one does not decode.
    pub fn from_pem(pem: &[u8]) -> Result<Vec<Certificate>, ConfigError> {
        let certs = CertificateDer::pem_slice_iter(pem)
            .map(|c| c.map(Certificate))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| ConfigError::Certificates(Cause::new(e)))?;
        if certs.is_empty() {
            return Err(ConfigError::NoCertificate);
        }
        Ok(certs)
    }

    /// [`Certificate::from_pem`] of a file's contents.
    pub fn from_pem_file(
        path: impl AsRef<std::path::Path>,
    ) -> Result<Vec<Certificate>, ConfigError> {
        let pem = std::fs::read(path).map_err(|e| ConfigError::Certificates(Cause::new(e)))?;
        Certificate::from_pem(&pem)
    }

    /// The DER bytes.
    pub fn der(&self) -> &[u8] {
        &self.0
    }

    /// The SHA-256 of the DER bytes (what [`Trust::CertificateHashes`]
    /// lists, and what browsers' `serverCertificateHashes` take).
    pub fn sha256(&self) -> [u8; 32] {
        sha256(&self.0)
    }
}

impl fmt::Debug for Certificate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let hex: String = self.sha256()[..8]
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        write!(f, "Certificate(sha256 {hex}…)")
    }
}

/// Which servers the client trusts.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Trust {
    /// Certificates signed by one of these roots (a private CA), or these
    /// very certificates (a self-signed server), for the server name.
    Roots(Vec<Certificate>),
    /// The platform's trust store (the operating system's certificate
    /// verifier; on Linux its CA certificates), for the server name: a
    /// server with a certificate from a public CA.
    Platform,
    /// A server certificate whose SHA-256 (of its DER) is one of these,
    /// whatever its name, issuer or dates: a pin, as browsers'
    /// `serverCertificateHashes`. The handshake's signature is still
    /// checked against the certificate's key.
    CertificateHashes(Vec<[u8; 32]>),
}

impl From<Vec<Certificate>> for Trust {
    fn from(roots: Vec<Certificate>) -> Trust {
        Trust::Roots(roots)
    }
}

fn sha256(der: &[u8]) -> [u8; 32] {
    let digest = ring::digest::digest(&ring::digest::SHA256, der);
    let mut out = [0u8; 32];
    out.copy_from_slice(digest.as_ref());
    out
}

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn rustls_error(e: rustls::Error) -> TlsError {
    TlsError(Cause::new(e))
}

/// TLS 1.3 trusting `roots` only, no ALPN yet.
pub(crate) fn tls_with_roots(
    roots: &[CertificateDer<'static>],
) -> Result<rustls::ClientConfig, TlsError> {
    let mut store = rustls::RootCertStore::empty();
    for root in roots {
        store.add(root.clone()).map_err(rustls_error)?;
    }
    Ok(rustls::ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(rustls_error)?
        .with_root_certificates(store)
        .with_no_client_auth())
}

/// TLS 1.3 trusting what `trust` says, no ALPN yet (the QUIC and the
/// WebSocket carriers each set their own).
pub(crate) fn client_tls(trust: &Trust) -> Result<rustls::ClientConfig, TlsError> {
    let verifier: Arc<dyn ServerCertVerifier> = match trust {
        Trust::Roots(roots) => {
            let roots: Vec<_> = roots.iter().map(|c| c.0.clone()).collect();
            return tls_with_roots(&roots);
        }
        Trust::Platform => {
            Arc::new(rustls_platform_verifier::Verifier::new(provider()).map_err(rustls_error)?)
        }
        Trust::CertificateHashes(hashes) => Arc::new(HashVerifier {
            hashes: hashes.clone(),
            provider: provider(),
        }),
    };
    Ok(rustls::ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(rustls_error)?
        .dangerous()
        .with_custom_certificate_verifier(verifier)
        .with_no_client_auth())
}

/// QUIC crypto over `tls`.
pub(crate) fn quic_crypto(tls: rustls::ClientConfig) -> Result<QuicClientConfig, TlsError> {
    QuicClientConfig::try_from(tls).map_err(|e| TlsError(Cause::new(e)))
}

/// [`Trust::CertificateHashes`]: the certificate is known by its hash.
#[derive(Debug)]
struct HashVerifier {
    hashes: Vec<[u8; 32]>,
    provider: Arc<CryptoProvider>,
}

impl ServerCertVerifier for HashVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        if self.hashes.contains(&sha256(end_entity)) {
            Ok(ServerCertVerified::assertion())
        } else {
            Err(rustls::Error::InvalidCertificate(
                rustls::CertificateError::UnknownIssuer,
            ))
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}

/// With `unstable-internals`: rustls' certificate type converts.
#[cfg(feature = "unstable-internals")]
impl From<CertificateDer<'static>> for Certificate {
    fn from(der: CertificateDer<'static>) -> Certificate {
        Certificate(der)
    }
}

/// With `unstable-internals`: roots as rustls' certificate type.
#[cfg(feature = "unstable-internals")]
impl From<Vec<CertificateDer<'static>>> for Trust {
    fn from(roots: Vec<CertificateDer<'static>>) -> Trust {
        Trust::Roots(roots.into_iter().map(Certificate).collect())
    }
}

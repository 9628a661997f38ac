//! How a node proves itself to NATS and how it checks NATS: credentials
//! (user and password, token, nkey seed or creds file) and TLS (a CA file,
//! a client certificate, TLS required). The secrets are never printed: their
//! `Debug` shows only which are set.

use std::path::PathBuf;

/// A secret string: `Debug` and `Display` never show it.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    pub fn new(value: impl Into<String>) -> Secret {
        Secret(value.into())
    }

    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("<secret>")
    }
}

/// One way of proving who the node is to NATS.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub enum NatsCredentials {
    /// None (a NATS server without authentication).
    #[default]
    None,
    UserPassword {
        user: String,
        password: Secret,
    },
    Token(Secret),
    /// An nkey seed (`SU…`).
    NkeySeed(Secret),
    /// A `.creds` file (a user JWT and its nkey seed, as `nsc` writes it).
    CredsFile(PathBuf),
}

/// The NATS side of a node's connection: credentials and TLS.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct NatsAccess {
    pub credentials: NatsCredentials,
    /// PEM file of the CA certificates the NATS servers' certificates are
    /// checked against (in addition to the system's roots).
    pub tls_ca: Option<PathBuf>,
    /// PEM client certificate and key, for NATS servers that verify clients.
    pub tls_client: Option<(PathBuf, PathBuf)>,
    /// Refuse a connection that is not TLS (also implied by a `tls://` URL).
    pub require_tls: bool,
}

impl NatsAccess {
    /// The connect options of these credentials and TLS settings; `Err`: a
    /// creds file that cannot be read (the message names it).
    pub(crate) async fn apply(
        &self,
        mut options: async_nats::ConnectOptions,
    ) -> Result<async_nats::ConnectOptions, std::io::Error> {
        options = match &self.credentials {
            NatsCredentials::None => options,
            NatsCredentials::UserPassword { user, password } => {
                options.user_and_password(user.clone(), password.expose().to_owned())
            }
            NatsCredentials::Token(token) => options.token(token.expose().to_owned()),
            NatsCredentials::NkeySeed(seed) => options.nkey(seed.expose().to_owned()),
            NatsCredentials::CredsFile(path) => {
                options.credentials_file(path).await.map_err(|e| {
                    std::io::Error::new(
                        e.kind(),
                        format!("cannot read the NATS creds file {}: {e}", path.display()),
                    )
                })?
            }
        };
        if let Some(ca) = &self.tls_ca {
            options = options.add_root_certificates(ca.clone());
        }
        if let Some((cert, key)) = &self.tls_client {
            options = options.add_client_certificate(cert.clone(), key.clone());
        }
        if self.require_tls {
            options = options.require_tls(true);
        }
        Ok(options)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secrets_are_never_printed() {
        let access = NatsAccess {
            credentials: NatsCredentials::UserPassword {
                user: "greendot".into(),
                password: Secret::new("hunter2"),
            },
            ..NatsAccess::default()
        };
        let text = format!("{access:?}");
        assert!(
            text.contains("greendot") && !text.contains("hunter2"),
            "{text}"
        );
        for c in [
            NatsCredentials::Token(Secret::new("tok-123")),
            NatsCredentials::NkeySeed(Secret::new("SUASEED")),
        ] {
            let text = format!("{c:?}");
            assert!(
                !text.contains("tok-123") && !text.contains("SUASEED"),
                "{text}"
            );
        }
    }
}

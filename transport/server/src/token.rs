//! Credentials: a JWT signed with HS256, so any backend language can mint one.
//!
//! Claims: `sub` (user), `dev` (device), `kind` (`mobile`, `desktop`, `web`,
//! `other`; default `other`), `watch` (a list of user names, or `"*"` for
//! anybody; default: nobody but the user; `["*"]` is the user named `*`, not
//! a wildcard), `svc` (a service token: may call route and query many users
//! at once; default false), `exp` (Unix seconds), `iat` (Unix seconds, when
//! issued: what a revocation compares; a token without it counts as issued
//! at 0, so any revocation of its user refuses it). `sub`, `dev` and `exp` are
//! required; the header needs `alg: HS256` and nothing else (`typ` is not
//! checked). The HMAC key is the secret's bytes as given (the `greendot`
//! binary reads its secret file with surrounding whitespace removed).

use greendot_proto::{ErrorCode, Kind, WireError};
use jsonwebtoken::{errors::ErrorKind, Algorithm, DecodingKey, EncodingKey, Header, Validation};
use serde::{Deserialize, Serialize};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// The claims of a greendot token.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Claims {
    pub sub: String,
    pub dev: String,
    #[serde(default)]
    pub kind: Kind,
    #[serde(default)]
    pub watch: WatchClaim,
    #[serde(default)]
    pub svc: bool,
    pub exp: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub iat: Option<u64>,
}

/// `watch`: `"*"` or a list of user names.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum WatchClaim {
    Star(String),
    List(Vec<String>),
}

impl Default for WatchClaim {
    fn default() -> WatchClaim {
        WatchClaim::List(Vec::new())
    }
}

impl WatchClaim {
    pub fn all() -> WatchClaim {
        WatchClaim::Star("*".into())
    }

    pub fn only<I, S>(users: I) -> WatchClaim
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        WatchClaim::List(users.into_iter().map(Into::into).collect())
    }
}

impl Claims {
    /// Claims issued now, valid for `ttl` from now.
    pub fn new(
        user: impl Into<String>,
        device: impl Into<String>,
        kind: Kind,
        watch: WatchClaim,
        ttl: Duration,
    ) -> Claims {
        Claims {
            sub: user.into(),
            dev: device.into(),
            kind,
            watch,
            svc: false,
            exp: unix_now().saturating_add(ttl.as_secs()),
            iat: Some(unix_now()),
        }
    }

    pub fn service(mut self) -> Claims {
        self.svc = true;
        self
    }
}

/// Seconds since the Unix epoch.
pub fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// A token could not be signed.
#[derive(Debug, thiserror::Error)]
#[error("cannot sign token: {0}")]
pub struct MintError(#[source] jsonwebtoken::errors::Error);

/// Mints and verifies tokens with one shared secret.
#[derive(Clone)]
pub struct TokenKeys {
    encoding: EncodingKey,
    decoding: DecodingKey,
    validation: Validation,
}

impl std::fmt::Debug for TokenKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TokenKeys(..)")
    }
}

impl TokenKeys {
    /// `leeway` is the clock skew tolerated on `exp`.
    pub fn new(secret: &[u8], leeway: Duration) -> TokenKeys {
        let mut validation = Validation::new(Algorithm::HS256);
        validation.leeway = leeway.as_secs();
        validation.validate_aud = false;
        validation.set_required_spec_claims(&["exp", "sub"]);
        TokenKeys {
            encoding: EncodingKey::from_secret(secret),
            decoding: DecodingKey::from_secret(secret),
            validation,
        }
    }

    pub fn mint(&self, claims: &Claims) -> Result<String, MintError> {
        jsonwebtoken::encode(&Header::new(Algorithm::HS256), claims, &self.encoding)
            .map_err(MintError)
    }

    /// Checks signature, algorithm, expiry and the shape of the claims.
    pub fn verify(&self, token: &str) -> Result<Claims, WireError> {
        if token.is_empty() {
            return Err(WireError::new(ErrorCode::BadToken, "missing token"));
        }
        let data = jsonwebtoken::decode::<Claims>(token, &self.decoding, &self.validation)
            .map_err(|e| match e.kind() {
                ErrorKind::ExpiredSignature => {
                    WireError::new(ErrorCode::TokenExpired, "token expired")
                }
                ErrorKind::InvalidSignature => {
                    WireError::new(ErrorCode::BadToken, "bad token signature")
                }
                _ => WireError::new(ErrorCode::BadToken, format!("bad token: {e}")),
            })?;
        let claims = data.claims;
        if let WatchClaim::Star(s) = &claims.watch {
            if s != "*" {
                return Err(WireError::new(
                    ErrorCode::BadToken,
                    "watch must be \"*\" or a list of users",
                ));
            }
        }
        Ok(claims)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mint_verify_expired_forged() {
        let keys = TokenKeys::new(b"secret", Duration::ZERO);
        let claims = Claims::new(
            "alice",
            "phone",
            Kind::Mobile,
            WatchClaim::only(["bob"]),
            Duration::from_secs(60),
        );
        let token = keys.mint(&claims).unwrap();
        assert_eq!(keys.verify(&token).unwrap(), claims);

        let mut old = claims.clone();
        old.exp = unix_now() - 3600;
        let e = keys.verify(&keys.mint(&old).unwrap()).unwrap_err();
        assert_eq!(e.code, ErrorCode::TokenExpired);

        let other = TokenKeys::new(b"other", Duration::ZERO);
        let e = keys.verify(&other.mint(&claims).unwrap()).unwrap_err();
        assert_eq!(e.code, ErrorCode::BadToken);
        assert_eq!(keys.verify("").unwrap_err().code, ErrorCode::BadToken);
        assert_eq!(keys.verify("a.b.c").unwrap_err().code, ErrorCode::BadToken);

        let json = r#"{"sub":"a","dev":"d","watch":"*","exp":99999999999}"#;
        let parsed: Claims = serde_json_like(json);
        assert_eq!(parsed.watch, WatchClaim::all());
        assert_eq!(parsed.kind, Kind::Other);

        // "*" inside a list is a user's name, not a wildcard.
        let json = r#"{"sub":"a","dev":"d","watch":["*"],"exp":99999999999}"#;
        assert_eq!(serde_json_like(json).watch, WatchClaim::only(["*"]));
        // A header without `typ` is fine; `dev` is required.
        let keys = TokenKeys::new(b"k", Duration::ZERO);
        let no_typ = signed(
            r#"{"alg":"HS256"}"#,
            r#"{"sub":"a","dev":"d","exp":99999999999}"#,
        );
        assert_eq!(keys.verify(&no_typ).unwrap().dev, "d");
        let no_dev = signed(r#"{"alg":"HS256"}"#, r#"{"sub":"a","exp":99999999999}"#);
        assert_eq!(keys.verify(&no_dev).unwrap_err().code, ErrorCode::BadToken);
    }

    /// A token signed with the key `k`, from raw header and claims JSON.
    fn signed(header: &str, claims: &str) -> String {
        use base64_url as b64;
        let signing_input = format!(
            "{}.{}",
            b64::encode(header.as_bytes()),
            b64::encode(claims.as_bytes())
        );
        let sig = jsonwebtoken::crypto::sign(
            signing_input.as_bytes(),
            &EncodingKey::from_secret(b"k"),
            Algorithm::HS256,
        )
        .unwrap();
        format!("{signing_input}.{sig}")
    }

    fn serde_json_like(json: &str) -> Claims {
        // jsonwebtoken decodes claims with serde_json; go through a real token.
        let keys = TokenKeys::new(b"k", Duration::ZERO);
        use base64_url as b64;
        let header = b64::encode(br#"{"alg":"HS256","typ":"JWT"}"#);
        let body = b64::encode(json.as_bytes());
        let signing_input = format!("{header}.{body}");
        let sig = jsonwebtoken::crypto::sign(
            signing_input.as_bytes(),
            &EncodingKey::from_secret(b"k"),
            Algorithm::HS256,
        )
        .unwrap();
        keys.verify(&format!("{signing_input}.{sig}")).unwrap()
    }

    mod base64_url {
        pub fn encode(bytes: &[u8]) -> String {
            const A: &[u8; 64] =
                b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
            let mut out = String::new();
            for chunk in bytes.chunks(3) {
                let b = [
                    chunk[0],
                    *chunk.get(1).unwrap_or(&0),
                    *chunk.get(2).unwrap_or(&0),
                ];
                let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
                let chars = chunk.len() + 1;
                for i in 0..chars {
                    out.push(A[((n >> (18 - 6 * i)) & 63) as usize] as char);
                }
            }
            out
        }
    }
}

//! Token refresh: the application's callback that fetches a new token for
//! the same user and device, and when to call it (ahead of the token's
//! `exp`, read from the token itself).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

type Fetch = dyn Fn() -> Pin<Box<dyn Future<Output = Result<String, String>> + Send>> + Send + Sync;

/// The application's way to get a new token (from its backend) for the
/// same user and device. The client calls it ahead of the current token's
/// expiry (see [`crate::ClientConfig::refresh_ahead`]) and sends the new
/// token on the live connection; and before reconnecting when the token
/// has run out (or the server closed with `TokenExpired`). An `Err` is
/// retried a second later while the token is still good.
#[derive(Clone)]
pub struct TokenRefresh(Arc<Fetch>);

impl TokenRefresh {
    pub fn new<F, Fut>(fetch: F) -> TokenRefresh
    where
        F: Fn() -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<String, String>> + Send + 'static,
    {
        TokenRefresh(Arc::new(move || Box::pin(fetch())))
    }

    pub(crate) fn fetch(&self) -> Pin<Box<dyn Future<Output = Result<String, String>> + Send>> {
        (self.0)()
    }
}

impl std::fmt::Debug for TokenRefresh {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TokenRefresh(..)")
    }
}

/// The `exp` claim of a JWT (Unix seconds), without checking anything:
/// the server checks; the client only needs to know when to refresh.
pub fn token_expiry(token: &str) -> Option<u64> {
    #[derive(serde::Deserialize)]
    struct Exp {
        exp: Option<u64>,
    }
    let payload = token.split('.').nth(1)?;
    let json = base64url(payload)?;
    serde_json::from_slice::<Exp>(&json).ok()?.exp
}

fn base64url(text: &str) -> Option<Vec<u8>> {
    let mut out = Vec::with_capacity(text.len() * 3 / 4);
    let (mut acc, mut bits) = (0u32, 0u32);
    for c in text.bytes().filter(|&c| c != b'=') {
        let v = match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'-' | b'+' => 62,
            b'_' | b'/' => 63,
            _ => return None,
        };
        acc = (acc << 6) | u32::from(v);
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            out.push((acc >> bits) as u8);
            acc &= (1 << bits) - 1;
        }
    }
    Some(out)
}

/// How long from now until the token should be refreshed: `ahead` before
/// its `exp`, but never earlier than 4/5 of its remaining life (a short
/// token is not refreshed at once). `None`: no `exp` to go by.
pub(crate) fn refresh_in(token: &str, ahead: Duration) -> Option<Duration> {
    let exp = token_expiry(token)?;
    let now = SystemTime::now().duration_since(UNIX_EPOCH).ok()?;
    let left = Duration::from_secs(exp).saturating_sub(now);
    Some(left.saturating_sub(ahead.min(left / 5)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_exp_from_a_jwt() {
        // {"alg":"HS256"} . {"sub":"a","dev":"d","exp":1234567890} . sig
        let token = "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiJhIiwiZGV2IjoiZCIsImV4cCI6MTIzNDU2Nzg5MH0.x";
        assert_eq!(token_expiry(token), Some(1_234_567_890));
        assert_eq!(token_expiry("no-dots"), None);
        assert_eq!(token_expiry("a.!!.c"), None);
        // Long past: refresh now.
        assert_eq!(
            refresh_in(token, Duration::from_secs(60)),
            Some(Duration::ZERO)
        );
    }
}

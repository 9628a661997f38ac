//! The live page on the HTTP port: `/` (the page), `/app.js` (its script),
//! `/greendot-client.js` (the TypeScript client compiled to one ES module,
//! checked in; `clients/typescript/test.sh` fails when it is out of date),
//! `/page.json` (where the page connects to, and the dev certificate's hash
//! for WebTransport) and, in dev mode only, `/dev/token/{user}`, which asks
//! for the code `serve` printed in the page's address (see [`DevTokens`]).
//!
//! Nothing is built at run time: the files are compiled into the binary.

use greendot_server::http::axum::extract::{Path, State};
use greendot_server::http::axum::http::{header, HeaderMap, StatusCode};
use greendot_server::http::axum::response::{IntoResponse, Response};
use greendot_server::http::axum::routing::get;
use greendot_server::http::Router;
use greendot_server::token::{Claims, TokenKeys, WatchClaim};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

const INDEX: &str = include_str!("page/index.html");
const APP: &str = include_str!("page/app.js");
const CLIENT: &str = include_str!("page/greendot-client.js");

/// How long a dev token is valid.
const DEV_TOKEN_TTL: Duration = Duration::from_secs(3600);

/// What the page is told, and what it may mint.
pub struct PageConfig {
    /// The QUIC (and WebTransport) address.
    pub quic: SocketAddr,
    /// The WebSocket binding's address, if on.
    pub websocket: Option<SocketAddr>,
    /// `serverCertificateHashes` value (hex SHA-256) of the generated dev
    /// certificate; `None` with a real certificate (browsers check it).
    pub certificate_hash: Option<String>,
    /// Mints `/dev/token` tokens; `None`: no dev tokens.
    pub dev_tokens: Option<DevTokens>,
}

/// The request header that carries the dev code.
pub const DEV_CODE_HEADER: &str = "greendot-dev-code";

/// Dev mode's minting: the token keys and a random code made at start,
/// printed by `serve` only (in the page's address, after `#dev=`), which
/// every `/dev/token` request must present. Anyone else who can reach the
/// loopback port (another user of the machine, a container in the same
/// network namespace) cannot mint without it. The code is good for the
/// whole run (a reload, a second tab, the page's reconnects all ask again);
/// a restart makes a new one.
pub struct DevTokens {
    keys: TokenKeys,
    code: String,
    /// The code checked in constant time: an HMAC of it under a random key.
    check: ring::hmac::Key,
    tag: ring::hmac::Tag,
}

impl DevTokens {
    pub fn new(keys: TokenKeys) -> Result<DevTokens, String> {
        use ring::rand::SecureRandom;
        let rng = ring::rand::SystemRandom::new();
        let mut bytes = [0u8; 16];
        rng.fill(&mut bytes)
            .map_err(|_| "no randomness for the dev code".to_string())?;
        let code: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
        let check = ring::hmac::Key::generate(ring::hmac::HMAC_SHA256, &rng)
            .map_err(|_| "no randomness for the dev code".to_string())?;
        let tag = ring::hmac::sign(&check, code.as_bytes());
        Ok(DevTokens {
            keys,
            code,
            check,
            tag,
        })
    }

    /// What the page's address carries after `#dev=`.
    pub fn code(&self) -> &str {
        &self.code
    }

    fn accepts(&self, presented: &[u8]) -> bool {
        ring::hmac::verify(&self.check, presented, self.tag.as_ref()).is_ok()
    }
}

pub fn routes(config: PageConfig) -> Router {
    Router::new()
        .route("/", get(index))
        .route("/app.js", get(app))
        .route("/greendot-client.js", get(client))
        .route("/page.json", get(page_json))
        .route("/dev/token/{user}", get(dev_token))
        .with_state(Arc::new(config))
}

fn file(content_type: &'static str, body: &'static str) -> Response {
    (
        [
            (header::CONTENT_TYPE, content_type),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        body,
    )
        .into_response()
}

async fn index() -> Response {
    file("text/html; charset=utf-8", INDEX)
}

async fn app() -> Response {
    file("text/javascript; charset=utf-8", APP)
}

async fn client() -> Response {
    file("text/javascript; charset=utf-8", CLIENT)
}

fn json(status: StatusCode, value: serde_json::Value) -> Response {
    (
        status,
        [
            (header::CONTENT_TYPE, "application/json"),
            (header::CACHE_CONTROL, "no-store"),
        ],
        value.to_string(),
    )
        .into_response()
}

/// An unspecified listen address (0.0.0.0, ::) is reached by whatever host
/// the page was loaded from: `host` null tells the page to use its own.
fn host_of(addr: SocketAddr) -> Option<String> {
    if addr.ip().is_unspecified() {
        return None;
    }
    Some(match addr {
        SocketAddr::V4(a) => a.ip().to_string(),
        SocketAddr::V6(a) => format!("[{}]", a.ip()),
    })
}

async fn page_json(State(config): State<Arc<PageConfig>>) -> Response {
    json(
        StatusCode::OK,
        serde_json::json!({
            "webTransport": { "host": host_of(config.quic), "port": config.quic.port() },
            "webSocket": config.websocket.map(|a| serde_json::json!({ "host": host_of(a), "port": a.port() })),
            "certificateHash": config.certificate_hash,
            "devTokens": config.dev_tokens.is_some(),
        }),
    )
}

/// A user name as the server takes it: 1–128 bytes of UTF-8, no control
/// characters.
fn valid_name(name: &str) -> bool {
    (1..=128).contains(&name.len()) && !name.chars().any(char::is_control)
}

/// Whether the request named this machine as its host: a page from another
/// site that rebinds its own name to 127.0.0.1 sends its own name here, and
/// is refused (the port itself only listens on loopback in dev mode).
fn loopback_host(headers: &HeaderMap) -> bool {
    let Some(host) = headers.get(header::HOST).and_then(|h| h.to_str().ok()) else {
        return false;
    };
    let name = match host.strip_prefix('[') {
        Some(v6) => v6.split(']').next().unwrap_or(""),
        None => host.rsplit_once(':').map_or(host, |(name, _port)| name),
    };
    name.eq_ignore_ascii_case("localhost")
        || name
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

/// Mints a token for `user` (device `page-XXXX`, kind web, may watch
/// anybody, valid an hour), in dev mode only.
async fn dev_token(
    State(config): State<Arc<PageConfig>>,
    Path(user): Path<String>,
    headers: HeaderMap,
) -> Response {
    let Some(dev) = &config.dev_tokens else {
        return json(
            StatusCode::NOT_FOUND,
            serde_json::json!({ "error": "dev tokens are off: paste a token (see README, \"The page\")" }),
        );
    };
    if !loopback_host(&headers) {
        return json(
            StatusCode::FORBIDDEN,
            serde_json::json!({ "error": "dev tokens are only given to http://127.0.0.1 or http://localhost" }),
        );
    }
    let presented = headers
        .get(DEV_CODE_HEADER)
        .map_or(&b""[..], |v| v.as_bytes());
    if !dev.accepts(presented) {
        return json(
            StatusCode::FORBIDDEN,
            serde_json::json!({ "error": "no dev code, or not this run's: open the page at the address `greendot serve` printed (it ends in #dev=…)" }),
        );
    }
    if !valid_name(&user) {
        return json(
            StatusCode::BAD_REQUEST,
            serde_json::json!({ "error": "a user name is 1-128 bytes with no control characters" }),
        );
    }
    let device = format!("page-{:04x}", rand_u16());
    let claims = Claims::new(
        user.clone(),
        device.clone(),
        greendot_proto::Kind::Web,
        WatchClaim::all(),
        DEV_TOKEN_TTL,
    );
    match dev.keys.mint(&claims) {
        Ok(token) => json(
            StatusCode::OK,
            serde_json::json!({ "token": token, "user": user, "device": device }),
        ),
        Err(e) => json(
            StatusCode::INTERNAL_SERVER_ERROR,
            serde_json::json!({ "error": e.to_string() }),
        ),
    }
}

/// A device name of its own per tab (a second tab would otherwise replace
/// the first one's connection).
fn rand_u16() -> u16 {
    use ring::rand::SecureRandom;
    let mut b = [0u8; 2];
    let _ = ring::rand::SystemRandom::new().fill(&mut b);
    u16::from_be_bytes(b)
}

#[cfg(test)]
mod tests {
    use super::*;
    use greendot_server::http::axum::http::HeaderValue;

    fn host(h: &str) -> HeaderMap {
        let mut m = HeaderMap::new();
        m.insert(header::HOST, HeaderValue::from_str(h).unwrap());
        m
    }

    #[test]
    fn the_dev_code_is_random_and_checked_whole() {
        let keys = || TokenKeys::new(b"0123456789abcdef0123456789abcdef", Duration::ZERO);
        let dev = DevTokens::new(keys()).unwrap();
        let other = DevTokens::new(keys()).unwrap();
        assert_eq!(dev.code().len(), 32);
        assert_ne!(dev.code(), other.code(), "a new code each run");
        assert!(dev.accepts(dev.code().as_bytes()));
        assert!(!dev.accepts(other.code().as_bytes()));
        assert!(!dev.accepts(b""));
        assert!(!dev.accepts(&dev.code().as_bytes()[..31]));
        assert!(!dev.accepts(format!("{}0", dev.code()).as_bytes()));
    }

    #[test]
    fn dev_tokens_only_for_loopback_hosts() {
        for ok in [
            "127.0.0.1:9464",
            "localhost:9464",
            "[::1]:9464",
            "127.0.0.2",
            "LOCALHOST",
        ] {
            assert!(loopback_host(&host(ok)), "{ok}");
        }
        for no in [
            "evil.example:9464",
            "10.0.0.1:9464",
            "[::2]:1",
            "localhost.evil:9464",
            "",
        ] {
            assert!(!loopback_host(&host(no)), "{no}");
        }
        assert!(!loopback_host(&HeaderMap::new()));
        assert!(valid_name("alice"));
        assert!(!valid_name(""));
        assert!(!valid_name("a\nb"));
        assert!(!valid_name(&"x".repeat(129)));
    }
}

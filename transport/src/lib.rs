//! # greendot-transport
//!
//! greendot over QUIC (quinn + rustls on `ring`, tokio):
//!
//! - [`proto`]: the wire protocol: length-prefixed postcard frames, error codes
//!   and close codes (also written down in `docs/protocol.md`);
//! - [`token`]: HS256 JWT credentials;
//! - [`server`]: the server, a library: [`Server::bind`] gives a handle with
//!   `local_addr()` and `shutdown()`; one task owns the core;
//! - [`client`]: the Rust client library, with automatic reconnect and
//!   session resume;
//! - [`tls`]: TLS 1.3 configuration and development certificates.

pub mod client;
pub mod loadgen;
pub mod proto;
pub mod server;
pub mod tls;
pub mod token;

pub use server::{Server, ServerConfig, ServerError, ServerEvent, Stats};

// Re-exported so users (tests, the binary) need no second copy of them.
pub use quinn;
pub use rustls;

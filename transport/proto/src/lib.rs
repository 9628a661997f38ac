//! The greendot wire protocol, version 1 (written down for other languages in
//! `docs/protocol.md`).
//!
//! Every frame is a big-endian `u32` length followed by that many bytes of
//! postcard, with a hard cap on the length ([`DEFAULT_MAX_FRAME`]).
//!
//! - The client opens one bidirectional **control stream**. Its first frame is a
//!   [`Hello`] (version first, so any future version can be recognised); the
//!   server answers [`ServerFrame::Welcome`] or [`ServerFrame::Error`]. Then the
//!   client sends [`RequestFrame`]s, each with its own id, and the server answers
//!   every one with a [`ServerFrame::Reply`] carrying the same id.
//! - After the welcome the server opens two **unidirectional push streams**: the
//!   first frame of each is [`Push::Stream`] naming its tier, then
//!   [`Push::Update`]s. Realtime and batched pushes travel apart, so a large batch
//!   never delays a realtime change.
//! - Connection-level failures close the QUIC connection with a [`CloseCode`]
//!   and a human-readable reason; an application close with
//!   [`CloseCode::Logout`] from the client is a logout.

pub mod codec;
mod frames;

pub use codec::{decode, decode_hello, encode_frame, peek_version, FrameError, FrameReader};
pub use frames::*;

/// The ALPN of this protocol.
pub const ALPN: &[u8] = b"greendot/1";
/// The protocol version spoken by this build (the first field of [`Hello`]).
pub const VERSION: u32 = 1;
/// The default hard cap on the length of a frame from a client (the bytes
/// after the prefix); the server announces its cap in the welcome.
pub const DEFAULT_MAX_FRAME: usize = 64 * 1024;
/// The cap a client puts on frames from the server (a welcome or an answer may
/// carry many snapshots).
pub const MAX_SERVER_FRAME: usize = 16 * 1024 * 1024;

/// QUIC application close codes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum CloseCode {
    /// A plain close (a client going away without logging out: the device
    /// lingers for its grace period).
    Normal = 0,
    /// Graceful logout (sent by a client, or by the server after answering a
    /// `Logout` request).
    Logout = 1,
    /// The same device connected again; this connection's session is over.
    Superseded = 2,
    /// The core reaped the session (no sign of life within the heartbeat timeout).
    SessionExpired = 3,
    /// A frame could not be decoded, or came out of order.
    ProtocolError = 4,
    /// A frame's length prefix exceeded the cap.
    FrameTooLarge = 5,
    /// The hello named a protocol version the server does not speak.
    UnsupportedVersion = 6,
    /// Missing, malformed or forged token.
    Unauthorized = 7,
    /// The token's `exp` has passed.
    TokenExpired = 8,
    /// The server is at its connection cap.
    TooManyConnections = 9,
    /// The server is shutting down.
    Shutdown = 10,
    /// The client did not read its pushes fast enough.
    Overloaded = 11,
    /// No hello within the hello timeout.
    HelloTimeout = 12,
    /// The hello was refused (a limit, a bad name): see the error frame.
    Refused = 13,
    /// The server is draining (a restart or a deploy): reconnect at once,
    /// resuming the session; the server (or its successor) is back shortly.
    Draining = 14,
    /// The client kept sending past its request rate for
    /// `RATE_LIMIT_PATIENCE` (requests refused every second for 5 s):
    /// reconnect only after slowing down.
    RateLimited = 15,
    /// The client stopped (STOP_SENDING) one of its push streams: it would
    /// stay online while missing every update.
    StreamStopped = 16,
    /// The session's token was revoked (`Request::Revoke`): reconnect only
    /// with a token issued after the revocation.
    Revoked = 17,
}

impl CloseCode {
    pub const ALL: [CloseCode; 18] = [
        CloseCode::Normal,
        CloseCode::Logout,
        CloseCode::Superseded,
        CloseCode::SessionExpired,
        CloseCode::ProtocolError,
        CloseCode::FrameTooLarge,
        CloseCode::UnsupportedVersion,
        CloseCode::Unauthorized,
        CloseCode::TokenExpired,
        CloseCode::TooManyConnections,
        CloseCode::Shutdown,
        CloseCode::Overloaded,
        CloseCode::HelloTimeout,
        CloseCode::Refused,
        CloseCode::Draining,
        CloseCode::RateLimited,
        CloseCode::StreamStopped,
        CloseCode::Revoked,
    ];

    pub const fn code(self) -> u32 {
        self as u32
    }

    pub fn from_code(code: u64) -> Option<CloseCode> {
        CloseCode::ALL.into_iter().find(|c| c.code() as u64 == code)
    }

    pub fn varint(self) -> quinn::VarInt {
        quinn::VarInt::from_u32(self.code())
    }

    /// Whether a client should reconnect (and try to resume) after the server
    /// closed with this code.
    pub fn may_reconnect(self) -> bool {
        matches!(
            self,
            CloseCode::Normal
                | CloseCode::SessionExpired
                | CloseCode::Shutdown
                | CloseCode::Draining
                | CloseCode::Overloaded
                | CloseCode::HelloTimeout
                | CloseCode::TooManyConnections
                | CloseCode::ProtocolError
                | CloseCode::FrameTooLarge
                | CloseCode::RateLimited
                | CloseCode::StreamStopped
        )
    }
}

/// The close code for an error sent just before closing.
pub fn close_code_for(code: ErrorCode) -> CloseCode {
    match code {
        ErrorCode::FrameTooLarge => CloseCode::FrameTooLarge,
        ErrorCode::UnsupportedVersion => CloseCode::UnsupportedVersion,
        ErrorCode::BadToken => CloseCode::Unauthorized,
        ErrorCode::TokenExpired => CloseCode::TokenExpired,
        ErrorCode::TokenRevoked => CloseCode::Revoked,
        ErrorCode::TooManyConnections => CloseCode::TooManyConnections,
        ErrorCode::ShuttingDown => CloseCode::Shutdown,
        ErrorCode::BadFrame | ErrorCode::UnexpectedFrame => CloseCode::ProtocolError,
        ErrorCode::RateLimited => CloseCode::RateLimited,
        _ => CloseCode::Refused,
    }
}

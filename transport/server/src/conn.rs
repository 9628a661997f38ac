//! One connection's side of the protocol, sans IO: frame bytes in, a [`Step`]
//! out (decoding, version check, token verification, rate limiting), which the
//! [`Hub`] then applies. [`handle_frame`] chains the two: it is exactly what the
//! server does with a frame, minus the network, so a fuzzer can drive it.

use crate::hub::Hub;
use crate::token::{Claims, TokenKeys};
use greendot_core::{Millis, SessionId};
use greendot_proto::{
    self as proto, close_code_for, decode, decode_hello, peek_version, CloseCode, ErrorCode,
    FrameError, Hello, RequestFrame, ServerFrame, WireError,
};
use std::sync::Arc;

/// A request rate per session: a token bucket.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct RateLimit {
    /// Sustained requests per second.
    pub per_second: u32,
    /// Requests allowed in a burst.
    pub burst: u32,
}

impl Default for RateLimit {
    fn default() -> RateLimit {
        RateLimit {
            per_second: 50,
            burst: 100,
        }
    }
}

impl RateLimit {
    /// `per_second` sustained, bursts of `burst`.
    pub fn new(per_second: u32, burst: u32) -> RateLimit {
        RateLimit { per_second, burst }
    }
}

#[derive(Clone, Copy, Debug)]
struct Bucket {
    limit: RateLimit,
    /// In thousandths of a request.
    level: u64,
    at: Millis,
}

impl Bucket {
    fn new(limit: RateLimit) -> Bucket {
        Bucket {
            limit,
            level: u64::from(limit.burst) * 1000,
            at: Millis::ZERO,
        }
    }

    fn take(&mut self, now: Millis) -> bool {
        let elapsed = now.0.saturating_sub(self.at.0);
        self.at = Millis(self.at.0.max(now.0));
        let cap = u64::from(self.limit.burst) * 1000;
        self.level = self
            .level
            .saturating_add(elapsed.saturating_mul(u64::from(self.limit.per_second)))
            .min(cap);
        if self.level >= 1000 {
            self.level -= 1000;
            true
        } else {
            false
        }
    }
}

/// How long a client may keep sending past its rate before it is closed
/// with `CloseCode::RateLimited`: a refusal streak that lasts this long (no
/// second without a refusal in it) means the client does not slow down for
/// refusals, and answering each one would go on forever.
pub const RATE_LIMIT_PATIENCE: Millis = Millis(5_000);

/// A second without a refusal ends a refusal streak.
const STREAK_GAP: Millis = Millis(1_000);

#[derive(Clone, Copy, Debug, Default)]
struct Streak {
    /// The first and the latest refusal of the current streak.
    since: Millis,
    last: Millis,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    AwaitHello,
    /// The hello went to the hub; no answer yet.
    Pending,
    Ready(SessionId),
    Closed,
}

/// What a connection asks for after one frame.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Step {
    /// A verified hello: connect (or resume) this device.
    /// `foreground`: the app's state (I12), `true` for an older client.
    Hello {
        claims: Claims,
        resume: Option<u64>,
        foreground: bool,
    },
    /// A request of the established session.
    Request {
        session: SessionId,
        id: u64,
        request: proto::Request,
    },
    /// A verified `Refresh` of the established session (request `id`).
    Refresh {
        session: SessionId,
        id: u64,
        claims: Claims,
    },
    /// Answer with this frame; the hub is not involved.
    Reply(ServerFrame),
    /// Send this error, then close the connection with the matching code.
    Close(WireError),
    /// Nothing to do (a frame after the connection was condemned).
    Nothing,
}

impl Step {
    /// Whether the hub must see this step.
    pub fn needs_hub(&self) -> bool {
        matches!(
            self,
            Step::Hello { .. } | Step::Request { .. } | Step::Refresh { .. }
        )
    }
}

/// What to send back, and whether to close afterwards.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Handled {
    pub reply: Option<ServerFrame>,
    pub close: Option<CloseCode>,
    /// A hello succeeded and this is the new session.
    pub welcomed: Option<SessionId>,
}

impl Handled {
    pub fn close(error: WireError) -> Handled {
        Handled {
            close: Some(close_code_for(error.code)),
            reply: Some(ServerFrame::Error(error)),
            welcomed: None,
        }
    }
}

/// One connection's protocol state.
#[derive(Debug)]
pub struct ConnState {
    keys: Arc<TokenKeys>,
    phase: Phase,
    bucket: Bucket,
    refusals: Option<Streak>,
}

impl ConnState {
    pub fn new(keys: Arc<TokenKeys>, rate: RateLimit) -> ConnState {
        ConnState {
            keys,
            phase: Phase::AwaitHello,
            bucket: Bucket::new(rate),
            refusals: None,
        }
    }

    /// The established session, once welcomed.
    pub fn session(&self) -> Option<SessionId> {
        match self.phase {
            Phase::Ready(s) => Some(s),
            _ => None,
        }
    }

    /// The hub accepted the hello.
    pub fn on_welcome(&mut self, session: SessionId) {
        if self.phase == Phase::Pending {
            self.phase = Phase::Ready(session);
        }
    }

    /// The byte stream could not be cut into frames.
    pub fn on_frame_error(&mut self, error: FrameError) -> Step {
        self.phase = Phase::Closed;
        Step::Close(error.into())
    }

    fn condemn(&mut self, error: WireError) -> Step {
        self.phase = Phase::Closed;
        Step::Close(error)
    }

    /// One frame's payload (without its length prefix).
    pub fn on_frame(&mut self, now: Millis, payload: &[u8]) -> Step {
        match self.phase {
            Phase::Closed => Step::Nothing,
            Phase::AwaitHello => {
                let version = match peek_version(payload) {
                    Ok(v) => v,
                    Err(e) => return self.condemn(e),
                };
                if version != proto::VERSION {
                    return self.condemn(WireError::new(
                        ErrorCode::UnsupportedVersion,
                        format!(
                            "protocol version {version} is not supported; this server speaks {}",
                            proto::VERSION
                        ),
                    ));
                }
                let hello: Hello = match decode_hello(payload) {
                    Ok(h) => h,
                    Err(e) => return self.condemn(e),
                };
                match self.keys.verify(&hello.token) {
                    Ok(claims) => {
                        self.phase = Phase::Pending;
                        Step::Hello {
                            claims,
                            resume: hello.resume,
                            foreground: hello.foreground,
                        }
                    }
                    Err(e) => self.condemn(e),
                }
            }
            Phase::Pending => self.condemn(WireError::new(
                ErrorCode::UnexpectedFrame,
                "a frame before the welcome",
            )),
            Phase::Ready(session) => {
                let frame: RequestFrame = match decode(payload) {
                    Ok(f) => f,
                    Err(e) => return self.condemn(e),
                };
                if !self.bucket.take(now) {
                    let streak = match self.refusals {
                        Some(s) if now.0.saturating_sub(s.last.0) < STREAK_GAP.0 => {
                            Streak { last: now, ..s }
                        }
                        _ => Streak {
                            since: now,
                            last: now,
                        },
                    };
                    self.refusals = Some(streak);
                    if now.0.saturating_sub(streak.since.0) >= RATE_LIMIT_PATIENCE.0 {
                        return self.condemn(WireError::new(
                            ErrorCode::RateLimited,
                            "requests kept coming past the rate limit",
                        ));
                    }
                    return Step::Reply(ServerFrame::Reply {
                        id: frame.id,
                        result: Err(WireError::new(
                            ErrorCode::RateLimited,
                            "too many requests; this one was not processed",
                        )),
                    });
                }
                match frame.request {
                    // Verified here, with the hello's keys; a bad token is
                    // refused and the connection goes on under its current one.
                    proto::Request::Refresh { token } => match self.keys.verify(&token) {
                        Ok(claims) => Step::Refresh {
                            session,
                            id: frame.id,
                            claims,
                        },
                        Err(e) => Step::Reply(ServerFrame::Reply {
                            id: frame.id,
                            result: Err(e),
                        }),
                    },
                    request => Step::Request {
                        session,
                        id: frame.id,
                        request,
                    },
                }
            }
        }
    }
}

/// The sans-network request handler: one frame's payload from a peer in,
/// whatever the server would answer out (and the core inputs it implies applied
/// to `hub`). The server's one task runs exactly these two halves, one after
/// the other, for each frame of a connection (see `server::driver`).
pub fn handle_frame(hub: &mut Hub, conn: &mut ConnState, now: Millis, payload: &[u8]) -> Handled {
    let step = conn.on_frame(now, payload);
    let handled = hub.apply(now, step);
    if let Some(session) = handled.welcomed {
        conn.on_welcome(session);
    }
    handled
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hub::HubLimits;
    use crate::token::WatchClaim;
    use greendot_proto::{encode_frame, Answer, Kind, Request, Tier};
    use std::time::Duration;

    fn payload<T: serde::Serialize>(v: &T) -> Vec<u8> {
        encode_frame(v).unwrap()[4..].to_vec()
    }

    #[test]
    fn hello_request_and_bad_input_without_a_network() {
        let keys = Arc::new(TokenKeys::new(b"s", Duration::ZERO));
        let mut hub = Hub::new(Default::default(), HubLimits::default(), 0).unwrap();
        let mut conn = ConnState::new(keys.clone(), RateLimit::default());

        // A request before the hello is a bad frame (it is no hello).
        let mut early = ConnState::new(keys.clone(), RateLimit::default());
        let h = handle_frame(&mut hub, &mut early, Millis(0), &[0xff; 3]);
        assert_eq!(h.close, Some(CloseCode::ProtocolError));

        let claims = Claims::new(
            "alice",
            "phone",
            Kind::Mobile,
            WatchClaim::only(["bob"]),
            Duration::from_secs(60),
        );
        let hello = Hello {
            version: proto::VERSION,
            token: keys.mint(&claims).unwrap(),
            resume: None,
            foreground: true,
        };
        let h = handle_frame(&mut hub, &mut conn, Millis(1), &payload(&hello));
        assert!(matches!(h.reply, Some(ServerFrame::Welcome(_))));
        assert!(conn.session().is_some());

        let sub = |target: &str| RequestFrame {
            id: 9,
            request: Request::Subscribe {
                targets: vec![target.into()],
                tier: Tier::Realtime,
            },
        };
        let h = handle_frame(&mut hub, &mut conn, Millis(2), &payload(&sub("bob")));
        match h.reply {
            Some(ServerFrame::Reply {
                id: 9,
                result: Ok(Answer::Subscribed { snapshots, refused }),
            }) => assert!(snapshots.len() == 1 && refused.is_empty()),
            other => panic!("{other:?}"),
        }
        let h = handle_frame(&mut hub, &mut conn, Millis(3), &payload(&sub("carol")));
        match h.reply {
            Some(ServerFrame::Reply {
                result: Ok(Answer::Subscribed { refused, .. }),
                ..
            }) => assert_eq!(refused[0].error.code, ErrorCode::NotAllowed),
            other => panic!("{other:?}"),
        }
        let h = handle_frame(&mut hub, &mut conn, Millis(4), &[1, 2, 3, 4, 5, 6, 7]);
        assert_eq!(h.close, Some(CloseCode::ProtocolError));
    }

    #[test]
    fn a_client_that_never_slows_down_is_closed() {
        let keys = Arc::new(TokenKeys::new(b"s", Duration::ZERO));
        let rate = RateLimit {
            per_second: 10,
            burst: 10,
        };
        let mut hub = Hub::new(Default::default(), HubLimits::default(), 0).unwrap();
        let mut conn = ConnState::new(keys.clone(), rate);
        let claims = Claims::new(
            "al",
            "phone",
            Kind::Mobile,
            WatchClaim::all(),
            Duration::from_secs(60),
        );
        let hello = Hello {
            version: proto::VERSION,
            token: keys.mint(&claims).unwrap(),
            resume: None,
            foreground: true,
        };
        handle_frame(&mut hub, &mut conn, Millis(0), &payload(&hello));
        let ping = payload(&RequestFrame {
            id: 1,
            request: Request::Ping,
        });
        // A refusal now and then (a burst past the limit, then calm) never
        // closes: each streak ends with a quiet second.
        let mut closed = None;
        let mut refused = 0;
        for t in (0..20_000).step_by(2_000) {
            for _ in 0..15 {
                match conn.on_frame(Millis(t), &ping) {
                    Step::Close(e) => closed = Some((t, e)),
                    Step::Reply(_) => refused += 1,
                    _ => {}
                }
            }
        }
        assert_eq!(closed, None, "bursts past the rate, each followed by calm");
        assert!(refused >= 50);
        // 100 per second from now on: refused every second, closed after
        // RATE_LIMIT_PATIENCE.
        let start = 20_000;
        for t in (start..start + 20_000).step_by(10) {
            if let Step::Close(e) = conn.on_frame(Millis(t), &ping) {
                closed = Some((t, e));
                break;
            }
        }
        let (at, error) = closed.expect("closed");
        assert_eq!(error.code, ErrorCode::RateLimited);
        assert_eq!(close_code_for(error.code), CloseCode::RateLimited);
        assert!(at - start >= RATE_LIMIT_PATIENCE.0 && at - start <= RATE_LIMIT_PATIENCE.0 + 2_000);
        assert_eq!(conn.on_frame(Millis(at + 1), &ping), Step::Nothing);
    }

    #[test]
    fn rate_limit_refuses_past_the_burst() {
        let mut bucket = Bucket::new(RateLimit {
            per_second: 10,
            burst: 3,
        });
        assert!((0..3).all(|_| bucket.take(Millis(0))));
        assert!(!bucket.take(Millis(0)));
        assert!(bucket.take(Millis(100)));
        assert!(!bucket.take(Millis(100)));
    }
}

//! A device of the multi-node simulation: a WebSocket client speaking the
//! real protocol (docs/protocol.md, "WebSocket over TLS") to one node at a
//! time. Client messages are control frames without their length prefix;
//! server messages are a stream byte (0 control, 1 and 2 push streams) and
//! one frame's payload.

use greendot_proto::{
    self as proto, Answer, Hello, Push, Request, RequestFrame, ServerFrame, Status, Tier,
};
use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

/// What a device asked and waits for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Asked {
    Subscribe,
    /// The group every user is a member of (`super::groups::GROUP`).
    GroupSubscribe,
    SetStatus,
    SetInvisible(bool),
    Logout,
}

/// A watcher's latest view of one user.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Seen {
    pub version: u64,
    pub online: bool,
    pub at: Duration,
}

/// One WebSocket connection of a device.
#[derive(Debug)]
pub struct Conn {
    pub id: u64,
    pub node: usize,
    pub welcomed: Option<Duration>,
    /// Subscribed (granted) since.
    pub subscribed: Option<Duration>,
    pub pending: HashMap<u64, Asked>,
    /// The last message heard from the server.
    pub heard: Duration,
    /// A logout was sent on it.
    pub logging_out: bool,
    /// Per push stream and target, the highest version it pushed.
    pub versions: BTreeMap<(u8, usize), u64>,
    /// Its group subscription, once answered (or carried over by a resume).
    pub group: Option<GroupSub>,
}

/// A connection's subscription to the group, and what it was told.
#[derive(Debug, Default)]
pub struct GroupSub {
    /// Answered then (a subscribe is sent at each welcome).
    pub since: Option<Duration>,
    /// The last count told, if any.
    pub count: Option<u32>,
    /// Per push stream, the highest version pushed.
    pub versions: BTreeMap<u8, u64>,
}

/// A device and what it saw.
#[derive(Debug)]
pub struct Device {
    pub user: usize,
    pub token: String,
    pub conn: Option<Conn>,
    /// The session to resume at the next connect.
    pub resume: Option<u64>,
    pub reconnect_at: Option<Duration>,
    /// Targets it watches.
    pub targets: Vec<usize>,
    /// Per target, the view it shows: the highest version it was shown,
    /// on any connection (docs/protocol.md: keep the highest, drop older).
    pub seen: BTreeMap<usize, Seen>,
    pub next_id: u64,
    /// Its session holds the group subscription (so a resume carries it).
    pub group_held: bool,
    /// The servers do not serve group subscriptions (a cluster sending
    /// protocol 3): not asked again.
    pub groups_unsupported: bool,
}

/// What a device learned from one server message.
#[derive(Debug)]
pub enum Heard {
    /// `covered`: the welcome carried a snapshot of every target (a resume
    /// whose subscriptions all carried over).
    Welcome {
        resumed: bool,
        session: u64,
        covered: bool,
    },
    Answer {
        asked: Asked,
        ok: bool,
    },
    /// A group subscribe's answer: the snapshot's version and count, or
    /// the refusal's code.
    GroupAnswer(Result<(u64, u32), proto::ErrorCode>),
    /// A group push: the count (and the member change, to an admin).
    GroupPush {
        stream: u8,
        version: u64,
        count: u32,
        member: Option<(usize, bool)>,
    },
    GroupEnded,
    /// `stream`: 0 for a snapshot (control stream), else the push stream.
    View {
        target: usize,
        presence: proto::Presence,
        stream: u8,
    },
    Error(String),
    Nothing,
}

pub fn user_name(user: usize) -> String {
    format!("u{user}")
}

fn user_index(name: &str) -> Option<usize> {
    name.strip_prefix('u')?.parse().ok()
}

/// A control frame as a WebSocket client sends it: no length prefix.
fn unprefixed(framed: Result<Vec<u8>, postcard::Error>) -> Vec<u8> {
    let framed = framed.expect("client frames encode");
    framed[4..].to_vec()
}

impl Device {
    pub fn new(user: usize, token: String, targets: Vec<usize>) -> Device {
        Device {
            user,
            token,
            conn: None,
            resume: None,
            reconnect_at: None,
            targets,
            seen: BTreeMap::new(),
            next_id: 0,
            group_held: false,
            groups_unsupported: false,
        }
    }

    pub fn hello(&self) -> Vec<u8> {
        unprefixed(proto::encode_frame(&Hello {
            version: proto::VERSION,
            token: self.token.clone(),
            resume: self.resume,
            foreground: true,
        }))
    }

    /// A request frame, remembered as waiting.
    pub fn request(&mut self, request: Request, asked: Asked) -> Option<Vec<u8>> {
        let conn = self.conn.as_mut()?;
        conn.welcomed?;
        self.next_id += 1;
        conn.pending.insert(self.next_id, asked);
        Some(unprefixed(proto::encode_frame(&RequestFrame {
            id: self.next_id,
            request,
        })))
    }

    pub fn subscribe(&mut self) -> Option<Vec<u8>> {
        let targets = self.targets.iter().map(|t| user_name(*t)).collect();
        self.request(
            Request::Subscribe {
                targets,
                tier: Tier::Realtime,
            },
            Asked::Subscribe,
        )
    }

    pub fn group_subscribe(&mut self) -> Option<Vec<u8>> {
        let group = super::groups::GROUP;
        self.request(Request::GroupSubscribe { group }, Asked::GroupSubscribe)
    }

    pub fn set_status(&mut self, status: Status) -> Option<Vec<u8>> {
        self.request(
            Request::SetStatus {
                status,
                message: None,
            },
            Asked::SetStatus,
        )
    }

    /// Reads one server message of the current connection.
    pub fn receive(&mut self, bytes: &[u8], now: Duration) -> Vec<Heard> {
        let Some(conn) = self.conn.as_mut() else {
            return vec![Heard::Nothing];
        };
        conn.heard = now;
        let Some((&stream, payload)) = bytes.split_first() else {
            return vec![Heard::Error("an empty server message".into())];
        };
        if stream == 0 {
            let frame: ServerFrame = match proto::decode(payload) {
                Ok(f) => f,
                Err(e) => return vec![Heard::Error(format!("control frame: {e}"))],
            };
            return match frame {
                ServerFrame::Welcome(w) => {
                    conn.welcomed = Some(now);
                    self.resume = Some(w.session);
                    let covered = w.resumed
                        && self.targets.iter().all(|t| {
                            w.snapshots
                                .iter()
                                .any(|s| user_index(&s.target) == Some(*t))
                        });
                    if covered {
                        conn.subscribed = Some(now);
                    }
                    let mut out = vec![Heard::Welcome {
                        resumed: w.resumed,
                        session: w.session,
                        covered,
                    }];
                    for s in w.snapshots {
                        if let Some(target) = user_index(&s.target) {
                            out.push(Heard::View {
                                target,
                                presence: s.presence,
                                stream: 0,
                            });
                        }
                    }
                    out
                }
                ServerFrame::Reply { id, result } => {
                    let Some(asked) = conn.pending.remove(&id) else {
                        return vec![Heard::Error(format!("a reply to {id}, never asked"))];
                    };
                    if asked == Asked::GroupSubscribe {
                        let answer = match result {
                            Ok(Answer::GroupSubscribed(s)) => Ok((s.version, s.count)),
                            Ok(other) => {
                                return vec![Heard::Error(format!(
                                    "a group subscribe answered {other:?}"
                                ))]
                            }
                            Err(e) => Err(e.code),
                        };
                        return vec![Heard::GroupAnswer(answer)];
                    }
                    let mut out = Vec::new();
                    if let Ok(Answer::Subscribed { snapshots, .. }) = &result {
                        conn.subscribed = Some(now);
                        for s in snapshots {
                            if let Some(target) = user_index(&s.target) {
                                out.push(Heard::View {
                                    target,
                                    presence: s.presence.clone(),
                                    stream: 0,
                                });
                            }
                        }
                    }
                    out.push(Heard::Answer {
                        asked,
                        ok: result.is_ok(),
                    });
                    out
                }
                ServerFrame::Error(_) => vec![Heard::Nothing],
            };
        }
        match proto::decode::<Push>(payload) {
            Ok(Push::Update { target, presence }) => match user_index(&target) {
                Some(target) => vec![Heard::View {
                    target,
                    presence,
                    stream,
                }],
                None => vec![Heard::Error(format!("a push about {target}"))],
            },
            Ok(Push::GroupCount {
                group: super::groups::GROUP,
                version,
                count,
            }) => vec![Heard::GroupPush {
                stream,
                version,
                count,
                member: None,
            }],
            Ok(Push::GroupMember {
                group: super::groups::GROUP,
                version,
                member,
                online,
                count,
            }) => match user_index(&member) {
                Some(m) => vec![Heard::GroupPush {
                    stream,
                    version,
                    count,
                    member: Some((m, online)),
                }],
                None => vec![Heard::Error(format!("a group change of {member}"))],
            },
            Ok(Push::GroupEnded {
                group: super::groups::GROUP,
            }) => vec![Heard::GroupEnded],
            Ok(Push::GroupCount { .. } | Push::GroupMember { .. } | Push::GroupEnded { .. }) => {
                vec![Heard::Error("a push of a group never subscribed".into())]
            }
            Ok(_) => vec![Heard::Nothing],
            Err(e) => vec![Heard::Error(format!("push frame: {e}"))],
        }
    }
}

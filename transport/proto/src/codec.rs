//! Length-prefixed postcard frames, sans IO: bytes in, frames out.

use super::frames::{ErrorCode, Hello, WireError};
use bytes::{Buf, BytesMut};
use serde::de::DeserializeOwned;
use serde::Serialize;

/// Why a byte stream could not be cut into frames. After one of these the
/// stream is out of step and must be closed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    #[error("frame of {len} bytes exceeds the cap of {max}")]
    TooLarge { len: usize, max: usize },
    #[error("empty frame")]
    Empty,
    #[error("stream ended inside a frame")]
    Truncated,
}

impl From<FrameError> for WireError {
    fn from(error: FrameError) -> WireError {
        let code = match error {
            FrameError::TooLarge { .. } => ErrorCode::FrameTooLarge,
            FrameError::Empty | FrameError::Truncated => ErrorCode::BadFrame,
        };
        WireError::new(code, error.to_string())
    }
}

/// Encodes `value` as one frame: a big-endian `u32` length, then postcard.
pub fn encode_frame<T: Serialize>(value: &T) -> Result<Vec<u8>, postcard::Error> {
    let mut out = postcard::to_extend(value, vec![0u8; 4])?;
    let len = u32::try_from(out.len() - 4).map_err(|_| postcard::Error::SerializeBufferFull)?;
    out[..4].copy_from_slice(&len.to_be_bytes());
    Ok(out)
}

/// Decodes one frame's payload; trailing bytes are an error.
pub fn decode<T: DeserializeOwned>(payload: &[u8]) -> Result<T, WireError> {
    match postcard::take_from_bytes::<T>(payload) {
        Ok((value, [])) => Ok(value),
        Ok((_, rest)) => Err(WireError::new(
            ErrorCode::BadFrame,
            format!("{} trailing bytes after the frame", rest.len()),
        )),
        Err(e) => Err(WireError::new(
            ErrorCode::BadFrame,
            format!("undecodable frame: {e}"),
        )),
    }
}

/// A `Hello`, also from a client that sends none of its optional trailing
/// fields (`foreground`, absent: in the foreground).
pub fn decode_hello(payload: &[u8]) -> Result<Hello, WireError> {
    /// The hello before `foreground` was added.
    #[derive(serde::Deserialize)]
    struct HelloV1 {
        version: u32,
        token: String,
        resume: Option<u64>,
    }
    decode::<Hello>(payload).or_else(|full| match decode::<HelloV1>(payload) {
        Ok(v1) => Ok(Hello {
            version: v1.version,
            token: v1.token,
            resume: v1.resume,
            foreground: true,
        }),
        Err(_) => Err(full),
    })
}

/// The protocol version at the start of a `Hello` payload, whatever follows.
pub fn peek_version(payload: &[u8]) -> Result<u32, WireError> {
    postcard::take_from_bytes::<u32>(payload)
        .map(|(version, _)| version)
        .map_err(|e| WireError::new(ErrorCode::BadFrame, format!("no version in hello: {e}")))
}

/// Cuts a byte stream into frame payloads, refusing any length over `max`
/// before buffering it. Each frame is split off the front of the buffer
/// (a cursor move, no shifting of what follows), so a burst of many small
/// frames costs time linear in its bytes.
#[derive(Debug)]
pub struct FrameReader {
    buf: BytesMut,
    max: usize,
}

impl FrameReader {
    pub fn new(max: usize) -> FrameReader {
        FrameReader {
            buf: BytesMut::new(),
            max,
        }
    }

    /// Changes the largest frame accepted from now on (a connection's
    /// first frame, its hello, is held to less than the later ones).
    pub fn set_max(&mut self, max: usize) {
        self.max = max;
    }

    pub fn push(&mut self, bytes: &[u8]) {
        self.buf.extend_from_slice(bytes);
    }

    /// Bytes received but not yet part of a complete frame.
    pub fn pending(&self) -> usize {
        self.buf.len()
    }

    /// The next complete frame, if one is buffered.
    pub fn next_frame(&mut self) -> Result<Option<Vec<u8>>, FrameError> {
        let Some(header) = self.buf.get(..4) else {
            return Ok(None);
        };
        let mut prefix = [0u8; 4];
        prefix.copy_from_slice(header);
        let len = u32::from_be_bytes(prefix) as usize;
        if len > self.max {
            return Err(FrameError::TooLarge { len, max: self.max });
        }
        if len == 0 {
            return Err(FrameError::Empty);
        }
        if self.buf.len() < 4 + len {
            return Ok(None);
        }
        self.buf.advance(4);
        Ok(Some(self.buf.split_to(len).to_vec()))
    }

    /// Gives back a large buffer once it is empty: an idle connection keeps
    /// no read buffer.
    pub fn compact(&mut self) {
        if self.buf.is_empty() && self.buf.capacity() > 256 {
            self.buf = BytesMut::new();
        }
    }

    /// At the end of the stream: fine if nothing is left over.
    pub fn finish(&self) -> Result<(), FrameError> {
        if self.buf.is_empty() {
            Ok(())
        } else {
            Err(FrameError::Truncated)
        }
    }
}

/// Reads the next frame from a QUIC stream: `Ok(None)` at a clean end of the
/// stream. Cancel-safe: partial data stays in `reader`.
pub async fn read_frame(
    recv: &mut quinn::RecvStream,
    reader: &mut FrameReader,
) -> Result<Option<Vec<u8>>, ReadError> {
    let mut chunk = [0u8; 4096];
    loop {
        if let Some(frame) = reader.next_frame()? {
            return Ok(Some(frame));
        }
        match recv.read(&mut chunk).await? {
            Some(n) => reader.push(&chunk[..n]),
            None => {
                reader.finish()?;
                return Ok(None);
            }
        }
    }
}

/// Why reading a frame from a stream failed.
#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    #[error(transparent)]
    Frame(#[from] FrameError),
    #[error(transparent)]
    Stream(#[from] quinn::ReadError),
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Hello, Request, RequestFrame, VERSION};

    /// A hello without `foreground` (a client older than the field) is in
    /// the foreground; one with it says so; a bad trailing byte is refused.
    #[test]
    fn hello_foreground_is_optional_on_the_wire() {
        #[derive(serde::Serialize)]
        struct OldHello {
            version: u32,
            token: String,
            resume: Option<u64>,
        }
        let old = OldHello {
            version: VERSION,
            token: "t".into(),
            resume: Some(9),
        };
        let bytes = postcard::to_allocvec(&old).unwrap();
        let hello = decode_hello(&bytes).unwrap();
        assert!(hello.foreground && hello.resume == Some(9) && hello.token == "t");
        let new = Hello {
            version: VERSION,
            token: "t".into(),
            resume: None,
            foreground: false,
        };
        let mut bytes = postcard::to_allocvec(&new).unwrap();
        assert_eq!(decode_hello(&bytes).unwrap(), new);
        *bytes.last_mut().unwrap() = 2;
        assert!(decode_hello(&bytes).is_err());
        bytes.push(0);
        assert!(decode_hello(&bytes).is_err());
    }

    #[test]
    fn round_trip_in_pieces() {
        let hello = Hello {
            version: VERSION,
            token: "t".into(),
            resume: Some(7),
            foreground: true,
        };
        let req = RequestFrame {
            id: 3,
            request: Request::Subscribe {
                targets: vec!["bob".into()],
                tier: crate::Tier::Batched,
            },
        };
        let mut bytes = encode_frame(&hello).unwrap();
        bytes.extend(encode_frame(&req).unwrap());
        let mut reader = FrameReader::new(1024);
        let mut frames = Vec::new();
        for b in &bytes {
            reader.push(std::slice::from_ref(b));
            while let Some(f) = reader.next_frame().unwrap() {
                frames.push(f);
            }
        }
        assert_eq!(frames.len(), 2);
        assert_eq!(peek_version(&frames[0]).unwrap(), VERSION);
        assert_eq!(decode::<Hello>(&frames[0]).unwrap(), hello);
        assert_eq!(decode::<RequestFrame>(&frames[1]).unwrap(), req);
        assert!(reader.finish().is_ok());
    }

    /// The examples of docs/protocol.md, byte for byte.
    #[test]
    fn bytes_match_the_protocol_document() {
        let hello = Hello {
            version: 1,
            token: "ab".into(),
            resume: Some(5),
            foreground: true,
        };
        assert_eq!(
            encode_frame(&hello).unwrap(),
            [0, 0, 0, 7, 0x01, 0x02, b'a', b'b', 0x01, 0x05, 0x01]
        );
        assert_eq!(
            decode_hello(&[0x01, 0x02, b'a', b'b', 0x01, 0x05]).unwrap(),
            hello
        );
        let req = RequestFrame {
            id: 7,
            request: Request::SetForeground { foreground: false },
        };
        assert_eq!(encode_frame(&req).unwrap(), [0, 0, 0, 3, 0x07, 0x0a, 0x00]);
        let req = RequestFrame {
            id: 300,
            request: Request::Subscribe {
                targets: vec!["bob".into()],
                tier: crate::Tier::Batched,
            },
        };
        assert_eq!(
            encode_frame(&req).unwrap(),
            [0, 0, 0, 9, 0xac, 0x02, 0x01, 0x01, 0x03, b'b', b'o', b'b', 0x01]
        );
        let error = crate::WireError::new(ErrorCode::TooManyTargets, "");
        assert_eq!(postcard::to_stdvec(&error).unwrap(), [26, 0]);
    }

    /// The group examples of docs/protocol.md, byte for byte.
    #[test]
    fn group_bytes_match_the_protocol_document() {
        use crate::{Answer, GroupRole, GroupSnapshot, Push, ServerFrame};
        let req = RequestFrame {
            id: 5,
            request: Request::SetGroup {
                group: 42,
                members: vec!["ann".into(), "bob".into()],
                admins: vec!["ann".into()],
            },
        };
        assert_eq!(
            encode_frame(&req).unwrap(),
            [
                0, 0, 0, 17, 0x05, 0x0b, 0x2a, 0x02, 0x03, b'a', b'n', b'n', 0x03, b'b', b'o',
                b'b', 0x01, 0x03, b'a', b'n', b'n'
            ]
        );
        let req = RequestFrame {
            id: 4,
            request: Request::GroupSubscribe { group: 42 },
        };
        assert_eq!(encode_frame(&req).unwrap(), [0, 0, 0, 3, 0x04, 0x0d, 0x2a]);
        let reply = ServerFrame::Reply {
            id: 4,
            result: Ok(Answer::GroupSubscribed(GroupSnapshot {
                group: 42,
                role: GroupRole::Member,
                version: 7,
                count: 3,
                members: 10,
            })),
        };
        assert_eq!(
            encode_frame(&reply).unwrap(),
            [0, 0, 0, 9, 0x01, 0x04, 0x00, 0x07, 0x2a, 0x00, 0x07, 0x03, 0x0a]
        );
        let push = Push::GroupCount {
            group: 42,
            version: 8,
            count: 4,
        };
        assert_eq!(
            encode_frame(&push).unwrap(),
            [0, 0, 0, 4, 0x02, 0x2a, 0x08, 0x04]
        );
        let error = crate::WireError::new(ErrorCode::NotMember, "");
        assert_eq!(postcard::to_stdvec(&error).unwrap(), [29, 0]);
        for code in 29..=38u16 {
            assert_eq!(ErrorCode::from(code).code(), code);
            assert!(!matches!(ErrorCode::from(code), ErrorCode::Other(_)));
        }
    }

    /// The other group rows of docs/protocol.md ("Groups", byte for byte):
    /// every group request, answer and push, payloads only.
    #[test]
    fn every_group_frame_matches_the_protocol_document() {
        use crate::{
            Answer, GroupCursor, GroupEntry, GroupPage, GroupRole, GroupSnapshot, Presence, Push,
            ServerFrame, Status,
        };
        fn hex(s: &str) -> Vec<u8> {
            s.split(' ')
                .map(|b| u8::from_str_radix(b, 16).unwrap())
                .collect()
        }
        fn request(id: u64, request: Request) -> Vec<u8> {
            postcard::to_stdvec(&RequestFrame { id, request }).unwrap()
        }
        fn reply(id: u64, answer: Answer) -> Vec<u8> {
            postcard::to_stdvec(&ServerFrame::Reply {
                id,
                result: Ok(answer),
            })
            .unwrap()
        }
        let push = |p: Push| postcard::to_stdvec(&p).unwrap();
        assert_eq!(
            request(6, Request::RemoveGroup { group: 42 }),
            hex("06 0c 2a")
        );
        assert_eq!(
            request(7, Request::GroupUnsubscribe { group: 42 }),
            hex("07 0e 2a")
        );
        let first_page = Request::GroupPage {
            group: 300,
            after: None,
            limit: 200,
        };
        assert_eq!(request(8, first_page), hex("08 0f ac 02 00 c8 01"));
        let next_page = Request::GroupPage {
            group: 42,
            after: Some(GroupCursor {
                online: true,
                after: 300,
            }),
            limit: 50,
        };
        assert_eq!(request(9, next_page), hex("09 0f 2a 01 01 ac 02 32"));
        assert_eq!(
            reply(5, Answer::GroupSet { version: 1 }),
            hex("01 05 00 06 01")
        );
        let admin = GroupSnapshot {
            group: 42,
            role: GroupRole::Admin,
            version: 7,
            count: 3,
            members: 10,
        };
        assert_eq!(
            reply(4, Answer::GroupSubscribed(admin)),
            hex("01 04 00 07 2a 01 07 03 0a")
        );
        let page = GroupPage {
            group: 42,
            version: 9,
            count: 1,
            entries: vec![GroupEntry {
                user: "ann".into(),
                presence: Presence {
                    version: 3,
                    online: true,
                    status: Status::Available,
                    message: None,
                    kinds: 4,
                    last_seen: None,
                    invisible: false,
                },
            }],
            next: Some(GroupCursor {
                online: true,
                after: 3,
            }),
        };
        assert_eq!(
            reply(9, Answer::GroupPage(page)),
            hex("01 09 00 08 2a 09 01 01 03 61 6e 6e 03 01 00 00 04 00 00 01 01 03")
        );
        let member = Push::GroupMember {
            group: 42,
            version: 9,
            member: "bob".into(),
            online: false,
            count: 3,
        };
        assert_eq!(push(member), hex("03 2a 09 03 62 6f 62 00 03"));
        assert_eq!(
            push(Push::GroupEnded { group: u64::MAX }),
            hex("04 ff ff ff ff ff ff ff ff ff 01")
        );
        let change = Request::ChangeGroup {
            group: 42,
            add: vec!["cy".into()],
            remove: vec!["bob".into()],
            add_admins: Vec::new(),
            remove_admins: vec!["ann".into()],
            expect_version: Some(3),
        };
        assert_eq!(
            request(10, change),
            hex("0a 13 2a 01 02 63 79 01 03 62 6f 62 00 01 03 61 6e 6e 01 03")
        );
        let promote = Request::ChangeGroup {
            group: 42,
            add: Vec::new(),
            remove: Vec::new(),
            add_admins: vec!["dee".into()],
            remove_admins: Vec::new(),
            expect_version: None,
        };
        assert_eq!(
            request(11, promote),
            hex("0b 13 2a 00 00 01 03 64 65 65 00 00")
        );
        let error = crate::WireError::new(ErrorCode::VersionMismatch, "");
        assert_eq!(postcard::to_stdvec(&error).unwrap(), hex("26 00"));
    }

    /// The watched-page examples of docs/protocol.md, byte for byte.
    #[test]
    fn watched_page_bytes_match_the_protocol_document() {
        use crate::{GroupCursor, GroupEntry, Presence, Push};
        let req = RequestFrame {
            id: 6,
            request: Request::GroupWatchPage {
                group: 42,
                after: None,
                limit: 50,
            },
        };
        assert_eq!(
            encode_frame(&req).unwrap(),
            [0, 0, 0, 5, 0x06, 0x10, 0x2a, 0x00, 0x32]
        );
        let cursor = Some(GroupCursor {
            online: false,
            after: 7,
        });
        let req = RequestFrame {
            id: 7,
            request: Request::GroupRenewWatch {
                group: 42,
                after: cursor,
            },
        };
        assert_eq!(
            encode_frame(&req).unwrap(),
            [0, 0, 0, 6, 0x07, 0x11, 0x2a, 0x01, 0x00, 0x07]
        );
        let req = RequestFrame {
            id: 8,
            request: Request::GroupUnwatchPage {
                group: 42,
                after: cursor,
            },
        };
        assert_eq!(
            encode_frame(&req).unwrap(),
            [0, 0, 0, 6, 0x08, 0x12, 0x2a, 0x01, 0x00, 0x07]
        );
        let push = Push::GroupPageDelta {
            group: 42,
            entries: vec![GroupEntry {
                user: "bob".into(),
                presence: Presence {
                    version: 9,
                    online: true,
                    kinds: 1,
                    ..Presence::default()
                },
            }],
        };
        assert_eq!(
            encode_frame(&push).unwrap(),
            [
                0, 0, 0, 14, 0x05, 0x2a, 0x01, 0x03, b'b', b'o', b'b', 0x09, 0x01, 0x00, 0x00,
                0x01, 0x00, 0x00
            ]
        );
        let error = crate::WireError::new(ErrorCode::PageRateLimited, "");
        assert_eq!(postcard::to_stdvec(&error).unwrap(), [37, 0]);
        let error = crate::WireError::new(ErrorCode::TooManyWatchedPages, "");
        assert_eq!(postcard::to_stdvec(&error).unwrap(), [36, 0]);
    }

    /// 200,000 pipelined frames in one buffer: each is split off the front
    /// (a draining reader moved the rest every time: 200,000 × 1.2 MB on
    /// average, seconds instead of milliseconds).
    #[test]
    fn many_buffered_frames_take_linear_time() {
        let frame = encode_frame(&RequestFrame {
            id: 1,
            request: Request::Ping,
        })
        .unwrap();
        let n = 200_000;
        let mut reader = FrameReader::new(1024);
        reader.push(&frame.repeat(n));
        let started = std::time::Instant::now();
        let mut count = 0;
        while let Some(payload) = reader.next_frame().unwrap() {
            assert_eq!(payload, frame[4..]);
            count += 1;
        }
        assert_eq!(count, n);
        assert!(reader.finish().is_ok());
        // Linear: a few milliseconds; quadratic: tens of seconds.
        assert!(started.elapsed() < std::time::Duration::from_secs(2));
    }

    #[test]
    fn oversized_and_garbage_are_typed_errors() {
        let mut reader = FrameReader::new(16);
        reader.push(&1000u32.to_be_bytes());
        assert_eq!(
            reader.next_frame(),
            Err(FrameError::TooLarge { len: 1000, max: 16 })
        );
        let e = decode::<RequestFrame>(&[0xff, 0xff, 0xff]).unwrap_err();
        assert_eq!(e.code, ErrorCode::BadFrame);
        let e = decode::<Hello>(&[1, 0, 0, 9]).unwrap_err();
        assert_eq!(e.code, ErrorCode::BadFrame);
    }
}

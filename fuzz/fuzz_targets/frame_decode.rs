//! Arbitrary bytes as a control or push stream: cutting them into frames and
//! decoding every frame type never panics, and whatever decodes re-encodes to
//! a frame that decodes to the same value.
#![no_main]

use greendot_proto::codec::{decode, encode_frame, peek_version, FrameReader};
use greendot_proto::{Hello, Push, RequestFrame, ServerFrame};
use libfuzzer_sys::fuzz_target;
use serde::de::DeserializeOwned;
use serde::Serialize;
use std::fmt::Debug;

fn round_trip<T: Serialize + DeserializeOwned + PartialEq + Debug>(payload: &[u8]) {
    let Ok(value) = decode::<T>(payload) else {
        return;
    };
    let frame = encode_frame(&value).expect("a decoded value encodes");
    let mut reader = FrameReader::new(usize::MAX);
    reader.push(&frame);
    let again = reader
        .next_frame()
        .expect("an encoded frame is well formed")
        .expect("an encoded frame is complete");
    assert_eq!(
        decode::<T>(&again).ok(),
        Some(value),
        "round trip changed the value"
    );
}

fuzz_target!(|data: &[u8]| {
    // The first byte splits the input into two pushes, as a stream arrives in
    // pieces; the cap is small so that oversized lengths are exercised too.
    let (split, bytes) = match data.split_first() {
        Some((s, rest)) => (usize::from(*s), rest),
        None => return,
    };
    let mut reader = FrameReader::new(4096);
    let (a, b) = bytes.split_at(split.min(bytes.len()));
    reader.push(a);
    let mut frames = Vec::new();
    let mut pushed_rest = false;
    loop {
        match reader.next_frame() {
            Ok(Some(frame)) => frames.push(frame),
            Ok(None) if !pushed_rest => {
                reader.push(b);
                pushed_rest = true;
            }
            Ok(None) => {
                let _ = reader.finish();
                break;
            }
            Err(_) => break,
        }
    }
    // Also treat the whole input as one payload.
    frames.push(bytes.to_vec());
    for payload in &frames {
        let _ = peek_version(payload);
        round_trip::<Hello>(payload);
        round_trip::<RequestFrame>(payload);
        round_trip::<ServerFrame>(payload);
        round_trip::<Push>(payload);
    }
});

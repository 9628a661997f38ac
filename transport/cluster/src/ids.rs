//! Names the cluster puts into NATS: node ids, shard ids, and the KV keys of
//! user ids (which may hold any character; KV keys may not).

use std::fmt;

/// Longest node id: it appears in KV keys, values and subjects.
pub const MAX_NODE_ID_LEN: usize = 64;
/// Longest user id accepted for a KV key (before escaping).
pub const MAX_USER_ID_LEN: usize = 256;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IdError {
    #[error("node id must be 1..={MAX_NODE_ID_LEN} characters of [A-Za-z0-9_-], got {0:?}")]
    BadNodeId(String),
    #[error("user id must be 1..={MAX_USER_ID_LEN} bytes, got {0} bytes")]
    BadUserIdLength(usize),
}

/// A node's id: `[A-Za-z0-9_-]{1,64}`, so it is a valid KV key token and
/// subject token as is, and never contains the `@` the claim values use.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct NodeId(String);

impl NodeId {
    pub fn new(id: impl Into<String>) -> Result<NodeId, IdError> {
        let id = id.into();
        let ok = !id.is_empty()
            && id.len() <= MAX_NODE_ID_LEN
            && id
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
        if ok {
            Ok(NodeId(id))
        } else {
            Err(IdError::BadNodeId(id))
        }
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for NodeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// A shard: `0..shard_count`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ShardId(pub u32);

impl fmt::Display for ShardId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// The KV key token of a user id: `[A-Za-z0-9_-]` kept, every other byte as
/// `=XX` (hex). Injective (`=` itself is escaped), and within the KV key
/// alphabet `[-/_=.A-Za-z0-9]`.
pub fn user_key(user: &str) -> Result<String, IdError> {
    if user.is_empty() || user.len() > MAX_USER_ID_LEN {
        return Err(IdError::BadUserIdLength(user.len()));
    }
    let mut key = String::with_capacity(user.len());
    for b in user.bytes() {
        if b.is_ascii_alphanumeric() || b == b'_' || b == b'-' {
            key.push(b as char);
        } else {
            key.push('=');
            key.push_str(&format!("{b:02X}"));
        }
    }
    Ok(key)
}

/// The KV key of a user's device: both escaped as [`user_key`], joined by
/// a dot (which no escaped id holds, so the pair is unambiguous).
pub fn device_key(user: &str, device: &str) -> Result<String, IdError> {
    Ok(format!("{}.{}", user_key(user)?, user_key(device)?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_ids_are_checked() {
        assert!(NodeId::new("node-1_a").is_ok());
        for bad in ["", "a.b", "a b", "a@b", "a>", "ü", &"x".repeat(65)] {
            assert!(NodeId::new(bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn user_keys_escape_everything_outside_the_alphabet() {
        assert_eq!(user_key("alice").unwrap(), "alice");
        assert_eq!(user_key("a.b").unwrap(), "a=2Eb");
        assert_eq!(
            user_key("a=2Eb").unwrap(),
            "a=3D2Eb",
            "escaping stays injective"
        );
        assert_eq!(user_key("ü").unwrap(), "=C3=BC");
        assert_eq!(user_key("*>").unwrap(), "=2A=3E");
        assert!(user_key("").is_err());
        assert!(user_key(&"x".repeat(257)).is_err());
    }

    #[test]
    fn device_keys_keep_user_and_device_apart() {
        assert_eq!(device_key("alice", "phone").unwrap(), "alice.phone");
        assert_eq!(device_key("a.b", "c").unwrap(), "a=2Eb.c");
        assert_ne!(device_key("a.b", "c"), device_key("a", "b.c"));
        assert!(device_key("alice", "").is_err());
    }
}

//! A deterministic `UserId -> slot` index.
//!
//! std's `RandomState` would make the core non-deterministic, so the hasher is
//! a fixed mixer. The index is derived from `Core::users` and
//! `Core::free_users` (every held user record carries its id), so it takes no
//! part in the core's `Eq`/`Hash`: two cores with equal user records have
//! equal indexes.

use crate::types::UserId;
use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hash, Hasher};

/// murmur3's 64-bit finalizer: ids are small dense integers, this spreads them.
#[derive(Default)]
pub(crate) struct IdHasher(u64);

impl Hasher for IdHasher {
    fn write(&mut self, bytes: &[u8]) {
        for &byte in bytes {
            self.write_u64(u64::from(byte));
        }
    }

    fn write_u64(&mut self, n: u64) {
        let mut h = self.0 ^ n;
        h ^= h >> 33;
        h = h.wrapping_mul(0xff51_afd7_ed55_8ccd);
        h ^= h >> 33;
        h = h.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
        h ^= h >> 33;
        self.0 = h;
    }

    fn finish(&self) -> u64 {
        self.0
    }
}

#[derive(Clone, Debug, Default)]
pub(crate) struct UserIndex(HashMap<UserId, u32, BuildHasherDefault<IdHasher>>);

impl UserIndex {
    pub(crate) fn get(&self, user: UserId) -> Option<u32> {
        self.0.get(&user).copied()
    }

    pub(crate) fn insert(&mut self, user: UserId, slot: u32) {
        self.0.insert(user, slot);
    }

    pub(crate) fn remove(&mut self, user: UserId) {
        self.0.remove(&user);
    }

    #[cfg(feature = "check")]
    pub(crate) fn len(&self) -> usize {
        self.0.len()
    }
}

impl PartialEq for UserIndex {
    fn eq(&self, _: &UserIndex) -> bool {
        true
    }
}

impl Eq for UserIndex {}

impl Hash for UserIndex {
    fn hash<H: Hasher>(&self, _: &mut H) {}
}

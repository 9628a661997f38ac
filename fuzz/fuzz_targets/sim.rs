//! Drives the deterministic simulator (greendot-sim) from fuzz input: the
//! first 8 bytes are the seed, the next picks the number of users, and the
//! rest scripts the run's first random choices (devices, links, which
//! client acts how, which fault strikes when), so coverage guides them; the
//! seed's generator takes over when the input is used up. Any broken
//! invariant (or panic) is a crash, with the simulator's log.
#![no_main]

use greendot_sim::{run, Options};
use libfuzzer_sys::fuzz_target;
use std::sync::Arc;

/// Steps per input: about a simulated minute or two, a few tens of ms.
const STEPS: u64 = 1_500;

fuzz_target!(|data: &[u8]| {
    let Some((seed, rest)) = data.split_first_chunk::<8>() else {
        return;
    };
    let Some((&users, script)) = rest.split_first() else {
        return;
    };
    let mut options = Options::new(u64::from_le_bytes(*seed), STEPS);
    options.users = 2 + usize::from(users % 4);
    options.script = Some(Arc::from(script));
    if let Err(failure) = run(options) {
        panic!("{failure}");
    }
});

//! Drives the multi-node simulation (greendot-sim's `cluster`) from fuzz
//! input: the first 8 bytes are the seed, the next picks the number of
//! nodes (1 to 5), and the rest scripts the run's first random choices
//! (which device acts how, which fault strikes which node when, message
//! delays and losses), so coverage guides them; the seed's generator takes
//! over when the input is used up. Any broken check (C1–C4, versions, a
//! livelock) or panic is a crash, with the simulation's log.
#![no_main]

use greendot_sim::cluster::{run, Options};
use libfuzzer_sys::fuzz_target;
use std::sync::Arc;

/// Steps per input: a simulated minute or two, a few ms.
const STEPS: u64 = 3_000;

fuzz_target!(|data: &[u8]| {
    let Some((seed, rest)) = data.split_first_chunk::<8>() else {
        return;
    };
    let Some((&nodes, script)) = rest.split_first() else {
        return;
    };
    let mut options = Options::new(u64::from_le_bytes(*seed), STEPS);
    options.nodes = 1 + usize::from(nodes % 5);
    options.script = Some(Arc::from(script));
    if let Err(failure) = run(options) {
        panic!("{failure}");
    }
});

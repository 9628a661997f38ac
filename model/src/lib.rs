//! # greendot-model
//!
//! stateright models that drive the real `greendot-core` (never a
//! re-implementation) and check the invariants I1–I12 of DESIGN.md:
//!
//! - [`core_model`] (Model 1): the core under every input, stale ones
//!   included, with time advancing in small steps across every threshold;
//! - [`protocol`] (Model 2): a server actor running the core and client actors
//!   using the core's `View`, over a network that loses, reorders and
//!   duplicates messages, with reconnects that resume.
//! - [`group_model`] (Model 1, groups): the core with one group, G1–G4;
//! - [`sum_model`] (Model 4): a group's count across a cluster, the real
//!   `GroupSum` at the aggregator under lossy delivery and failovers, G1–G3;
//! - [`cluster`] (Model 3): nodes that are edges and owners, a KV with
//!   leases and compare-and-set, a lossy network, crashes, restarts and
//!   cut-offs, with the real core in every owner and the real `Fanout` and
//!   `View` at the watcher's edge: C1–C5 (C6 is a differential property
//!   test in `core/tests/cluster.rs`).
//!
//! See VERIFIED.md for what is checked, the bounds and the state counts.

pub mod cluster;
pub mod core_model;
pub mod group_model;
pub mod protocol;
pub mod sum_model;

pub use core_model::{Bounds, CoreModel, CoreState};
pub use protocol::{protocol_model, protocol_model_with, ProtocolBounds, ProtocolModel};

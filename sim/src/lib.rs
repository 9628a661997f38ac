//! # greendot-sim
//!
//! A deterministic simulation of the whole greendot system, in the manner of
//! FoundationDB's and TigerBeetle's simulators: the real sans-IO server
//! ([`greendot_server::ServerState`]) and many simulated devices,
//! each a real quinn-proto client connection speaking the real wire
//! protocol and keeping the core's real `View`, over a simulated network, on
//! a simulated store and host, all on virtual time and all from one seed.
//!
//! - **Network** ([`net`]): per-link loss, delay with jitter (so reordering),
//!   duplication, partitions, a client that stops reading its socket, a
//!   client that changes address (migration).
//! - **Host**: the store's writes failing or stalling ([`store`]: the
//!   simulator plays the store thread), the process restarting (drained, or
//!   crashed and rebuilt from what the store durably holds), the wall clock
//!   jumping.
//! - **Clients** ([`client`]): connect, subscribe in either tier, unsubscribe,
//!   set a status, go invisible and back, query, ping, log out, get killed
//!   (vanish without a word) and resume, close and resume, stop reading
//!   their streams, move.
//!
//! After every step ([`world`]) it checks, as a watcher sees them: the core's
//! structural invariants (I1–I11, `check_invariants`); every snapshot and
//! push equals what the core published under that version (I7), never shows
//! another user invisible, nor online after their invisibility was saved
//! (I5, across restarts), nor a user outside the token's watch (I11); per push
//! stream, versions strictly increase (I7); a healthy watcher's `View`
//! converges on what the core publishes (I8); no user stays online longer than
//! idle timeout + twice the longest grace + debounce + batch + slack after
//! every device vanished or logged out (I2); no user is published offline
//! while one of its devices is connected on a healthy link and visible (no
//! flap); a logout's connection is closed (I4); the server never closes a
//! healthy connection without cause (a migration, a lease renewed by
//! traffic); every request on a healthy connection is answered; no queue
//! grows without bound (datagrams in flight, store writes, client buffers,
//! the server's queued push bytes); no panic.
//!
//! A failing run prints one line that replays it ([`Options::replay_line`]).

pub mod client;
pub mod cluster;
pub mod net;
pub mod rng;
pub mod store;
pub mod world;

pub use greendot_server::ServerMutant;
pub use world::{run, Failure, Faults, Options, Report};

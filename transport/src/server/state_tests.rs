//! [`ServerState`] driven directly, on virtual time, with synthetic datagrams.

use super::*;

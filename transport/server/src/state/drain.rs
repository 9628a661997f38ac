//! A stop (a drain): every connection closed, a linger for them to go,
//! then the final store write and the end.

use super::tickets::Ticket;
use super::{ServerOutput, ServerState, StoreRequest};
use crate::store::Batch;
use crate::with_retry_hint;
use greendot_core::Millis;
use greendot_proto::CloseCode;
use std::time::{Duration, Instant};

/// How long a stop waits for the connections to go.
const STOP_LINGER: Duration = Duration::from_secs(2);

/// How long a stop waits for the final store write.
const STOP_SAVE_TIMEOUT: Duration = Duration::from_secs(10);

/// How long a device disconnected by a saving drain lingers in the old
/// process: beyond any drain (the process ends first).
pub(super) const DRAIN_HOLD: Millis = Millis(3_600_000);

pub(super) enum Stopping {
    /// Connections are closing, until `until`.
    Closing { save: bool, until: Instant },
    /// The final store write is in flight (its ticket answers it).
    Saving,
    /// [`ServerOutput::Stopped`] was emitted.
    Done,
}

impl ServerState {
    pub(super) fn stop(&mut self, now: Instant, code: CloseCode, text: Vec<u8>, save: bool) {
        if self.stopping.is_some() {
            return;
        }
        self.endpoint.set_server_config(None);
        // Clients reconnecting to the next process are spread over the time
        // it needs to readmit them all.
        let text = match code {
            CloseCode::Draining => with_retry_hint(&text, self.retry_ms()),
            _ => text,
        };
        // A device whose grace ran out during the drain would be saved as
        // gone and shown offline, though its client comes back to the next
        // process: the saved ones get their grace there. (With a cluster
        // the owners hold the devices, each with its grace.)
        self.drain_holds = save && self.stored && self.cluster.is_none();
        for ch in 0..self.conns.len() {
            if self.conns[ch].is_some() {
                self.close(ch, now, code, &text);
            }
        }
        self.stopping = Some(Stopping::Closing {
            save,
            until: now + STOP_LINGER,
        });
    }

    /// Once every connection is gone (or the linger is over): the final
    /// store write, then the end.
    pub(super) fn check_stop(&mut self, now: Instant) {
        let Some(Stopping::Closing { save, until }) = self.stopping else {
            return;
        };
        if self.conns.iter().any(Option::is_some) && now < until {
            return;
        }
        if save && self.stored {
            let batch = Batch {
                drained: Some(self.hub.live_devices()),
                ..self.changed_records()
            };
            let ticket = self.ticket(Ticket::Stop {
                deadline: now + STOP_SAVE_TIMEOUT,
            });
            self.outputs
                .push_back(ServerOutput::Store(StoreRequest::Durable {
                    ticket,
                    batch,
                    timeout: STOP_SAVE_TIMEOUT,
                }));
            self.stopping = Some(Stopping::Saving);
        } else {
            self.stopped();
        }
    }

    pub(super) fn stopped(&mut self) {
        self.stopping = Some(Stopping::Done);
        self.outputs.push_back(ServerOutput::Stopped);
    }
}

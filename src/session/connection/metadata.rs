//! The connection's side of metadata commands: handing them to the runtime, taking their
//! results back, and replaying what a parked channel kept (see [`crate::session::meta`]).

use std::collections::VecDeque;

use super::{Connection, State};
use crate::meta::{Command, MetaError};
use crate::session::meta::{MetaResult, MetaToken, ParkedFrame, Then};
use crate::time::Instant;

impl Connection {
    /// The next metadata command to commit, with the token its result must carry back to
    /// [`Connection::handle_meta_result`]. Commit them in the order they come.
    pub fn poll_meta(&mut self) -> Option<(MetaToken, Command)> {
        self.meta.poll()
    }

    /// The result of a command from [`Connection::poll_meta`]. The channel that waits for it
    /// finishes its method and replays the frames it kept. A result nobody waits for any more
    /// (channel or connection gone, or delivered twice) is dropped.
    pub fn handle_meta_result(&mut self, token: MetaToken, result: MetaResult, now: Instant) {
        let Some(ch) = token.channel() else {
            match result {
                Ok(_) | Err(MetaError::NotFound { .. }) => {}
                Err(e) => {
                    tracing::warn!(conn = self.id, error = %e, "teardown metadata command refused")
                }
            }
            return;
        };
        if self.state != State::Open {
            return;
        }
        let Some((then, frames)) = self.meta.take(token) else {
            tracing::debug!(
                conn = self.id,
                channel = ch,
                "result for no waiting channel, dropped"
            );
            return;
        };
        let (class_id, method_id) = then.method_ids();
        if let Some(mut c) = self.channels.remove(&ch) {
            let r = if c.is_closing() {
                Ok(())
            } else {
                c.resume(self, then, result, now)
            };
            self.channels.insert(ch, c);
            if let Err(e) = r {
                self.fail(ch, e.at(class_id, method_id), now);
            }
        }
        self.replay(ch, frames, now);
        if self.close_requested && !self.meta.any_parked() && self.state == State::Open {
            self.finish_peer_close(now);
        }
        self.flush_confirms();
    }

    /// Emits `command` for channel `ch`, which stays parked until its result.
    pub(crate) fn park(&mut self, ch: u16, command: Command, then: Then) {
        self.meta.park(ch, command, then);
    }

    /// Emits `command` with nobody waiting for its result (teardown).
    pub(crate) fn emit_detached(&mut self, command: Command) {
        self.meta.emit_detached(command);
    }

    /// Processes the frames a channel kept while parked, until it parks again.
    fn replay(&mut self, ch: u16, mut frames: VecDeque<ParkedFrame>, now: Instant) {
        while let Some(f) = frames.pop_front() {
            if self.state != State::Open {
                return;
            }
            self.handle_frame(f.frame(ch), now);
            if self.meta.is_parked(ch) {
                self.meta.restore(ch, frames);
                return;
            }
        }
    }
}

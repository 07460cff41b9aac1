//! The connection's side of metadata commands: handing them to the runtime, taking their
//! results back, and replaying what a parked channel kept (see [`crate::session::meta`]).

use std::collections::VecDeque;

use super::{Connection, State};
use crate::broker::remote::{QueueCall, QueueReply};
use crate::broker::{ChannelKey, Settle};
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
        self.resume_parked(ch, token, now, |c, conn, then| {
            c.resume(conn, then, result, now)
        });
    }

    /// The next question for the node of a queue of another node, with the token its answer
    /// must carry back to [`Connection::handle_queue_reply`]. Ask them in the order they come.
    pub fn poll_queue_call(&mut self) -> Option<(MetaToken, QueueCall)> {
        self.meta.poll_call()
    }

    /// The answer to a call from [`Connection::poll_queue_call`]: the waiting channel
    /// finishes its method (get-ok, declare-ok, purge-ok...) and replays what it kept.
    pub fn handle_queue_reply(&mut self, token: MetaToken, reply: QueueReply, now: Instant) {
        let Some(ch) = token.channel() else {
            return;
        };
        // A message taken for a channel that is gone goes back to its queue.
        let returned = match &reply {
            QueueReply::Got(Some(g)) => g.source.clone().map(|q| (q, g.seq)),
            _ => None,
        };
        let taken = self.resume_parked(ch, token, now, |c, conn, then| {
            c.resume_call(conn, then, reply, now)
        });
        if let (false, Some((queue, seq))) = (taken, returned) {
            let key = ChannelKey {
                conn: self.id,
                channel: ch,
            };
            queue
                .link
                .settle(&queue, key, vec![seq], Settle::Nack { requeue: true });
        }
    }

    /// Unparks channel `ch` if it waits for `token`: runs `finish` on it (the reply, or the
    /// error that closes it), then replays the frames it kept. False when nobody waited.
    fn resume_parked(
        &mut self,
        ch: u16,
        token: MetaToken,
        now: Instant,
        finish: impl FnOnce(
            &mut crate::session::channel::Channel,
            &mut Connection,
            Then,
        ) -> Result<(), crate::amqp::AmqpError>,
    ) -> bool {
        if self.state != State::Open {
            return false;
        }
        let Some((then, frames)) = self.meta.take(token) else {
            tracing::debug!(
                conn = self.id,
                channel = ch,
                "result for no waiting channel, dropped"
            );
            return false;
        };
        let (class_id, method_id) = then.method_ids();
        let mut taken = false;
        if let Some(mut c) = self.channels.remove(&ch) {
            let r = if c.is_closing() {
                Ok(())
            } else {
                taken = true;
                finish(&mut c, self, then)
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
        self.flush_confirms(now);
        taken
    }

    /// Emits `call` for channel `ch`, which stays parked until its answer.
    pub(crate) fn park_call(&mut self, ch: u16, call: QueueCall, then: Then) {
        self.meta.park_call(ch, call, then);
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

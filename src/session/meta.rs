//! Metadata commands as requests: how a channel waits for one without blocking the others.
//!
//! Declaring, deleting and binding exchanges and queues change the node's metadata. In a
//! cluster such a change is committed through Raft before its reply (declare-ok, bind-ok, ...)
//! may be sent, which takes milliseconds and happens in the runtime. The session therefore
//! never applies these commands itself:
//!
//! 1. The channel checks permissions and arguments as before (synchronously), then emits the
//!    [`Command`] with a [`Then`]: what to do with the result (look the queue up, check its
//!    exclusive owner, read its counts, send declare-ok unless nowait, ...). The channel is now
//!    *parked*.
//! 2. The runtime takes the command from [`Connection::poll_meta`], commits it (a single node
//!    applies it to its broker at once) and hands the result back with
//!    [`Connection::handle_meta_result`], matched by its [`MetaToken`].
//! 3. The channel finishes the method: the reply, or the same channel or connection error (and
//!    reply code) the synchronous code raised. It is unparked, and the frames it received
//!    meanwhile are replayed.
//!
//! # Why the whole channel is parked
//! A channel is a serial stream of commands: a `basic.publish` after a nowait `queue.declare`
//! must route to the new queue, a `queue.bind` after it must find it, a `channel.close` must
//! come after the declare-ok. So while a channel waits, every later frame for it (methods,
//! content headers and bodies, `channel.close`) is kept raw, in arrival order, and replayed
//! through the normal frame path once the result arrives; errors in those frames surface at
//! the same point of the stream as before. Other channels and channel 0 (heartbeats) carry on:
//! RabbitMQ runs each channel as its own process, so it promises no order across channels
//! either. A parked channel's confirms are held too, so they keep their order relative to its
//! replies.
//!
//! # Bounds and backpressure
//! Parked frames cost their payload plus [`FRAME_OVERHEAD_BYTES`], against
//! [`BACKLOG_BYTES_MAX`] for the whole connection. A frame that does not fit is left unread:
//! `handle_bytes` returns before it and [`Connection::wants_read`] is false, exactly as when the
//! memory alarm blocks a publisher, so the bytes wait in the runtime's read buffer and the
//! kernel, and TCP flow control throttles the client. Reading resumes when a result unparks a
//! channel. This cannot deadlock: results never depend on reading. While input is held,
//! heartbeats from the client are not read either; that lasts one commit, far below the
//! heartbeat timeout.
//!
//! # Closing
//! A client's connection.close that arrives while channels are parked is recognised at once
//! (later input is ignored, the close deadline is armed) but answered once the parked channels
//! have finished the frames that came before it, as RabbitMQ waits for its channel processes;
//! on a single node that is the same turn of the runtime's loop. If results are later than
//! the deadline, close-ok goes out without them. Every other close (server error, shutdown,
//! socket loss, missed heartbeats) drops parked channels at once.
//!
//! # Commands nobody waits for
//! Teardown emits commands without a waiter ("detached"): `DeleteExclusiveQueues` when the
//! connection ends, `DeleteQueue` for an auto-delete queue whose last consumer went with a
//! closing channel. Their results are only logged. A result whose token matches no parked
//! channel (its channel or connection is gone, or it came twice) is dropped.
//!
//! [`Connection::poll_meta`]: super::Connection::poll_meta
//! [`Connection::handle_meta_result`]: super::Connection::handle_meta_result
//! [`Connection::wants_read`]: super::Connection::wants_read

use std::collections::{BTreeMap, VecDeque};

use amq_protocol::types::ShortString;

use std::sync::Arc;

use crate::amqp::frame::{Frame, FrameKind};
use crate::broker::remote::{QueueCall, RemoteQueue};
use crate::meta::state::Applied;
use crate::meta::{Command, MetaError};

/// Bytes of parked frames one connection may hold before it stops reading its socket.
pub const BACKLOG_BYTES_MAX: usize = 1 << 20;

/// What a parked frame costs beyond its payload (bookkeeping), so that a flood of empty
/// frames is bounded too.
pub const FRAME_OVERHEAD_BYTES: usize = 64;

/// The result of committing a metadata command: what [`crate::broker::Broker::apply`] returns.
pub type MetaResult = Result<Applied, MetaError>;

/// Identifies one metadata command a connection emitted; its result must carry it back.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct MetaToken {
    /// Emission order within the connection.
    seq: u64,
    /// The parked channel; 0 for a detached command.
    channel: u16,
}

impl MetaToken {
    /// The channel waiting for the result, or `None` when nobody waits (teardown).
    pub fn channel(&self) -> Option<u16> {
        (self.channel != 0).then_some(self.channel)
    }
}

/// What a parked channel does with its command's result. Each variant finishes one method.
#[derive(Debug)]
pub(crate) enum Then {
    /// exchange.declare: declare-ok.
    ExchangeDeclare { nowait: bool },
    /// exchange.delete: delete-ok; a missing exchange is no error (RabbitMQ 3.10).
    ExchangeDelete { nowait: bool },
    /// exchange.bind: bind-ok.
    ExchangeBind { nowait: bool },
    /// exchange.unbind: unbind-ok.
    ExchangeUnbind { nowait: bool },
    /// queue.declare: exclusivity check, touch, counts, `last_queue`, declare-ok.
    QueueDeclare { name: String, nowait: bool },
    /// queue.bind: bind-ok.
    QueueBind { nowait: bool },
    /// queue.unbind: unbind-ok (the method has no nowait).
    QueueUnbind,
    /// queue.delete: delete-ok with the count read when the checks passed.
    QueueDelete { message_count: u32, nowait: bool },
    /// basic.cancel that auto-deletes the queue: cancel-ok whatever the result.
    BasicCancel {
        consumer_tag: ShortString,
        nowait: bool,
    },
    /// basic.get of a queue of another node: get-ok or get-empty ([`QueueCall::Get`]).
    BasicGet {
        queue: Arc<RemoteQueue>,
        no_ack: bool,
    },
    /// queue.declare (passive, or after its command) of a queue of another node: its counts
    /// in declare-ok ([`QueueCall::Counts`]).
    QueueDeclareCounts { name: String, nowait: bool },
    /// queue.purge of a queue of another node ([`QueueCall::Purge`]).
    QueuePurge { nowait: bool },
    /// queue.delete with if-unused / if-empty of a queue of another node: its counts decide
    /// whether the delete command is emitted ([`QueueCall::Counts`]).
    QueueDeleteChecked {
        name: String,
        if_unused: bool,
        if_empty: bool,
        nowait: bool,
    },
}

impl Then {
    /// The method being finished, for the class and method ids of an error.
    pub(crate) fn method_ids(&self) -> (u16, u16) {
        match self {
            Then::ExchangeDeclare { .. } => (40, 10),
            Then::ExchangeDelete { .. } => (40, 20),
            Then::ExchangeBind { .. } => (40, 30),
            Then::ExchangeUnbind { .. } => (40, 40),
            Then::QueueDeclare { .. } => (50, 10),
            Then::QueueBind { .. } => (50, 20),
            Then::QueueUnbind => (50, 50),
            Then::QueueDelete { .. } => (50, 40),
            Then::BasicCancel { .. } => (60, 30),
            Then::BasicGet { .. } => (60, 70),
            Then::QueueDeclareCounts { .. } => (50, 10),
            Then::QueuePurge { .. } => (50, 30),
            Then::QueueDeleteChecked { .. } => (50, 40),
        }
    }
}

/// A frame received for a parked channel, kept until the channel resumes.
#[derive(Debug)]
pub(crate) struct ParkedFrame {
    kind: FrameKind,
    payload: Vec<u8>,
}

impl ParkedFrame {
    /// The frame again, on `channel`.
    pub(crate) fn frame(&self, channel: u16) -> Frame<'_> {
        Frame {
            kind: self.kind,
            channel,
            payload: &self.payload,
        }
    }

    fn cost(&self) -> usize {
        self.payload.len() + FRAME_OVERHEAD_BYTES
    }
}

/// A channel waiting for a command's result.
#[derive(Debug)]
struct Parked {
    token: MetaToken,
    then: Then,
    backlog: VecDeque<ParkedFrame>,
}

/// A connection's outgoing metadata commands and its parked channels.
///
/// Bounds: at most one parked entry per open channel (a parked channel processes nothing that
/// could emit a second command); `outgoing` holds those plus teardown's detached commands
/// until the runtime polls them; parked frames are bounded by [`BACKLOG_BYTES_MAX`].
#[derive(Debug, Default)]
pub(crate) struct MetaPort {
    next_seq: u64,
    outgoing: VecDeque<(MetaToken, Command)>,
    /// Questions to other nodes' queues, in emission order.
    calls: VecDeque<(MetaToken, QueueCall)>,
    parked: BTreeMap<u16, Parked>,
    backlog_bytes: usize,
    /// A frame did not fit: input stops until a channel resumes.
    backlog_full: bool,
}

impl MetaPort {
    fn token(&mut self, channel: u16) -> MetaToken {
        self.next_seq += 1;
        MetaToken {
            seq: self.next_seq,
            channel,
        }
    }

    /// Emits `command` for channel `channel` (not 0), which is parked until its result.
    pub(crate) fn park(&mut self, channel: u16, command: Command, then: Then) {
        let token = self.park_channel(channel, then);
        self.outgoing.push_back((token, command));
    }

    /// Emits `call` for channel `channel`, which is parked until its answer.
    pub(crate) fn park_call(&mut self, channel: u16, call: QueueCall, then: Then) {
        let token = self.park_channel(channel, then);
        self.calls.push_back((token, call));
    }

    /// Parks `channel` until the result for the returned token comes back.
    fn park_channel(&mut self, channel: u16, then: Then) -> MetaToken {
        assert!(channel != 0, "channel 0 never parks");
        let token = self.token(channel);
        let old = self.parked.insert(
            channel,
            Parked {
                token,
                then,
                backlog: VecDeque::new(),
            },
        );
        // A parked channel processes nothing, so it cannot emit a second request.
        debug_assert!(old.is_none(), "channel {channel} parked twice");
        if let Some(old) = old {
            self.backlog_bytes -= old.backlog.iter().map(ParkedFrame::cost).sum::<usize>();
        }
        token
    }

    /// The next question for the runtime.
    pub(crate) fn poll_call(&mut self) -> Option<(MetaToken, QueueCall)> {
        self.calls.pop_front()
    }

    /// Emits `command` with nobody waiting for its result.
    pub(crate) fn emit_detached(&mut self, command: Command) {
        let token = self.token(0);
        self.outgoing.push_back((token, command));
    }

    /// The next command for the runtime.
    pub(crate) fn poll(&mut self) -> Option<(MetaToken, Command)> {
        self.outgoing.pop_front()
    }

    /// Whether `channel` waits for a result (its frames must be kept).
    pub(crate) fn is_parked(&self, channel: u16) -> bool {
        self.parked.contains_key(&channel)
    }

    /// Whether any channel waits.
    pub(crate) fn any_parked(&self) -> bool {
        !self.parked.is_empty()
    }

    /// Whether input must stop until a channel resumes.
    pub(crate) fn is_full(&self) -> bool {
        self.backlog_full
    }

    /// Keeps `f` (for a parked channel) if it fits; false (and input stops) if not.
    pub(crate) fn keep(&mut self, f: &Frame<'_>) -> bool {
        let Some(p) = self.parked.get_mut(&f.channel) else {
            return false;
        };
        let cost = f.payload.len() + FRAME_OVERHEAD_BYTES;
        if self.backlog_bytes + cost > BACKLOG_BYTES_MAX {
            self.backlog_full = true;
            return false;
        }
        self.backlog_bytes += cost;
        p.backlog.push_back(ParkedFrame {
            kind: f.kind,
            payload: f.payload.to_vec(),
        });
        true
    }

    /// Unparks the channel `token` names if it still waits for exactly this token: its
    /// continuation and the frames it kept. Input may resume.
    pub(crate) fn take(&mut self, token: MetaToken) -> Option<(Then, VecDeque<ParkedFrame>)> {
        if self.parked.get(&token.channel)?.token != token {
            return None;
        }
        let p = self.parked.remove(&token.channel)?;
        self.backlog_bytes -= p.backlog.iter().map(ParkedFrame::cost).sum::<usize>();
        self.backlog_full = false;
        Some((p.then, p.backlog))
    }

    /// Gives frames not yet replayed back to `channel`, parked again; they go before any
    /// frame kept since.
    pub(crate) fn restore(&mut self, channel: u16, mut frames: VecDeque<ParkedFrame>) {
        let Some(p) = self.parked.get_mut(&channel) else {
            return;
        };
        self.backlog_bytes += frames.iter().map(ParkedFrame::cost).sum::<usize>();
        frames.append(&mut p.backlog);
        p.backlog = frames;
    }

    /// Forgets every parked channel (the connection is going away). Commands already
    /// emitted stay: the runtime still commits them, and their results are dropped.
    pub(crate) fn clear_parked(&mut self) {
        self.parked.clear();
        self.backlog_bytes = 0;
        self.backlog_full = false;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn exclusive() -> Command {
        Command::DeleteExclusiveQueues { owner: 1 }
    }

    #[test]
    fn a_stale_or_repeated_token_unparks_nothing() {
        let mut port = MetaPort::default();
        port.park(1, exclusive(), Then::QueueUnbind);
        let (first, _) = port.poll().expect("emitted");
        assert_eq!(first.channel(), Some(1));
        assert!(port.take(first).is_some());
        assert!(port.take(first).is_none(), "a second result is dropped");
        port.park(1, exclusive(), Then::QueueUnbind);
        let (second, _) = port.poll().expect("emitted");
        assert!(port.take(first).is_none(), "the old token does not match");
        assert!(port.is_parked(1));
        assert!(port.take(second).is_some());
        assert!(!port.any_parked());
    }

    #[test]
    fn detached_commands_wait_for_nobody() {
        let mut port = MetaPort::default();
        port.emit_detached(exclusive());
        let (token, _) = port.poll().expect("emitted");
        assert_eq!(token.channel(), None);
        assert!(port.take(token).is_none());
    }

    #[test]
    fn the_backlog_is_bounded_and_released_on_resume() {
        let mut port = MetaPort::default();
        port.park(3, exclusive(), Then::QueueUnbind);
        let (token, _) = port.poll().expect("emitted");
        let payload = vec![0u8; 4096];
        let f = Frame {
            kind: FrameKind::Body,
            channel: 3,
            payload: &payload,
        };
        let mut kept = 0;
        while port.keep(&f) {
            kept += 1;
        }
        assert_eq!(kept, BACKLOG_BYTES_MAX / (4096 + FRAME_OVERHEAD_BYTES));
        assert!(port.is_full());
        let (_, frames) = port.take(token).expect("parked");
        assert_eq!(frames.len(), kept);
        assert!(!port.is_full());
        assert_eq!(port.backlog_bytes, 0);
    }

    #[test]
    fn frames_for_an_unparked_channel_are_not_kept() {
        let mut port = MetaPort::default();
        let f = Frame {
            kind: FrameKind::Heartbeat,
            channel: 2,
            payload: &[],
        };
        assert!(!port.keep(&f));
        assert!(!port.is_full());
    }

    #[test]
    fn restored_frames_go_before_later_ones() {
        let mut port = MetaPort::default();
        port.park(1, exclusive(), Then::QueueUnbind);
        let (token, _) = port.poll().expect("emitted");
        for b in [1u8, 2, 3] {
            let payload = [b];
            assert!(port.keep(&Frame {
                kind: FrameKind::Body,
                channel: 1,
                payload: &payload,
            }));
        }
        let (_, mut frames) = port.take(token).expect("parked");
        let first = frames.pop_front().expect("three kept");
        assert_eq!(first.payload, vec![1]);
        // Replaying the first frame parked the channel again; a new frame arrives after.
        port.park(1, exclusive(), Then::QueueUnbind);
        assert!(port.keep(&Frame {
            kind: FrameKind::Body,
            channel: 1,
            payload: &[4],
        }));
        port.restore(1, frames);
        let (token, _) = port.poll().expect("emitted");
        let (_, frames) = port.take(token).expect("parked");
        let order: Vec<u8> = frames.iter().map(|f| f.payload[0]).collect();
        assert_eq!(order, vec![2, 3, 4]);
        assert_eq!(port.backlog_bytes, 0);
    }
}

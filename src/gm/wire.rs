//! What GM hosts send each other, and the bookkeeping that makes a lossy request/reply link
//! a reliable FIFO channel between two members.
//!
//! GM assumes its left neighbour's messages arrive in order and none is lost while both
//! live (gm.erl had Erlang's ordered, reliable messaging between live processes). A node
//! link can drop a frame when it breaks, and a call can time out with the frame delivered,
//! so each (group, sender, receiver) stream numbers its messages: the sender keeps them in
//! an [`Outbox`] until the receiver's [`Inbox`] accepted them, resends on silence, and the
//! receiver drops what it already has. Only one batch is in flight per stream, so order
//! holds and the batches grow with the load.

use std::collections::{BTreeMap, VecDeque};

use bytes::Bytes;
use serde::{Deserialize, Serialize};

use super::member::GmMsg;
use super::view::MemberId;

/// A batch of one stream's messages.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct GmFrame {
    /// The group.
    pub group: String,
    /// The sending member.
    pub from: MemberId,
    /// The receiving member.
    pub to: MemberId,
    /// The stream number of `msgs[0]` (numbers start at 1).
    pub first_seq: u64,
    /// Consecutive messages.
    pub msgs: Vec<GmMsg<Bytes>>,
}

/// The answer to a [`GmFrame`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum GmReply {
    /// The receiver holds the stream up to this number.
    Accepted {
        /// Highest stream number accepted.
        upto: u64,
    },
    /// No such member runs on that node (not started yet, or gone): try again later; the
    /// metadata decides whether it is dead.
    NoMember,
}

/// The sender's side of one stream: messages not yet accepted, oldest first.
#[derive(Debug, Default)]
pub struct Outbox {
    next_seq: u64,
    unacked: VecDeque<(u64, GmMsg<Bytes>)>,
}

impl Outbox {
    /// An empty stream.
    pub fn new() -> Outbox {
        Outbox {
            next_seq: 1,
            unacked: VecDeque::new(),
        }
    }

    /// Queues `msg`.
    pub fn push(&mut self, msg: GmMsg<Bytes>) {
        self.unacked.push_back((self.next_seq, msg));
        self.next_seq += 1;
    }

    /// Whether everything was accepted.
    pub fn is_empty(&self) -> bool {
        self.unacked.is_empty()
    }

    /// The oldest unaccepted messages, at most `max` of them and `max_bytes` of payload
    /// (the first one whatever its size): their first number and the messages.
    pub fn batch(&self, max: usize, max_bytes: usize) -> Option<(u64, Vec<GmMsg<Bytes>>)> {
        let first = self.unacked.front()?.0;
        let mut bytes = 0usize;
        let mut msgs = Vec::new();
        for (_, m) in self.unacked.iter().take(max.max(1)) {
            let size = payload_bytes(m);
            if !msgs.is_empty() && bytes + size > max_bytes {
                break;
            }
            bytes += size;
            msgs.push(m.clone());
        }
        Some((first, msgs))
    }

    /// The receiver holds everything up to `upto`.
    pub fn accepted(&mut self, upto: u64) {
        while self.unacked.front().is_some_and(|(n, _)| *n <= upto) {
            self.unacked.pop_front();
        }
    }
}

/// About how many bytes `msg` takes on the wire: its payloads plus a little per publish,
/// ack and origin (more than the encoding needs, never much less).
pub fn payload_bytes(msg: &GmMsg<Bytes>) -> usize {
    const PER_ITEM: usize = 48;
    const PER_NUM: usize = 16;
    match msg {
        GmMsg::Activity { items, .. } => {
            PER_ITEM
                + items
                    .iter()
                    .map(|i| {
                        PER_ITEM
                            + i.pubs.iter().map(|(_, m)| PER_NUM + m.len()).sum::<usize>()
                            + PER_NUM * i.acks.len()
                    })
                    .sum::<usize>()
        }
        GmMsg::Catchup { state, .. } => {
            PER_ITEM
                + state
                    .values()
                    .map(|p| {
                        PER_ITEM
                            + p.pending_ack
                                .iter()
                                .map(|(_, m)| PER_NUM + m.len())
                                .sum::<usize>()
                    })
                    .sum::<usize>()
        }
    }
}

/// The receiver's side of every stream into one node: the highest number accepted per
/// (group, sender, receiver).
#[derive(Debug, Default)]
pub struct Inbox {
    accepted: BTreeMap<(String, MemberId, MemberId), u64>,
}

impl Inbox {
    /// An empty inbox.
    pub fn new() -> Inbox {
        Inbox::default()
    }

    /// Takes `frame`: the messages not seen before (in order) and the number to answer with.
    /// A frame that starts past a gap is refused whole (answered with what is held, so the
    /// sender resends from there); with one batch in flight per stream that cannot happen
    /// unless the sender's bookkeeping is lost.
    pub fn accept(&mut self, frame: GmFrame) -> (Vec<GmMsg<Bytes>>, u64) {
        let key = (frame.group, frame.from, frame.to);
        let held = self.accepted.get(&key).copied().unwrap_or(0);
        if frame.first_seq > held + 1 {
            return (Vec::new(), held);
        }
        let skip = (held + 1 - frame.first_seq) as usize;
        let new: Vec<GmMsg<Bytes>> = frame.msgs.into_iter().skip(skip).collect();
        let upto = held + new.len() as u64;
        self.accepted.insert(key, upto);
        (new, upto)
    }

    /// Forgets the streams into `to` (the member stopped).
    pub fn forget(&mut self, group: &str, to: MemberId) {
        self.accepted
            .retain(|(g, _, t), _| !(g == group && *t == to));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gm::member::Item;

    fn msg(v: u64) -> GmMsg<Bytes> {
        GmMsg::Activity {
            version: v,
            from: MemberId { node: 1, since: 1 },
            items: Vec::new(),
        }
    }

    fn frame(first_seq: u64, msgs: Vec<GmMsg<Bytes>>) -> GmFrame {
        GmFrame {
            group: "g".into(),
            from: MemberId { node: 1, since: 1 },
            to: MemberId { node: 2, since: 1 },
            first_seq,
            msgs,
        }
    }

    #[test]
    fn a_resent_batch_is_taken_once_and_a_lost_reply_costs_nothing() {
        let mut out = Outbox::new();
        let mut inbox = Inbox::new();
        out.push(msg(1));
        out.push(msg(2));
        let (first, msgs) = out.batch(10, usize::MAX).unwrap();
        // Delivered, but the reply is lost: the sender resends with one more message.
        let (got, upto) = inbox.accept(frame(first, msgs));
        assert_eq!((got.len(), upto), (2, 2));
        out.push(msg(3));
        let (first, msgs) = out.batch(10, usize::MAX).unwrap();
        assert_eq!(first, 1);
        let (got, upto) = inbox.accept(frame(first, msgs));
        assert_eq!(got, vec![msg(3)], "only the new message");
        assert_eq!(upto, 3);
        out.accepted(upto);
        assert!(out.is_empty());
        // A frame past a gap is refused whole.
        let (got, upto) = inbox.accept(frame(5, vec![msg(5)]));
        assert!(got.is_empty());
        assert_eq!(upto, 3);
        inbox.forget("g", MemberId { node: 2, since: 1 });
        assert_eq!(inbox.accept(frame(1, vec![msg(1)])).1, 1, "a fresh stream");
    }

    #[test]
    fn batches_are_bounded_and_start_at_the_oldest_unaccepted() {
        let mut out = Outbox::new();
        for v in 0..5 {
            out.push(msg(v));
        }
        out.accepted(2);
        let (first, msgs) = out.batch(2, usize::MAX).unwrap();
        assert_eq!(first, 3);
        assert_eq!(msgs, vec![msg(2), msg(3)]);
    }

    fn publishing(sizes: &[usize]) -> GmMsg<Bytes> {
        GmMsg::Activity {
            version: 1,
            from: MemberId { node: 1, since: 1 },
            items: vec![Item {
                id: MemberId { node: 1, since: 1 },
                pubs: sizes
                    .iter()
                    .enumerate()
                    .map(|(n, s)| (n as u64, Bytes::from(vec![7u8; *s])))
                    .collect(),
                acks: vec![1, 2, 3],
            }],
        }
    }

    #[test]
    fn the_byte_estimate_covers_the_encoding() {
        for sizes in [&[][..], &[1][..], &[1000, 5, 70_000][..]] {
            let m = publishing(sizes);
            let encoded = bincode::serialize(&m).expect("encodes").len();
            let estimate = payload_bytes(&m);
            assert!(
                encoded <= estimate && estimate <= encoded + 256,
                "{sizes:?}: encoded {encoded}, estimated {estimate}"
            );
        }
    }

    #[test]
    fn batches_stop_at_the_byte_budget_but_always_carry_one_message() {
        let mut out = Outbox::new();
        out.push(publishing(&[3000]));
        out.push(publishing(&[3000]));
        out.push(publishing(&[9000]));
        out.push(publishing(&[10]));
        let (first, msgs) = out.batch(10, 7000).unwrap();
        assert_eq!(
            (first, msgs.len()),
            (1, 2),
            "two of 3000 fit 7000, not a third"
        );
        out.accepted(2);
        let (first, msgs) = out.batch(10, 7000).unwrap();
        assert_eq!(
            (first, msgs.len()),
            (3, 1),
            "one over the budget goes alone"
        );
        out.accepted(3);
        assert_eq!(out.batch(10, 7000).unwrap().1.len(), 1);
    }
}

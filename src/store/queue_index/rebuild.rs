//! Recovery bookkeeping, sans-IO: folds the records read from the segment files and the
//! journal into an [`IndexState`] and the list of surviving messages.
//!
//! Records are applied as set operations (published, delivered, acked), so order and
//! repetition do not matter: a crash between a flush's segment fsync and its journal
//! truncation replays records that are already in the segments, harmlessly.

use std::collections::{BTreeMap, BTreeSet};

use super::codec::Record;
use super::state::{IndexState, Pending};
use super::{IndexEntry, Publish};

#[derive(Debug, Default)]
struct Seen {
    publish: Option<Publish>,
    delivered: bool,
    acked: bool,
    // Which records are already in the seq's segment file (the others must be written).
    file_pub: bool,
    file_del: bool,
    file_ack: bool,
}

/// Collects records during recovery.
#[derive(Debug)]
pub struct Rebuild {
    entries_per_segment: u64,
    seen: BTreeMap<u64, Seen>,
    max_seq: Option<u64>,
    files: BTreeSet<u64>,
}

/// The outcome of recovery bookkeeping.
#[derive(Debug)]
pub struct Rebuilt {
    /// The index state, with whatever the segments lack queued as journal records.
    pub state: IndexState,
    /// Surviving (un-acked, not dropped) messages in seq order.
    pub live: Vec<IndexEntry>,
    /// Un-acked messages before transient ones were dropped (checked against `clean.dot`).
    pub unacked_before_drop: u64,
    /// Transient messages dropped.
    pub dropped_transient: u64,
}

impl Rebuild {
    /// Nothing seen yet.
    pub fn new(entries_per_segment: u64) -> Rebuild {
        Rebuild {
            entries_per_segment,
            seen: BTreeMap::new(),
            max_seq: None,
            files: BTreeSet::new(),
        }
    }

    /// Segment file `n` exists (even if it holds nothing usable: a flush then removes it).
    pub fn segment_file(&mut self, n: u64) {
        self.files.insert(n);
    }

    fn apply(&mut self, r: Record, in_file: bool) {
        let seq = r.seq();
        self.max_seq = self.max_seq.max(Some(seq));
        let s = self.seen.entry(seq).or_default();
        match r {
            Record::Publish(p) => {
                s.publish = Some(p);
                s.file_pub |= in_file;
            }
            Record::Deliver { .. } => {
                s.delivered = true;
                s.file_del |= in_file;
            }
            Record::Ack { .. } => {
                s.acked = true;
                s.file_ack |= in_file;
            }
        }
    }

    /// A record read from segment file `n`; `false` (and ignored) when its seq belongs to
    /// another segment.
    pub fn segment_record(&mut self, n: u64, r: Record) -> bool {
        if r.seq() / self.entries_per_segment != n {
            return false;
        }
        self.apply(r, true);
        true
    }

    /// A record read from the journal.
    pub fn journal_record(&mut self, r: Record) {
        self.apply(r, false);
    }

    /// Builds the state. Transient messages are dropped (acked) when `drop_transient`;
    /// the next seq is at least `min_next_seq` and above every seq seen in any record, so
    /// a seq is never reused while a record of it remains on disk.
    pub fn finish(self, drop_transient: bool, min_next_seq: u64) -> Rebuilt {
        let mut state = IndexState::new(self.entries_per_segment);
        for n in &self.files {
            state.load_segment_file(*n);
        }
        state.raise_next_seq(min_next_seq);
        if let Some(max) = self.max_seq {
            state.raise_next_seq(max + 1);
        }
        let mut out = Rebuilt {
            state,
            live: Vec::new(),
            unacked_before_drop: 0,
            dropped_transient: 0,
        };
        for (seq, s) in self.seen {
            // Deliver or ack without a publish: the publish was in a deleted segment or in
            // a damaged region; nothing survives of that seq.
            let Some(publish) = s.publish else { continue };
            let mut acked = s.acked;
            if !acked {
                out.unacked_before_drop += 1;
                if drop_transient && !publish.persistent {
                    acked = true;
                    out.dropped_transient += 1;
                }
            }
            let (entry, pending_publish) = match (acked, s.file_pub) {
                (false, true) => (Some(publish), None),
                (false, false) => (Some(publish.clone()), Some(publish)),
                (true, true) => (None, None),
                // Published and acked, neither in a segment: nothing to keep or write.
                (true, false) => continue,
            };
            let pending = Pending {
                publish: pending_publish,
                deliver: s.delivered && !s.file_del && !acked,
                ack: acked && !s.file_ack,
            };
            out.state.load_entry(seq, s.delivered, acked, pending);
            if let Some(publish) = entry {
                out.live.push(IndexEntry {
                    publish,
                    delivered: s.delivered,
                });
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::super::state::FlushPlan;
    use super::*;

    fn publish(seq: u64, persistent: bool) -> Record {
        Record::Publish(Publish {
            seq,
            msg_id: [seq as u8; 16],
            persistent,
            expires_at_ms: None,
            size: 10,
            embedded: None,
        })
    }

    fn seqs(live: &[IndexEntry]) -> Vec<(u64, bool)> {
        live.iter().map(|e| (e.publish.seq, e.delivered)).collect()
    }

    #[test]
    fn replaying_records_already_in_segments_writes_nothing() {
        let mut r = Rebuild::new(4);
        r.segment_file(0);
        for rec in [
            publish(0, true),
            publish(1, true),
            Record::Deliver { seq: 1 },
        ] {
            assert!(r.segment_record(0, rec.clone()));
            r.journal_record(rec);
        }
        let mut out = r.finish(true, 0);
        assert_eq!(seqs(&out.live), vec![(0, false), (1, true)]);
        assert_eq!(out.state.journal_records(), 0);
        assert_eq!(out.state.take_flush(), FlushPlan::default());
        assert_eq!(out.state.next_seq(), 2);
    }

    #[test]
    fn journal_records_missing_from_segments_are_queued_for_the_next_flush() {
        let mut r = Rebuild::new(4);
        r.segment_file(0);
        r.segment_record(0, publish(0, true));
        r.journal_record(Record::Deliver { seq: 0 });
        r.journal_record(publish(5, true));
        let mut out = r.finish(true, 0);
        assert_eq!(seqs(&out.live), vec![(0, true), (5, false)]);
        let plan = out.state.take_flush();
        assert_eq!(plan.writes.len(), 2);
        assert_eq!(plan.writes[0].records, vec![Record::Deliver { seq: 0 }]);
        assert!(!plan.writes[0].creates);
        assert_eq!(plan.writes[1].records, vec![publish(5, true)]);
        assert!(plan.writes[1].creates);
    }

    #[test]
    fn a_segment_acked_through_the_journal_is_deleted() {
        let mut r = Rebuild::new(4);
        r.segment_file(0);
        r.segment_record(0, publish(0, true));
        r.journal_record(Record::Ack { seq: 0 });
        let mut out = r.finish(true, 0);
        assert!(out.live.is_empty());
        let plan = out.state.take_flush();
        assert_eq!((plan.writes, plan.deletes), (vec![], vec![0]));
    }

    #[test]
    fn transient_messages_are_dropped_with_an_ack() {
        let mut r = Rebuild::new(4);
        r.segment_file(0);
        r.segment_record(0, publish(0, false));
        r.segment_record(0, publish(1, true));
        r.journal_record(publish(2, false));
        let mut out = r.finish(true, 0);
        assert_eq!(seqs(&out.live), vec![(1, false)]);
        assert_eq!((out.unacked_before_drop, out.dropped_transient), (3, 2));
        let plan = out.state.take_flush();
        assert_eq!(plan.writes[0].records, vec![Record::Ack { seq: 0 }]);
    }

    #[test]
    fn orphans_and_foreign_records_are_ignored_but_raise_the_next_seq() {
        let mut r = Rebuild::new(4);
        r.segment_file(1);
        assert!(!r.segment_record(1, publish(2, true)));
        r.journal_record(Record::Ack { seq: 9 });
        r.journal_record(Record::Ack { seq: 6 });
        r.journal_record(publish(6, true));
        let mut out = r.finish(true, 3);
        assert!(out.live.is_empty());
        assert_eq!(out.state.next_seq(), 10);
        assert_eq!(out.state.take_flush().deletes, vec![1]);
    }

    #[test]
    fn the_clean_marker_can_raise_the_next_seq() {
        let out = Rebuild::new(4).finish(true, 42);
        assert_eq!(out.state.next_seq(), 42);
        assert_eq!(out.state.low_seq(), 42);
    }
}

//! Recovery bookkeeping, sans-IO, one segment at a time: folds the records read from the
//! journal and the segment files into an [`IndexState`], and hands back each segment's
//! surviving messages as soon as that segment is done.
//!
//! The records of seq `s` can only be in segment file `s / E` or in the journal, so recovery
//! never needs more than one segment in RAM besides the journal (which `journal_max_entries`
//! bounds):
//! 1. every journal record is given first ([`Rebuild::journal_record`]) and kept grouped by
//!    segment;
//! 2. each segment that has a file or journal records ([`Rebuild::segments`]) is then folded,
//!    in ascending order: [`Rebuild::start_segment`], its file's records
//!    ([`SegmentFold::file_record`]), then [`Rebuild::finish_segment`], which merges that
//!    segment's journal records, loads the segment's part of the state (its summary, plus what
//!    its file lacks as pending journal records) and returns its live entries. Nothing of the
//!    segment stays behind but its bitsets and the journal-only records, so the caller decides
//!    what to keep of the bodies;
//! 3. [`Rebuild::finish`] sets the next seq.
//!
//! [`Survivors`] is the caller's side of that bargain: it keeps the head of the queue (whole
//! segments, up to a limit) and only counts the rest, which is read back later per segment.
//!
//! Records are applied as set operations (published, delivered, acked), so order and
//! repetition do not matter: a crash between a flush's segment fsync and its journal
//! truncation replays records that are already in the segments, harmlessly.

use std::collections::{BTreeMap, BTreeSet};

use super::codec::Record;
use super::state::{IndexState, Pending, Tally};
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

fn apply(seen: &mut BTreeMap<u64, Seen>, r: Record, in_file: bool) {
    let s = seen.entry(r.seq()).or_default();
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

fn count_publishes<'a>(records: impl IntoIterator<Item = &'a Record>) -> usize {
    let publishes = records
        .into_iter()
        .filter(|r| matches!(r, Record::Publish(_)));
    publishes.count()
}

/// Collects records during recovery, one segment at a time (see the module docs).
#[derive(Debug)]
pub struct Rebuild {
    entries_per_segment: u64,
    drop_transient: bool,
    state: IndexState,
    /// Journal records not folded yet, by segment, in journal order.
    journal: BTreeMap<u64, Vec<Record>>,
    /// Publish records in `journal`.
    journal_publishes: usize,
    /// Journal-only publishes handed to the state as pending records (written at the flush).
    pending_publishes: usize,
    max_seq: Option<u64>,
    /// The last segment folded (they come in ascending order).
    folded: Option<u64>,
    unacked_before_drop: u64,
    dropped_transient: u64,
    peak_held: usize,
}

/// One segment being folded: the records of its file.
#[derive(Debug)]
pub struct SegmentFold {
    segment: u64,
    entries_per_segment: u64,
    file: bool,
    seen: BTreeMap<u64, Seen>,
    max_seq: Option<u64>,
}

impl SegmentFold {
    /// The segment number.
    pub fn segment(&self) -> u64 {
        self.segment
    }

    /// A record read from the segment's file; `false` (and ignored) when its seq belongs to
    /// another segment.
    pub fn file_record(&mut self, r: Record) -> bool {
        let seq = r.seq();
        if seq / self.entries_per_segment != self.segment {
            return false;
        }
        debug_assert!(self.file, "a file record of a segment without a file");
        self.max_seq = self.max_seq.max(Some(seq));
        apply(&mut self.seen, r, true);
        true
    }
}

/// What folding one segment found.
#[derive(Debug)]
pub struct SegmentOutcome {
    /// The segment number.
    pub segment: u64,
    /// Its surviving (un-acked, not dropped) messages in seq order.
    pub live: Vec<IndexEntry>,
    /// `Some` when the segment's file was damaged and still holds survivors: the file must be
    /// replaced by one holding the publish (and deliver, when delivered) of every entry of
    /// `live` and an ack of each seq listed here (every acked seq whose publish was seen).
    /// Nothing of the segment is left pending for the flush: the new file has it all.
    pub rewrite: Option<Vec<u64>>,
}

/// The outcome of recovery bookkeeping.
#[derive(Debug)]
pub struct Rebuilt {
    /// The index state, with whatever the segments lack queued as journal records.
    pub state: IndexState,
    /// Un-acked messages before transient ones were dropped (checked against `clean.dot`).
    pub unacked_before_drop: u64,
    /// Transient messages dropped.
    pub dropped_transient: u64,
    /// The most publish records (each possibly with its body) held at once: one segment's
    /// plus the journal's, whatever the queue's length.
    pub peak_held: usize,
}

impl Rebuild {
    /// Nothing seen yet. Transient messages are dropped (acked) when `drop_transient`.
    pub fn new(entries_per_segment: u64, drop_transient: bool) -> Rebuild {
        Rebuild {
            entries_per_segment,
            drop_transient,
            state: IndexState::new(entries_per_segment),
            journal: BTreeMap::new(),
            journal_publishes: 0,
            pending_publishes: 0,
            max_seq: None,
            folded: None,
            unacked_before_drop: 0,
            dropped_transient: 0,
            peak_held: 0,
        }
    }

    /// A record read from the journal. All of them come before the first segment is folded.
    pub fn journal_record(&mut self, r: Record) {
        debug_assert!(self.folded.is_none(), "journal record after a segment fold");
        let seq = r.seq();
        self.max_seq = self.max_seq.max(Some(seq));
        if matches!(r, Record::Publish(_)) {
            self.journal_publishes += 1;
        }
        let segment = seq / self.entries_per_segment;
        self.journal.entry(segment).or_default().push(r);
    }

    /// The segments to fold, in ascending order: those with a file (`files`) and those the
    /// journal mentions.
    pub fn segments(&self, files: impl IntoIterator<Item = u64>) -> Vec<u64> {
        let mut all: BTreeSet<u64> = files.into_iter().collect();
        all.extend(self.journal.keys().copied());
        all.into_iter().collect()
    }

    /// Starts folding segment `n`; `file` tells whether `N.idx` exists (even if it holds
    /// nothing usable: the flush then removes it).
    pub fn start_segment(&self, n: u64, file: bool) -> SegmentFold {
        debug_assert!(
            self.folded < Some(n),
            "segments are folded in ascending order"
        );
        SegmentFold {
            segment: n,
            entries_per_segment: self.entries_per_segment,
            file,
            seen: BTreeMap::new(),
            max_seq: None,
        }
    }

    /// Merges the segment's journal records into `fold`, loads the segment into the state and
    /// returns its survivors. `damaged` tells that its file had unreadable bytes or foreign
    /// records: if messages survive, the file is then to be rewritten (see
    /// [`SegmentOutcome::rewrite`]).
    pub fn finish_segment(&mut self, fold: SegmentFold, damaged: bool) -> SegmentOutcome {
        let SegmentFold {
            segment: n,
            file,
            mut seen,
            max_seq,
            ..
        } = fold;
        self.folded = Some(n);
        self.max_seq = self.max_seq.max(max_seq);
        let file_publishes = seen.values().filter(|s| s.publish.is_some()).count();
        let held = file_publishes + self.journal_publishes + self.pending_publishes;
        self.peak_held = self.peak_held.max(held);
        if let Some(records) = self.journal.remove(&n) {
            self.journal_publishes -= count_publishes(&records);
            for r in records {
                apply(&mut seen, r, false);
            }
        }

        let drop_transient = self.drop_transient;
        let survives = |s: &Seen| {
            let kept = |p: &Publish| p.persistent || !drop_transient;
            !s.acked && s.publish.as_ref().is_some_and(kept)
        };
        let rewrite = damaged && file && seen.values().any(survives);
        if file {
            self.state.load_segment_file(n);
        }
        let mut out = SegmentOutcome {
            segment: n,
            live: Vec::new(),
            rewrite: rewrite.then(Vec::new),
        };
        for (seq, s) in seen {
            // Deliver or ack without a publish: the publish was in a deleted segment or in
            // a damaged region; nothing survives of that seq.
            let Some(publish) = s.publish else { continue };
            let mut acked = s.acked;
            if !acked {
                self.unacked_before_drop += 1;
                if drop_transient && !publish.persistent {
                    acked = true;
                    self.dropped_transient += 1;
                }
            }
            if let Some(acks) = &mut out.rewrite {
                // The new file holds it all. The ack goes in even when the publish is only in
                // the journal: a crash before the flush truncates the journal replays that
                // publish over the new file, which must still say it is gone.
                if acked {
                    acks.push(seq);
                }
                if !acked || s.file_pub {
                    self.state
                        .load_entry(seq, s.delivered, acked, Pending::default());
                }
                if !acked {
                    out.live.push(IndexEntry {
                        publish,
                        delivered: s.delivered,
                    });
                }
                continue;
            }
            let (entry, pending_publish) = match (acked, s.file_pub) {
                (false, true) => (Some(publish), None),
                (false, false) => (Some(publish.clone()), Some(publish)),
                (true, true) => (None, None),
                // Acked, and no publish in the segment to cancel: nothing to keep or write.
                (true, false) => continue,
            };
            self.pending_publishes += usize::from(pending_publish.is_some());
            let pending = Pending {
                publish: pending_publish,
                deliver: s.delivered && !s.file_del && !acked,
                ack: acked && !s.file_ack,
            };
            self.state.load_entry(seq, s.delivered, acked, pending);
            if let Some(publish) = entry {
                out.live.push(IndexEntry {
                    publish,
                    delivered: s.delivered,
                });
            }
        }
        // What a clean close will save of the segment, known now for free.
        let tally = Tally::of(out.live.iter().map(|e| &e.publish));
        self.state.set_tally(n, tally);
        out
    }

    /// Builds the state once every segment of [`Rebuild::segments`] was folded. The next seq
    /// is at least `min_next_seq` and above every seq seen in any record, so a seq is never
    /// reused while a record of it remains on disk.
    pub fn finish(self, min_next_seq: u64) -> Rebuilt {
        debug_assert!(
            self.journal.is_empty(),
            "a segment the journal mentions was not folded"
        );
        let mut state = self.state;
        state.raise_next_seq(min_next_seq);
        if let Some(max) = self.max_seq {
            state.raise_next_seq(max + 1);
        }
        Rebuilt {
            state,
            unacked_before_drop: self.unacked_before_drop,
            dropped_transient: self.dropped_transient,
            peak_held: self.peak_held,
        }
    }
}

/// Takes the survivors of each segment, in ascending segment order, and keeps the head of the
/// queue: whole segments, from the first live one, until `head_limit` entries were reached
/// (0 counts as 1: a non-empty queue always has its first live segment in the head). Of the
/// rest only counts are kept; it is read back later, a segment at a time.
#[derive(Debug)]
pub struct Survivors {
    head_limit: usize,
    /// The head, in seq order.
    pub entries: Vec<IndexEntry>,
    /// The first seq of the first live segment left out of the head, if any.
    pub rest_from: Option<u64>,
    /// Survivors in all.
    pub live: u64,
    /// Sum of `Publish::size` of the survivors left out of the head.
    pub rest_bytes: u64,
    /// Message-store references of every survivor whose body is not embedded.
    pub store_refs: BTreeMap<[u8; 16], u32>,
}

impl Survivors {
    /// Nothing yet.
    pub fn new(head_limit: usize) -> Survivors {
        Survivors {
            head_limit: head_limit.max(1),
            entries: Vec::new(),
            rest_from: None,
            live: 0,
            rest_bytes: 0,
            store_refs: BTreeMap::new(),
        }
    }

    /// Whether the next segment with survivors goes to the head (its entries are needed)
    /// rather than to the rest (only counted, see [`Survivors::counted`]).
    pub fn in_head(&self) -> bool {
        self.rest_from.is_none() && self.entries.len() < self.head_limit
    }

    /// The survivors of the segment starting at `first_seq` (segments in ascending order).
    pub fn segment(&mut self, first_seq: u64, live: Vec<IndexEntry>) {
        if live.is_empty() {
            return;
        }
        debug_assert!(self
            .entries
            .last()
            .is_none_or(|e| e.publish.seq < first_seq));
        self.live += live.len() as u64;
        for e in live.iter().filter(|e| e.publish.embedded.is_none()) {
            *self.store_refs.entry(e.publish.msg_id).or_default() += 1;
        }
        if self.in_head() {
            self.entries.extend(live);
        } else {
            self.rest_from.get_or_insert(first_seq);
            let bytes = live.iter().map(|e| u64::from(e.publish.size));
            self.rest_bytes += bytes.sum::<u64>();
        }
    }

    /// The survivors of a segment of the rest, known by their count, the sum of their sizes
    /// and the store ids of those whose body is not embedded, without their entries (a clean
    /// open knows them from the summary). Only once [`Survivors::in_head`] is false.
    pub fn counted(&mut self, first_seq: u64, live: u64, bytes: u64, refs: &[[u8; 16]]) {
        debug_assert!(!self.in_head(), "the head needs the entries");
        if live == 0 {
            return;
        }
        self.live += live;
        for id in refs {
            *self.store_refs.entry(*id).or_default() += 1;
        }
        self.rest_from.get_or_insert(first_seq);
        self.rest_bytes += bytes;
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

    /// Folds `files` (segment -> records) and the journal the way `open` does; returns the
    /// outcome of each segment and the rebuilt state.
    fn fold(
        e: u64,
        files: &[(u64, Vec<Record>)],
        journal: Vec<Record>,
        damaged: &[u64],
        min_next_seq: u64,
    ) -> (Vec<SegmentOutcome>, Rebuilt) {
        let mut r = Rebuild::new(e, true);
        journal.into_iter().for_each(|rec| r.journal_record(rec));
        let mut outcomes = Vec::new();
        for n in r.segments(files.iter().map(|(n, _)| *n)) {
            let file = files.iter().find(|(f, _)| *f == n);
            let mut fold = r.start_segment(n, file.is_some());
            for rec in file.map_or(&[][..], |(_, recs)| &recs[..]) {
                fold.file_record(rec.clone());
            }
            outcomes.push(r.finish_segment(fold, damaged.contains(&n)));
        }
        (outcomes, r.finish(min_next_seq))
    }

    fn all_live(outcomes: &[SegmentOutcome]) -> Vec<(u64, bool)> {
        outcomes.iter().flat_map(|o| seqs(&o.live)).collect()
    }

    #[test]
    fn replaying_records_already_in_segments_writes_nothing() {
        let recs = vec![
            publish(0, true),
            publish(1, true),
            Record::Deliver { seq: 1 },
        ];
        let (outcomes, mut out) = fold(4, &[(0, recs.clone())], recs, &[], 0);
        assert_eq!(all_live(&outcomes), vec![(0, false), (1, true)]);
        assert_eq!(out.state.journal_records(), 0);
        assert_eq!(out.state.take_flush(), FlushPlan::default());
        assert_eq!(out.state.next_seq(), 2);
    }

    #[test]
    fn journal_records_missing_from_segments_are_queued_for_the_next_flush() {
        let journal = vec![Record::Deliver { seq: 0 }, publish(5, true)];
        let (outcomes, mut out) = fold(4, &[(0, vec![publish(0, true)])], journal, &[], 0);
        assert_eq!(
            outcomes.iter().map(|o| o.segment).collect::<Vec<_>>(),
            [0, 1]
        );
        assert_eq!(all_live(&outcomes), vec![(0, true), (5, false)]);
        let plan = out.state.take_flush();
        assert_eq!(plan.writes.len(), 2);
        assert_eq!(plan.writes[0].records, vec![Record::Deliver { seq: 0 }]);
        assert!(!plan.writes[0].creates);
        assert_eq!(plan.writes[1].records, vec![publish(5, true)]);
        assert!(plan.writes[1].creates);
    }

    #[test]
    fn a_segment_acked_through_the_journal_is_deleted() {
        let journal = vec![Record::Ack { seq: 0 }];
        let (outcomes, mut out) = fold(4, &[(0, vec![publish(0, true)])], journal, &[], 0);
        assert!(all_live(&outcomes).is_empty());
        let plan = out.state.take_flush();
        assert_eq!((plan.writes, plan.deletes), (vec![], vec![0]));
    }

    #[test]
    fn transient_messages_are_dropped_with_an_ack() {
        let file = vec![publish(0, false), publish(1, true)];
        let (outcomes, mut out) = fold(4, &[(0, file)], vec![publish(2, false)], &[], 0);
        assert_eq!(all_live(&outcomes), vec![(1, false)]);
        assert_eq!((out.unacked_before_drop, out.dropped_transient), (3, 2));
        let plan = out.state.take_flush();
        assert_eq!(plan.writes[0].records, vec![Record::Ack { seq: 0 }]);
    }

    #[test]
    fn transient_messages_are_kept_when_not_dropping() {
        let mut r = Rebuild::new(4, false);
        let mut f = r.start_segment(0, true);
        assert!(f.file_record(publish(0, false)));
        let o = r.finish_segment(f, false);
        assert_eq!(seqs(&o.live), vec![(0, false)]);
        assert_eq!(r.finish(0).dropped_transient, 0);
    }

    #[test]
    fn orphans_and_foreign_records_are_ignored_but_raise_the_next_seq() {
        let mut r = Rebuild::new(4, true);
        r.journal_record(Record::Ack { seq: 9 });
        r.journal_record(Record::Ack { seq: 6 });
        r.journal_record(publish(6, true));
        assert_eq!(r.segments([1]), vec![1, 2]);
        let mut f = r.start_segment(1, true);
        assert!(!f.file_record(publish(2, true)));
        assert_eq!(f.segment(), 1);
        assert!(r.finish_segment(f, true).live.is_empty());
        let f = r.start_segment(2, false);
        let o = r.finish_segment(f, false);
        assert!(o.live.is_empty() && o.rewrite.is_none());
        let mut out = r.finish(3);
        assert_eq!(out.state.next_seq(), 10);
        assert_eq!(out.state.take_flush().deletes, vec![1]);
    }

    #[test]
    fn the_clean_marker_can_raise_the_next_seq() {
        let out = Rebuild::new(4, true).finish(42);
        assert_eq!(out.state.next_seq(), 42);
        assert_eq!(out.state.low_seq(), 42);
    }

    #[test]
    fn a_damaged_segment_with_survivors_is_rewritten_with_nothing_pending() {
        // Seq 1 was acked in the file while its publish is still in the journal (a crash
        // between a flush and its journal truncation); 2 is transient; 3 is journal-only.
        let file = vec![
            publish(0, true),
            publish(1, true),
            Record::Ack { seq: 1 },
            publish(2, false),
        ];
        let journal = vec![
            publish(1, true),
            publish(3, true),
            Record::Deliver { seq: 3 },
        ];
        let (outcomes, mut out) = fold(4, &[(0, file)], journal, &[0], 0);
        assert_eq!(all_live(&outcomes), vec![(0, false), (3, true)]);
        assert_eq!(outcomes[0].rewrite, Some(vec![1, 2]));
        assert_eq!(out.state.journal_records(), 0);
        assert_eq!(out.state.take_flush(), FlushPlan::default());
        assert_eq!(out.state.unacked(), 2);
        assert!(out.state.is_delivered(3));
    }

    #[test]
    fn a_damaged_segment_without_survivors_is_left_to_the_flush() {
        let file = vec![publish(0, true)];
        let (outcomes, mut out) = fold(4, &[(0, file)], vec![Record::Ack { seq: 0 }], &[0], 0);
        assert!(outcomes[0].rewrite.is_none() && outcomes[0].live.is_empty());
        assert_eq!(out.state.take_flush().deletes, vec![0]);
    }

    #[test]
    fn only_one_segment_and_the_journal_are_held_at_once() {
        // 10 full segments of 4 in files, and a journal of 3 publishes and 2 acks.
        let files: Vec<(u64, Vec<Record>)> = (0..10)
            .map(|n| (n, (n * 4..n * 4 + 4).map(|s| publish(s, true)).collect()))
            .collect();
        let journal = vec![
            publish(40, true),
            publish(41, true),
            publish(42, true),
            Record::Ack { seq: 0 },
            Record::Ack { seq: 5 },
        ];
        let (outcomes, out) = fold(4, &files, journal, &[], 0);
        assert_eq!(all_live(&outcomes).len(), 41);
        assert_eq!(
            out.peak_held,
            4 + 3,
            "one segment plus the journal's publishes"
        );
    }

    fn entry(seq: u64, size: u32, embedded: bool) -> IndexEntry {
        IndexEntry {
            publish: Publish {
                seq,
                msg_id: [(seq % 3) as u8; 16],
                persistent: true,
                expires_at_ms: None,
                size,
                embedded: embedded.then(Vec::new),
            },
            delivered: false,
        }
    }

    #[test]
    fn survivors_keep_whole_segments_up_to_the_limit() {
        let mut s = Survivors::new(3);
        s.segment(0, vec![]);
        s.segment(4, vec![entry(5, 1, false), entry(6, 2, true)]);
        s.segment(8, vec![entry(8, 4, false), entry(11, 8, false)]);
        s.segment(12, vec![entry(12, 16, false)]);
        s.segment(16, vec![]);
        s.segment(20, vec![entry(21, 32, true)]);
        let head: Vec<u64> = s.entries.iter().map(|e| e.publish.seq).collect();
        assert_eq!(head, [5, 6, 8, 11]);
        assert_eq!((s.rest_from, s.live, s.rest_bytes), (Some(12), 6, 48));
        // msg ids: 5 -> 2, 8 -> 2, 11 -> 2, 12 -> 0 (the embedded ones are not counted).
        let refs: Vec<([u8; 16], u32)> = s.store_refs.into_iter().collect();
        assert_eq!(refs, vec![([0; 16], 1), ([2; 16], 3)]);
    }

    #[test]
    fn a_zero_limit_still_keeps_the_first_live_segment() {
        let mut s = Survivors::new(0);
        s.segment(0, vec![]);
        s.segment(4, vec![entry(4, 1, true)]);
        s.segment(8, vec![entry(8, 1, true)]);
        assert_eq!(
            (s.entries.len(), s.rest_from, s.rest_bytes),
            (1, Some(8), 1)
        );
        let all = Survivors::new(usize::MAX);
        assert!(all.entries.is_empty() && all.rest_from.is_none());
    }
}

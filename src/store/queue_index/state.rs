//! The sans-IO core of the queue index: per-segment summaries and the in-RAM mirror of the
//! journal. It decides which records go to which segment, which segments are fully acked
//! (deleted, never written) and when the journal must be flushed; it never touches a disk.
//!
//! Per segment it keeps three bitsets (published, delivered, acked), so a flush needs no
//! reads, deliver is idempotent and an ack of an unknown or already-acked seq is refused
//! instead of silently skewing the counts that decide a segment's deletion.
//!
//! Per segment it also keeps, while that is cheap, a [`Tally`] of the live messages: what a
//! clean shutdown must save (see [`super::summary`]) so that the next open does not have to
//! read the segment. A publish adds to it; an ack drops it (the acked message's size and id
//! are not known here), and the clean close reads that segment back to tally it again. It
//! costs 16 bytes per live persistent message whose body is in the message store (its id: the
//! store's own index holds more per message) and 8 per live transient one; nothing per
//! message with an embedded body.

use std::collections::btree_map::Entry;
use std::collections::BTreeMap;

use super::codec::Record;
use super::Publish;

/// A call the index must refuse; nothing was changed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StateError {
    /// Seq ids must grow: the queue assigns them in arrival order.
    #[error("seq {seq} published out of order (next seq is {next})")]
    OutOfOrder {
        /// The seq given.
        seq: u64,
        /// The lowest seq accepted.
        next: u64,
    },
    /// Deliver or ack of a seq that is not a published, un-acked message.
    #[error("seq {0} is not a published, un-acked message")]
    NotLive(u64),
    /// The same seq twice in one ack batch.
    #[error("seq {0} appears twice in one ack batch")]
    DuplicateAck(u64),
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct BitSet(Vec<u64>);

impl BitSet {
    fn new(bits: u64) -> BitSet {
        BitSet(vec![0; bits.div_ceil(64) as usize])
    }

    /// A bitset of `bits` bits from its words; `None` when the word count is wrong or a bit
    /// at or past `bits` is set.
    fn from_words(bits: u64, words: Vec<u64>) -> Option<BitSet> {
        let set = BitSet(words);
        let tail = bits % 64;
        let last_ok = tail == 0 || set.0.last().is_none_or(|w| w >> tail == 0);
        (set.0.len() == bits.div_ceil(64) as usize && last_ok).then_some(set)
    }

    fn count(&self) -> u32 {
        self.0.iter().map(|w| w.count_ones()).sum()
    }

    /// Whether every bit set here is set in `other`.
    fn subset_of(&self, other: &BitSet) -> bool {
        self.0.iter().zip(&other.0).all(|(a, b)| a & !b == 0)
    }

    fn get(&self, i: usize) -> bool {
        self.0[i / 64] & (1 << (i % 64)) != 0
    }

    fn set(&mut self, i: usize) {
        self.0[i / 64] |= 1 << (i % 64);
    }

    /// The first index set here and clear in `other`, a word at a time.
    fn first_without(&self, other: &BitSet) -> Option<usize> {
        let mut words = self.0.iter().zip(&other.0).enumerate();
        words.find_map(|(w, (a, b))| {
            let left = a & !b;
            (left != 0).then(|| w * 64 + left.trailing_zeros() as usize)
        })
    }
}

/// What a clean shutdown saves of a segment's live (published, un-acked) messages besides
/// its bitsets, so the next open knows the queue's byte count and message-store references
/// without reading the segment.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Tally {
    /// Sum of [`Publish::size`] of the live persistent messages.
    pub bytes: u64,
    /// Store ids of the live persistent messages whose body is not embedded, in seq order.
    pub refs: Vec<[u8; 16]>,
    /// Seqs of the live transient messages, ascending (the next open drops them).
    pub transient: Vec<u64>,
}

impl Tally {
    /// Counts one live message.
    pub fn add(&mut self, p: &Publish) {
        if !p.persistent {
            self.transient.push(p.seq);
            return;
        }
        self.bytes += u64::from(p.size);
        if p.embedded.is_none() {
            self.refs.push(p.msg_id);
        }
    }

    /// The tally of a segment's live messages, given in seq order.
    pub fn of<'a>(live: impl IntoIterator<Item = &'a Publish>) -> Tally {
        let mut t = Tally::default();
        live.into_iter().for_each(|p| t.add(p));
        t
    }
}

/// What the index knows about one segment without reading it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SegmentSummary {
    published: BitSet,
    delivered: BitSet,
    acked: BitSet,
    /// Publishes recorded (on disk or in the journal).
    pub pubs: u32,
    /// Delivers recorded.
    pub delivers: u32,
    /// Acks recorded.
    pub acks: u32,
    /// Whether its `N.idx` file exists.
    pub on_disk: bool,
    /// Its live messages' tally, when known (see the module docs).
    tally: Option<Tally>,
}

impl SegmentSummary {
    fn new(entries: u64, on_disk: bool) -> SegmentSummary {
        SegmentSummary {
            published: BitSet::new(entries),
            delivered: BitSet::new(entries),
            acked: BitSet::new(entries),
            pubs: 0,
            delivers: 0,
            acks: 0,
            on_disk,
            tally: Some(Tally::default()),
        }
    }

    /// A summary of a segment of `entries` seqs from saved parts: the words of the three
    /// bitsets and the counts, which must match them; its tally is unknown. `None` when they
    /// are inconsistent (wrong sizes, counts that are not the bits', delivers or acks of
    /// unpublished seqs).
    pub(super) fn from_parts(
        entries: u64,
        [published, delivered, acked]: [Vec<u64>; 3],
        [pubs, delivers, acks]: [u32; 3],
        on_disk: bool,
    ) -> Option<SegmentSummary> {
        let s = SegmentSummary {
            published: BitSet::from_words(entries, published)?,
            delivered: BitSet::from_words(entries, delivered)?,
            acked: BitSet::from_words(entries, acked)?,
            pubs,
            delivers,
            acks,
            on_disk,
            tally: None,
        };
        let counts = [s.published.count(), s.delivered.count(), s.acked.count()];
        let subsets = s.delivered.subset_of(&s.published) && s.acked.subset_of(&s.published);
        (counts == [pubs, delivers, acks] && subsets).then_some(s)
    }

    /// The words of the published, delivered and acked bitsets (for the clean summary).
    pub(super) fn words(&self) -> [&[u64]; 3] {
        [&self.published.0, &self.delivered.0, &self.acked.0]
    }

    /// Its live messages' tally, if known.
    pub fn tally(&self) -> Option<&Tally> {
        self.tally.as_ref()
    }

    pub(super) fn with_tally(self, tally: Tally) -> SegmentSummary {
        SegmentSummary {
            tally: Some(tally),
            ..self
        }
    }

    /// Every publish is acked: the segment is deleted at the next flush.
    pub fn fully_acked(&self) -> bool {
        self.acks == self.pubs
    }

    /// Published and not acked.
    pub fn unacked(&self) -> u64 {
        u64::from(self.pubs - self.acks)
    }

    pub(super) fn is_live(&self, rel: usize) -> bool {
        self.published.get(rel) && !self.acked.get(rel)
    }

    /// Sets the bits, counting each only once, so replaying a record is harmless.
    /// Returns the change in un-acked messages.
    fn mark(&mut self, rel: usize, delivered: bool, acked: bool) -> i64 {
        let before = self.unacked();
        if !self.published.get(rel) {
            self.published.set(rel);
            self.pubs += 1;
        }
        if delivered && !self.delivered.get(rel) {
            self.delivered.set(rel);
            self.delivers += 1;
        }
        if acked && !self.acked.get(rel) {
            self.acked.set(rel);
            self.acks += 1;
        }
        self.unacked() as i64 - before as i64
    }
}

/// Records of one seq that are in the journal but not yet in its segment.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(super) struct Pending {
    pub(super) publish: Option<Publish>,
    pub(super) deliver: bool,
    pub(super) ack: bool,
}

/// Records to append to one segment file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SegmentWrite {
    /// The segment number.
    pub segment: u64,
    /// The records, in seq order.
    pub records: Vec<Record>,
    /// The file does not exist yet (its name must be made durable).
    pub creates: bool,
}

/// What a journal flush must do, in this order: append and fsync the writes, remove the
/// deleted segments, sync the folder, then truncate and fsync the journal.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FlushPlan {
    /// Segment appends.
    pub writes: Vec<SegmentWrite>,
    /// Fully acked segments whose files must be removed.
    pub deletes: Vec<u64>,
}

/// The index's bookkeeping: segment summaries, the journal mirror, the next seq.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IndexState {
    entries_per_segment: u64,
    segments: BTreeMap<u64, SegmentSummary>,
    pending: BTreeMap<u64, Pending>,
    journal_records: usize,
    next_seq: u64,
    /// Kept up to date rather than summed, as the queue asks for it often.
    unacked: u64,
}

impl IndexState {
    /// An empty index whose segments hold `entries_per_segment` seqs each.
    pub fn new(entries_per_segment: u64) -> IndexState {
        IndexState {
            entries_per_segment,
            segments: BTreeMap::new(),
            pending: BTreeMap::new(),
            journal_records: 0,
            next_seq: 0,
            unacked: 0,
        }
    }

    /// The segment holding `seq`.
    pub fn segment_of(&self, seq: u64) -> u64 {
        seq / self.entries_per_segment
    }

    fn rel(&self, seq: u64) -> usize {
        (seq % self.entries_per_segment) as usize
    }

    /// The next seq the queue may assign.
    pub fn next_seq(&self) -> u64 {
        self.next_seq
    }

    pub(super) fn raise_next_seq(&mut self, to: u64) {
        self.next_seq = self.next_seq.max(to);
    }

    /// Records appended to the journal since the last flush (cancelled ones included: they
    /// take journal space all the same).
    pub fn journal_records(&self) -> usize {
        self.journal_records
    }

    /// Whether the journal has reached `max_entries` and must be flushed.
    pub fn needs_flush(&self, max_entries: usize) -> bool {
        self.journal_records >= max_entries
    }

    /// The summary of a segment, if it has any record.
    pub fn segment(&self, n: u64) -> Option<&SegmentSummary> {
        self.segments.get(&n)
    }

    /// Every segment's summary, in order.
    pub fn segments(&self) -> impl Iterator<Item = (u64, &SegmentSummary)> + '_ {
        self.segments.iter().map(|(n, s)| (*n, s))
    }

    /// Segments holding at least one un-acked message, in order.
    pub fn live_segments(&self) -> Vec<u64> {
        let live = self.segments.iter().filter(|(_, s)| s.unacked() > 0);
        live.map(|(n, _)| *n).collect()
    }

    /// Segment files that exist (or will, once the pending flush lands).
    pub fn segments_on_disk(&self) -> usize {
        self.segments.values().filter(|s| s.on_disk).count()
    }

    /// Un-acked messages.
    pub fn unacked(&self) -> u64 {
        self.unacked
    }

    /// The lowest un-acked seq, or the next seq when there is none.
    pub fn low_seq(&self) -> u64 {
        let mut live = self.segments.iter().filter(|(_, s)| s.unacked() > 0);
        let first = live.find_map(|(n, s)| {
            let rel = s.published.first_without(&s.acked)?;
            Some(n * self.entries_per_segment + rel as u64)
        });
        first.unwrap_or(self.next_seq)
    }

    /// Published and not acked.
    pub fn is_live(&self, seq: u64) -> bool {
        let seg = self.segments.get(&self.segment_of(seq));
        seg.is_some_and(|s| s.is_live(self.rel(seq)))
    }

    /// Whether a deliver was recorded for `seq`.
    pub fn is_delivered(&self, seq: u64) -> bool {
        let seg = self.segments.get(&self.segment_of(seq));
        seg.is_some_and(|s| s.delivered.get(self.rel(seq)))
    }

    /// Seqs with records only in the journal (tests: what the journal mirror keeps in RAM).
    #[cfg(test)]
    pub(super) fn pending_len(&self) -> usize {
        self.pending.len()
    }

    /// Publishes of segment `n` still only in the journal.
    pub fn pending_publishes(&self, n: u64) -> impl Iterator<Item = &Publish> + '_ {
        let first = n * self.entries_per_segment;
        let range = self.pending.range(first..first + self.entries_per_segment);
        range.filter_map(|(_, p)| p.publish.as_ref())
    }

    /// Marks `seq` in its segment's summary (creating it), keeping the un-acked count.
    fn mark(&mut self, seq: u64, delivered: bool, acked: bool) {
        let (entries, rel) = (self.entries_per_segment, self.rel(seq));
        let seg = self.segments.entry(seq / entries);
        let summary = seg.or_insert_with(|| SegmentSummary::new(entries, false));
        let delta = summary.mark(rel, delivered, acked);
        self.unacked = self.unacked.saturating_add_signed(delta);
    }

    /// Records a publish (to be appended to the journal).
    pub fn publish(&mut self, p: Publish) -> Result<(), StateError> {
        if p.seq < self.next_seq {
            return Err(StateError::OutOfOrder {
                seq: p.seq,
                next: self.next_seq,
            });
        }
        let seq = p.seq;
        self.mark(seq, false, false);
        let summary = self.segments.get_mut(&(seq / self.entries_per_segment));
        if let Some(tally) = summary.and_then(|s| s.tally.as_mut()) {
            tally.add(&p);
        }
        self.pending.entry(seq).or_default().publish = Some(p);
        self.journal_records += 1;
        self.next_seq = seq + 1;
        Ok(())
    }

    /// Records a deliver; `Ok(false)` when it was already recorded (nothing to write).
    pub fn deliver(&mut self, seq: u64) -> Result<bool, StateError> {
        if !self.is_live(seq) {
            return Err(StateError::NotLive(seq));
        }
        if self.is_delivered(seq) {
            return Ok(false);
        }
        self.mark(seq, true, false);
        self.pending.entry(seq).or_default().deliver = true;
        self.journal_records += 1;
        Ok(true)
    }

    /// Records acks; refuses the whole batch (changing nothing) if any seq is not live.
    pub fn ack(&mut self, seqs: &[u64]) -> Result<(), StateError> {
        let mut sorted = seqs.to_vec();
        sorted.sort_unstable();
        if let Some(w) = sorted.windows(2).find(|w| w[0] == w[1]) {
            return Err(StateError::DuplicateAck(w[0]));
        }
        if let Some(&seq) = sorted.iter().find(|&&s| !self.is_live(s)) {
            return Err(StateError::NotLive(seq));
        }
        for &seq in seqs {
            self.mark(seq, false, true);
            if let Some(s) = self.segments.get_mut(&(seq / self.entries_per_segment)) {
                // The acked message's size and id are not known here: the tally is redone
                // from the file if a clean close needs it.
                s.tally = None;
            }
            // Published in this journal generation: the publish and the ack cancel out
            // (`take_flush` writes neither), so the entry goes now, and with it an embedded
            // body, instead of staying in RAM until the flush (RabbitMQ's journal drops a
            // published, delivered and acked entry the same way). A busy queue's journal
            // holds up to `journal_max_entries` records: thousands of bodies.
            match self.pending.entry(seq) {
                Entry::Occupied(e) if e.get().publish.is_some() => {
                    e.remove();
                }
                e => e.or_default().ack = true,
            }
        }
        self.journal_records += seqs.len();
        Ok(())
    }

    /// Takes the journal mirror and turns it into segment writes and deletions, updating
    /// the summaries as if the plan had been carried out. If carrying it out fails the
    /// index must be reopened (recovery rebuilds everything from the files).
    pub fn take_flush(&mut self) -> FlushPlan {
        let mut writes: BTreeMap<u64, SegmentWrite> = BTreeMap::new();
        for (seq, p) in std::mem::take(&mut self.pending) {
            let seg = self.segment_of(seq);
            let Some(summary) = self.segments.get(&seg) else {
                continue;
            };
            // A fully acked segment is deleted, so its records are never written. (A seq
            // published and acked within one journal generation left `pending` at its ack.)
            if summary.fully_acked() {
                continue;
            }
            let w = writes.entry(seg).or_insert_with(|| SegmentWrite {
                segment: seg,
                records: Vec::new(),
                creates: !summary.on_disk,
            });
            if let Some(publish) = p.publish {
                w.records.push(Record::Publish(publish));
            }
            // An acked seq never comes back, so its deliver is not worth writing.
            if p.ack {
                w.records.push(Record::Ack { seq });
            } else if p.deliver {
                w.records.push(Record::Deliver { seq });
            }
        }
        let mut deletes = Vec::new();
        self.segments.retain(|n, s| {
            if s.fully_acked() && s.on_disk {
                deletes.push(*n);
            }
            !s.fully_acked()
        });
        for w in writes.values() {
            if let Some(s) = self.segments.get_mut(&w.segment) {
                s.on_disk = true;
            }
        }
        self.journal_records = 0;
        FlushPlan {
            writes: writes.into_values().collect(),
            deletes,
        }
    }

    /// Recovery: a segment file exists (its summary starts out on disk).
    pub(super) fn load_segment_file(&mut self, n: u64) {
        let entries = self.entries_per_segment;
        self.segments
            .entry(n)
            .or_insert_with(|| SegmentSummary::new(entries, true));
    }

    /// Recovery: the tally of segment `n`'s live messages (if the segment is known).
    pub(super) fn set_tally(&mut self, n: u64, tally: Tally) {
        if let Some(s) = self.segments.get_mut(&n) {
            s.tally = Some(tally);
        }
    }

    /// Clean recovery: a segment as the clean summary saved it (nothing of it is pending).
    pub(super) fn load_summary(&mut self, n: u64, summary: SegmentSummary) {
        self.unacked += summary.unacked();
        if let Some(old) = self.segments.insert(n, summary) {
            self.unacked -= old.unacked();
        }
    }

    /// Clean recovery: drops the live transient messages of a summary-loaded segment as the
    /// scan does (an ack each, written at the next flush) and takes them out of its tally.
    /// Returns how many were dropped.
    pub(super) fn drop_transients(&mut self, n: u64) -> u64 {
        let tally = self.segments.get_mut(&n).and_then(|s| s.tally.as_mut());
        let seqs = tally.map(|t| std::mem::take(&mut t.transient));
        let seqs = seqs.unwrap_or_default();
        for &seq in &seqs {
            let pending = Pending {
                ack: true,
                ..Pending::default()
            };
            self.load_entry(seq, false, true, pending);
        }
        seqs.len() as u64
    }

    /// Recovery: the state of one seq, and which of its records are not in its segment file
    /// yet (those become journal records again and are written at the next flush).
    pub(super) fn load_entry(&mut self, seq: u64, delivered: bool, acked: bool, pending: Pending) {
        self.mark(seq, delivered, acked);
        let n = usize::from(pending.publish.is_some()) + usize::from(pending.deliver);
        let n = n + usize::from(pending.ack);
        if n > 0 {
            self.pending.insert(seq, pending);
            self.journal_records += n;
        }
        self.raise_next_seq(seq + 1);
    }
}

/// What of a state decides the index's behaviour, for comparing two states: the bits of acked
/// seqs are left out (they only count, and a scan sees those the files still hold while the
/// state that wrote them may also remember seqs whose publish and ack cancelled out).
#[cfg(test)]
#[derive(Debug, PartialEq, Eq)]
pub(super) struct LiveView {
    next_seq: u64,
    unacked: u64,
    journal_records: usize,
    pending: BTreeMap<u64, Pending>,
    segments: Vec<SegmentView>,
}

#[cfg(test)]
#[derive(Debug, PartialEq, Eq)]
pub(super) struct SegmentView {
    n: u64,
    on_disk: bool,
    unacked: u64,
    live: Vec<u64>,
    delivered_live: Vec<u64>,
    tally: Option<Tally>,
}

#[cfg(test)]
impl IndexState {
    pub(super) fn live_view(&self) -> LiveView {
        let segments = self.segments.iter().map(|(n, s)| {
            let live: Vec<u64> = (s.published.0.iter().zip(&s.acked.0))
                .map(|(p, a)| p & !a)
                .collect();
            let delivered = live.iter().zip(&s.delivered.0).map(|(l, d)| l & d);
            SegmentView {
                n: *n,
                on_disk: s.on_disk,
                unacked: s.unacked(),
                delivered_live: delivered.collect(),
                live,
                tally: s.tally.clone(),
            }
        });
        LiveView {
            next_seq: self.next_seq,
            unacked: self.unacked,
            journal_records: self.journal_records,
            pending: self.pending.clone(),
            segments: segments.collect(),
        }
    }
}

#[cfg(test)]
#[path = "state_tests.rs"]
mod tests;

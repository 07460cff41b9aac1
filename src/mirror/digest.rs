//! A kept mirror copy checked against its master's queue without the message ids on the
//! wire (`docs/mirroring.md`, *Mirrors keep their data*).
//!
//! Per range of seqs `[lo, hi)` the master sends a [`RangeSummary`]: which seqs are live
//! and which of those were delivered (one bit each), and one SHA-256 over the live
//! messages' `(seq, id)` in seq order. The mirror [`compare`]s its copy's live entries of
//! the range with it. The copy matches when it holds every live seq, with the same ids (the
//! hash), and each body: then its entries the master no longer holds are acked and the
//! deliveries it missed recorded. Anything else, and the copy cannot be caught up (an index
//! takes publishes in seq order only): it starts empty.
//!
//! A million-message range costs 2 bits a seq on the wire instead of 25 bytes a message.

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// What the master's queue holds in `[lo, hi)`, without ids or bodies.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RangeSummary {
    /// The first seq covered.
    pub lo: u64,
    /// The seq after the last one covered.
    pub hi: u64,
    /// Bit `i` (word `i / 64`, bit `i % 64`): seq `lo + i` is live.
    pub live: Vec<u64>,
    /// Bit `i`: seq `lo + i` is live and was delivered.
    pub delivered: Vec<u64>,
    /// SHA-256 over each live message's seq (8 bytes, big-endian) and id (16 bytes,
    /// big-endian), in seq order.
    pub hash: [u8; 32],
}

/// Builds a [`RangeSummary`] from the live messages of the range, given in seq order.
pub struct SummaryBuilder {
    lo: u64,
    hi: u64,
    live: Vec<u64>,
    delivered: Vec<u64>,
    hasher: Sha256,
}

impl SummaryBuilder {
    /// An empty summary of `[lo, hi)` (`hi >= lo`).
    pub fn new(lo: u64, hi: u64) -> SummaryBuilder {
        let words = words_for(lo, hi);
        SummaryBuilder {
            lo,
            hi,
            live: vec![0; words],
            delivered: vec![0; words],
            hasher: Sha256::new(),
        }
    }

    /// Adds a live message; seqs outside the range are ignored. Seqs must come in
    /// increasing order (the hash is over that order).
    pub fn add(&mut self, seq: u64, id: u128, delivered: bool) {
        if seq < self.lo || seq >= self.hi {
            return;
        }
        let (w, bit) = bit_of(self.lo, seq);
        self.live[w] |= bit;
        if delivered {
            self.delivered[w] |= bit;
        }
        self.hasher.update(seq.to_be_bytes());
        self.hasher.update(id.to_be_bytes());
    }

    /// The summary.
    pub fn finish(self) -> RangeSummary {
        RangeSummary {
            lo: self.lo,
            hi: self.hi,
            live: self.live,
            delivered: self.delivered,
            hash: self.hasher.finalize().into(),
        }
    }
}

/// One live entry of a mirror's copy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CopyEntry {
    /// Its seq.
    pub seq: u64,
    /// Its message id.
    pub id: u128,
    /// Its size in bytes (an ack carries it).
    pub size: u64,
    /// A deliver is recorded in the copy.
    pub delivered: bool,
    /// The copy holds its body.
    pub body: bool,
}

/// What a copy must do to match the master's range.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// The copy holds every live message of the range: ack `acks` (gone from the master)
    /// and record deliveries of `delivers`, and it is the master's range.
    Matches {
        /// The copy's entries the master no longer holds.
        acks: Vec<CopyEntry>,
        /// Seqs the master delivered that the copy has not recorded delivered.
        delivers: Vec<u64>,
    },
    /// The copy lacks a live message, holds another message at its seq, has lost a
    /// body, or the summary is malformed.
    Differs,
}

/// Compares the copy's live entries of the summary's range (in increasing seq order;
/// entries outside the range are ignored) with the master's summary.
pub fn compare(summary: &RangeSummary, copy: impl IntoIterator<Item = CopyEntry>) -> Verdict {
    let words = words_for(summary.lo, summary.hi);
    if summary.hi < summary.lo
        || summary.live.len() != words
        || summary.delivered.len() != words
        || summary
            .live
            .iter()
            .zip(&summary.delivered)
            .any(|(l, d)| d & !l != 0)
        || tail_bits(summary) != 0
    {
        return Verdict::Differs;
    }
    let mut hasher = Sha256::new();
    let (mut acks, mut delivers) = (Vec::new(), Vec::new());
    let mut held = 0u64;
    let mut last = None;
    for e in copy {
        if e.seq < summary.lo || e.seq >= summary.hi {
            continue;
        }
        if last.is_some_and(|l| e.seq <= l) {
            return Verdict::Differs;
        }
        last = Some(e.seq);
        let (w, bit) = bit_of(summary.lo, e.seq);
        if summary.live[w] & bit == 0 {
            acks.push(e);
            continue;
        }
        if !e.body {
            return Verdict::Differs;
        }
        held += 1;
        hasher.update(e.seq.to_be_bytes());
        hasher.update(e.id.to_be_bytes());
        if summary.delivered[w] & bit != 0 && !e.delivered {
            delivers.push(e.seq);
        }
    }
    let live: u64 = summary.live.iter().map(|w| u64::from(w.count_ones())).sum();
    let hash: [u8; 32] = hasher.finalize().into();
    if held != live || hash != summary.hash {
        return Verdict::Differs;
    }
    Verdict::Matches { acks, delivers }
}

fn words_for(lo: u64, hi: u64) -> usize {
    (hi.saturating_sub(lo)).div_ceil(64) as usize
}

fn bit_of(lo: u64, seq: u64) -> (usize, u64) {
    let rel = seq - lo;
    ((rel / 64) as usize, 1u64 << (rel % 64))
}

/// Bits set past `hi` in the last word (a well-formed summary has none).
fn tail_bits(s: &RangeSummary) -> u64 {
    let used = (s.hi.saturating_sub(s.lo) % 64) as u32;
    match (s.live.last(), used) {
        (Some(w), 1..) => w & !((1u64 << used) - 1),
        _ => 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::BTreeMap;

    fn summary(lo: u64, hi: u64, master: &BTreeMap<u64, (u128, bool)>) -> RangeSummary {
        let mut b = SummaryBuilder::new(lo, hi);
        for (&seq, &(id, delivered)) in master {
            b.add(seq, id, delivered);
        }
        b.finish()
    }

    fn entry(seq: u64, id: u128, delivered: bool) -> CopyEntry {
        CopyEntry {
            seq,
            id,
            size: 10,
            delivered,
            body: true,
        }
    }

    #[test]
    fn a_copy_that_holds_more_is_acked_down_and_learns_the_deliveries() {
        let master = BTreeMap::from([(3, (30, false)), (5, (50, true)), (70, (700, false))]);
        let s = summary(0, 100, &master);
        let copy = [
            entry(1, 10, false),
            entry(3, 30, false),
            entry(5, 50, false),
            entry(70, 700, true),
        ];
        assert_eq!(
            compare(&s, copy),
            Verdict::Matches {
                acks: vec![entry(1, 10, false)],
                delivers: vec![5],
            }
        );
    }

    #[test]
    fn another_id_a_missing_message_or_a_lost_body_differs() {
        let master = BTreeMap::from([(3, (30, false)), (5, (50, false))]);
        let s = summary(0, 10, &master);
        assert_eq!(
            compare(&s, [entry(3, 30, false), entry(5, 51, false)]),
            Verdict::Differs
        );
        assert_eq!(compare(&s, [entry(3, 30, false)]), Verdict::Differs);
        let mut no_body = entry(5, 50, false);
        no_body.body = false;
        assert_eq!(
            compare(&s, [entry(3, 30, false), no_body]),
            Verdict::Differs
        );
        assert!(matches!(
            compare(&s, [entry(3, 30, false), entry(5, 50, false)]),
            Verdict::Matches { .. }
        ));
    }

    #[test]
    fn malformed_summaries_differ() {
        let s = summary(0, 70, &BTreeMap::from([(3, (30, false))]));
        let mut short = s.clone();
        short.live.pop();
        assert_eq!(compare(&short, [entry(3, 30, false)]), Verdict::Differs);
        let mut past_hi = s.clone();
        past_hi.live[1] |= 1 << 10;
        assert_eq!(compare(&past_hi, [entry(3, 30, false)]), Verdict::Differs);
        let mut delivered_not_live = s.clone();
        delivered_not_live.delivered[0] |= 1 << 4;
        assert_eq!(
            compare(&delivered_not_live, [entry(3, 30, false)]),
            Verdict::Differs
        );
        assert_eq!(
            compare(&s, [entry(3, 30, false), entry(3, 30, false)]),
            Verdict::Differs
        );
    }

    #[test]
    fn an_empty_summary_acks_the_whole_range() {
        let s = SummaryBuilder::new(10, 20).finish();
        let copy = [entry(9, 1, false), entry(12, 2, false), entry(20, 3, false)];
        assert_eq!(
            compare(&s, copy),
            Verdict::Matches {
                acks: vec![entry(12, 2, false)],
                delivers: vec![],
            }
        );
    }

    proptest! {
        /// A copy matches exactly when, over the range, it holds every live message of the
        /// master with its id and body; after the acks and delivers it is the master's range.
        #[test]
        fn matches_exactly_when_the_copy_holds_every_live_message(
            lo in 0u64..200,
            len in 0u64..300,
            master in proptest::collection::btree_map(0u64..600, (0u128..4, any::<bool>()), 0..80),
            extra in proptest::collection::btree_map(0u64..600, (0u128..4, any::<bool>()), 0..40),
            drop_some in any::<bool>(),
            lost_body in proptest::option::of(0u64..600),
        ) {
            let hi = lo + len;
            let master: BTreeMap<u64, (u128, bool)> =
                master.into_iter().filter(|(s, _)| (lo..hi).contains(s)).collect();
            // The copy: the master's live messages (some maybe missing, or another id,
            // delivered or not) plus messages the master acked.
            let mut copy: BTreeMap<u64, CopyEntry> = BTreeMap::new();
            for (&seq, &(id, _)) in &master {
                if drop_some && seq % 7 == 0 {
                    continue;
                }
                copy.insert(seq, entry(seq, id, seq % 3 == 0));
            }
            for (&seq, &(id, delivered)) in &extra {
                copy.entry(seq).or_insert(entry(seq, id + 10, delivered));
            }
            if let Some(c) = lost_body.and_then(|s| copy.get_mut(&s)) {
                c.body = false;
            }
            let s = summary(lo, hi, &master);
            let holds_all = master.iter().all(|(seq, (id, _))| {
                copy.get(seq).is_some_and(|c| c.id == *id && c.body)
            });
            match compare(&s, copy.values().copied()) {
                Verdict::Differs => prop_assert!(!holds_all),
                Verdict::Matches { acks, delivers } => {
                    prop_assert!(holds_all);
                    for a in &acks {
                        prop_assert!(!master.contains_key(&a.seq));
                        prop_assert!(copy.remove(&a.seq).is_some());
                    }
                    for d in &delivers {
                        copy.get_mut(d).expect("live in the copy").delivered = true;
                    }
                    let after: BTreeMap<u64, u128> = copy
                        .values()
                        .filter(|c| (lo..hi).contains(&c.seq))
                        .map(|c| (c.seq, c.id))
                        .collect();
                    let want: BTreeMap<u64, u128> =
                        master.iter().map(|(s, (id, _))| (*s, *id)).collect();
                    prop_assert_eq!(after, want);
                    for (seq, (_, delivered)) in &master {
                        if *delivered {
                            prop_assert!(copy[seq].delivered);
                        }
                    }
                }
            }
        }
    }
}

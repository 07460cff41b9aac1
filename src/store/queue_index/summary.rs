//! The clean-shutdown summary, `clean.summary`: what [`QueueIndex::open`] needs to rebuild
//! the index state after a clean close without reading the segment files (RabbitMQ's
//! recovery terms). [`QueueIndex::close`] writes it from the in-RAM state after its final
//! flush, fsyncs it and syncs the folder, and only then writes `clean.dot`; the open removes
//! both (and syncs the folder) before it changes anything, so a summary is only ever read
//! next to the marker of the close that wrote it.
//!
//! Every record is framed with [`record::encode`] (`len u32, crc32 u32, payload`); all
//! integers are little-endian. The file is the header, then one record per segment of the
//! state, in ascending segment order, and nothing else:
//! - header: `"WQIS", version u8 (1), segment_entry_count u64, next_seq u64, unacked u64,
//!   segments u64` (`next_seq` and `unacked`, transient messages included, as in `clean.dot`;
//!   `segments`: how many segment records follow);
//! - segment: `n u64, flags u8 (1: its file exists), pubs u32, delivers u32, acks u32,
//!   bytes u64, published [u64; W], delivered [u64; W], acked [u64; W], transient_count u32,
//!   transient [u32 rel; transient_count], refs_count u32, refs [[u8; 16]; refs_count]`, where
//!   `W = ceil(segment_entry_count / 64)`, bit `i` of the bitsets is seq `n * E + i`, the
//!   counts are the bitsets' popcounts, `bytes` is the sum of `Publish::size` of its live
//!   persistent messages, `transient` the offsets of its live transient messages and `refs`
//!   the store ids of its live persistent messages whose body is not embedded, in seq order
//!   (see [`Tally`]).
//!
//! [`decode`] accepts a file only if it is whole (every byte in a checksummed record, the
//! announced number of segment records) and consistent in itself; [`QueueIndex::open`] then
//! checks it against `clean.dot`, the folder's geometry, its segment files and the journal.
//!
//! [`QueueIndex::open`]: super::QueueIndex::open
//! [`QueueIndex::close`]: super::QueueIndex::close

use crate::store::record;

use super::state::{SegmentSummary, Tally};

const MAGIC: &[u8; 4] = b"WQIS";
const VERSION: u8 = 1;
const HEADER_LEN: usize = 4 + 1 + 4 * 8;
/// `n, flags, pubs, delivers, acks, bytes`.
const SEGMENT_FIXED: usize = 8 + 1 + 3 * 4 + 8;
const FLAG_ON_DISK: u8 = 1;

/// The summary's first record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    /// The folder's segment size.
    pub entries_per_segment: u64,
    /// The next seq at the close.
    pub next_seq: u64,
    /// Un-acked messages at the close, transient ones included.
    pub unacked: u64,
    /// Segment records that follow.
    pub segments: u64,
}

/// Appends the header record.
pub fn encode_header(out: &mut Vec<u8>, h: &Header) {
    let mut payload = Vec::with_capacity(HEADER_LEN);
    payload.extend_from_slice(MAGIC);
    payload.push(VERSION);
    for v in [h.entries_per_segment, h.next_seq, h.unacked, h.segments] {
        payload.extend_from_slice(&v.to_le_bytes());
    }
    record::encode(out, &payload);
}

/// Appends the record of segment `n`, with `tally` as its live messages' tally.
pub fn encode_segment(
    out: &mut Vec<u8>,
    entries_per_segment: u64,
    n: u64,
    s: &SegmentSummary,
    tally: &Tally,
) {
    let words = s.words();
    let len = SEGMENT_FIXED
        + words.iter().map(|w| w.len() * 8).sum::<usize>()
        + 4
        + tally.transient.len() * 4
        + 4
        + tally.refs.len() * 16;
    let mut p = Vec::with_capacity(len);
    p.extend_from_slice(&n.to_le_bytes());
    p.push(if s.on_disk { FLAG_ON_DISK } else { 0 });
    for c in [s.pubs, s.delivers, s.acks] {
        p.extend_from_slice(&c.to_le_bytes());
    }
    p.extend_from_slice(&tally.bytes.to_le_bytes());
    for set in words {
        set.iter()
            .for_each(|w| p.extend_from_slice(&w.to_le_bytes()));
    }
    p.extend_from_slice(&(tally.transient.len() as u32).to_le_bytes());
    for seq in &tally.transient {
        // Below the segment size (at most 2^20), so it fits.
        let rel = (seq - n * entries_per_segment) as u32;
        p.extend_from_slice(&rel.to_le_bytes());
    }
    p.extend_from_slice(&(tally.refs.len() as u32).to_le_bytes());
    tally.refs.iter().for_each(|id| p.extend_from_slice(id));
    debug_assert_eq!(p.len(), len);
    record::encode(out, &p);
}

/// A decoded summary.
#[derive(Debug)]
pub struct Decoded {
    /// Its header.
    pub header: Header,
    /// The segments, ascending, each with its tally.
    pub segments: Vec<(u64, SegmentSummary)>,
}

/// A little cursor over a payload.
struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if self.0.len() < n {
            return None;
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Some(head)
    }

    fn u8(&mut self) -> Option<u8> {
        Some(self.take(1)?[0])
    }

    fn u32(&mut self) -> Option<u32> {
        Some(u32::from_le_bytes(self.take(4)?.try_into().ok()?))
    }

    fn u64(&mut self) -> Option<u64> {
        Some(u64::from_le_bytes(self.take(8)?.try_into().ok()?))
    }

    fn words(&mut self, n: usize) -> Option<Vec<u64>> {
        (0..n).map(|_| self.u64()).collect()
    }
}

fn decode_header(payload: &[u8]) -> Option<Header> {
    let mut r = Reader(payload);
    if r.take(4)? != MAGIC || r.u8()? != VERSION {
        return None;
    }
    let h = Header {
        entries_per_segment: r.u64()?,
        next_seq: r.u64().filter(|n| *n <= super::codec::SEQ_LIMIT)?,
        unacked: r.u64()?,
        segments: r.u64()?,
    };
    r.0.is_empty().then_some(h)
}

fn decode_segment(payload: &[u8], h: &Header) -> Option<(u64, SegmentSummary)> {
    let e = h.entries_per_segment;
    let mut r = Reader(payload);
    let n = r.u64()?;
    let first = n.checked_mul(e)?;
    let flags = r.u8()?;
    if flags & !FLAG_ON_DISK != 0 {
        return None;
    }
    let counts = [r.u32()?, r.u32()?, r.u32()?];
    let bytes = r.u64()?;
    let w = e.div_ceil(64) as usize;
    let sets = [r.words(w)?, r.words(w)?, r.words(w)?];
    // No seq at or past the next seq was published.
    if let Some(top) = highest_bit(&sets[0]) {
        if first.checked_add(top)? >= h.next_seq {
            return None;
        }
    }
    let transient_count = r.u32()? as usize;
    let mut transient = Vec::with_capacity(transient_count.min(r.0.len() / 4));
    for _ in 0..transient_count {
        let rel = u64::from(r.u32()?);
        let seq = first.checked_add(rel)?;
        if rel >= e || transient.last().is_some_and(|&last| last >= seq) {
            return None;
        }
        transient.push(seq);
    }
    let refs_count = r.u32()? as usize;
    if r.0.len() != refs_count.checked_mul(16)? {
        return None;
    }
    let refs: Option<Vec<[u8; 16]>> = r.0.chunks_exact(16).map(|c| c.try_into().ok()).collect();
    let tally = Tally {
        bytes,
        refs: refs?,
        transient,
    };
    let on_disk = flags & FLAG_ON_DISK != 0;
    let listed = (tally.refs.len() + tally.transient.len()) as u64;
    let s = SegmentSummary::from_parts(e, sets, counts, on_disk)?;
    let transient_live = tally
        .transient
        .iter()
        .all(|seq| s.is_live((seq - first) as usize));
    let ok = s.unacked() > 0 && listed <= s.unacked() && transient_live;
    ok.then(|| (n, s.with_tally(tally)))
}

fn highest_bit(words: &[u64]) -> Option<u64> {
    let (i, w) = words.iter().enumerate().rev().find(|(_, w)| **w != 0)?;
    Some(i as u64 * 64 + 63 - u64::from(w.leading_zeros()))
}

/// Reads a summary; `Err` says why it is unusable.
pub fn decode(bytes: &[u8]) -> Result<Decoded, &'static str> {
    let (found, valid) = record::scan(bytes);
    if valid != bytes.len() {
        return Err("damaged or torn");
    }
    let mut records = found.into_iter();
    let header = records.next().ok_or("empty")?;
    let header = decode_header(header.payload).ok_or("bad header")?;
    if !(1..=super::MAX_SEGMENT_ENTRY_COUNT).contains(&header.entries_per_segment) {
        return Err("bad header");
    }
    if records.len() as u64 != header.segments {
        return Err("segment records missing");
    }
    let mut segments: Vec<(u64, SegmentSummary)> = Vec::with_capacity(records.len());
    let mut unacked = 0u64;
    for f in records {
        let (n, s) = decode_segment(f.payload, &header).ok_or("bad segment record")?;
        if segments.last().is_some_and(|(last, _)| *last >= n) {
            return Err("segments out of order");
        }
        unacked += s.unacked();
        segments.push((n, s));
    }
    if unacked != header.unacked {
        return Err("message count mismatch");
    }
    Ok(Decoded { header, segments })
}

#[cfg(test)]
mod tests {
    use super::super::state::IndexState;
    use super::super::Publish;
    use super::*;

    fn sample() -> (IndexState, Vec<u8>) {
        let mut st = IndexState::new(70);
        for seq in 0..150 {
            st.publish(Publish {
                seq,
                msg_id: [seq as u8; 16],
                persistent: !seq.is_multiple_of(5),
                expires_at_ms: None,
                size: seq as u32,
                embedded: seq.is_multiple_of(3).then(Vec::new),
            })
            .unwrap();
        }
        st.deliver(3).unwrap();
        st.ack(&[1, 2, 71]).unwrap();
        st.take_flush();
        // Acks dropped the tallies of segments 0 and 1.
        st.set_tally(0, Tally::default());
        st.set_tally(1, Tally::default());
        let mut out = Vec::new();
        let header = Header {
            entries_per_segment: 70,
            next_seq: st.next_seq(),
            unacked: st.unacked(),
            segments: st.segments().count() as u64,
        };
        encode_header(&mut out, &header);
        for (n, s) in st.segments() {
            encode_segment(&mut out, 70, n, s, s.tally().expect("tally"));
        }
        (st, out)
    }

    #[test]
    fn a_summary_round_trips() {
        let (st, bytes) = sample();
        let d = decode(&bytes).expect("decode");
        assert_eq!(
            d.header,
            Header {
                entries_per_segment: 70,
                next_seq: 150,
                unacked: 147,
                segments: 3
            }
        );
        let want: Vec<(u64, SegmentSummary)> = st.segments().map(|(n, s)| (n, s.clone())).collect();
        assert_eq!(d.segments, want);
        let t = d.segments[2].1.tally().expect("tally");
        assert_eq!(t.transient, [140, 145]);
        assert_eq!(
            t.bytes,
            (141u64..150).filter(|s| !s.is_multiple_of(5)).sum::<u64>()
        );
    }

    #[test]
    fn any_damage_is_refused() {
        let (_, bytes) = sample();
        for at in (0..bytes.len()).step_by(7) {
            let mut bad = bytes.clone();
            bad[at] ^= 0x40;
            assert!(decode(&bad).is_err(), "flip at {at}");
        }
        for len in (0..bytes.len()).step_by(11) {
            assert!(decode(&bytes[..len]).is_err(), "cut at {len}");
        }
        let mut longer = bytes.clone();
        longer.extend_from_slice(&bytes[..40]);
        assert!(decode(&longer).is_err());
    }
}

//! Byte layout of index records (the journal and the segments share it) and of the two small
//! marker files, plus a scanner that skips damaged regions instead of stopping at the first.
//!
//! Every record is framed with [`record::encode`] (`len, crc32, payload`). Payloads:
//! - publish: `1, seq u64, msg_id [16], flags u8, [expires_at_ms u64], size u32,
//!   [embedded_len u32, embedded bytes]` (flags: 1 persistent, 2 has expiry, 4 has body);
//! - deliver: `2, seq u64`; ack: `3, seq u64`.
//!
//! Segments carry full seq ids rather than RabbitMQ's 14-bit relative ones: eight bytes per
//! record buy a check that each record really belongs to the segment it was read from.

use crate::store::record::{self, RECORD_OVERHEAD};

use super::Publish;

const TAG_PUBLISH: u8 = 1;
const TAG_DELIVER: u8 = 2;
const TAG_ACK: u8 = 3;
const FLAG_PERSISTENT: u8 = 1;
const FLAG_EXPIRES: u8 = 2;
const FLAG_EMBEDDED: u8 = 4;
/// Publish payload without expiry and body: tag, seq, msg id, flags, size.
const PUBLISH_FIXED: usize = 1 + 8 + 16 + 1 + 4;
const SEQ_ONLY: usize = 1 + 8;

/// Seq ids stay below this (and a next seq at or below it). A queue publishing a billion
/// messages a second would take 146 years to reach it, so a record beyond it is damage,
/// and recovery's `seq + 1` cannot overflow.
pub const SEQ_LIMIT: u64 = 1 << 62;

const META_MAGIC: &[u8; 4] = b"WQIM";
const CLEAN_MAGIC: &[u8; 4] = b"WQIC";
const MARKER_VERSION: u8 = 1;

/// One index record, as found in the journal or in a segment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Record {
    /// A message entered the queue.
    Publish(Publish),
    /// The message was handed to a consumer (it comes back redelivered after a restart).
    Deliver {
        /// Its seq id.
        seq: u64,
    },
    /// The message is gone for good.
    Ack {
        /// Its seq id.
        seq: u64,
    },
}

impl Record {
    /// The seq id the record concerns.
    pub fn seq(&self) -> u64 {
        match self {
            Record::Publish(p) => p.seq,
            Record::Deliver { seq } | Record::Ack { seq } => *seq,
        }
    }
}

/// Appends one framed publish record.
pub fn encode_publish(out: &mut Vec<u8>, p: &Publish) {
    let body_len = p.embedded.as_ref().map_or(0, |b| 4 + b.len());
    let mut payload = Vec::with_capacity(PUBLISH_FIXED + 8 + body_len);
    payload.push(TAG_PUBLISH);
    payload.extend_from_slice(&p.seq.to_le_bytes());
    payload.extend_from_slice(&p.msg_id);
    let mut flags = 0;
    if p.persistent {
        flags |= FLAG_PERSISTENT;
    }
    if p.expires_at_ms.is_some() {
        flags |= FLAG_EXPIRES;
    }
    if p.embedded.is_some() {
        flags |= FLAG_EMBEDDED;
    }
    payload.push(flags);
    if let Some(at) = p.expires_at_ms {
        payload.extend_from_slice(&at.to_le_bytes());
    }
    payload.extend_from_slice(&p.size.to_le_bytes());
    if let Some(body) = &p.embedded {
        payload.extend_from_slice(&(body.len() as u32).to_le_bytes());
        payload.extend_from_slice(body);
    }
    record::encode(out, &payload);
}

/// Appends one framed deliver record.
pub fn encode_deliver(out: &mut Vec<u8>, seq: u64) {
    encode_seq_only(out, TAG_DELIVER, seq);
}

/// Appends one framed ack record.
pub fn encode_ack(out: &mut Vec<u8>, seq: u64) {
    encode_seq_only(out, TAG_ACK, seq);
}

fn encode_seq_only(out: &mut Vec<u8>, tag: u8, seq: u64) {
    let mut payload = [0u8; SEQ_ONLY];
    payload[0] = tag;
    payload[1..].copy_from_slice(&seq.to_le_bytes());
    record::encode(out, &payload);
}

/// Appends any record, framed.
pub fn encode_record(out: &mut Vec<u8>, r: &Record) {
    match r {
        Record::Publish(p) => encode_publish(out, p),
        Record::Deliver { seq } => encode_deliver(out, *seq),
        Record::Ack { seq } => encode_ack(out, *seq),
    }
}

fn u64_at(b: &[u8], at: usize) -> Option<u64> {
    Some(u64::from_le_bytes(b.get(at..at + 8)?.try_into().ok()?))
}

fn u32_at(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_le_bytes(b.get(at..at + 4)?.try_into().ok()?))
}

/// The payload length the header of `payload` announces, read without copying, so the
/// resynchronising scanner rejects most false starts before paying for a checksum.
fn announced_len(payload: &[u8]) -> Option<usize> {
    match *payload.first()? {
        TAG_DELIVER | TAG_ACK => Some(SEQ_ONLY),
        TAG_PUBLISH => {
            let flags = *payload.get(25)?;
            if flags & !(FLAG_PERSISTENT | FLAG_EXPIRES | FLAG_EMBEDDED) != 0 {
                return None;
            }
            let mut len = PUBLISH_FIXED;
            if flags & FLAG_EXPIRES != 0 {
                len += 8;
            }
            if flags & FLAG_EMBEDDED != 0 {
                len += 4 + u32_at(payload, len)? as usize;
            }
            Some(len)
        }
        _ => None,
    }
}

/// Decodes one payload; `None` when it is malformed (wrong tag, flags or length, or a seq
/// at or past [`SEQ_LIMIT`]).
pub fn decode(payload: &[u8]) -> Option<Record> {
    decode_as(payload, true)
}

/// [`decode`] without copying an embedded body: a publish that has one gets an empty
/// `embedded` (for readers that need only seqs, ids and sizes).
pub fn decode_light(payload: &[u8]) -> Option<Record> {
    decode_as(payload, false)
}

fn decode_as(payload: &[u8], bodies: bool) -> Option<Record> {
    if announced_len(payload)? != payload.len() {
        return None;
    }
    let seq = u64_at(payload, 1).filter(|s| *s < SEQ_LIMIT)?;
    match payload[0] {
        TAG_DELIVER => Some(Record::Deliver { seq }),
        TAG_ACK => Some(Record::Ack { seq }),
        _ => {
            let msg_id: [u8; 16] = payload.get(9..25)?.try_into().ok()?;
            let flags = payload[25];
            let mut at = 26;
            let expires_at_ms = if flags & FLAG_EXPIRES != 0 {
                at += 8;
                Some(u64_at(payload, at - 8)?)
            } else {
                None
            };
            let size = u32_at(payload, at)?;
            at += 4;
            let embedded = (flags & FLAG_EMBEDDED != 0).then(|| {
                if bodies {
                    payload[at + 4..].to_vec()
                } else {
                    Vec::new()
                }
            });
            Some(Record::Publish(Publish {
                seq,
                msg_id,
                persistent: flags & FLAG_PERSISTENT != 0,
                expires_at_ms,
                size,
                embedded,
            }))
        }
    }
}

/// What [`scan`] found in a file.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Scan {
    /// The intact records, in file order.
    pub records: Vec<Record>,
    /// Damaged byte ranges `[start, end)` that were skipped.
    pub skipped: Vec<(usize, usize)>,
}

/// Whether a valid, decodable record starts at the beginning of `b`.
fn plausible(b: &[u8]) -> bool {
    if b.len() < RECORD_OVERHEAD {
        return false;
    }
    let Some(len) = u32_at(b, 0).map(|l| l as usize) else {
        return false;
    };
    if len < SEQ_ONLY || b.len() - RECORD_OVERHEAD < len {
        return false;
    }
    let payload = &b[RECORD_OVERHEAD..RECORD_OVERHEAD + len];
    announced_len(payload) == Some(len) && u32_at(b, 4) == Some(crc32fast::hash(payload))
}

/// Every intact record of `buf`. Unlike [`record::scan`] it does not stop at damage: it skips
/// forward to the next offset where a checksummed, well-formed record starts, so a flipped
/// byte in the middle of a segment costs one record, not the rest of the file.
pub fn scan(buf: &[u8]) -> Scan {
    scan_by(buf, decode)
}

/// [`scan`] with [`decode_light`]: embedded bodies are not copied (left empty).
pub fn scan_light(buf: &[u8]) -> Scan {
    scan_by(buf, decode_light)
}

fn scan_by(buf: &[u8], decode: fn(&[u8]) -> Option<Record>) -> Scan {
    let mut out = Scan::default();
    let mut pos = 0;
    while pos < buf.len() {
        let (found, valid) = record::scan(&buf[pos..]);
        let mut bad = None;
        for f in found {
            match decode(f.payload) {
                Some(r) => out.records.push(r),
                None => {
                    bad = Some(pos + f.offset);
                    break;
                }
            }
        }
        let start = match bad {
            Some(at) => at,
            None if pos + valid >= buf.len() => break,
            None => pos + valid,
        };
        let mut next = start + 1;
        while next < buf.len() && !plausible(&buf[next..]) {
            next += 1;
        }
        out.skipped.push((start, next));
        pos = next;
    }
    out
}

/// The `index.meta` file: the segment geometry the folder was created with.
pub fn encode_meta(segment_entry_count: u64) -> Vec<u8> {
    let mut payload = META_MAGIC.to_vec();
    payload.push(MARKER_VERSION);
    payload.extend_from_slice(&segment_entry_count.to_le_bytes());
    let mut out = Vec::new();
    record::encode(&mut out, &payload);
    out
}

/// Reads `index.meta`; `None` when it is damaged.
pub fn decode_meta(bytes: &[u8]) -> Option<u64> {
    let p = single_payload(bytes, META_MAGIC, 8)?;
    u64_at(p, 5)
}

/// What a clean shutdown leaves in `clean.dot`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CleanMarker {
    /// The next seq id the queue would have assigned.
    pub next_seq: u64,
    /// Un-acked messages at shutdown, transient ones included.
    pub unacked: u64,
}

/// The `clean.dot` file.
pub fn encode_clean(m: CleanMarker) -> Vec<u8> {
    let mut payload = CLEAN_MAGIC.to_vec();
    payload.push(MARKER_VERSION);
    payload.extend_from_slice(&m.next_seq.to_le_bytes());
    payload.extend_from_slice(&m.unacked.to_le_bytes());
    let mut out = Vec::new();
    record::encode(&mut out, &payload);
    out
}

/// Reads `clean.dot`; `None` when it is damaged.
pub fn decode_clean(bytes: &[u8]) -> Option<CleanMarker> {
    let p = single_payload(bytes, CLEAN_MAGIC, 16)?;
    Some(CleanMarker {
        next_seq: u64_at(p, 5).filter(|n| *n <= SEQ_LIMIT)?,
        unacked: u64_at(p, 13)?,
    })
}

fn single_payload<'a>(bytes: &'a [u8], magic: &[u8; 4], body: usize) -> Option<&'a [u8]> {
    let (found, valid) = record::scan(bytes);
    let p = found.first()?.payload;
    let ok = found.len() == 1
        && valid == bytes.len()
        && p.len() == 5 + body
        && &p[..4] == magic
        && p[4] == MARKER_VERSION;
    ok.then_some(p)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn publish(seq: u64, body: Option<&[u8]>, expires: Option<u64>) -> Publish {
        Publish {
            seq,
            msg_id: [seq as u8; 16],
            persistent: seq.is_multiple_of(2),
            expires_at_ms: expires,
            size: 1234,
            embedded: body.map(<[u8]>::to_vec),
        }
    }

    #[test]
    fn records_round_trip() {
        let records = vec![
            Record::Publish(publish(7, None, None)),
            Record::Publish(publish(8, Some(b"hello"), Some(99))),
            Record::Publish(publish(9, Some(b""), None)),
            Record::Deliver { seq: 7 },
            Record::Ack { seq: SEQ_LIMIT - 1 },
        ];
        let mut buf = Vec::new();
        for r in &records {
            encode_record(&mut buf, r);
        }
        assert_eq!(
            scan(&buf),
            Scan {
                records,
                skipped: vec![]
            }
        );
    }

    /// The light scan gives what the full one does, an embedded body left empty.
    #[test]
    fn a_light_scan_is_the_full_one_without_bodies() {
        let records = vec![
            Record::Publish(publish(7, None, None)),
            Record::Publish(publish(8, Some(b"hello"), Some(99))),
            Record::Deliver { seq: 8 },
            Record::Ack { seq: 7 },
        ];
        let mut buf = Vec::new();
        for r in &records {
            encode_record(&mut buf, r);
        }
        let light: Vec<Record> = records
            .into_iter()
            .map(|r| match r {
                Record::Publish(mut p) => {
                    p.embedded = p.embedded.map(|_| Vec::new());
                    Record::Publish(p)
                }
                other => other,
            })
            .collect();
        assert_eq!(scan_light(&buf).records, light);
        assert_eq!(decode_light(&[]), None);
    }

    #[test]
    fn malformed_payloads_are_rejected() {
        assert_eq!(decode(&[]), None);
        assert_eq!(decode(&[9, 0, 0, 0, 0, 0, 0, 0, 0]), None);
        assert_eq!(decode(&[TAG_ACK, 1, 2, 3]), None);
        let mut buf = Vec::new();
        encode_publish(&mut buf, &publish(1, Some(b"abc"), None));
        let payload = &buf[RECORD_OVERHEAD..];
        assert_eq!(decode(&payload[..payload.len() - 1]), None);
        let mut bad_flags = payload.to_vec();
        bad_flags[25] |= 0x80;
        assert_eq!(decode(&bad_flags), None);
    }

    /// Found by the `store` fuzz target: a journal record of seq `u64::MAX` made recovery's
    /// next seq overflow. Seqs at or past the limit are damage, like a bad tag.
    #[test]
    fn seqs_past_the_limit_are_damage() {
        for seq in [SEQ_LIMIT, u64::MAX] {
            let (mut ack, mut publ) = (Vec::new(), Vec::new());
            encode_ack(&mut ack, seq);
            encode_publish(&mut publ, &publish(seq, None, None));
            assert_eq!(decode(&ack[RECORD_OVERHEAD..]), None);
            assert_eq!(decode(&publ[RECORD_OVERHEAD..]), None);
            assert_eq!(scan(&ack).records, vec![]);
        }
        let mut ack = Vec::new();
        encode_ack(&mut ack, SEQ_LIMIT - 1);
        assert_eq!(
            decode(&ack[RECORD_OVERHEAD..]),
            Some(Record::Ack { seq: SEQ_LIMIT - 1 })
        );
        let marker = |next_seq| CleanMarker {
            next_seq,
            unacked: 0,
        };
        let at_limit = marker(SEQ_LIMIT);
        assert_eq!(decode_clean(&encode_clean(at_limit)), Some(at_limit));
        assert_eq!(decode_clean(&encode_clean(marker(SEQ_LIMIT + 1))), None);
    }

    #[test]
    fn scan_skips_a_damaged_record_and_keeps_the_rest() {
        let mut buf = Vec::new();
        encode_ack(&mut buf, 1);
        let second = buf.len();
        encode_publish(&mut buf, &publish(2, Some(b"body"), None));
        let third = buf.len();
        encode_deliver(&mut buf, 3);
        buf[second + RECORD_OVERHEAD + 3] ^= 0xFF;
        let s = scan(&buf);
        assert_eq!(
            s.records,
            vec![Record::Ack { seq: 1 }, Record::Deliver { seq: 3 }]
        );
        assert_eq!(s.skipped, vec![(second, third)]);
    }

    #[test]
    fn scan_reports_a_torn_tail_as_a_region_to_the_end() {
        let mut buf = Vec::new();
        encode_ack(&mut buf, 1);
        let whole = buf.len();
        encode_ack(&mut buf, 2);
        buf.truncate(buf.len() - 2);
        let s = scan(&buf);
        assert_eq!(s.records, vec![Record::Ack { seq: 1 }]);
        assert_eq!(s.skipped, vec![(whole, buf.len())]);
    }

    #[test]
    fn markers_round_trip_and_reject_damage() {
        assert_eq!(decode_meta(&encode_meta(8)), Some(8));
        let m = CleanMarker {
            next_seq: 42,
            unacked: 3,
        };
        let mut bytes = encode_clean(m);
        assert_eq!(decode_clean(&bytes), Some(m));
        assert_eq!(decode_meta(&bytes), None);
        bytes[10] ^= 1;
        assert_eq!(decode_clean(&bytes), None);
    }

    proptest! {
        #[test]
        fn scan_never_panics_on_garbage(bytes in prop::collection::vec(any::<u8>(), 0..300)) {
            let s = scan(&bytes);
            for (a, b) in s.skipped {
                prop_assert!(a < b && b <= bytes.len());
            }
        }

        #[test]
        fn one_flipped_byte_loses_at_most_the_record_it_hits(
            seqs in prop::collection::vec(0u64..1000, 1..20),
            at in any::<prop::sample::Index>(),
        ) {
            let mut buf = Vec::new();
            let records: Vec<Record> = seqs
                .iter()
                .map(|&s| if s.is_multiple_of(3) {
                    Record::Publish(publish(s, Some(&[s as u8; 5]), Some(s)))
                } else {
                    Record::Ack { seq: s }
                })
                .collect();
            for r in &records {
                encode_record(&mut buf, r);
            }
            let i = at.index(buf.len());
            buf[i] ^= 0xFF;
            let s = scan(&buf);
            prop_assert!(!s.skipped.is_empty());
            prop_assert!(s.records.len() + 1 >= records.len());
            for r in &s.records {
                prop_assert!(records.contains(r));
            }
        }
    }
}

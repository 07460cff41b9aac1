//! Formats of what a clean shutdown leaves: the saved index and the `clean.dot` marker.
//!
//! Both are sequences of [`record`] frames, so a torn or flipped byte is detected rather than
//! trusted. The marker carries the length and checksum of the saved index it vouches for: a
//! stale index from an earlier shutdown can never be paired with a newer marker.
//!
//! Saved index: a header record (`WRNMSIX1`, current file, entry count), then records of up to
//! [`ENTRIES_PER_RECORD`] entries of 40 bytes: id (16), ref count (u32), file (u64), offset
//! (u64), total size (u32), all little-endian.

use crate::store::record;

use super::{Location, MsgId};

const INDEX_MAGIC: &[u8; 8] = b"WRNMSIX1";
const MARKER_MAGIC: &[u8; 8] = b"WRNCLEAN";
const ENTRY_BYTES: usize = 40;
/// Entries per record: bounds one record to about 2.6 MB.
pub(super) const ENTRIES_PER_RECORD: usize = 65536;

/// A decoded saved index.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct SavedIndex {
    pub(super) current_file: u64,
    pub(super) entries: Vec<(MsgId, u32, Location)>,
}

/// Encodes the index: `entries` as given (the caller sorts them).
pub(super) fn encode_index(current_file: u64, entries: &[(MsgId, u32, Location)]) -> Vec<u8> {
    let mut out = Vec::with_capacity(32 + entries.len() * ENTRY_BYTES * 41 / 40);
    let mut header = Vec::with_capacity(24);
    header.extend_from_slice(INDEX_MAGIC);
    header.extend_from_slice(&current_file.to_le_bytes());
    header.extend_from_slice(&(entries.len() as u64).to_le_bytes());
    record::encode(&mut out, &header);
    let mut chunk = Vec::with_capacity(ENTRIES_PER_RECORD.min(entries.len()) * ENTRY_BYTES);
    for group in entries.chunks(ENTRIES_PER_RECORD) {
        chunk.clear();
        for (id, ref_count, loc) in group {
            chunk.extend_from_slice(&id.0);
            chunk.extend_from_slice(&ref_count.to_le_bytes());
            chunk.extend_from_slice(&loc.file.to_le_bytes());
            chunk.extend_from_slice(&loc.offset.to_le_bytes());
            chunk.extend_from_slice(&loc.total_size.to_le_bytes());
        }
        record::encode(&mut out, &chunk);
    }
    out
}

fn u64_at(b: &[u8], at: usize) -> Option<u64> {
    Some(u64::from_le_bytes(b.get(at..at + 8)?.try_into().ok()?))
}

fn u32_at(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_le_bytes(b.get(at..at + 4)?.try_into().ok()?))
}

/// Decodes a saved index; `None` if anything is off (the caller then scans the files).
pub(super) fn decode_index(bytes: &[u8]) -> Option<SavedIndex> {
    let (found, valid) = record::scan(bytes);
    if valid != bytes.len() {
        return None;
    }
    let (header, chunks) = found.split_first()?;
    let h = header.payload;
    if h.len() != 24 || &h[..8] != INDEX_MAGIC {
        return None;
    }
    let current_file = u64_at(h, 8)?;
    let count = usize::try_from(u64_at(h, 16)?).ok()?;
    let mut entries = Vec::with_capacity(count.min(bytes.len() / ENTRY_BYTES));
    for chunk in chunks {
        if chunk.payload.len() % ENTRY_BYTES != 0 {
            return None;
        }
        for e in chunk.payload.chunks_exact(ENTRY_BYTES) {
            let id = MsgId::from_prefix(e)?;
            let loc = Location {
                file: u64_at(e, 20)?,
                offset: u64_at(e, 28)?,
                total_size: u32_at(e, 36)?,
            };
            entries.push((id, u32_at(e, 16)?, loc));
        }
    }
    (entries.len() == count).then_some(SavedIndex {
        current_file,
        entries,
    })
}

/// The marker vouching for the saved index `index`.
pub(super) fn encode_marker(index: &[u8]) -> Vec<u8> {
    let mut payload = Vec::with_capacity(20);
    payload.extend_from_slice(MARKER_MAGIC);
    payload.extend_from_slice(&(index.len() as u64).to_le_bytes());
    payload.extend_from_slice(&crc32fast::hash(index).to_le_bytes());
    let mut out = Vec::with_capacity(28);
    record::encode(&mut out, &payload);
    out
}

/// True when `marker` is intact and vouches for exactly `index`.
pub(super) fn marker_matches(marker: &[u8], index: &[u8]) -> bool {
    marker == encode_marker(index).as_slice()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entries(n: usize) -> Vec<(MsgId, u32, Location)> {
        (0..n)
            .map(|i| {
                let mut id = [0u8; 16];
                id[..8].copy_from_slice(&(i as u64).to_le_bytes());
                let loc = Location {
                    file: i as u64 / 3,
                    offset: i as u64 * 50,
                    total_size: 50,
                };
                (MsgId(id), i as u32 + 1, loc)
            })
            .collect()
    }

    #[test]
    fn the_index_round_trips_across_several_records() {
        let e = entries(ENTRIES_PER_RECORD + 5);
        let bytes = encode_index(7, &e);
        let back = decode_index(&bytes).expect("decodes");
        assert_eq!(back.current_file, 7);
        assert_eq!(back.entries, e);
        let empty = decode_index(&encode_index(0, &[])).expect("decodes");
        assert!(empty.entries.is_empty());
    }

    #[test]
    fn a_damaged_or_truncated_index_is_rejected() {
        let bytes = encode_index(1, &entries(10));
        assert!(decode_index(&bytes[..bytes.len() - 1]).is_none());
        let mut flipped = bytes.clone();
        flipped[40] ^= 1;
        assert!(decode_index(&flipped).is_none());
        assert!(decode_index(b"").is_none());
        // A whole record missing: the count no longer matches.
        let mut short = Vec::new();
        record::encode(&mut short, &{
            let mut h = INDEX_MAGIC.to_vec();
            h.extend_from_slice(&0u64.to_le_bytes());
            h.extend_from_slice(&3u64.to_le_bytes());
            h
        });
        assert!(decode_index(&short).is_none());
    }

    #[test]
    fn the_marker_only_vouches_for_its_own_index() {
        let a = encode_index(1, &entries(3));
        let b = encode_index(1, &entries(4));
        let m = encode_marker(&a);
        assert!(marker_matches(&m, &a));
        assert!(!marker_matches(&m, &b));
        assert!(!marker_matches(&m[..m.len() - 1], &a));
    }
}

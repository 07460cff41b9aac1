//! Record framing for append-only files: `len: u32 LE, crc32: u32 LE, payload[len]`.
//!
//! A crash can leave a file ending in a partial record, and a bad disk can flip bytes. The
//! checksum covers the payload; [`scan`] returns the records up to the first one that is
//! incomplete or fails its checksum, and the length of that valid prefix, so recovery cuts
//! the file there instead of trusting garbage.

/// Bytes of framing per record.
pub const RECORD_OVERHEAD: usize = 8;
/// Largest payload accepted when scanning (a corrupt length must not allocate gigabytes).
pub const RECORD_PAYLOAD_MAX: usize = 512 * 1024 * 1024;

/// Appends one framed record.
pub fn encode(out: &mut Vec<u8>, payload: &[u8]) {
    out.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    out.extend_from_slice(&crc32fast::hash(payload).to_le_bytes());
    out.extend_from_slice(payload);
}

/// One record found by [`scan`]: its offset in the file and its payload.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Found<'a> {
    /// Offset of the record's framing in the buffer.
    pub offset: usize,
    /// The payload.
    pub payload: &'a [u8],
}

/// The valid records at the start of `buf`, and the length of that valid prefix.
pub fn scan(buf: &[u8]) -> (Vec<Found<'_>>, usize) {
    let mut found = Vec::new();
    let mut pos = 0;
    while buf.len() - pos >= RECORD_OVERHEAD {
        let len = u32::from_le_bytes(buf[pos..pos + 4].try_into().expect("4 bytes")) as usize;
        let crc = u32::from_le_bytes(buf[pos + 4..pos + 8].try_into().expect("4 bytes"));
        if len > RECORD_PAYLOAD_MAX || buf.len() - pos - RECORD_OVERHEAD < len {
            break;
        }
        let payload = &buf[pos + RECORD_OVERHEAD..pos + RECORD_OVERHEAD + len];
        if crc32fast::hash(payload) != crc {
            break;
        }
        found.push(Found {
            offset: pos,
            payload,
        });
        pos += RECORD_OVERHEAD + len;
    }
    (found, pos)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn scan_stops_at_a_torn_tail() {
        let mut buf = Vec::new();
        encode(&mut buf, b"first");
        encode(&mut buf, b"second");
        let whole = buf.len();
        encode(&mut buf, b"third, torn");
        buf.truncate(buf.len() - 3);
        let (found, valid) = scan(&buf);
        assert_eq!(found.len(), 2);
        assert_eq!(found[1].payload, b"second");
        assert_eq!(valid, whole);
    }

    #[test]
    fn scan_stops_at_a_corrupt_record() {
        let mut buf = Vec::new();
        encode(&mut buf, b"good");
        let good = buf.len();
        encode(&mut buf, b"flipped");
        buf[good + RECORD_OVERHEAD] ^= 1;
        let (found, valid) = scan(&buf);
        assert_eq!((found.len(), valid), (1, good));
    }

    proptest! {
        #[test]
        fn scan_never_panics_and_never_passes_garbage(bytes in prop::collection::vec(any::<u8>(), 0..200)) {
            let (found, valid) = scan(&bytes);
            prop_assert!(valid <= bytes.len());
            for f in found {
                prop_assert!(f.offset + RECORD_OVERHEAD + f.payload.len() <= valid);
            }
        }
    }
}

//! Byte fields that decode as views of the buffer they arrived in, not as copies.
//!
//! A mirrored publish is nested five encodings deep on the node link (link envelope, GM
//! frame, GM message, mirror message, operations, stored message), each with its bytes as
//! one length-prefixed field. Decoded the usual way (`Vec<u8>`, or `Bytes`' own serde
//! impl), every layer copies the body once more: with large messages that was a fifth of a
//! mirrored cluster's CPU (`docs/performance.md`). A field declared
//! `#[serde(with = "crate::shared_bytes")]` instead becomes a [`Bytes`] that shares the
//! buffer being decoded, when the decoder runs inside [`decode_in`] over that buffer.
//! Elsewhere (another format, a reader, no buffer set) it is copied as before, so the
//! encoding on the wire is exactly `serde_bytes`'.
//!
//! The buffer is passed through a thread-local because serde gives a field's deserializer
//! no way to reach it; [`decode_in`] sets it for one synchronous decode and restores what
//! was there, so decodes nest (a payload decoded inside the frame it came in).
//!
//! A view keeps its whole buffer alive. The decoded layers here live no longer than a
//! round (a mirror writes the operations and drops them; GM holds a message until its
//! ack lap), so what is kept is the frame for a lap, not the body for a queue's life.

use std::cell::RefCell;

use bytes::Bytes;
use serde::de::{Deserializer, Error, Visitor};
use serde::Serializer;

thread_local! {
    static SOURCE: RefCell<Option<Bytes>> = const { RefCell::new(None) };
}

/// Runs `decode` over `source`'s bytes; the shared-bytes fields it decodes are views of
/// `source`.
pub fn decode_in<T>(source: &Bytes, decode: impl FnOnce(&[u8]) -> T) -> T {
    let outer = SOURCE.with(|s| s.replace(Some(source.clone())));
    // Restores the outer buffer even if `decode` unwinds.
    struct Restore(Option<Bytes>);
    impl Drop for Restore {
        fn drop(&mut self) {
            let outer = self.0.take();
            SOURCE.with(|s| *s.borrow_mut() = outer);
        }
    }
    let _restore = Restore(outer);
    decode(source)
}

/// `bytes` as a view of the buffer [`decode_in`] set, when it lies inside it; else a copy.
fn share(bytes: &[u8]) -> Bytes {
    SOURCE.with(|s| match s.borrow().as_ref() {
        Some(src) if within(src, bytes) => src.slice_ref(bytes),
        _ => Bytes::copy_from_slice(bytes),
    })
}

fn within(src: &[u8], part: &[u8]) -> bool {
    let (start, end) = (src.as_ptr() as usize, src.as_ptr() as usize + src.len());
    let p = part.as_ptr() as usize;
    p >= start && p + part.len() <= end
}

/// Encodes as serde bytes (the same as `serde_bytes` on a `Vec<u8>`).
pub fn serialize<S: Serializer>(bytes: &Bytes, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_bytes(bytes)
}

/// Decodes serde bytes, as a view when the decoder borrows from the [`decode_in`] buffer.
pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Bytes, D::Error> {
    d.deserialize_bytes(SharedVisitor)
}

/// A payload type for generic messages (`GmMsg<M>`): [`Bytes`] decoded as a view. Decode
/// with it, then unwrap (`.0`) into the `Bytes` the rest of the code holds.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Shared(#[serde(with = "self")] pub Bytes);

struct SharedVisitor;

impl<'de> Visitor<'de> for SharedVisitor {
    type Value = Bytes;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("bytes")
    }

    fn visit_borrowed_bytes<E: Error>(self, v: &'de [u8]) -> Result<Bytes, E> {
        Ok(share(v))
    }

    fn visit_bytes<E: Error>(self, v: &[u8]) -> Result<Bytes, E> {
        Ok(Bytes::copy_from_slice(v))
    }

    fn visit_byte_buf<E: Error>(self, v: Vec<u8>) -> Result<Bytes, E> {
        Ok(Bytes::from(v))
    }

    // Formats without a bytes type (JSON) send a sequence of numbers.
    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Bytes, A::Error> {
        let mut out = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(4096));
        while let Some(b) = seq.next_element::<u8>()? {
            out.push(b);
        }
        Ok(Bytes::from(out))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::{Deserialize, Serialize};

    #[derive(Serialize, Deserialize, Debug, PartialEq)]
    struct Outer {
        tag: u32,
        #[serde(with = "crate::shared_bytes")]
        payload: Bytes,
    }

    #[derive(Serialize, Deserialize, Debug, PartialEq)]
    struct Plain {
        tag: u32,
        #[serde(with = "serde_bytes")]
        payload: Vec<u8>,
    }

    fn is_view(of: &Bytes, part: &Bytes) -> bool {
        within(of, part)
    }

    #[test]
    fn encodes_as_serde_bytes() {
        let shared = Outer {
            tag: 7,
            payload: Bytes::from_static(b"body"),
        };
        let plain = Plain {
            tag: 7,
            payload: b"body".to_vec(),
        };
        assert_eq!(
            bincode::serialize(&shared).unwrap(),
            bincode::serialize(&plain).unwrap()
        );
    }

    #[test]
    fn decodes_a_view_inside_decode_in_and_a_copy_outside() {
        let wire = Bytes::from(
            bincode::serialize(&Outer {
                tag: 1,
                payload: Bytes::from(vec![9u8; 1000]),
            })
            .unwrap(),
        );
        let inside: Outer = decode_in(&wire, |b| bincode::deserialize(b)).unwrap();
        assert_eq!(inside.payload, vec![9u8; 1000]);
        assert!(is_view(&wire, &inside.payload));
        let outside: Outer = bincode::deserialize(&wire).unwrap();
        assert_eq!(outside, inside);
        assert!(!is_view(&wire, &outside.payload));
    }

    #[test]
    fn nested_decodes_share_the_innermost_buffer_and_restore_the_outer() {
        let inner = bincode::serialize(&Outer {
            tag: 2,
            payload: Bytes::from_static(b"innermost"),
        })
        .unwrap();
        let wire = Bytes::from(
            bincode::serialize(&Outer {
                tag: 1,
                payload: Bytes::from(inner),
            })
            .unwrap(),
        );
        decode_in(&wire, |b| {
            let outer: Outer = bincode::deserialize(b).unwrap();
            let inner: Outer = decode_in(&outer.payload, |b| bincode::deserialize(b)).unwrap();
            assert_eq!(&inner.payload[..], b"innermost");
            assert!(is_view(&wire, &inner.payload));
            // Back in the outer decode: its buffer is the source again.
            let again: Outer = bincode::deserialize(b).unwrap();
            assert!(is_view(&wire, &again.payload));
        });
        SOURCE.with(|s| assert!(s.borrow().is_none()));
    }

    #[test]
    fn a_buffer_from_elsewhere_is_copied() {
        let wire = Bytes::from(
            bincode::serialize(&Outer {
                tag: 1,
                payload: Bytes::from_static(b"x"),
            })
            .unwrap(),
        );
        let other = Bytes::from_static(b"unrelated");
        let got: Outer = decode_in(&other, |_| bincode::deserialize(&wire)).unwrap();
        assert_eq!(&got.payload[..], b"x");
        assert!(!is_view(&wire, &got.payload));
    }

    #[test]
    fn json_round_trips() {
        let v = Outer {
            tag: 3,
            payload: Bytes::from_static(b"ab"),
        };
        let s = serde_json::to_string(&v).unwrap();
        assert_eq!(serde_json::from_str::<Outer>(&s).unwrap(), v);
    }
}

//! How a message is laid out on disk (message store record or embedded in the queue index):
//! `exchange_len:u8 exchange routing_key_len:u8 routing_key properties_len:u32 LE properties
//! body`. Properties are kept raw, exactly as the publisher sent them.

use bytes::Bytes;

/// The stored form of a message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredMessage {
    /// Exchange published to.
    pub exchange: String,
    /// Routing key.
    pub routing_key: String,
    /// Raw property flags and values.
    pub properties_raw: Bytes,
    /// Body.
    pub body: Bytes,
}

/// Bytes [`StoredMessage::encode`] produces for these fields.
pub fn encoded_len(exchange: &str, routing_key: &str, properties: usize, body: usize) -> usize {
    2 + exchange.len().min(255) + routing_key.len().min(255) + 4 + properties + body
}

/// Appends the encoding up to the body of a message with these fields
/// ([`StoredMessage::encode`] is this followed by the body, which a writer can then take
/// from where it is instead of copying it into one buffer with the rest).
pub fn encode_head(out: &mut Vec<u8>, exchange: &str, routing_key: &str, properties: &[u8]) {
    short(out, exchange);
    short(out, routing_key);
    out.extend_from_slice(&(properties.len() as u32).to_le_bytes());
    out.extend_from_slice(properties);
}

/// Why stored bytes do not decode.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("stored message is truncated or malformed")]
pub struct CodecError;

fn short(out: &mut Vec<u8>, s: &str) {
    let b = &s.as_bytes()[..s.len().min(255)];
    out.push(b.len() as u8);
    out.extend_from_slice(b);
}

impl StoredMessage {
    /// Bytes [`StoredMessage::encode`] produces.
    pub fn encoded_len(&self) -> usize {
        encoded_len(
            &self.exchange,
            &self.routing_key,
            self.properties_raw.len(),
            self.body.len(),
        )
    }

    /// Serialises.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.encoded_len());
        encode_head(
            &mut out,
            &self.exchange,
            &self.routing_key,
            &self.properties_raw,
        );
        out.extend_from_slice(&self.body);
        out
    }

    /// Parses what [`StoredMessage::encode`] wrote (properties and body copied out).
    pub fn decode(bytes: &[u8]) -> Result<StoredMessage, CodecError> {
        let (exchange, routing_key, props, body) = Self::parse(bytes)?;
        Ok(StoredMessage {
            exchange,
            routing_key,
            properties_raw: Bytes::copy_from_slice(&bytes[props]),
            body: Bytes::copy_from_slice(&bytes[body]),
        })
    }

    /// Parses what [`StoredMessage::encode`] wrote, the properties and the body as views of
    /// `bytes` (a mirrored publish's body is not copied on its way to the mirror's store).
    pub fn decode_shared(bytes: &Bytes) -> Result<StoredMessage, CodecError> {
        let (exchange, routing_key, props, body) = Self::parse(bytes)?;
        Ok(StoredMessage {
            exchange,
            routing_key,
            properties_raw: bytes.slice(props),
            body: bytes.slice(body),
        })
    }

    /// Exchange, routing key, and where the properties and the body are.
    #[allow(clippy::type_complexity)]
    fn parse(
        bytes: &[u8],
    ) -> Result<
        (
            String,
            String,
            std::ops::Range<usize>,
            std::ops::RangeFrom<usize>,
        ),
        CodecError,
    > {
        let mut pos = 0;
        let mut take = |n: usize| -> Result<&[u8], CodecError> {
            let s = bytes.get(pos..pos + n).ok_or(CodecError)?;
            pos += n;
            Ok(s)
        };
        let n = take(1)?[0] as usize;
        let exchange = String::from_utf8(take(n)?.to_vec()).map_err(|_| CodecError)?;
        let n = take(1)?[0] as usize;
        let routing_key = String::from_utf8(take(n)?.to_vec()).map_err(|_| CodecError)?;
        let n = u32::from_le_bytes(take(4)?.try_into().map_err(|_| CodecError)?) as usize;
        take(n)?;
        Ok((exchange, routing_key, pos - n..pos, pos..))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn round_trips(ex in "[a-z.]{0,20}", rk in "[a-z.#*]{0,40}", props in prop::collection::vec(any::<u8>(), 0..30), body in prop::collection::vec(any::<u8>(), 0..300)) {
            let m = StoredMessage { exchange: ex, routing_key: rk, properties_raw: Bytes::from(props), body: Bytes::from(body) };
            let e = m.encode();
            prop_assert_eq!(e.len(), m.encoded_len());
            prop_assert_eq!(StoredMessage::decode(&e).unwrap(), m);
        }

        #[test]
        fn the_head_is_the_encoding_before_the_body(ex in "[a-z.]{0,300}", props in prop::collection::vec(any::<u8>(), 0..30), body in prop::collection::vec(any::<u8>(), 0..300)) {
            let m = StoredMessage { exchange: ex, routing_key: "rk".into(), properties_raw: Bytes::from(props), body: Bytes::from(body) };
            let mut joined = Vec::new();
            encode_head(&mut joined, &m.exchange, &m.routing_key, &m.properties_raw);
            joined.extend_from_slice(&m.body);
            prop_assert_eq!(joined, m.encode());
        }

        #[test]
        fn shared_decode_is_the_copying_decode_as_views(ex in "[a-z.]{0,20}", props in prop::collection::vec(any::<u8>(), 0..30), body in prop::collection::vec(any::<u8>(), 0..300)) {
            let m = StoredMessage { exchange: ex, routing_key: "rk".into(), properties_raw: Bytes::from(props), body: Bytes::from(body) };
            let e = Bytes::from(m.encode());
            let shared = StoredMessage::decode_shared(&e).unwrap();
            prop_assert_eq!(&shared, &m);
            let end = e.as_ptr() as usize + e.len();
            prop_assert_eq!(shared.body.as_ptr() as usize + shared.body.len(), end);
        }

        #[test]
        fn garbage_never_panics(bytes in prop::collection::vec(any::<u8>(), 0..64)) {
            let _ = StoredMessage::decode(&bytes);
            let _ = StoredMessage::decode_shared(&Bytes::from(bytes));
        }
    }
}

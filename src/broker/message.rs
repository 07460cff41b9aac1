//! A published message as the broker holds it: routing info, raw and parsed properties, body.

use amq_protocol::protocol::basic::AMQPProperties;
use bytes::Bytes;

/// An immutable message, shared by every queue it was routed to.
#[derive(Debug, Clone)]
pub struct Message {
    /// Node-unique id; the message store keys bodies by it (written once, refcounted).
    pub id: u128,
    /// The exchange it was published to.
    pub exchange: String,
    /// The routing key it was published with.
    pub routing_key: String,
    /// Property flags and values exactly as received (forwarded unchanged).
    pub properties_raw: Bytes,
    /// Parsed properties.
    pub properties: AMQPProperties,
    /// The body.
    pub body: Bytes,
}

impl Message {
    /// The message whose stored form (`store::message_codec::StoredMessage`) is `bytes`,
    /// with id `id`; `None` if the bytes or its properties do not decode, or its headers nest
    /// deeper than `amqp::nesting::NESTING_MAX`.
    pub fn from_stored(bytes: &[u8], id: u128) -> Option<Message> {
        Self::of_stored(
            crate::store::message_codec::StoredMessage::decode(bytes).ok()?,
            id,
        )
    }

    /// [`Message::from_stored`] with the properties and body as views of `bytes`, not
    /// copies.
    pub fn from_stored_shared(bytes: &Bytes, id: u128) -> Option<Message> {
        Self::of_stored(
            crate::store::message_codec::StoredMessage::decode_shared(bytes).ok()?,
            id,
        )
    }

    fn of_stored(stored: crate::store::message_codec::StoredMessage, id: u128) -> Option<Message> {
        // A damaged or forged file must not overflow the stack in the recursive parser.
        if crate::amqp::nesting::properties_too_deep(&stored.properties_raw) {
            return None;
        }
        let (_, properties) =
            amq_protocol::protocol::basic::parse_properties(&stored.properties_raw[..]).ok()?;
        Some(Message {
            id,
            exchange: stored.exchange,
            routing_key: stored.routing_key,
            properties_raw: stored.properties_raw,
            properties,
            body: stored.body,
        })
    }

    /// The stored form of this message (what the message store and the index keep).
    pub fn to_stored(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.stored_len());
        self.encode_stored_head(&mut out);
        out.extend_from_slice(&self.body);
        out
    }

    /// The stored form up to the body: [`to_stored`](Self::to_stored) is this followed
    /// by [`Message::body`].
    pub fn stored_head(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.stored_len() - self.body.len());
        self.encode_stored_head(&mut out);
        out
    }

    /// Appends [`stored_head`](Self::stored_head)'s bytes to `out`.
    pub fn encode_stored_head(&self, out: &mut Vec<u8>) {
        crate::store::message_codec::encode_head(
            out,
            &self.exchange,
            &self.routing_key,
            &self.properties_raw,
        );
    }

    /// The length of [`to_stored`](Self::to_stored)'s bytes.
    pub fn stored_len(&self) -> usize {
        crate::store::message_codec::encoded_len(
            &self.exchange,
            &self.routing_key,
            self.properties_raw.len(),
            self.body.len(),
        )
    }

    /// Bytes this message accounts for in memory.
    pub fn size(&self) -> u64 {
        (self.body.len() + self.properties_raw.len() + self.routing_key.len() + 64) as u64
    }

    /// `delivery_mode = 2`.
    pub fn persistent(&self) -> bool {
        *self.properties.delivery_mode() == Some(2)
    }

    /// The per-message TTL from the `expiration` property, if valid.
    pub fn expiration_ms(&self) -> Option<u64> {
        self.properties
            .expiration()
            .as_ref()
            .and_then(|e| e.as_str().parse::<u64>().ok())
    }

    /// The `priority` property.
    pub fn priority(&self) -> u8 {
        self.properties.priority().unwrap_or(0)
    }
}

/// Checks the `delivery_mode` property as RabbitMQ does: absent, 1 or 2.
pub fn validate_delivery_mode(properties: &AMQPProperties) -> Result<(), String> {
    match properties.delivery_mode() {
        None | Some(1) | Some(2) => Ok(()),
        Some(m) => Err(format!("invalid message: {{delivery_mode_unknown,{m}}}")),
    }
}

/// Checks the `expiration` property as RabbitMQ does: absent, or a non-negative integer.
pub fn validate_expiration(properties: &AMQPProperties) -> Result<(), String> {
    match properties.expiration() {
        None => Ok(()),
        Some(e) if e.as_str().parse::<u64>().is_ok() => Ok(()),
        // RabbitMQ's reasons: `{value_negative,N}` for a negative integer, else `no_integer`.
        Some(e) => match e.as_str().parse::<i64>() {
            Ok(n) => Err(format!(
                "invalid expiration '{}': {{value_negative,{n}}}",
                e.as_str()
            )),
            Err(_) => Err(format!("invalid expiration '{}': no_integer", e.as_str())),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Regression (issue 21): a stored message whose headers nest 10,000 deep (a damaged
    /// or forged store file) overflowed the stack in amq-protocol's parser at recovery.
    #[test]
    fn stored_message_with_too_deep_headers_does_not_decode() {
        let mut v = vec![b'V'];
        for _ in 0..10_000 {
            let mut n = vec![b'A'];
            n.extend_from_slice(&(v.len() as u32).to_be_bytes());
            n.extend_from_slice(&v);
            v = n;
        }
        let mut fields = vec![1u8, b'a'];
        fields.extend_from_slice(&v);
        let mut raw = vec![0x20, 0x00];
        raw.extend_from_slice(&(fields.len() as u32).to_be_bytes());
        raw.extend_from_slice(&fields);
        let stored = crate::store::message_codec::StoredMessage {
            exchange: "x".into(),
            routing_key: "rk".into(),
            properties_raw: Bytes::from(raw),
            body: Bytes::from_static(b"body"),
        }
        .encode();
        assert!(Message::from_stored(&stored, 1).is_none());
    }
}

//! The node-link wire format: length-delimited frames (a 4-byte big-endian length, then the
//! body) whose body is one bincode-encoded [`Envelope`].
//!
//! The framing is generic over the stream ([`FrameReader`], [`FrameWriter`]): a plaintext
//! TCP link and a TLS one (`[cluster.tls]`) run the same code, each half boxed.
//!
//! Both layers are bounded by the same `max_frame`: the codec refuses a length prefix above
//! it before reading the body, and bincode refuses a body that claims more than it, so a
//! hostile or corrupt peer cannot make us allocate unbounded memory.

use bincode::Options;
use bytes::{Bytes, BytesMut};
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio_util::codec::{Decoder, Encoder, LengthDelimitedCodec};

use super::LinkError;
use crate::runtime::raft::NodeId;

/// Bumped when [`Envelope`] changes incompatibly; a peer speaking another version is refused.
/// 4: heartbeats carry the sender's resource alarms. 5: a listed connection carries its
/// start time and socket counters. 6: a queue's listed figures carry its head message's
/// timestamp and its exclusive or single active consumer's tag; a node's figures carry its
/// listeners, storage I/O and node links. 7: the relay's deliveries, gets and settles name
/// the queue's instance. 8: a forwarded proposal asks for, and its answer names, the nodes
/// the leader served reads to (`cluster::read_log`).
pub const PROTOCOL_VERSION: u32 = 8;

/// Which local service a request is for. Only Raft exists today; GM activity, forwarded
/// publishes and deliveries get their own variants so they share the one connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Service {
    /// The metadata Raft group's RPCs.
    Raft,
    /// Broker traffic for queues of another node (publishes, consumers, acks,
    /// deliveries): handled in arrival order, see [`super::transport::BrokerService`].
    Broker,
    /// GM frames between members' hosts ([`crate::runtime::gm_host`]).
    Gm,
}

/// Why a peer could not answer a request.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
pub enum RemoteFailure {
    /// The peer has no handler for that service yet (it is still starting).
    #[error("peer is not serving that service")]
    NotServing,
}

/// Everything that crosses a node link.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Envelope {
    /// The first frame each side sends: who it is and which cluster it belongs to.
    Hello {
        /// The cluster's id; a mismatch is refused.
        cluster_id: String,
        /// The sender's node id; an unknown one is refused.
        node_id: NodeId,
        /// [`PROTOCOL_VERSION`] of the sender.
        version: u32,
    },
    /// Sent instead of a `Hello` answer before the acceptor closes, so the dialer can log why.
    Refused {
        /// Human-readable reason.
        reason: String,
    },
    /// A call; answered by a `Response` with the same id on the same link.
    Request {
        /// Chosen by the caller, unique per link.
        id: u64,
        /// Which handler gets `payload`.
        service: Service,
        /// Opaque to the link. Encoded as serde bytes; decoded by [`decode_body`] as a view
        /// of the frame, not a copy (`crate::shared_bytes`).
        #[serde(with = "crate::shared_bytes")]
        payload: Bytes,
    },
    /// The answer to the `Request` with `id`.
    Response {
        /// The request's id.
        id: u64,
        /// The handler's reply frame, or why there is none.
        #[serde(with = "reply_bytes")]
        result: Result<Vec<u8>, RemoteFailure>,
    },
    /// Sent every heartbeat interval; any frame counts as a sign of life. It carries the
    /// sender's resource alarms (`broker::alarm` bits): as in RabbitMQ, an alarm on any
    /// node blocks publishers on every node.
    Heartbeat {
        /// The sender's alarms when it sent this.
        alarms: u8,
    },
}

/// `Response::result` with its frame as bytes (see `Request::payload`).
mod reply_bytes {
    use serde::{Deserialize, Deserializer, Serialize, Serializer};
    use serde_bytes::{ByteBuf, Bytes};

    use super::RemoteFailure;

    pub fn serialize<S: Serializer>(
        r: &Result<Vec<u8>, RemoteFailure>,
        s: S,
    ) -> Result<S::Ok, S::Error> {
        r.as_ref().map(|v| Bytes::new(v)).serialize(s)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(
        d: D,
    ) -> Result<Result<Vec<u8>, RemoteFailure>, D::Error> {
        let r: Result<ByteBuf, RemoteFailure> = Deserialize::deserialize(d)?;
        Ok(r.map(ByteBuf::into_vec))
    }
}

fn options(max_frame: usize) -> impl Options {
    bincode::DefaultOptions::new()
        .with_fixint_encoding()
        .with_limit(max_frame as u64)
        .reject_trailing_bytes()
}

/// The framing codec with the given largest body.
pub fn codec(max_frame: usize) -> LengthDelimitedCodec {
    LengthDelimitedCodec::builder()
        .max_frame_length(max_frame)
        .new_codec()
}

/// Encodes `env` as a frame body.
pub fn encode_body(env: &Envelope, max_frame: usize) -> Result<Bytes, LinkError> {
    options(max_frame)
        .serialize(env)
        .map(Bytes::from)
        .map_err(LinkError::Encode)
}

/// Decodes a frame body; a request's payload is a view of `body`.
pub fn decode_body(body: &Bytes, max_frame: usize) -> Result<Envelope, LinkError> {
    crate::shared_bytes::decode_in(body, |b| options(max_frame).deserialize(b))
        .map_err(LinkError::Decode)
}

/// Encodes `env` as a whole frame (length prefix included): what a peer writes on the socket.
/// Public so tests can speak the protocol on a raw socket.
pub fn encode_frame(env: &Envelope, max_frame: usize) -> Result<BytesMut, LinkError> {
    let body = encode_body(env, max_frame)?;
    let mut out = BytesMut::new();
    codec(max_frame)
        .encode(body, &mut out)
        .map_err(|e| LinkError::Frame(e.to_string()))?;
    Ok(out)
}

/// The next envelope of a stream's bytes in `buf` (consumed from it), `None` while a frame
/// is incomplete. Pure: [`FrameReader`] runs it on what the socket gave, and the fuzz
/// target `node_link` (`crate::fuzzing`) on arbitrary bytes.
pub fn next_envelope(
    codec: &mut LengthDelimitedCodec,
    buf: &mut BytesMut,
    max_frame: usize,
) -> Result<Option<Envelope>, LinkError> {
    match codec.decode(buf) {
        Ok(Some(body)) => decode_body(&body.freeze(), max_frame).map(Some),
        Ok(None) => Ok(None),
        Err(e) => Err(LinkError::Frame(e.to_string())),
    }
}

/// The read half of a link's stream, plaintext or TLS.
pub(crate) type LinkRead = Box<dyn AsyncRead + Send + Unpin>;
/// The write half of a link's stream, plaintext or TLS.
pub(crate) type LinkWrite = Box<dyn AsyncWrite + Send + Unpin>;

/// Reads envelopes from one stream.
pub(crate) struct FrameReader<R = LinkRead> {
    rd: R,
    buf: BytesMut,
    codec: LengthDelimitedCodec,
    max_frame: usize,
    /// Bytes read from the stream so far.
    read: u64,
}

impl<R: AsyncRead + Unpin> FrameReader<R> {
    pub(crate) fn new(rd: R, max_frame: usize) -> FrameReader<R> {
        FrameReader {
            rd,
            buf: BytesMut::with_capacity(8 * 1024),
            codec: codec(max_frame),
            max_frame,
            read: 0,
        }
    }

    /// Bytes read from the stream so far.
    pub(crate) fn bytes_read(&self) -> u64 {
        self.read
    }

    /// The next envelope; `None` at a clean end of stream. Any error means the link is
    /// unusable: the stream's framing can no longer be trusted.
    pub(crate) async fn next(&mut self) -> Result<Option<Envelope>, LinkError> {
        loop {
            if let Some(env) = next_envelope(&mut self.codec, &mut self.buf, self.max_frame)? {
                return Ok(Some(env));
            }
            let n = self.rd.read_buf(&mut self.buf).await?;
            self.read += n as u64;
            if n == 0 {
                return if self.buf.is_empty() {
                    Ok(None)
                } else {
                    Err(LinkError::Frame("stream ended inside a frame".into()))
                };
            }
        }
    }
}

/// Writes envelopes to one stream.
pub(crate) struct FrameWriter<W = LinkWrite> {
    wr: W,
    buf: BytesMut,
    max_frame: usize,
    /// Bytes written to the stream so far.
    written: u64,
}

impl<W: AsyncWrite + Unpin> FrameWriter<W> {
    pub(crate) fn new(wr: W, max_frame: usize) -> FrameWriter<W> {
        FrameWriter {
            wr,
            buf: BytesMut::with_capacity(8 * 1024),
            max_frame,
            written: 0,
        }
    }

    /// Bytes written to the stream so far.
    pub(crate) fn bytes_written(&self) -> u64 {
        self.written
    }

    /// Encodes and writes one envelope.
    pub(crate) async fn send(&mut self, env: &Envelope) -> Result<(), LinkError> {
        self.push(env)?;
        self.write_pushed().await
    }

    /// Encodes one envelope after those pushed before, to go out with them in one write
    /// ([`FrameWriter::write_pushed`]).
    /// The envelope is encoded in place, after a length prefix patched in afterwards: the
    /// same bytes as [`encode_frame`], without first encoding it into a buffer of its own
    /// (a large payload would be copied once more).
    pub(crate) fn push(&mut self, env: &Envelope) -> Result<(), LinkError> {
        use bytes::BufMut;
        let at = self.buf.len();
        self.buf.put_u32(0);
        let encoded = options(self.max_frame).serialize_into((&mut self.buf).writer(), env);
        let len = self.buf.len() - at - 4;
        if let Err(e) = encoded {
            self.buf.truncate(at);
            return Err(LinkError::Encode(e));
        }
        if len > self.max_frame {
            self.buf.truncate(at);
            return Err(LinkError::Frame(format!(
                "frame of {len} bytes exceeds the {}-byte limit",
                self.max_frame
            )));
        }
        self.buf[at..at + 4].copy_from_slice(&(len as u32).to_be_bytes());
        Ok(())
    }

    /// Bytes pushed and not written yet.
    pub(crate) fn pushed(&self) -> usize {
        self.buf.len()
    }

    /// Writes every pushed envelope: one write, and on TLS as few records as the bytes
    /// need, instead of one per frame.
    pub(crate) async fn write_pushed(&mut self) -> Result<(), LinkError> {
        self.wr.write_all(&self.buf).await?;
        self.written += self.buf.len() as u64;
        self.buf.clear();
        // A no-op on TCP; a TLS stream may keep the end of a record in its buffer when the
        // socket was full, and nothing else would push it out before the next frame.
        self.wr.flush().await?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `Envelope` before its payloads were marked as bytes.
    #[derive(Serialize)]
    enum PlainEnvelope {
        #[allow(dead_code)]
        Hello {
            cluster_id: String,
            node_id: NodeId,
            version: u32,
        },
        #[allow(dead_code)]
        Refused { reason: String },
        Request {
            id: u64,
            service: Service,
            payload: Vec<u8>,
        },
        Response {
            id: u64,
            result: Result<Vec<u8>, RemoteFailure>,
        },
    }

    #[test]
    fn payloads_as_bytes_encode_as_the_sequences_they_were() {
        let max = 1 << 20;
        let payload: Vec<u8> = (0..=255u8).cycle().take(1500).collect();
        let pairs = [
            (
                Envelope::Request {
                    id: 7,
                    service: Service::Gm,
                    payload: Bytes::from(payload.clone()),
                },
                PlainEnvelope::Request {
                    id: 7,
                    service: Service::Gm,
                    payload: payload.clone(),
                },
            ),
            (
                Envelope::Response {
                    id: 8,
                    result: Ok(payload.clone()),
                },
                PlainEnvelope::Response {
                    id: 8,
                    result: Ok(payload.clone()),
                },
            ),
            (
                Envelope::Response {
                    id: 9,
                    result: Err(RemoteFailure::NotServing),
                },
                PlainEnvelope::Response {
                    id: 9,
                    result: Err(RemoteFailure::NotServing),
                },
            ),
        ];
        for (env, plain) in pairs {
            let body = encode_body(&env, max).expect("encodes");
            let old = options(max).serialize(&plain).expect("encodes");
            assert_eq!(body.as_ref(), old.as_slice(), "{env:?}");
            assert_eq!(decode_body(&body, max).expect("decodes"), env);
        }
    }

    /// `push` writes what `encode_frame` (the codec's framing) writes, and refuses what
    /// does not fit without leaving a partial frame behind.
    #[test]
    fn push_writes_the_codec_framing_and_refuses_oversized_frames_cleanly() {
        let max = 4096;
        let (client, _server) = tokio::io::duplex(1 << 16);
        let mut writer = FrameWriter::new(client, max);
        let mut expected = BytesMut::new();
        for n in [0usize, 1, 1000, 4000] {
            let env = Envelope::Request {
                id: n as u64,
                service: Service::Gm,
                payload: Bytes::from(vec![n as u8; n]),
            };
            writer.push(&env).expect("fits");
            expected.extend_from_slice(&encode_frame(&env, max).expect("encodes"));
        }
        let too_big = Envelope::Request {
            id: 9,
            service: Service::Gm,
            payload: Bytes::from(vec![1u8; max]),
        };
        assert!(writer.push(&too_big).is_err());
        assert!(encode_frame(&too_big, max).is_err());
        assert_eq!(&writer.buf[..], &expected[..]);
    }

    /// A write loop's batch: envelopes pushed one after another leave in one write and are
    /// read back as the same envelopes in the same order; nothing is written before.
    #[tokio::test]
    async fn pushed_envelopes_go_out_in_one_write_and_read_back_in_order() {
        let max = 1 << 20;
        let (client, server) = tokio::io::duplex(1 << 20);
        let mut writer = FrameWriter::new(client, max);
        let envs: Vec<Envelope> = (0..5u64)
            .map(|id| Envelope::Request {
                id,
                service: Service::Raft,
                payload: Bytes::from(vec![id as u8; 100 * id as usize]),
            })
            .collect();
        for env in &envs {
            writer.push(env).expect("encodes");
        }
        assert!(writer.pushed() > 5 * 4, "all five are buffered");
        let pushed = writer.pushed() as u64;
        assert_eq!(writer.bytes_written(), 0);
        let mut reader = FrameReader::new(server, max);
        let early = tokio::time::timeout(std::time::Duration::from_millis(50), reader.next()).await;
        assert!(early.is_err(), "nothing is written before write_pushed");
        writer.write_pushed().await.expect("writes");
        assert_eq!(writer.pushed(), 0);
        for env in &envs {
            assert_eq!(reader.next().await.expect("reads").as_ref(), Some(env));
        }
        // Both ends count the bytes that crossed: the link's cluster_links figures.
        assert_eq!(writer.bytes_written(), pushed);
        assert_eq!(reader.bytes_read(), pushed);
    }
}

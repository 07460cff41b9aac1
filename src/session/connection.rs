//! The connection state machine.
//!
//! # Contract
//! - Inputs: [`Connection::handle_bytes`] (returns how many bytes it consumed; the caller
//!   keeps the rest and calls again with more), [`Connection::handle_timeout`],
//!   [`Connection::handle_outbox`] (deliveries queued by the broker), [`Connection::handle_alarm`]
//!   (memory watermark), [`Connection::handle_shutdown`].
//! - Outputs: [`Connection::poll_meta`] (metadata commands to commit; see below),
//!   [`Connection::poll_transmit`] (bytes to write), [`Connection::poll_timeout`] (when to
//!   call `handle_timeout`), [`Connection::wants_read`] (false while blocked by the memory
//!   alarm or while parked channels hold as many frames as allowed), [`Connection::is_finished`]
//!   (close the socket after writing what is left).
//! - Call order after any input: drain `poll_meta` (committing each command and, once its
//!   result is known, calling [`Connection::handle_meta_result`], which may emit more), then
//!   `handle_outbox`, then `poll_transmit`, then `poll_timeout`.
//!
//! # Metadata commands
//! The session never changes metadata itself. exchange.declare/delete/bind/unbind,
//! queue.declare/bind/unbind/delete, the auto-delete on basic.cancel and teardown's deletions
//! go out through `poll_meta` as [`Command`]s; the channel that sent the method is parked,
//! keeping its later frames in order, until `handle_meta_result` brings the result (what
//! `Broker::apply` returns). Other channels and channel 0 carry on meanwhile. A single node
//! commits at once, in the same turn of the runtime's loop, so nothing changes on the wire;
//! a cluster commits through Raft first. [`super::meta`] explains the design.
//!
//! A client's connection.close that arrives while channels are parked completes once they
//! have finished the frames they received before it (RabbitMQ likewise waits for its channel
//! processes), or after the close deadline at the latest; later input is ignored.
//!
//! Errors never escape: a soft error closes the channel with `channel.close`, a hard one the
//! connection with `connection.close`, both with the spec's reply code.
//!
//! # Listings
//! From connection.open until teardown the connection is listed in the broker's session
//! registry ([`crate::broker::registry`]) for `warrenctl list_connections` and the like; its
//! channels keep their entries current as they change (counts by relaxed stores, so the
//! per-message path takes no lock).

mod metadata;

use crate::broker::{ChannelKey, Settle};
use std::collections::BTreeMap;
use std::sync::Arc;

use amq_protocol::protocol::{channel as chm, connection as conn, AMQPClass};

use super::channel::Channel;
use super::handshake::{self, ClientCapabilities};
use super::meta::MetaPort;
use super::permissions::Permissions;
use crate::amqp::frame::{self, Frame, FrameKind, FRAME_MIN_SIZE, PROTOCOL_HEADER};
use crate::amqp::reply_code::{channel_error, command_invalid, unexpected_frame};
use crate::amqp::{short, AmqpError, ReplyCode};
use crate::broker::registry::{
    ChannelHandle, ConnectionHandle, ConnectionInfo, ConnectionLimits, ConnectionState,
    LimitReached, SocketCounters, SslInfo,
};
use crate::broker::{Broker, OutItem, Outbox};
use crate::meta::{limits, Command, MetaState};
use crate::time::Instant;

/// Negotiation limits and policies for sessions, from the node config.
#[derive(Debug, Clone)]
pub struct SessionConfig {
    /// Heartbeat proposed (seconds).
    pub heartbeat_s: u16,
    /// frame_max proposed and enforced.
    pub frame_max: u32,
    /// channel_max proposed.
    pub channel_max: u16,
    /// Handshake deadline (ms).
    pub handshake_timeout_ms: u64,
    /// Users allowed only from loopback.
    pub loopback_users: Vec<String>,
    /// Largest message body.
    pub max_message_size: u64,
    /// Node name for server_properties.
    pub node_name: String,
}

impl SessionConfig {
    /// Session settings from the node config.
    pub fn from_config(c: &crate::config::Config) -> SessionConfig {
        SessionConfig {
            heartbeat_s: c.amqp.heartbeat_s,
            frame_max: c.amqp.frame_max_bytes,
            channel_max: c.amqp.channel_max,
            handshake_timeout_ms: c.amqp.handshake_timeout_ms,
            loopback_users: c.amqp.loopback_users.clone(),
            max_message_size: c.amqp.max_message_size_bytes,
            node_name: c.node.name.clone(),
        }
    }
}

/// What the session knows of the peer.
#[derive(Debug, Clone)]
pub struct PeerInfo {
    /// Address text for logs.
    pub addr: String,
    /// Whether the peer is on a loopback address.
    pub is_loopback: bool,
    /// The peer's IP as text (IPv6 without brackets), for listings.
    pub host: String,
    /// The peer's port.
    pub port: u16,
    /// The node's end of the socket: IP as text.
    pub local_host: String,
    /// The node's end of the socket: port.
    pub local_port: u16,
    /// The TLS session, when the client came in on the TLS listener.
    pub tls: Option<super::external::TlsPeer>,
    /// When the socket was accepted, in milliseconds since the Unix epoch.
    pub connected_at: u64,
    /// The socket's traffic, which the driver counts and the listings read.
    pub socket: Arc<SocketCounters>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    AwaitHeader,
    AwaitStartOk,
    AwaitTuneOk,
    AwaitOpen,
    Open,
    /// We sent connection.close and wait for close-ok (or the deadline).
    Closing,
    /// We answered the client's close with close-ok; the client closes the socket (as with
    /// RabbitMQ), or the deadline does.
    ClosedByPeer,
    /// Nothing more to do: write what is left and close the socket.
    Finished,
}

/// Time allowed for the peer's close-ok after we close.
const CLOSE_TIMEOUT_MS: u64 = 3_000;

/// Outbound bytes above which deliveries wait in the outbox.
const OUT_HIGH_BYTES: usize = 1 << 20;

/// RabbitMQ's name for the connection's state, in "unexpected method" errors.
fn state_name(state: State, blocked: bool) -> &'static str {
    match state {
        State::AwaitHeader | State::AwaitStartOk => "starting",
        State::AwaitTuneOk => "tuning",
        State::AwaitOpen => "opening",
        State::Open if blocked => "blocked",
        State::Open => "running",
        State::Closing => "closing",
        State::ClosedByPeer | State::Finished => "closed",
    }
}

/// RabbitMQ's text for a frame it did not expect: the type and the payload's first 16
/// octets (all of them when there are no more).
fn unexpected_frame_text(kind: FrameKind, payload: &[u8]) -> String {
    let kind = match kind {
        FrameKind::Method => 1,
        FrameKind::Header => 2,
        FrameKind::Body => 3,
        FrameKind::Heartbeat => 8,
    };
    if payload.len() <= 16 {
        format!(
            "type {kind}, all octets = {}",
            frame::erlang_binary(payload)
        )
    } else {
        format!(
            "type {kind}, first 16 octets = {}",
            frame::erlang_binary(&payload[..16])
        )
    }
}

/// One client connection.
pub struct Connection {
    pub(crate) id: u64,
    pub(crate) broker: Arc<Broker>,
    pub(crate) cfg: SessionConfig,
    peer: PeerInfo,
    state: State,
    pub(crate) out: Vec<u8>,
    pub(crate) frame_max: u32,
    channel_max: u16,
    heartbeat_ms: u64,
    last_recv: Instant,
    last_sent: Instant,
    deadline: Option<Instant>,
    pub(crate) user: String,
    /// The SASL mechanism the user logged in with.
    pub(crate) auth_mechanism: String,
    pub(crate) vhost: String,
    pub(crate) caps: ClientCapabilities,
    /// From start-ok; kept until open, when the connection is listed with it.
    pub(crate) client_properties: amq_protocol::types::FieldTable,
    /// The connection's entry in the broker's session registry, from connection.open until
    /// teardown (dropping it removes the entry).
    listed: Option<ConnectionHandle>,
    pub(crate) permissions: Option<Permissions>,
    /// Boxed: every frame takes its channel out of the map and puts it back (the channel
    /// and the connection are both borrowed mutably while it is handled), and moving a
    /// pointer costs nothing where moving the channel itself was a tenth of a 16-byte
    /// publish's CPU.
    channels: BTreeMap<u16, Box<Channel>>,
    pub(crate) outbox: Arc<Outbox>,
    snapshot: Arc<MetaState>,
    alarm: bool,
    /// A publish arrived while the alarm was on: the socket is not read until it clears.
    blocked: bool,
    items: Vec<OutItem>,
    /// Metadata commands on their way out, parked channels and the frames they keep.
    meta: MetaPort,
    /// The client sent connection.close while channels were parked: close-ok follows once
    /// they are done (or at `deadline`); input is ignored meanwhile.
    close_requested: bool,
}

impl std::fmt::Debug for Connection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Connection")
            .field("id", &self.id)
            .field("state", &self.state)
            .finish_non_exhaustive()
    }
}

impl Drop for Connection {
    fn drop(&mut self) {
        // Dropped once, when its task ends.
        self.broker.metrics().connections_closed.inc();
    }
}

impl Connection {
    /// A new connection in the handshake. `outbox` is this connection's delivery queue.
    pub fn new(
        broker: Arc<Broker>,
        cfg: SessionConfig,
        peer: PeerInfo,
        outbox: Arc<Outbox>,
        now: Instant,
    ) -> Connection {
        let snapshot = broker.snapshot();
        broker.metrics().connections_opened.inc();
        Connection {
            id: broker.next_connection_id(),
            deadline: Some(now.plus_millis(cfg.handshake_timeout_ms)),
            broker,
            cfg,
            peer,
            state: State::AwaitHeader,
            out: Vec::with_capacity(4096),
            frame_max: FRAME_MIN_SIZE,
            channel_max: 0,
            heartbeat_ms: 0,
            last_recv: now,
            last_sent: now,
            user: String::new(),
            auth_mechanism: String::new(),
            vhost: String::new(),
            caps: ClientCapabilities::default(),
            client_properties: Default::default(),
            listed: None,
            permissions: None,
            channels: BTreeMap::new(),
            outbox,
            snapshot,
            alarm: false,
            blocked: false,
            items: Vec::new(),
            meta: MetaPort::default(),
            close_requested: false,
        }
    }

    /// The connection id (unique in the node).
    pub fn id(&self) -> u64 {
        self.id
    }

    /// The peer.
    pub fn peer(&self) -> &PeerInfo {
        &self.peer
    }

    /// The current metadata snapshot, refreshed when the broker's version moved.
    pub(crate) fn snapshot(&mut self) -> Arc<MetaState> {
        if self.snapshot.version != self.broker.version() {
            self.snapshot = self.broker.snapshot();
            if self.permissions.is_some() {
                self.permissions = Some(Permissions::new(
                    &self.user,
                    &self.vhost,
                    self.snapshot.permission(&self.user, &self.vhost),
                ));
            }
        }
        self.snapshot.clone()
    }

    /// Feeds received bytes; returns how many were consumed.
    pub fn handle_bytes(&mut self, data: &[u8], now: Instant) -> usize {
        if !data.is_empty() {
            self.last_recv = now;
        }
        let mut used = 0;
        if self.state == State::AwaitHeader {
            match handshake::check_protocol_header(data) {
                None => return 0,
                Some(Ok(())) => {
                    used = PROTOCOL_HEADER.len();
                    handshake::send_start(self);
                    self.state = State::AwaitStartOk;
                }
                Some(Err(())) => {
                    // Spec: answer with the header we support and close.
                    self.out.extend_from_slice(PROTOCOL_HEADER);
                    self.state = State::Finished;
                    return data.len();
                }
            }
        }
        if self.state == State::ClosedByPeer {
            // Nothing after close-ok means anything.
            return data.len();
        }
        while used < data.len() && self.state != State::Finished {
            if self.close_requested {
                // Nothing after connection.close means anything.
                used = data.len();
                break;
            }
            if !self.wants_read() {
                break;
            }
            let limit = if self.state == State::Open || self.state == State::Closing {
                self.frame_max
            } else {
                // Before tune-ok the peer may not exceed the spec minimum, or our own frame_max.
                self.cfg.frame_max.max(FRAME_MIN_SIZE)
            };
            match frame::split(&data[used..], limit) {
                Ok(None) => break,
                Ok(Some((f, n))) => {
                    if f.channel != 0 && self.meta.is_parked(f.channel) {
                        // Kept in order for the parked channel; when there is no room the
                        // frame stays unread (wants_read is now false).
                        if !self.meta.keep(&f) {
                            break;
                        }
                        used += n;
                        continue;
                    }
                    used += n;
                    self.handle_frame(f, now);
                }
                Err(e) => {
                    let err = e.to_amqp();
                    if self.state == State::Closing {
                        self.state = State::Finished;
                    } else {
                        self.close_connection(err, now);
                        // The stream is unreadable from here on: wait only for the deadline.
                    }
                    return data.len();
                }
            }
        }
        self.flush_confirms(now);
        used
    }

    fn handle_frame(&mut self, f: Frame<'_>, now: Instant) {
        if self.state == State::Closing {
            // After connection.close only close / close-ok count (spec 2.2.4).
            if f.kind == FrameKind::Method && f.channel == 0 {
                if let Ok(AMQPClass::Connection(m)) = frame::decode_method(f.payload) {
                    match m {
                        conn::AMQPMethod::CloseOk(_) => self.state = State::Finished,
                        conn::AMQPMethod::Close(_) => {
                            self.send_method(
                                0,
                                AMQPClass::Connection(conn::AMQPMethod::CloseOk(conn::CloseOk {})),
                            );
                        }
                        _ => {}
                    }
                }
            }
            return;
        }
        if self.state != State::Open
            && f.kind != FrameKind::Heartbeat
            && (f.kind != FrameKind::Method || f.channel != 0)
        {
            // Before open-ok only channel 0's methods mean anything (RabbitMQ's reader
            // calls anything else an unexpected frame, whatever the channel).
            let e = unexpected_frame(unexpected_frame_text(f.kind, f.payload));
            self.close_connection(e, now);
            return;
        }
        let result = match f.kind {
            FrameKind::Heartbeat => {
                if f.channel != 0 {
                    // RabbitMQ's text for it, as odd as it is.
                    Err(unexpected_frame(unexpected_frame_text(f.kind, f.payload)))
                } else {
                    Ok(())
                }
            }
            FrameKind::Method => self.handle_method_frame(f, now),
            FrameKind::Header | FrameKind::Body => self.handle_content_frame(f, now),
        };
        if let Err(e) = result {
            self.fail(f.channel, e, now);
        }
    }

    /// Routes an error to the right scope.
    pub(crate) fn fail(&mut self, channel: u16, e: AmqpError, now: Instant) {
        if e.is_hard() || channel == 0 || self.state != State::Open {
            self.close_connection(e, now);
        } else {
            self.close_channel_with_error(channel, e, now);
        }
    }

    fn handle_method_frame(&mut self, f: Frame<'_>, now: Instant) -> Result<(), AmqpError> {
        let method = frame::decode_method(f.payload)?;
        // amq-protocol's Qos drops prefetch_size; RabbitMQ refuses a non-zero one with 540.
        if frame::method_ids(f.payload) == Some((60, 10))
            && f.payload.len() >= 8
            && f.payload[4..8] != [0, 0, 0, 0]
        {
            let size = u32::from_be_bytes([f.payload[4], f.payload[5], f.payload[6], f.payload[7]]);
            return Err(crate::amqp::reply_code::not_implemented(format!(
                "prefetch_size!=0 ({size})"
            ))
            .at(60, 10));
        }
        let (class_id, method_id) = (method.get_amqp_class_id(), method.get_amqp_method_id());
        tracing::trace!(
            conn = self.id,
            channel = f.channel,
            class_id,
            method_id,
            "method"
        );
        let at = |e: AmqpError| e.at(class_id, method_id);
        if f.channel == 0 {
            let AMQPClass::Connection(m) = method else {
                return Err(at(channel_error(
                    "unexpected method in connection state running",
                )));
            };
            return self.handle_connection_method(m, now).map_err(at);
        }
        if matches!(method, AMQPClass::Connection(_)) {
            return Err(at(command_invalid(
                "connection methods must be sent on channel 0",
            )));
        }
        self.handle_channel_method(f.channel, method, now)
            .map_err(at)
    }

    fn handle_connection_method(
        &mut self,
        m: conn::AMQPMethod,
        now: Instant,
    ) -> Result<(), AmqpError> {
        match (self.state, m) {
            (State::AwaitStartOk, conn::AMQPMethod::StartOk(s)) => {
                handshake::handle_start_ok(self, s, now)?;
                self.state = State::AwaitTuneOk;
                Ok(())
            }
            (State::AwaitTuneOk, conn::AMQPMethod::TuneOk(t)) => {
                let (channel_max, frame_max, heartbeat_s) =
                    handshake::negotiate_tune(&self.cfg, &t)?;
                self.channel_max = channel_max;
                self.frame_max = frame_max;
                self.heartbeat_ms = heartbeat_s as u64 * 1000;
                self.state = State::AwaitOpen;
                Ok(())
            }
            (State::AwaitOpen, conn::AMQPMethod::Open(o)) => {
                let snapshot = self.snapshot();
                handshake::handle_open(self, &snapshot, o.virtual_host.as_str())?;
                self.state = State::Open;
                self.deadline = None;
                tracing::info!(conn = self.id, peer = %self.peer.addr, user = %self.user, vhost = %self.vhost, "connection opened");
                Ok(())
            }
            (State::Open, conn::AMQPMethod::Close(c)) => {
                tracing::debug!(conn = self.id, code = c.reply_code, text = %c.reply_text, "client closed connection");
                if self.meta.any_parked() {
                    // Parked channels first finish what the client sent before the close.
                    self.close_requested = true;
                    self.deadline = Some(now.plus_millis(CLOSE_TIMEOUT_MS));
                    return Ok(());
                }
                self.finish_peer_close(now);
                Ok(())
            }
            (State::Open, conn::AMQPMethod::UpdateSecret(_)) => {
                // Passwords are static; accept the refresh as RabbitMQ does for internal users.
                self.send_method(
                    0,
                    AMQPClass::Connection(conn::AMQPMethod::UpdateSecretOk(
                        conn::UpdateSecretOk {},
                    )),
                );
                Ok(())
            }
            // A close-ok nobody asked for, methods only a server sends, the handshake's
            // methods again or out of order: RabbitMQ's one answer.
            (state, _) => Err(channel_error(format!(
                "unexpected method in connection state {}",
                state_name(state, self.blocked)
            ))),
        }
    }

    fn handle_channel_method(
        &mut self,
        ch: u16,
        method: AMQPClass,
        now: Instant,
    ) -> Result<(), AmqpError> {
        if let AMQPClass::Channel(m) = &method {
            match m {
                chm::AMQPMethod::Open(_) => {
                    if self.channels.contains_key(&ch) {
                        return Err(channel_error("second 'channel.open' seen"));
                    }
                    if self.channel_max != 0 && self.channels.len() >= self.channel_max as usize {
                        return Err(crate::amqp::reply_code::not_allowed(format!(
                            "number of channels opened ({}) has reached the negotiated channel_max ({})",
                            self.channels.len(),
                            self.channel_max
                        )));
                    }
                    let user_max = self.snapshot().user_limit(&self.user, limits::MAX_CHANNELS);
                    let listed = match &self.listed {
                        Some(l) => l.open_channel_within(ch, user_max).map_err(|n| {
                            // A connection error, as in RabbitMQ's reader.
                            crate::amqp::reply_code::not_allowed(format!(
                                "number of channels opened for user '{}' has reached the maximum allowed user limit of ({n})",
                                self.user
                            ))
                        })?,
                        None => ChannelHandle::detached(ch),
                    };
                    self.channels.insert(
                        ch,
                        Box::new(Channel::new(
                            self.id,
                            ch,
                            self.outbox.clone(),
                            listed,
                            self.broker.metrics().clone(),
                        )),
                    );
                    self.send_method(
                        ch,
                        AMQPClass::Channel(chm::AMQPMethod::OpenOk(chm::OpenOk {})),
                    );
                    return Ok(());
                }
                chm::AMQPMethod::CloseOk(_) => {
                    if let Some(c) = self.channels.get(&ch) {
                        if c.is_closing() {
                            self.channels.remove(&ch);
                            return Ok(());
                        }
                    }
                    // As RabbitMQ: on an open channel, a close-ok nobody asked for is a
                    // method a client never sends (503); on no channel, 504.
                    if self.channels.contains_key(&ch) {
                        return Err(super::channel::unimplemented_method());
                    }
                    return Err(channel_error("expected 'channel.open'"));
                }
                chm::AMQPMethod::Close(_) => {
                    // A close that crossed ours (the channel is closing, torn down already):
                    // as RabbitMQ, answer close-ok and keep waiting for the close-ok to ours,
                    // which must not then find the channel gone (504).
                    if self.channels.get(&ch).is_some_and(|c| c.is_closing()) {
                        self.send_method(
                            ch,
                            AMQPClass::Channel(chm::AMQPMethod::CloseOk(chm::CloseOk {})),
                        );
                        return Ok(());
                    }
                    let Some(mut c) = self.channels.remove(&ch) else {
                        return Err(channel_error(format!("channel {ch} is not open")));
                    };
                    c.teardown(self, now);
                    self.send_method(
                        ch,
                        AMQPClass::Channel(chm::AMQPMethod::CloseOk(chm::CloseOk {})),
                    );
                    return Ok(());
                }
                _ => {}
            }
        }
        let Some(mut c) = self.channels.remove(&ch) else {
            return Err(channel_error("expected 'channel.open'"));
        };
        if c.is_closing() {
            // Everything but close / close-ok is dropped while a channel closes.
            self.channels.insert(ch, c);
            return Ok(());
        }
        let r = c.handle_method(self, method, now);
        self.channels.insert(ch, c);
        r
    }

    fn handle_content_frame(&mut self, f: Frame<'_>, now: Instant) -> Result<(), AmqpError> {
        if f.channel == 0 {
            return Err(unexpected_frame("content frame on channel 0"));
        }
        let Some(mut c) = self.channels.remove(&f.channel) else {
            return Err(channel_error(format!(
                "content on channel {} which is not open",
                f.channel
            )));
        };
        if c.is_closing() {
            self.channels.insert(f.channel, c);
            return Ok(());
        }
        let r = c.handle_content(self, f, now);
        self.channels.insert(f.channel, c);
        r
    }

    /// Closes one channel with an error (soft errors).
    pub(crate) fn close_channel_with_error(&mut self, ch: u16, e: AmqpError, now: Instant) {
        tracing::debug!(conn = self.id, channel = ch, code = e.code.code(), text = %e.text, "channel error");
        let Some(mut c) = self.channels.remove(&ch) else {
            self.close_connection(channel_error(format!("channel {ch} is not open")), now);
            return;
        };
        c.teardown(self, now);
        c.set_closing();
        self.channels.insert(ch, c);
        self.send_method(
            ch,
            AMQPClass::Channel(chm::AMQPMethod::Close(chm::Close {
                reply_code: e.code.code(),
                reply_text: short(&e.reply_text()),
                class_id: e.class_id,
                method_id: e.method_id,
            })),
        );
    }

    /// Closes the connection with an error (hard errors, auth failures, shutdown).
    pub(crate) fn close_connection(&mut self, e: AmqpError, now: Instant) {
        if matches!(
            self.state,
            State::Closing | State::ClosedByPeer | State::Finished
        ) {
            return;
        }
        if e.code != ReplyCode::ConnectionForced {
            tracing::info!(conn = self.id, code = e.code.code(), text = %e.text, "closing connection on error");
        }
        self.teardown(now);
        let mut e = e;
        match self.state {
            // A refused login: connection.close only for a client that asked for one (the
            // `authentication_failure_close` capability), naming no method, as RabbitMQ.
            State::AwaitStartOk
                if e.code == ReplyCode::AccessRefused && self.caps.authentication_failure_close =>
            {
                (e.class_id, e.method_id) = (0, 0);
            }
            // Before tune-ok RabbitMQ trusts nothing the client sent and closes the socket
            // without a method, whatever the error (RabbitMQ also waits 3 s first).
            State::AwaitHeader | State::AwaitStartOk | State::AwaitTuneOk => {
                self.state = State::Finished;
                return;
            }
            _ => {}
        }
        self.send_method(
            0,
            AMQPClass::Connection(conn::AMQPMethod::Close(conn::Close {
                reply_code: e.code.code(),
                reply_text: short(&e.reply_text()),
                class_id: e.class_id,
                method_id: e.method_id,
            })),
        );
        self.state = State::Closing;
        self.deadline = Some(now.plus_millis(CLOSE_TIMEOUT_MS));
    }

    /// Answers the client's connection.close: releases everything, close-ok.
    fn finish_peer_close(&mut self, now: Instant) {
        self.teardown(now);
        self.send_method(
            0,
            AMQPClass::Connection(conn::AMQPMethod::CloseOk(conn::CloseOk {})),
        );
        self.state = State::ClosedByPeer;
        self.deadline = Some(now.plus_millis(CLOSE_TIMEOUT_MS));
    }

    /// Releases everything the connection holds in the broker: requeues unacked messages,
    /// cancels consumers, deletes exclusive queues. Parked channels are dropped with the rest;
    /// commands already emitted stay emitted. Idempotent.
    fn teardown(&mut self, now: Instant) {
        self.meta.clear_parked();
        self.close_requested = false;
        let channels = std::mem::take(&mut self.channels);
        for (_, mut c) in channels {
            c.teardown(self, now);
        }
        // Gone from the listings as soon as it releases what it held.
        self.listed = None;
        for item in self.outbox.close() {
            if let OutItem::Deliver(d) = item {
                if d.ack_required {
                    let key = ChannelKey {
                        conn: self.id,
                        channel: d.channel,
                    };
                    d.queue
                        .settle(key, &[d.seq], Settle::Nack { requeue: true }, now);
                }
            }
        }
        if self.state == State::Open {
            self.meta
                .emit_detached(Command::DeleteExclusiveQueues { owner: self.id });
        }
    }

    /// Takes deliveries from the outbox and encodes them (unless the socket is backed up).
    pub fn handle_outbox(&mut self, now: Instant) {
        // After the client's connection.close nothing more is delivered; teardown requeues.
        if self.state != State::Open || self.close_requested {
            return;
        }
        // Confirms and commit-oks whose writes became durable.
        self.flush_confirms(now);
        if self.out.len() > OUT_HIGH_BYTES {
            return;
        }
        let mut items = std::mem::take(&mut self.items);
        self.outbox.drain(&mut items);
        if items.is_empty() {
            self.items = items;
            return;
        }
        let mut released = 0usize;
        let mut forced = None;
        for item in items.drain(..) {
            match item {
                OutItem::Close { reason } => forced = Some(reason),
                OutItem::Deliver(d) => {
                    released += d.message.size() as usize;
                    match self.channels.get_mut(&d.channel) {
                        Some(c) if !c.is_closing() => {
                            c.encode_delivery(&mut self.out, self.frame_max, d);
                        }
                        _ => {
                            if d.ack_required {
                                let key = ChannelKey {
                                    conn: self.id,
                                    channel: d.channel,
                                };
                                d.queue
                                    .settle(key, &[d.seq], Settle::Nack { requeue: true }, now);
                            }
                        }
                    }
                }
                OutItem::Reply {
                    channel,
                    key,
                    message,
                } => {
                    released += message.size() as usize;
                    if let Some(c) = self.channels.get_mut(&channel) {
                        if !c.is_closing() {
                            c.encode_reply(&mut self.out, self.frame_max, key, &message);
                        }
                    }
                }
                OutItem::Cancel {
                    channel,
                    consumer_tag,
                } => {
                    let notify = self.caps.consumer_cancel_notify;
                    if let Some(c) = self.channels.get_mut(&channel) {
                        c.handle_broker_cancel(&mut self.out, &consumer_tag, notify);
                    }
                }
                OutItem::Rehome {
                    channel,
                    consumer_tag,
                } => {
                    if let Some(mut c) = self.channels.remove(&channel) {
                        if !c.is_closing() {
                            c.handle_rehome(self, &consumer_tag, now);
                        }
                        self.channels.insert(channel, c);
                    }
                }
            }
        }
        self.items = items;
        for q in self.outbox.release(released) {
            let mut dead = Vec::new();
            q.lock().deliver(&q, now, &mut dead);
            if !dead.is_empty() {
                self.broker.dead_letter(&q, dead, now);
            }
        }
        if let Some(reason) = forced {
            tracing::info!(conn = self.id, %reason, "connection closed by an operator");
            self.close_connection(AmqpError::new(ReplyCode::ConnectionForced, reason), now);
        }
    }

    /// The memory alarm went on or off. As in RabbitMQ, only connections that publish while
    /// it is on are blocked (see [`Connection::note_publish`]); consumers keep draining.
    pub fn handle_alarm(&mut self, on: bool, _now: Instant) {
        self.alarm = on;
        if !on && self.blocked {
            self.blocked = false;
            if self.caps.connection_blocked && self.state == State::Open {
                self.send_method(
                    0,
                    AMQPClass::Connection(conn::AMQPMethod::Unblocked(conn::Unblocked {})),
                );
            }
        }
        self.publish_state();
    }

    /// A message was published: under the alarm this blocks the connection.
    pub(crate) fn note_publish(&mut self) {
        if self.alarm && !self.blocked {
            self.blocked = true;
            self.publish_state();
            if self.caps.connection_blocked {
                self.send_method(
                    0,
                    AMQPClass::Connection(conn::AMQPMethod::Blocked(conn::Blocked {
                        reason: "low on memory".into(),
                    })),
                );
            }
        }
    }

    /// The node is shutting down: close with 320 CONNECTION_FORCED.
    pub fn handle_shutdown(&mut self, now: Instant) {
        match self.state {
            State::Open => self.close_connection(
                AmqpError::new(
                    ReplyCode::ConnectionForced,
                    "broker forced connection closure with reason 'shutdown'",
                ),
                now,
            ),
            State::Closing | State::ClosedByPeer | State::Finished => {}
            _ => self.state = State::Finished,
        }
    }

    /// The socket closed or failed: release everything.
    pub fn handle_disconnect(&mut self, now: Instant) {
        if self.state != State::Finished || !self.channels.is_empty() {
            self.teardown(now);
        }
        self.state = State::Finished;
    }

    /// Timers: heartbeats, handshake and close deadlines.
    pub fn handle_timeout(&mut self, now: Instant) {
        if let Some(d) = self.deadline {
            if now >= d {
                if self.close_requested && self.state == State::Open {
                    tracing::info!(
                        conn = self.id,
                        "metadata results late, closing without them"
                    );
                    self.finish_peer_close(now);
                    return;
                }
                if self.state != State::Finished {
                    tracing::info!(conn = self.id, state = ?self.state, "deadline passed, closing socket");
                }
                self.handle_disconnect(now);
                return;
            }
        }
        if self.heartbeat_ms == 0 || self.state != State::Open {
            return;
        }
        if now.millis_since(self.last_recv) >= 2 * self.heartbeat_ms {
            tracing::info!(conn = self.id, "missed heartbeats from client, closing");
            self.handle_disconnect(now);
            return;
        }
        if now.millis_since(self.last_sent) >= self.heartbeat_ms / 2 {
            frame::encode_heartbeat(&mut self.out);
            self.last_sent = now;
        }
    }

    /// Bytes to write; the caller takes them all.
    pub fn poll_transmit(&mut self, now: Instant) -> Option<Vec<u8>> {
        if self.out.is_empty() {
            return None;
        }
        self.last_sent = now;
        Some(std::mem::replace(&mut self.out, Vec::with_capacity(4096)))
    }

    /// Appends pending bytes to `buf` (avoids an allocation per write).
    pub fn poll_transmit_into(&mut self, buf: &mut Vec<u8>, now: Instant) {
        if !self.out.is_empty() {
            self.last_sent = now;
            if buf.is_empty() {
                std::mem::swap(buf, &mut self.out);
            } else {
                buf.extend_from_slice(&self.out);
                self.out.clear();
            }
        }
    }

    /// When `handle_timeout` must be called next.
    pub fn poll_timeout(&self) -> Option<Instant> {
        let mut next = self.deadline;
        if self.heartbeat_ms > 0 && self.state == State::Open {
            let send = self.last_sent.plus_millis((self.heartbeat_ms / 2).max(1));
            let dead = self.last_recv.plus_millis(2 * self.heartbeat_ms);
            for t in [send, dead] {
                next = Some(next.map_or(t, |n| n.min(t)));
            }
        }
        next
    }

    /// Whether the socket should be read: false while publishing is blocked by the alarm, and
    /// while parked channels hold all the frames they may (until a result unparks one).
    pub fn wants_read(&self) -> bool {
        let blocked = self.blocked && self.state == State::Open;
        !(blocked || self.meta.is_full())
    }

    /// Whether the connection is done; the caller writes what is left and closes.
    pub fn is_finished(&self) -> bool {
        self.state == State::Finished
    }

    /// Lists the connection in the broker's session registry (at connection.open).
    /// Lists the connection in the broker's registry, within `limits` (connection.open).
    pub(crate) fn list(&mut self, limits: ConnectionLimits) -> Result<(), LimitReached> {
        let info = ConnectionInfo {
            id: self.id,
            user: self.user.clone(),
            vhost: self.vhost.clone(),
            peer_host: self.peer.host.clone(),
            peer_port: self.peer.port,
            host: self.peer.local_host.clone(),
            port: self.peer.local_port,
            timeout_s: (self.heartbeat_ms / 1000) as u16,
            frame_max: self.frame_max,
            channel_max: self.channel_max,
            client_properties: std::mem::take(&mut self.client_properties),
            auth_mechanism: self.auth_mechanism.clone(),
            ssl: self.peer.tls.as_ref().map(|t| SslInfo {
                protocol: t.protocol.clone(),
                cipher: t.cipher.clone(),
                key_exchange: t.key_exchange.clone(),
                hash: t.hash.clone(),
                peer_cert_subject: t.cert.as_ref().map(|c| c.subject.clone()),
                peer_cert_issuer: t.cert.as_ref().map(|c| c.issuer.clone()),
                peer_cert_validity: t.cert.as_ref().map(|c| c.validity.clone()),
            }),
            connected_at: self.peer.connected_at,
        };
        self.listed = Some(self.broker.sessions().register_within(
            info,
            self.flow_state(),
            Arc::downgrade(&self.outbox),
            self.peer.socket.clone(),
            limits,
        )?);
        Ok(())
    }

    fn flow_state(&self) -> ConnectionState {
        match (self.alarm, self.blocked) {
            (_, true) => ConnectionState::Blocked,
            (true, false) => ConnectionState::Blocking,
            (false, false) => ConnectionState::Running,
        }
    }

    /// Tells the registry about a change of the alarm or of `blocked` (both rare).
    fn publish_state(&self) {
        if let Some(l) = &self.listed {
            l.set_state(self.flow_state());
        }
    }

    /// Queues a method frame.
    pub(crate) fn send_method(&mut self, ch: u16, m: AMQPClass) {
        frame::encode_method(&mut self.out, ch, &m);
    }

    /// Sends the confirms and commit-oks that are ready. A parked channel's wait until it
    /// resumes, so they keep their place among its replies.
    fn flush_confirms(&mut self, now: Instant) {
        // tx.commit's class and method ids, named in the close of a failed commit.
        const TX_CLASS: u16 = 90;
        const TX_COMMIT: u16 = 20;
        let durability = self.broker.durability().cloned();
        let broker = self.broker.clone();
        let remote = broker.remote_outcomes();
        let mut waiting = false;
        for (ch, c) in self.channels.iter_mut() {
            if !self.meta.is_parked(*ch) {
                waiting |= c.flush_confirms(&mut self.out, durability.as_deref(), remote, now);
            }
        }
        if waiting {
            if let Some(d) = &durability {
                d.wait(&self.outbox);
            }
            remote.wait(&self.outbox);
            // The mark may have moved between the check and the registration.
            for (ch, c) in self.channels.iter_mut() {
                if !self.meta.is_parked(*ch) {
                    c.flush_confirms(&mut self.out, durability.as_deref(), remote, now);
                }
            }
        }
        // A transaction that could not be honoured closes its channel, as RabbitMQ's
        // does (rabbit_channel's complete_tx with tx = failed).
        let failed: Vec<u16> = self
            .channels
            .iter_mut()
            .filter_map(|(ch, c)| c.take_failed_commit().then_some(*ch))
            .collect();
        for ch in failed {
            let e = AmqpError::new(ReplyCode::PreconditionFailed, "partial tx completion")
                .at(TX_CLASS, TX_COMMIT);
            self.close_channel_with_error(ch, e, now);
        }
    }
}

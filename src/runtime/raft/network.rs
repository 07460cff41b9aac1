//! Raft RPCs, and proposals forwarded to the leader, over an abstract [`RaftTransport`] that
//! moves opaque frames.
//!
//! The client side ([`NetworkFactory`], one [`PeerClient`] per target) encodes openraft's
//! request into a frame, asks the transport for the reply frame within openraft's soft TTL,
//! and maps failures to the errors openraft acts on: *unreachable* makes it back off, a
//! *timeout* or *network* error makes it retry, a *remote* error carries the peer's Raft
//! answer. The server side ([`RpcServer`]) decodes a frame, hands it to the local Raft and
//! encodes the answer.
//!
//! # Frames
//!
//! A request frame is one `RpcRequest`, a reply frame one `RpcReply`, both bincode
//! (fixed-width integers, no trailing bytes) behind the format byte of [`super::persist`].
//! bincode writes an enum's variant index as a little-endian `u32` before its fields:
//!
//! | index | request | reply |
//! |---:|---|---|
//! | 0 | `Append` (AppendEntries) | `Append` |
//! | 1 | `Vote` | `Vote` |
//! | 2 | `Snapshot` (InstallSnapshot chunk) | `Snapshot` |
//! | 3 | `Forward` (a proposal, [`super::forward`]) | `Malformed` (the request did not decode) |
//! | 4 | | `Forward` (the leader's [`super::forward::ForwardReply`]) |
//!
//! Variants are only ever appended, so adding one leaves every existing frame byte for byte
//! as it was; a node that does not know a request kind answers `Malformed`, and an
//! incompatible change bumps the format byte instead. The forward variants carry only our own
//! types (the metadata command and its response), so no openraft type crosses the transport:
//! the in-process [`super::router::Router`] and the TCP node links only move bytes.
//!
//! A frame that does not decode is answered with `Malformed` (and logged); nothing on the
//! receiving side panics on what a peer sends.

use std::error::Error;
use std::future::Future;
use std::path::Path;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use openraft::error::{
    InstallSnapshotError, NetworkError, RPCError, RaftError, RemoteError, Timeout, Unreachable,
};
use openraft::network::RPCOption;
use openraft::raft::{
    AppendEntriesRequest, AppendEntriesResponse, InstallSnapshotRequest, InstallSnapshotResponse,
    VoteRequest, VoteResponse,
};
use openraft::{BasicNode, RPCTypes, Raft, RaftNetwork, RaftNetworkFactory};
use serde::{Deserialize, Serialize};

use super::forward::{self, ForwardReply, ForwardRequest, ReadIndexReply, SharedReads};
use super::persist::{self, PersistError};
use super::state_machine::SharedFence;
use super::types::{NodeId, TypeConfig};

/// Why a transport could not deliver a request or bring back its reply.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum TransportError {
    /// No connection to the node (down, refused, partitioned): openraft backs off.
    #[error("node {node} unreachable: {reason}")]
    Unreachable {
        /// The target.
        node: NodeId,
        /// Why.
        reason: String,
    },
    /// The deadline passed.
    #[error("timed out")]
    Timeout,
    /// The connection failed mid-call: openraft retries at once.
    #[error("{0}")]
    Io(String),
}

/// Moves request frames to peers and reply frames back. Implementations must give up by
/// `deadline` (the caller enforces it too) and must not open a connection per call: openraft
/// asks for a client often.
///
/// [`TransportError::Unreachable`] must mean that the frame was **not** handed to the peer's
/// [`RpcServer`] (no connection, refused, nothing serving there yet): a forwarded proposal is
/// retried on it, and only on it. Any error after the frame may have been delivered is
/// [`TransportError::Timeout`] or [`TransportError::Io`].
pub trait RaftTransport: Send + Sync + 'static {
    /// Sends `frame` to node `target` (whose cluster address is `addr`) and returns the reply.
    fn call(
        &self,
        target: NodeId,
        addr: &str,
        frame: Vec<u8>,
        deadline: Duration,
    ) -> impl Future<Output = Result<Vec<u8>, TransportError>> + Send;
}

/// The object-safe face of a [`RaftTransport`], so [`super::MetaRaft`] can keep one for
/// forwarding without becoming generic.
pub(super) trait DynTransport: Send + Sync + 'static {
    /// [`RaftTransport::call`], boxed.
    fn call_dyn<'a>(
        &'a self,
        target: NodeId,
        addr: &'a str,
        frame: Vec<u8>,
        deadline: Duration,
    ) -> Pin<Box<dyn Future<Output = Result<Vec<u8>, TransportError>> + Send + 'a>>;
}

impl<T: RaftTransport> DynTransport for T {
    fn call_dyn<'a>(
        &'a self,
        target: NodeId,
        addr: &'a str,
        frame: Vec<u8>,
        deadline: Duration,
    ) -> Pin<Box<dyn Future<Output = Result<Vec<u8>, TransportError>> + Send + 'a>> {
        Box::pin(self.call(target, addr, frame, deadline))
    }
}

/// A request frame's content. Append new variants at the end only (see the module docs).
#[derive(Debug, Serialize, Deserialize)]
pub(super) enum RpcRequest {
    Append(AppendEntriesRequest<TypeConfig>),
    Vote(VoteRequest<NodeId>),
    Snapshot(InstallSnapshotRequest<TypeConfig>),
    /// A proposal made on another node, for the leader to commit.
    Forward(ForwardRequest),
    /// A read on another node: the leader confirms its leadership with a quorum and answers
    /// the log index the reader must have applied (Raft's read index).
    ReadIndex {
        /// The reading node (for the leader's logs).
        origin: NodeId,
    },
}

/// A reply frame's content. Append new variants at the end only (see the module docs).
#[derive(Debug, Serialize, Deserialize)]
pub(super) enum RpcReply {
    Append(Result<AppendEntriesResponse<NodeId>, RaftError<NodeId>>),
    Vote(Result<VoteResponse<NodeId>, RaftError<NodeId>>),
    Snapshot(Result<InstallSnapshotResponse<NodeId>, RaftError<NodeId, InstallSnapshotError>>),
    /// The server could not decode the request.
    Malformed(String),
    /// The outcome of a forwarded proposal.
    Forward(ForwardReply),
    /// The answer to a read-index request.
    ReadIndex(ReadIndexReply),
}

/// Names the wire in decode errors.
fn wire() -> &'static Path {
    Path::new("raft rpc")
}

/// The frame carrying `req`.
pub(super) fn encode_request(req: &RpcRequest) -> Result<Vec<u8>, PersistError> {
    persist::encode("raft request", req)
}

/// Decodes a request frame.
pub(super) fn decode_request(frame: &[u8]) -> Result<RpcRequest, PersistError> {
    persist::decode("raft request", wire(), frame)
}

/// The frame carrying `reply`.
pub(super) fn encode_reply(reply: &RpcReply) -> Result<Vec<u8>, PersistError> {
    persist::encode("raft reply", reply)
}

/// Decodes a reply frame.
pub(super) fn decode_reply(frame: &[u8]) -> Result<RpcReply, PersistError> {
    persist::decode("raft reply", wire(), frame)
}

/// Creates one [`PeerClient`] per target; cheap, as openraft calls it per election round.
pub struct NetworkFactory<T> {
    me: NodeId,
    transport: Arc<T>,
}

impl<T: RaftTransport> NetworkFactory<T> {
    /// A factory for node `me`; `transport` may be shared with the proposal forwarder.
    pub fn new(me: NodeId, transport: Arc<T>) -> NetworkFactory<T> {
        NetworkFactory { me, transport }
    }
}

impl<T: RaftTransport> RaftNetworkFactory<TypeConfig> for NetworkFactory<T> {
    type Network = PeerClient<T>;

    async fn new_client(&mut self, target: NodeId, node: &BasicNode) -> PeerClient<T> {
        PeerClient {
            me: self.me,
            target,
            node: node.clone(),
            transport: Arc::clone(&self.transport),
        }
    }
}

/// Sends RPCs to one peer.
pub struct PeerClient<T> {
    me: NodeId,
    target: NodeId,
    node: BasicNode,
    transport: Arc<T>,
}

type RpcResult<R, E> = Result<R, RPCError<NodeId, BasicNode, E>>;

impl<T: RaftTransport> PeerClient<T> {
    async fn call<E: Error>(
        &self,
        action: RPCTypes,
        req: RpcRequest,
        option: &RPCOption,
    ) -> RpcResult<RpcReply, E> {
        let ttl = option.soft_ttl();
        let frame = encode_request(&req).map_err(|e| RPCError::Network(NetworkError::new(&e)))?;
        let call = self
            .transport
            .call(self.target, &self.node.addr, frame, ttl);
        let timeout = || {
            RPCError::Timeout(Timeout {
                action,
                id: self.me,
                target: self.target,
                timeout: ttl,
            })
        };
        // The transport promises a deadline; enforcing it here too keeps a faulty transport
        // from stalling replication.
        let reply = match tokio::time::timeout(ttl, call).await {
            Err(_) | Ok(Err(TransportError::Timeout)) => return Err(timeout()),
            Ok(Err(e @ TransportError::Unreachable { .. })) => {
                return Err(RPCError::Unreachable(Unreachable::new(&e)))
            }
            Ok(Err(e)) => return Err(RPCError::Network(NetworkError::new(&e))),
            Ok(Ok(reply)) => reply,
        };
        match decode_reply(&reply) {
            Ok(RpcReply::Malformed(why)) => Err(RPCError::Network(NetworkError::new(
                &TransportError::Io(format!("peer could not decode our request: {why}")),
            ))),
            Ok(r) => Ok(r),
            Err(e) => Err(RPCError::Network(NetworkError::new(&e))),
        }
    }

    fn remote<E: Error>(
        &self,
        e: RaftError<NodeId, E>,
    ) -> RPCError<NodeId, BasicNode, RaftError<NodeId, E>> {
        RPCError::RemoteError(RemoteError::new_with_node(
            self.target,
            self.node.clone(),
            e,
        ))
    }
}

fn mismatch<E: Error>() -> RPCError<NodeId, BasicNode, E> {
    RPCError::Network(NetworkError::new(&TransportError::Io(
        "reply does not match the request".into(),
    )))
}

impl<T: RaftTransport> RaftNetwork<TypeConfig> for PeerClient<T> {
    async fn append_entries(
        &mut self,
        rpc: AppendEntriesRequest<TypeConfig>,
        option: RPCOption,
    ) -> RpcResult<AppendEntriesResponse<NodeId>, RaftError<NodeId>> {
        match self
            .call(RPCTypes::AppendEntries, RpcRequest::Append(rpc), &option)
            .await?
        {
            RpcReply::Append(r) => r.map_err(|e| self.remote(e)),
            _ => Err(mismatch()),
        }
    }

    async fn install_snapshot(
        &mut self,
        rpc: InstallSnapshotRequest<TypeConfig>,
        option: RPCOption,
    ) -> RpcResult<InstallSnapshotResponse<NodeId>, RaftError<NodeId, InstallSnapshotError>> {
        match self
            .call(
                RPCTypes::InstallSnapshot,
                RpcRequest::Snapshot(rpc),
                &option,
            )
            .await?
        {
            RpcReply::Snapshot(r) => r.map_err(|e| self.remote(e)),
            _ => Err(mismatch()),
        }
    }

    async fn vote(
        &mut self,
        rpc: VoteRequest<NodeId>,
        option: RPCOption,
    ) -> RpcResult<VoteResponse<NodeId>, RaftError<NodeId>> {
        match self
            .call(RPCTypes::Vote, RpcRequest::Vote(rpc), &option)
            .await?
        {
            RpcReply::Vote(r) => r.map_err(|e| self.remote(e)),
            _ => Err(mismatch()),
        }
    }
}

/// The receiving end: feeds request frames to the local Raft node.
#[derive(Clone)]
pub struct RpcServer {
    raft: Raft<TypeConfig>,
    /// The longest a forwarded proposal may wait here for its outcome (the caller's budget
    /// is usually shorter).
    propose_timeout: Duration,
    fence: SharedFence,
    /// What this node served reads to as leader (`cluster::read_log`).
    reads: SharedReads,
}

impl RpcServer {
    pub(crate) fn new(
        raft: Raft<TypeConfig>,
        propose_timeout: Duration,
        fence: SharedFence,
        reads: SharedReads,
    ) -> RpcServer {
        RpcServer {
            raft,
            propose_timeout,
            fence,
            reads,
        }
    }

    /// Whether this leader is recording `origin` down (`cluster::read_fence`).
    fn fenced(&self, origin: NodeId) -> bool {
        let term = self.raft.metrics().borrow().current_term;
        self.fence.lock().refuses(origin, term)
    }

    fn refusal(&self, origin: NodeId) -> ReadIndexReply {
        ReadIndexReply::Failed {
            reason: format!("node {origin} is being recorded down"),
        }
    }

    /// Handles one request frame and returns the reply frame. Never panics: a frame that
    /// does not decode gets a `Malformed` reply.
    pub async fn handle(&self, frame: &[u8]) -> Vec<u8> {
        let reply = match decode_request(frame) {
            Ok(RpcRequest::Append(r)) => RpcReply::Append(self.raft.append_entries(r).await),
            Ok(RpcRequest::Vote(r)) => RpcReply::Vote(self.raft.vote(r).await),
            Ok(RpcRequest::Snapshot(r)) => RpcReply::Snapshot(self.raft.install_snapshot(r).await),
            Ok(RpcRequest::Forward(r)) => RpcReply::Forward(
                forward::serve(&self.raft, r, self.propose_timeout, &self.reads).await,
            ),
            Ok(RpcRequest::ReadIndex { origin }) => {
                // Checked before and after: a fence set while the quorum round ran also
                // refuses (the index was taken before the decision, and may predate the
                // `NodeDown` still to commit).
                let reply = if self.fenced(origin) {
                    self.refusal(origin)
                } else {
                    let reply = forward::read_index_as_leader(
                        &self.raft,
                        self.propose_timeout,
                        &self.reads,
                        origin,
                    )
                    .await;
                    if self.fenced(origin) {
                        self.refusal(origin)
                    } else {
                        reply
                    }
                };
                tracing::debug!(origin, "read index: {reply:?}");
                RpcReply::ReadIndex(reply)
            }
            Err(e) => {
                tracing::warn!(
                    bytes = frame.len(),
                    "answering an undecodable raft request: {e}"
                );
                RpcReply::Malformed(e.to_string())
            }
        };
        // Replies are plain data and always encode; an empty frame would surface at the
        // caller as a network error rather than a panic here.
        encode_reply(&reply).unwrap_or_else(|e| {
            tracing::error!("cannot encode a raft reply: {e}");
            Vec::new()
        })
    }
}

//! Proposals made on any node: committed by the leader, forwarded to it when it is elsewhere.
//!
//! [`super::MetaRaft::propose`] runs the loop in `Forwarder::propose`. Each attempt looks
//! at this node's Raft metrics:
//! - this node leads: it commits the command itself (`client_write`);
//! - another node leads: the command goes to it as a `Forward` request on the Raft transport
//!   (the same frames and links as AppendEntries, Vote and InstallSnapshot; see
//!   [`super::network`] for the layout), and the leader answers with a [`ForwardReply`];
//! - no leader is known (an election is under way): it waits until one is.
//!
//! The receiver of a forward never forwards it again: if it does not lead it answers
//! `NotLeader` with its own view of the leader, and the sender picks the next target.
//!
//! # Wire
//!
//! `RpcRequest::Forward(ForwardRequest { origin, budget_ms, request, readers_window_ms })`
//! and `RpcReply::Forward(ForwardReply)`, bincode behind the format byte like every Raft RPC
//! frame. `request` is the [`MetaRequest`] the leader appends to its log, unchanged;
//! `budget_ms` is how long the sender still waits, so the leader stops waiting (and answers
//! `Timeout`) a little before the sender gives up. With a `readers_window_ms`, the leader's
//! `Applied` answer names the nodes it served reads to within that window
//! (`cluster::read_log`); a routing change waits for exactly those. A `Malformed` answer
//! (the leader could not decode the frame: a node of another version) fails the proposal
//! with [`ProposeError::ForwardFailed`].
//!
//! # Deadline
//!
//! Everything happens within the node's `propose_timeout`, counted from the call: waiting
//! for a leader, every forward (the transport gets the time that is left), the pauses
//! between attempts (10 ms doubling to 200 ms) and the commit itself. At most
//! [`ATTEMPTS_MAX`] attempts are made.
//!
//! # Retries: at most once, never a duplicate
//!
//! A forward whose answer is lost may or may not have been committed, and plain retrying
//! would then apply the command twice. Metadata commands are not safely idempotent: a
//! late duplicate `queue.declare` can re-create a queue deleted in between, a duplicate
//! reports `created = false` to the channel that did create it, a duplicate
//! `DeleteExclusiveQueues` can remove a queue declared since. So a proposal is retried only
//! when no leader can have taken it:
//!
//! | what happened | taken by a leader? | then |
//! |---|---|---|
//! | no leader known | no | wait for one |
//! | the transport says *unreachable* (no connection, nothing serving there) | no | pause, retry |
//! | the receiver answers `NotLeader` (it checks before proposing) | no | retry at its hint |
//! | the receiver answers `Malformed` | no | [`ProposeError::ForwardFailed`] |
//! | `Applied` (accepted or refused by the state machine) | yes | the response |
//! | the leader's `Timeout`, or the transport's deadline | maybe | [`ProposeError::Timeout`] |
//! | the link broke, or the reply does not decode | maybe | [`ProposeError::Unknown`] |
//! | the leader lost its leadership or stopped with the command in flight | maybe | [`ProposeError::Unknown`] |
//!
//! The last row covers openraft's `ForwardToLeader` from `client_write` on a node that
//! passed the leadership check: openraft also uses it for an entry truncated after a step
//! down, and a truncated entry can still be committed by a later leader that holds it
//! (Raft paper, figure 8), so it is not proof that nothing happened. A proposal therefore
//! ends with exactly one of: the response, a certain "not applied" error
//! ([`ProposeError::NoLeader`], [`ProposeError::ForwardFailed`]), or an "outcome unknown"
//! error ([`ProposeError::outcome_unknown`]); the caller decides what an unknown outcome
//! means for it, for example by reading the metadata once a leader is back. Exactly-once
//! retries would need a proposer id and sequence number deduplicated by the state machine
//! (and kept in snapshots); that is not built.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use openraft::error::{CheckIsLeaderError, ClientWriteError, RaftError};
use openraft::{BasicNode, Raft, RaftMetrics, ServerState};
use serde::{Deserialize, Serialize};
use tokio::time::Instant;

use super::errors::ProposeError;
use super::network::{self, DynTransport, RpcReply, RpcRequest, TransportError};
use super::types::{MetaRequest, MetaResponse, NodeId, TypeConfig};
use crate::cluster::read_log::{ReadLog, Readers};

/// The most attempts one proposal makes (each bounded by the deadline anyway).
pub const ATTEMPTS_MAX: u32 = 4096;
/// First pause after an attempt that did not reach a leader; doubles up to `PAUSE_MAX`.
const PAUSE_MIN: Duration = Duration::from_millis(10);
const PAUSE_MAX: Duration = Duration::from_millis(200);
/// Time kept back from the leader's budget for its answer to travel back (at most a
/// quarter of the budget).
const REPLY_MARGIN_MAX: Duration = Duration::from_millis(100);
/// Below this much time left, no new forward is started.
const FORWARD_MIN: Duration = Duration::from_millis(5);

/// A proposal forwarded to the leader.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ForwardRequest {
    /// The node the command was proposed on (for the leader's logs).
    pub origin: NodeId,
    /// How long the sender still waits, in milliseconds; the leader waits at most this (and
    /// at most its own propose timeout) for the outcome.
    pub budget_ms: u64,
    /// The log entry's data, as the leader will append it.
    pub request: MetaRequest,
    /// Name the nodes served reads within this many milliseconds before the commit (0:
    /// not asked, [`Readers::Unknown`]).
    pub readers_window_ms: u64,
}

/// A leader's answer to a forwarded proposal (also the outcome of a local one).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum ForwardReply {
    /// Committed and applied; the outcome may be the state machine's refusal. With it, the
    /// nodes that may still route by metadata from before it (`cluster::read_log`).
    Applied(MetaResponse, Readers),
    /// The receiver does not lead and did not propose the command; its view of the leader.
    NotLeader {
        /// The leader's id, if known (never the receiver itself).
        leader: Option<NodeId>,
        /// The leader's cluster address.
        leader_addr: Option<String>,
    },
    /// Proposed; no outcome within the budget. It may still commit.
    Timeout {
        /// The budget that ran out.
        budget_ms: u64,
    },
    /// Proposed; the outcome was lost (leadership lost with the command in flight). It may
    /// or may not commit.
    Unknown {
        /// What happened.
        reason: String,
    },
    /// The leader's Raft stopped; a command already proposed may still commit elsewhere.
    Stopped {
        /// Why.
        reason: String,
    },
}

/// A leader's answer to a read-index request.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum ReadIndexReply {
    /// A quorum confirmed the leadership after the request arrived: a reader that has
    /// applied up to `index` sees every command committed before it sent the request.
    Ready {
        /// The log index to have applied.
        index: u64,
    },
    /// The receiver does not lead; its view of the leader.
    NotLeader {
        /// The leader's id, if known (never the receiver itself).
        leader: Option<NodeId>,
        /// The leader's cluster address.
        leader_addr: Option<String>,
    },
    /// No quorum confirmed the leadership in time, or Raft stopped.
    Failed {
        /// What happened.
        reason: String,
    },
}

/// What a leader served reads to (`cluster::read_log`), shared by the RPC server, which
/// serves other nodes' reads, and the forwarder, which serves this node's own and commits.
/// Time is the runtime's monotonic clock (the simulation's virtual one).
#[derive(Clone, Debug)]
pub struct SharedReads {
    log: Arc<Mutex<ReadLog>>,
    origin: Instant,
}

impl Default for SharedReads {
    fn default() -> SharedReads {
        SharedReads {
            log: Arc::default(),
            origin: Instant::now(),
        }
    }
}

impl SharedReads {
    fn now(&self) -> crate::time::Instant {
        crate::time::Instant::from_millis(millis(self.origin.elapsed()))
    }

    fn lock(&self) -> MutexGuard<'_, ReadLog> {
        self.log.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A read from `origin` arrived while this node leads in `term`.
    fn read(&self, term: u64, origin: NodeId) {
        let now = self.now();
        self.lock().handle_read(term, origin, now);
    }

    /// The nodes that may route by metadata from before what this node, leading in
    /// `term` (if it still does), committed just now.
    fn readers(&self, leading: Option<u64>, window_ms: u64) -> Readers {
        match leading {
            Some(term) if window_ms > 0 => {
                let now = self.now();
                self.lock().readers(term, now, window_ms)
            }
            _ => Readers::Unknown,
        }
    }
}

/// The term this node leads in, if it leads.
fn leading_term(m: &RaftMetrics<NodeId, BasicNode>) -> Option<u64> {
    (m.state == ServerState::Leader && m.running_state.is_ok()).then_some(m.current_term)
}

/// The leader side of a read index: confirms the leadership with a quorum (heartbeats sent
/// after the call) and answers the index up to which a reader must have applied. The read
/// is logged for `origin` before the index is taken (`cluster::read_log`).
pub(super) async fn read_index_as_leader(
    raft: &Raft<TypeConfig>,
    budget: Duration,
    reads: &SharedReads,
    origin: NodeId,
) -> ReadIndexReply {
    let metrics = raft.metrics();
    let refused = {
        let m = metrics.borrow();
        if let Some(term) = leading_term(&m) {
            reads.read(term, origin);
        }
        refuse_unless_leader(&m)
    };
    if let Some(ForwardReply::NotLeader {
        leader,
        leader_addr,
    }) = refused
    {
        return ReadIndexReply::NotLeader {
            leader,
            leader_addr,
        };
    }
    match tokio::time::timeout(budget, raft.get_read_log_id()).await {
        Err(_) => ReadIndexReply::Failed {
            reason: format!("no quorum within {budget:?}"),
        },
        Ok(Ok((read, _applied))) => ReadIndexReply::Ready {
            index: read.map_or(0, |l| l.index),
        },
        Ok(Err(RaftError::APIError(CheckIsLeaderError::ForwardToLeader(f)))) => {
            ReadIndexReply::NotLeader {
                leader: f.leader_id,
                leader_addr: f.leader_node.map(|n| n.addr),
            }
        }
        Ok(Err(e)) => ReadIndexReply::Failed {
            reason: e.to_string(),
        },
    }
}

fn millis(d: Duration) -> u64 {
    d.as_millis().try_into().unwrap_or(u64::MAX)
}

/// Commits `request` if this node leads, answering as to a forward, with the nodes served
/// reads within `readers_window_ms` (0: not asked). The leadership check comes first, so
/// `NotLeader` always means "not proposed".
pub(super) async fn write_as_leader(
    raft: &Raft<TypeConfig>,
    request: MetaRequest,
    budget: Duration,
    reads: &SharedReads,
    readers_window_ms: u64,
) -> ForwardReply {
    if let Some(not_leader) = refuse_unless_leader(&raft.metrics().borrow()) {
        return not_leader;
    }
    if budget.is_zero() {
        return ForwardReply::Timeout { budget_ms: 0 };
    }
    match tokio::time::timeout(budget, raft.client_write(request)).await {
        Err(_) => ForwardReply::Timeout {
            budget_ms: millis(budget),
        },
        Ok(Ok(resp)) => {
            let leading = leading_term(&raft.metrics().borrow());
            ForwardReply::Applied(resp.data, reads.readers(leading, readers_window_ms))
        }
        Ok(Err(RaftError::APIError(ClientWriteError::ForwardToLeader(f)))) => {
            ForwardReply::Unknown {
                reason: format!(
                    "leadership lost with the command in flight (leader now {:?})",
                    f.leader_id
                ),
            }
        }
        // Only membership changes fail this way; a command never does.
        Ok(Err(RaftError::APIError(ClientWriteError::ChangeMembershipError(e)))) => {
            ForwardReply::Unknown {
                reason: e.to_string(),
            }
        }
        Ok(Err(RaftError::Fatal(f))) => ForwardReply::Stopped {
            reason: f.to_string(),
        },
    }
}

/// `NotLeader` with this node's view of the leader, unless it leads.
fn refuse_unless_leader(m: &RaftMetrics<NodeId, BasicNode>) -> Option<ForwardReply> {
    if m.state == ServerState::Leader && m.running_state.is_ok() {
        return None;
    }
    let leader = m.current_leader.filter(|&l| l != m.id);
    let leader_addr = leader.and_then(|l| {
        m.membership_config
            .membership()
            .get_node(&l)
            .map(|n| n.addr.clone())
    });
    Some(ForwardReply::NotLeader {
        leader,
        leader_addr,
    })
}

/// The leader side: commits a forwarded proposal within the sender's budget.
pub(super) async fn serve(
    raft: &Raft<TypeConfig>,
    req: ForwardRequest,
    propose_timeout: Duration,
    reads: &SharedReads,
) -> ForwardReply {
    let budget = Duration::from_millis(req.budget_ms).min(propose_timeout);
    let reply = write_as_leader(raft, req.request, budget, reads, req.readers_window_ms).await;
    match &reply {
        ForwardReply::Applied(r, _) => {
            tracing::debug!(
                origin = req.origin,
                index = r.index,
                "forwarded proposal applied"
            )
        }
        other => tracing::debug!(origin = req.origin, "forwarded proposal: {other:?}"),
    }
    reply
}

/// Where the next attempt goes.
#[derive(Debug, PartialEq, Eq)]
enum Route {
    Local,
    Remote {
        leader: NodeId,
        addr: String,
    },
    /// No leader known (or not in this node's membership yet).
    Unknown,
    Stopped(String),
}

fn route(me: NodeId, m: &RaftMetrics<NodeId, BasicNode>) -> Route {
    if let Err(e) = &m.running_state {
        return Route::Stopped(e.to_string());
    }
    match m.state {
        ServerState::Shutdown => Route::Stopped("raft node shut down".into()),
        ServerState::Leader => Route::Local,
        _ => match m.current_leader.filter(|&l| l != me) {
            Some(leader) => match m.membership_config.membership().get_node(&leader) {
                Some(n) => Route::Remote {
                    leader,
                    addr: n.addr.clone(),
                },
                None => Route::Unknown,
            },
            None => Route::Unknown,
        },
    }
}

/// What one attempt came to.
enum Attempt {
    Done(Result<(MetaResponse, Readers), ProposeError>),
    /// Nothing was proposed; try again (at `hint` if the receiver named a leader).
    Retry {
        hint: Option<(NodeId, String)>,
        why: String,
    },
}

/// Routes proposals to the leader; one per [`super::MetaRaft`].
#[derive(Clone)]
pub(super) struct Forwarder {
    me: NodeId,
    raft: Raft<TypeConfig>,
    transport: Arc<dyn DynTransport>,
    timeout: Duration,
    reads: SharedReads,
}

impl Forwarder {
    pub(super) fn new(
        me: NodeId,
        raft: Raft<TypeConfig>,
        transport: Arc<dyn DynTransport>,
        timeout: Duration,
        reads: SharedReads,
    ) -> Forwarder {
        Forwarder {
            me,
            raft,
            transport,
            timeout,
            reads,
        }
    }

    /// Commits `request` through whichever node leads, within the propose timeout; with
    /// the nodes the leader served reads within `readers_window_ms` (0: not asked).
    pub(super) async fn propose(
        &self,
        request: MetaRequest,
        readers_window_ms: u64,
    ) -> Result<(MetaResponse, Readers), ProposeError> {
        let started = Instant::now();
        let deadline = started + self.timeout;
        let mut hint: Option<(NodeId, String)> = None;
        let mut pause = PAUSE_MIN;
        let mut why = String::from("no leader known");
        for _ in 0..ATTEMPTS_MAX {
            let leader_before = self.raft.metrics().borrow().current_leader;
            let next = match hint.take() {
                Some((leader, addr)) => Route::Remote { leader, addr },
                None => route(self.me, &self.raft.metrics().borrow()),
            };
            let attempt = match next {
                Route::Stopped(reason) => return Err(ProposeError::Stopped(reason)),
                Route::Local => {
                    let budget = deadline.saturating_duration_since(Instant::now());
                    let reply = write_as_leader(
                        &self.raft,
                        request.clone(),
                        budget,
                        &self.reads,
                        readers_window_ms,
                    )
                    .await;
                    self.settle(reply, self.me)
                }
                Route::Unknown => {
                    if self.wait_for_route(deadline).await {
                        continue;
                    }
                    break;
                }
                Route::Remote { leader, addr } => {
                    self.forward(leader, &addr, &request, readers_window_ms, deadline)
                        .await
                }
            };
            match attempt {
                Attempt::Done(Err(e)) if e.outcome_unknown() => {
                    tracing::warn!(node = self.me, "proposal: {e}");
                    return Err(e);
                }
                Attempt::Done(outcome) => return outcome,
                Attempt::Retry { hint: h, why: w } => {
                    tracing::debug!(node = self.me, "proposal not taken: {w}; retrying");
                    hint = h.filter(|(l, _)| *l != self.me);
                    why = w;
                }
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left < FORWARD_MIN {
                break;
            }
            // The pause ends early when another leader is known (an election ended while
            // the attempts went to a dead one): up to PAUSE_MAX would otherwise be added to
            // every failover.
            let mut metrics = self.raft.metrics();
            tokio::select! {
                _ = tokio::time::sleep(pause.min(left)) => {}
                _ = metrics.wait_for(|m| m.current_leader.is_some() && m.current_leader != leader_before) => {}
            }
            pause = (pause * 2).min(PAUSE_MAX);
        }
        let e = ProposeError::NoLeader {
            waited: started.elapsed(),
            reason: why,
        };
        tracing::warn!(node = self.me, "proposal: {e}");
        Err(e)
    }

    /// Commits `request` only if this node leads now: never forwarded.
    pub(super) async fn propose_here(
        &self,
        request: MetaRequest,
    ) -> Result<MetaResponse, ProposeError> {
        match self.settle(
            write_as_leader(&self.raft, request, self.timeout, &self.reads, 0).await,
            self.me,
        ) {
            Attempt::Done(outcome) => outcome.map(|(r, _)| r),
            Attempt::Retry { hint, .. } => {
                let (leader, leader_addr) = hint.unzip();
                Err(ProposeError::NotLeader {
                    leader,
                    leader_addr,
                })
            }
        }
    }

    /// Raft's read index from whichever node leads (this one, or the leader it knows of,
    /// once), within `within`: the index this node must have applied for a read that sees
    /// every command committed before the call.
    pub(super) async fn read_index(&self, within: Duration) -> Result<u64, ProposeError> {
        let deadline = Instant::now() + within;
        let not_leader =
            |leader: Option<NodeId>, leader_addr: Option<String>| ProposeError::NotLeader {
                leader,
                leader_addr,
            };
        let next = route(self.me, &self.raft.metrics().borrow());
        let reply = match next {
            Route::Stopped(reason) => return Err(ProposeError::Stopped(reason)),
            Route::Unknown => {
                return Err(ProposeError::NoLeader {
                    waited: Duration::ZERO,
                    reason: "no leader known".into(),
                })
            }
            Route::Local => {
                let left = deadline.saturating_duration_since(Instant::now());
                read_index_as_leader(&self.raft, left, &self.reads, self.me).await
            }
            Route::Remote { leader, addr } => {
                let frame = network::encode_request(&RpcRequest::ReadIndex { origin: self.me })
                    .map_err(|e| ProposeError::ForwardFailed {
                        leader,
                        reason: e.to_string(),
                    })?;
                let left = deadline.saturating_duration_since(Instant::now());
                let call = self.transport.call_dyn(leader, &addr, frame, left);
                match tokio::time::timeout(left, call).await {
                    Ok(Ok(bytes)) => match network::decode_reply(&bytes) {
                        Ok(RpcReply::ReadIndex(r)) => r,
                        other => {
                            return Err(ProposeError::ForwardFailed {
                                leader,
                                reason: format!("unexpected read-index reply: {other:?}"),
                            })
                        }
                    },
                    Ok(Err(e)) => {
                        return Err(ProposeError::ForwardFailed {
                            leader,
                            reason: e.to_string(),
                        })
                    }
                    Err(_) => return Err(ProposeError::Timeout(within)),
                }
            }
        };
        match reply {
            ReadIndexReply::Ready { index } => Ok(index),
            ReadIndexReply::NotLeader {
                leader,
                leader_addr,
            } => Err(not_leader(leader, leader_addr)),
            ReadIndexReply::Failed { reason } => Err(ProposeError::NoQuorum(reason)),
        }
    }

    /// Waits until this node leads, knows a leader, or stopped; false at the deadline.
    async fn wait_for_route(&self, deadline: Instant) -> bool {
        let mut rx = self.raft.metrics();
        let wait = async {
            loop {
                let next = route(self.me, &rx.borrow_and_update());
                if next != Route::Unknown || rx.changed().await.is_err() {
                    return;
                }
            }
        };
        tokio::time::timeout_at(deadline, wait).await.is_ok()
    }

    /// Sends `request` to `leader` and interprets what comes back.
    async fn forward(
        &self,
        leader: NodeId,
        addr: &str,
        request: &MetaRequest,
        readers_window_ms: u64,
        deadline: Instant,
    ) -> Attempt {
        let left = deadline.saturating_duration_since(Instant::now());
        if left < FORWARD_MIN {
            return Attempt::Retry {
                hint: None,
                why: "no time left to forward".into(),
            };
        }
        let budget = left - REPLY_MARGIN_MAX.min(left / 4);
        let req = RpcRequest::Forward(ForwardRequest {
            origin: self.me,
            budget_ms: millis(budget),
            request: request.clone(),
            readers_window_ms,
        });
        let frame = match network::encode_request(&req) {
            Ok(f) => f,
            Err(e) => {
                return Attempt::Done(Err(ProposeError::ForwardFailed {
                    leader,
                    reason: e.to_string(),
                }))
            }
        };
        let unknown = |reason: String| Attempt::Done(Err(ProposeError::Unknown { leader, reason }));
        let call = self.transport.call_dyn(leader, addr, frame, left);
        let reply = match tokio::time::timeout(left, call).await {
            Err(_) | Ok(Err(TransportError::Timeout)) => {
                return Attempt::Done(Err(ProposeError::Timeout(self.timeout)))
            }
            Ok(Err(TransportError::Unreachable { reason, .. })) => {
                return Attempt::Retry {
                    hint: None,
                    why: format!("leader {leader} unreachable: {reason}"),
                }
            }
            Ok(Err(TransportError::Io(e))) => {
                return unknown(format!("the link failed with the command in flight: {e}"))
            }
            Ok(Ok(reply)) => reply,
        };
        match network::decode_reply(&reply) {
            Ok(RpcReply::Forward(r)) => self.settle(r, leader),
            Ok(RpcReply::Malformed(why)) => Attempt::Done(Err(ProposeError::ForwardFailed {
                leader,
                reason: format!("it could not decode the request: {why}"),
            })),
            Ok(other) => unknown(format!("the reply does not match the request: {other:?}")),
            Err(e) => unknown(format!("the reply does not decode: {e}")),
        }
    }

    /// Maps a leader's answer (`leader` is this node for a local write) to the attempt's end.
    fn settle(&self, reply: ForwardReply, leader: NodeId) -> Attempt {
        let local = leader == self.me;
        match reply {
            ForwardReply::Applied(r, readers) => Attempt::Done(Ok((r, readers))),
            ForwardReply::NotLeader {
                leader: next,
                leader_addr,
            } => Attempt::Retry {
                hint: next.zip(leader_addr).filter(|(l, _)| *l != leader),
                why: format!("node {leader} does not lead (it names {next:?})"),
            },
            ForwardReply::Timeout { .. } => Attempt::Done(Err(ProposeError::Timeout(self.timeout))),
            ForwardReply::Stopped { reason } if local => {
                Attempt::Done(Err(ProposeError::Stopped(reason)))
            }
            ForwardReply::Stopped { reason } => Attempt::Done(Err(ProposeError::Unknown {
                leader,
                reason: format!("the leader stopped: {reason}"),
            })),
            ForwardReply::Unknown { reason } => {
                Attempt::Done(Err(ProposeError::Unknown { leader, reason }))
            }
        }
    }
}

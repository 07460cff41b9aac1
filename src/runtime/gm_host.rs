//! The GM host: runs a node's GM members ([`crate::gm::Member`]) and carries their messages
//! over the node links.
//!
//! - **Views** come from the metadata: every member task follows the applied state
//!   ([`MetaRaft::subscribe`]) and hands each newer group record to its member. Joins,
//!   leaves and alias erasures are compare-and-set commands on the record's version
//!   ([`Command::GmGroup`]); deaths are recorded by the metadata itself when the failure
//!   detector's `NodeDown` (or a restarted node's new incarnation) is applied. A member cut
//!   off from the majority therefore keeps its old view, and its laps cannot complete.
//! - **Messages** go to the right neighbour through one sender task per (member, right
//!   neighbour) stream, numbered and resent until accepted ([`crate::gm::wire`]), so a lost
//!   frame or a dropped link costs a retry, not a message. The receiving host routes them to
//!   the member's task.
//! - **Flushing**: a member task takes every command that is ready, then flushes once, so
//!   under load a flush carries many broadcasts and when idle each goes at once.
//!
//! The network is a trait ([`GmNet`]): the node links in production, turmoil's simulated
//! TCP in the simulation, which runs this same code.

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use bytes::Bytes;
use prometheus_client::metrics::histogram::Histogram;
use tokio::sync::{mpsc, oneshot};

use crate::gm::{Event, GmMsg, GmReply, Inbox, MemberId, PubNum};
use crate::runtime::raft::{MetaRaft, NodeId, TransportError};

mod join;
mod member_task;

/// Carries a GM frame to another node's host and brings its reply back.
pub trait GmNet: Send + Sync + 'static {
    /// Sends `frame` to node `to` and returns the reply, within `deadline`.
    fn call(
        &self,
        to: NodeId,
        frame: Vec<u8>,
        deadline: Duration,
    ) -> impl Future<Output = Result<Vec<u8>, TransportError>> + Send;
}

/// Timings of a host.
#[derive(Clone, Debug)]
pub struct GmHostConfig {
    /// How long a sender waits for a frame's reply before resending.
    pub call_timeout: Duration,
    /// Pause after a failed or refused send.
    pub retry_after: Duration,
    /// Messages per frame at most.
    pub max_batch: usize,
    /// Payload bytes per frame at most, well under the node link's frame limit (at least
    /// 16 MiB): a message bigger than this goes alone, in parts of this size.
    pub max_batch_bytes: usize,
    /// Own broadcasts are flushed as one activity once they hold this many bytes (so a
    /// burst pipelines instead of travelling as one message sent in parts).
    pub max_activity_bytes: usize,
    /// Pause between compare-and-set attempts that lost a race.
    pub cas_retry: Duration,
    /// Attempts for a join, leave or erase before giving up.
    pub cas_attempts: usize,
    /// Where each confirmed broadcast's lap time goes (`warren_gm_lap_latency_seconds`).
    pub lap_latency: Option<Histogram>,
}

impl Default for GmHostConfig {
    fn default() -> Self {
        GmHostConfig {
            call_timeout: Duration::from_secs(2),
            retry_after: Duration::from_millis(50),
            max_batch: 256,
            max_batch_bytes: 8 << 20,
            max_activity_bytes: 4 << 20,
            cas_retry: Duration::from_millis(20),
            cas_attempts: 200,
            lap_latency: None,
        }
    }
}

/// Why a GM operation failed.
#[derive(Debug, thiserror::Error)]
pub enum GmError {
    /// The member is no longer in the group (declared dead, or left).
    #[error("the GM member has stopped")]
    Stopped,
    /// The metadata would not take the membership change.
    #[error("cannot change GM group '{group}': {reason}")]
    Membership {
        /// The group.
        group: String,
        /// Why.
        reason: String,
    },
}

type Route = mpsc::UnboundedSender<Vec<GmMsg<Bytes>>>;

/// Commands a member task takes before it flushes, at most (flush when idle or past this).
const FLUSH_AFTER: usize = 512;
/// How long a join tries to learn whether its proposal of unknown outcome committed.
const SETTLE_WITHIN: Duration = Duration::from_secs(30);
/// One quorum read's bound within that.
const SETTLE_ATTEMPT: Duration = Duration::from_secs(2);

struct Inner<N> {
    node: NodeId,
    net: N,
    raft: MetaRaft,
    cfg: GmHostConfig,
    routes: Mutex<BTreeMap<(String, MemberId), Route>>,
    inbox: Mutex<Inbox>,
    /// Joins on this node one at a time: two at once into one group would predict the same
    /// member id, and the loser's cleanup would remove the winner's route.
    joining: tokio::sync::Mutex<()>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// One node's GM members. Clones share them.
pub struct GmHost<N> {
    inner: Arc<Inner<N>>,
}

impl<N> Clone for GmHost<N> {
    fn clone(&self) -> Self {
        GmHost {
            inner: Arc::clone(&self.inner),
        }
    }
}

impl<N> std::fmt::Debug for GmHost<N> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GmHost")
            .field("node", &self.inner.node)
            .finish_non_exhaustive()
    }
}

enum Cmd {
    Broadcast(Bytes),
    Confirmed(Bytes, oneshot::Sender<Result<(), GmError>>),
    Release(MemberId, PubNum),
    /// Leave; `drain`: once nothing of this member is in flight.
    Leave {
        tx: oneshot::Sender<Result<(), GmError>>,
        drain: bool,
    },
}

/// The application's end of one member.
#[derive(Debug)]
pub struct GmHandle {
    id: MemberId,
    group: String,
    cmds: mpsc::UnboundedSender<Cmd>,
    events: mpsc::UnboundedReceiver<Event<Bytes>>,
}

impl std::fmt::Debug for Cmd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Cmd::Broadcast(_) => "Broadcast",
            Cmd::Confirmed(..) => "Confirmed",
            Cmd::Release(..) => "Release",
            Cmd::Leave { .. } => "Leave",
        })
    }
}

/// A clonable sender for one member's broadcasts and releases (the application may send
/// from several places, e.g. the storage syncer, while one task reads the events).
#[derive(Debug, Clone)]
pub struct GmSender {
    cmds: mpsc::UnboundedSender<Cmd>,
}

impl GmSender {
    /// Broadcasts `msg`; see [`GmHandle::confirmed_broadcast`].
    pub fn confirmed_broadcast(
        &self,
        msg: Bytes,
    ) -> impl Future<Output = Result<(), GmError>> + Send + 'static {
        confirmed(&self.cmds, msg)
    }

    /// Broadcasts `msg` without waiting for its lap.
    pub fn broadcast(&self, msg: Bytes) -> Result<(), GmError> {
        self.cmds
            .send(Cmd::Broadcast(msg))
            .map_err(|_| GmError::Stopped)
    }

    /// Leaves the group; see [`GmHandle::leave`]. With durable acks the owner must go on
    /// releasing what is delivered meanwhile: the drain waits for it.
    pub fn leave(&self) -> impl Future<Output = Result<(), GmError>> + Send + 'static {
        self.leave_as(true)
    }

    /// Leaves the group now, as if this member had died: recorded dead at once, without
    /// waiting for what is in flight. For an owner that holds back a release on purpose
    /// (a mirror whose copy is not what the master thinks): a draining leave would wait
    /// for that release forever. Safe as a crash is: the ring repairs itself around a dead
    /// member, and the owner's copy must no longer be counted on (recorded first).
    pub fn abandon(&self) -> impl Future<Output = Result<(), GmError>> + Send + 'static {
        self.leave_as(false)
    }

    fn leave_as(&self, drain: bool) -> impl Future<Output = Result<(), GmError>> + Send + 'static {
        let (tx, rx) = oneshot::channel();
        let sent = self.cmds.send(Cmd::Leave { tx, drain }).is_ok();
        async move {
            if !sent {
                return Err(GmError::Stopped);
            }
            rx.await.unwrap_or(Err(GmError::Stopped))
        }
    }
}

fn confirmed(
    cmds: &mpsc::UnboundedSender<Cmd>,
    msg: Bytes,
) -> impl Future<Output = Result<(), GmError>> + Send + 'static {
    let (tx, rx) = oneshot::channel();
    let sent = cmds.send(Cmd::Confirmed(msg, tx)).is_ok();
    async move {
        if !sent {
            return Err(GmError::Stopped);
        }
        rx.await.unwrap_or(Err(GmError::Stopped))
    }
}

impl GmHandle {
    /// A clonable sender for this member's broadcasts.
    pub fn sender(&self) -> GmSender {
        GmSender {
            cmds: self.cmds.clone(),
        }
    }

    /// This member.
    pub fn id(&self) -> MemberId {
        self.id
    }

    /// Its group.
    pub fn group(&self) -> &str {
        &self.group
    }

    /// Broadcasts `msg` (delivered here at once, as an event).
    pub fn broadcast(&self, msg: Bytes) -> Result<(), GmError> {
        self.cmds
            .send(Cmd::Broadcast(msg))
            .map_err(|_| GmError::Stopped)
    }

    /// Broadcasts `msg`; the future completes once it has made a full lap (with durable
    /// acks: once every member released it), or fails if the member stops first.
    pub fn confirmed_broadcast(
        &self,
        msg: Bytes,
    ) -> impl Future<Output = Result<(), GmError>> + Send + 'static {
        confirmed(&self.cmds, msg)
    }

    /// Durable acks: `origin`'s publishes up to `upto` are durable here.
    pub fn release(&self, origin: MemberId, upto: PubNum) {
        let _ = self.cmds.send(Cmd::Release(origin, upto));
    }

    /// The next event: `Joined` first, then deliveries (own broadcasts included) and
    /// membership changes; `Stopped` last. `None` once the member task is gone.
    pub async fn next_event(&mut self) -> Option<Event<Bytes>> {
        self.events.recv().await
    }

    /// The next event if one is ready.
    pub fn try_event(&mut self) -> Option<Event<Bytes>> {
        self.events.try_recv().ok()
    }

    /// Leaves the group: waits until nothing of this member is in flight (drain before
    /// stop), then records it dead, so the rest carry on without waiting for a timeout.
    pub async fn leave(&self) -> Result<(), GmError> {
        self.sender().leave().await
    }
}

impl<N: GmNet + Clone> GmHost<N> {
    /// A host for node `node`, following `raft`'s metadata and sending over `net`.
    pub fn new(node: NodeId, net: N, raft: MetaRaft, cfg: GmHostConfig) -> GmHost<N> {
        GmHost {
            inner: Arc::new(Inner {
                node,
                net,
                raft,
                cfg,
                routes: Mutex::new(BTreeMap::new()),
                inbox: Mutex::new(Inbox::new()),
                joining: tokio::sync::Mutex::new(()),
            }),
        }
    }

    /// The node.
    pub fn node(&self) -> NodeId {
        self.inner.node
    }

    /// Answers a frame from another node's host (the server side of [`GmNet::call`]).
    pub fn handle_frame(&self, payload: &Bytes) -> Vec<u8> {
        let reply = match crate::gm::wire::decode_frame(payload) {
            Err(e) => {
                tracing::warn!(node = self.inner.node, "undecodable GM frame: {e}");
                GmReply::NoMember
            }
            Ok(frame) => {
                let route = lock(&self.inner.routes)
                    .get(&(frame.group.clone(), frame.to))
                    .cloned();
                match route {
                    None => GmReply::NoMember,
                    Some(route) => {
                        let (msgs, reply) = lock(&self.inner.inbox).accept(frame);
                        if msgs.is_empty() || route.send(msgs).is_ok() {
                            reply
                        } else {
                            GmReply::NoMember
                        }
                    }
                }
            }
        };
        bincode::serialize(&reply).unwrap_or_default()
    }
}

//! [`MetaStateMachine`]: openraft's state machine (v2) over [`MetaState`].
//!
//! The state lives in memory behind an `Arc`; after each applied batch the new `Arc` is
//! published on a `watch` channel as a [`MetaView`], so readers hold an immutable snapshot
//! and never block the apply loop. Durability comes from two places: the Raft log (committed
//! entries are re-applied at start-up) and snapshots, which are written to `snapshot` in the
//! node's folder (atomically, fsynced) before openraft may purge the log they cover.
//!
//! Each applied entry also extends a chained CRC-32, the *digest*. Two nodes with the same
//! digest applied the same entries with the same outcomes in the same order; snapshots carry
//! it, so a node that caught up from a snapshot still compares equal.

use std::io::Cursor;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

use openraft::storage::RaftStateMachine;
use openraft::{
    BasicNode, Entry, EntryPayload, LogId, OptionalSend, RaftSnapshotBuilder, Snapshot,
    SnapshotMeta, StorageError, StorageIOError, StoredMembership,
};
use serde::{Deserialize, Serialize};
use tokio::sync::watch;

use super::image::Image;
use super::persist::{self, PersistError};
use super::types::{AppliedSummary, MetaResponse, NodeId, Rejected, TypeConfig};
use crate::cluster::ReadFence;
use crate::meta::{Command, MetaState};
use crate::store::Disk;

const SNAPSHOT: &str = "snapshot";

/// What readers see: the metadata after the last applied entry.
#[derive(Clone, Debug, Default)]
pub struct MetaView {
    /// The metadata.
    pub state: Arc<MetaState>,
    /// Index of the last applied log entry (`None` before the first).
    pub applied_index: Option<u64>,
    /// Chained checksum of every applied entry and its outcome.
    pub digest: u32,
}

/// A snapshot as stored on disk: openraft's metadata and the encoded [`Image`].
#[derive(Clone, Serialize, Deserialize)]
struct StoredSnapshot {
    meta: SnapshotMeta<NodeId, BasicNode>,
    #[serde(with = "serde_bytes")]
    data: Vec<u8>,
}

/// The newest snapshot, shared by the state machine and its builders.
#[derive(Clone)]
struct SnapshotSlot {
    disk: Arc<dyn Disk>,
    dir: PathBuf,
    current: Arc<Mutex<Option<StoredSnapshot>>>,
}

impl SnapshotSlot {
    /// Makes `snap` durable and current, unless a newer one already is (a build racing an
    /// install). The lock also keeps two writers off the file at once.
    fn store(&self, snap: StoredSnapshot) -> Result<(), PersistError> {
        let mut current = self.current.lock().unwrap_or_else(|e| e.into_inner());
        if current
            .as_ref()
            .is_some_and(|c| c.meta.last_log_id > snap.meta.last_log_id)
        {
            return Ok(());
        }
        persist::write_durable(&*self.disk, &self.dir, SNAPSHOT, "snapshot", &snap)?;
        *current = Some(snap);
        Ok(())
    }

    fn get(&self) -> Option<StoredSnapshot> {
        self.current
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
}

/// The leader's read fence (`cluster::read_fence`), shared by the state machine (which
/// reports each applied `NodeDown`), the RPC server (which refuses fenced readers) and
/// the failure detector's driver (which fences).
#[derive(Clone, Debug, Default)]
pub struct SharedFence(Arc<Mutex<ReadFence>>);

impl SharedFence {
    /// The fence, locked (briefly: every holder only looks or updates).
    pub fn lock(&self) -> MutexGuard<'_, ReadFence> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The metadata state machine of one node.
pub struct MetaStateMachine {
    state: Arc<MetaState>,
    last_applied: Option<LogId<NodeId>>,
    membership: StoredMembership<NodeId, BasicNode>,
    digest: u32,
    slot: SnapshotSlot,
    view: watch::Sender<MetaView>,
    fence: SharedFence,
}

/// Extends the digest with one applied entry.
fn chain(digest: u32, index: u64, body: &[u8]) -> u32 {
    let mut h = crc32fast::Hasher::new_with_initial(digest);
    h.update(&index.to_le_bytes());
    h.update(body);
    h.finalize()
}

fn decode_image(data: &[u8], path: &Path) -> Result<Image, PersistError> {
    Image::decode(data, path)
}

impl MetaStateMachine {
    /// Opens the state machine in `dir`, starting from the stored snapshot if there is one.
    pub fn open(
        disk: Arc<dyn Disk>,
        dir: &Path,
    ) -> Result<(MetaStateMachine, watch::Receiver<MetaView>), PersistError> {
        disk.create_dir_all(dir)?;
        let stored: Option<StoredSnapshot> =
            persist::read_durable(&*disk, dir, SNAPSHOT, "snapshot")?;
        let mut sm = MetaStateMachine {
            state: Arc::default(),
            last_applied: None,
            membership: StoredMembership::default(),
            digest: 0,
            slot: SnapshotSlot {
                disk,
                dir: dir.to_path_buf(),
                current: Arc::default(),
            },
            view: watch::Sender::new(MetaView::default()),
            fence: SharedFence::default(),
        };
        if let Some(snap) = stored {
            let image = decode_image(&snap.data, &dir.join(SNAPSHOT))?;
            sm.restore(&snap.meta, image);
            *sm.slot.current.lock().unwrap_or_else(|e| e.into_inner()) = Some(snap);
        }
        let rx = sm.view.subscribe();
        sm.publish();
        Ok((sm, rx))
    }

    /// The read fence this state machine reports applied `NodeDown`s to.
    pub fn fence(&self) -> SharedFence {
        self.fence.clone()
    }

    fn restore(&mut self, meta: &SnapshotMeta<NodeId, BasicNode>, image: Image) {
        self.digest = image.digest;
        self.state = Arc::new(image.into_state());
        self.last_applied = meta.last_log_id;
        self.membership = meta.last_membership.clone();
    }

    fn publish(&self) {
        self.view.send_replace(MetaView {
            state: Arc::clone(&self.state),
            applied_index: self.last_applied.map(|l| l.index),
            digest: self.digest,
        });
    }

    /// Applies one entry; returns its response and the bytes the digest covers.
    fn apply_one(
        &mut self,
        entry: Entry<TypeConfig>,
    ) -> Result<(MetaResponse, Vec<u8>), PersistError> {
        let log_id = entry.log_id;
        let (outcome, body) = match entry.payload {
            EntryPayload::Blank => (Ok(AppliedSummary::default()), Vec::new()),
            EntryPayload::Normal(req) => {
                // MetaState::apply validates first and changes nothing when it refuses.
                let outcome = Arc::make_mut(&mut self.state)
                    .apply(&req.command)
                    .map(AppliedSummary::from)
                    .map_err(Rejected::from);
                let body = persist::encode("applied command", &(&req.command, &outcome))?;
                // Refused or not, it is committed: reads from now on have an index past it.
                if let Command::NodeDown { id } = req.command {
                    self.fence.lock().handle_recorded(id);
                }
                (outcome, body)
            }
            EntryPayload::Membership(m) => {
                let body = persist::encode("membership", &m)?;
                self.membership = StoredMembership::new(Some(log_id), m);
                (Ok(AppliedSummary::default()), body)
            }
        };
        self.last_applied = Some(log_id);
        let resp = MetaResponse {
            index: log_id.index,
            outcome,
        };
        Ok((resp, body))
    }
}

impl RaftStateMachine<TypeConfig> for MetaStateMachine {
    type SnapshotBuilder = SnapshotBuilder;

    async fn applied_state(
        &mut self,
    ) -> Result<(Option<LogId<NodeId>>, StoredMembership<NodeId, BasicNode>), StorageError<NodeId>>
    {
        Ok((self.last_applied, self.membership.clone()))
    }

    async fn apply<I>(&mut self, entries: I) -> Result<Vec<MetaResponse>, StorageError<NodeId>>
    where
        I: IntoIterator<Item = Entry<TypeConfig>> + OptionalSend,
        I::IntoIter: OptionalSend,
    {
        let mut replies = Vec::new();
        for entry in entries {
            let log_id = entry.log_id;
            let (resp, body) = self
                .apply_one(entry)
                .map_err(|e| StorageIOError::apply(log_id, &e))?;
            self.digest = chain(self.digest, log_id.index, &body);
            replies.push(resp);
        }
        // One publication per batch: readers never see a half-applied batch's clone churn.
        self.publish();
        Ok(replies)
    }

    async fn get_snapshot_builder(&mut self) -> SnapshotBuilder {
        SnapshotBuilder {
            state: Arc::clone(&self.state),
            last_applied: self.last_applied,
            membership: self.membership.clone(),
            digest: self.digest,
            slot: self.slot.clone(),
        }
    }

    async fn begin_receiving_snapshot(
        &mut self,
    ) -> Result<Box<Cursor<Vec<u8>>>, StorageError<NodeId>> {
        Ok(Box::new(Cursor::new(Vec::new())))
    }

    async fn install_snapshot(
        &mut self,
        meta: &SnapshotMeta<NodeId, BasicNode>,
        snapshot: Box<Cursor<Vec<u8>>>,
    ) -> Result<(), StorageError<NodeId>> {
        let data = snapshot.into_inner();
        let sig = || Some(meta.signature());
        let image = decode_image(&data, Path::new("received snapshot"))
            .map_err(|e| StorageIOError::read_snapshot(sig(), &e))?;
        let stored = StoredSnapshot {
            meta: meta.clone(),
            data,
        };
        // Durable before the state moves: the log below it may be purged next.
        self.slot
            .store(stored)
            .map_err(|e| StorageIOError::write_snapshot(sig(), &e))?;
        self.restore(meta, image);
        self.publish();
        Ok(())
    }

    async fn get_current_snapshot(
        &mut self,
    ) -> Result<Option<Snapshot<TypeConfig>>, StorageError<NodeId>> {
        Ok(self.slot.get().map(|s| Snapshot {
            meta: s.meta,
            snapshot: Box::new(Cursor::new(s.data)),
        }))
    }
}

/// Builds a snapshot from the state as it was when openraft asked for the builder; openraft
/// runs it in its own task while the state machine keeps applying.
pub struct SnapshotBuilder {
    state: Arc<MetaState>,
    last_applied: Option<LogId<NodeId>>,
    membership: StoredMembership<NodeId, BasicNode>,
    digest: u32,
    slot: SnapshotSlot,
}

impl RaftSnapshotBuilder<TypeConfig> for SnapshotBuilder {
    async fn build_snapshot(&mut self) -> Result<Snapshot<TypeConfig>, StorageError<NodeId>> {
        let data = Image::of(&self.state, self.digest)
            .encode()
            .map_err(|e| StorageIOError::write_snapshot(None, &e))?;
        // term-index-digest: two builds at one position hold the same data, so share an id.
        let snapshot_id = match self.last_applied {
            Some(l) => format!("{}-{}-{:08x}", l.leader_id.term, l.index, self.digest),
            None => format!("0-0-{:08x}", self.digest),
        };
        let meta = SnapshotMeta {
            last_log_id: self.last_applied,
            last_membership: self.membership.clone(),
            snapshot_id,
        };
        self.slot
            .store(StoredSnapshot {
                meta: meta.clone(),
                data: data.clone(),
            })
            .map_err(|e| StorageIOError::write_snapshot(Some(meta.signature()), &e))?;
        Ok(Snapshot {
            meta,
            snapshot: Box::new(Cursor::new(data)),
        })
    }
}

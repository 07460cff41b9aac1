//! Which queues this node ships rounds for, and through which GM member: what the storage
//! tap reads for every round of a mirrored queue mastered here.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use super::{lock, Key};
use crate::gm::MemberId;
use crate::runtime::gm_host::{GmHandle, GmSender};

/// Where the storage tap ships a mastered queue's rounds.
#[derive(Clone)]
pub(super) struct Shipping {
    pub(super) sender: GmSender,
    pub(super) epoch: u64,
    /// The queue incarnation shipped for ([`crate::meta::state::MirrorSet::incarnation`]).
    pub(super) incarnation: u64,
    /// The master's member (a handover waits for it to leave).
    pub(super) member: MemberId,
    /// Set when a controlled stop starts handing the queue over: from then on no round is
    /// confirmed, not even one whose lap is under way. The target may die during the
    /// handover, and a lap completes without a dead member, so a confirm given then could
    /// be missing from the copy that becomes the queue.
    pub(super) handing_over: Arc<std::sync::atomic::AtomicBool>,
}

impl Shipping {
    /// Shipping through `handle`'s member at `epoch` of queue incarnation `incarnation`.
    pub(super) fn of(handle: &GmHandle, epoch: u64, incarnation: u64) -> Shipping {
        Shipping {
            sender: handle.sender(),
            epoch,
            incarnation,
            member: handle.id(),
            handing_over: Arc::default(),
        }
    }
}

/// The queues this node ships rounds for. Its lock is never held while another is taken:
/// the storage tap reads it under the storage lock, and a queue's lock and the broker's are
/// taken before the storage lock, so a queue or broker lock taken under this one closes a
/// cycle (bug 11 in `docs/reliability.md`: `keep_leases` held it while looking a queue up,
/// an adoption held the broker and waited for storage, and the syncer waited for this; the
/// node froze). Every method takes the lock for one map operation and returns owned values.
#[derive(Default)]
pub(super) struct Shippers(Mutex<HashMap<Key, Shipping>>);

impl Shippers {
    pub(super) fn get(&self, key: &Key) -> Option<Shipping> {
        lock(&self.0).get(key).cloned()
    }

    pub(super) fn insert(&self, key: Key, shipping: Shipping) {
        lock(&self.0).insert(key, shipping);
    }

    pub(super) fn remove(&self, key: &Key) {
        lock(&self.0).remove(key);
    }

    pub(super) fn is_empty(&self) -> bool {
        lock(&self.0).is_empty()
    }

    pub(super) fn all(&self) -> Vec<(Key, Shipping)> {
        lock(&self.0)
            .iter()
            .map(|(k, s)| (k.clone(), s.clone()))
            .collect()
    }

    pub(super) fn drain(&self) -> Vec<Key> {
        lock(&self.0).drain().map(|(k, _)| k).collect()
    }
}

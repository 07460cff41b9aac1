//! openraft's own conformance suite against our log store and state machine.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use openraft::testing::{StoreBuilder, Suite};
use openraft::{StorageError, StorageIOError};

use super::harness::TempDir;
use crate::runtime::file_disk::FileDisk;
use crate::runtime::raft::log_store::LogStore;
use crate::runtime::raft::state_machine::MetaStateMachine;
use crate::runtime::raft::types::{NodeId, TypeConfig};
use crate::store::{Disk, MemDisk};

fn open(
    disk: Arc<dyn Disk>,
    dir: &Path,
    segment_bytes: u64,
) -> Result<(LogStore, MetaStateMachine), StorageError<NodeId>> {
    let err = |e| StorageError::from(StorageIOError::read(&e));
    let log = LogStore::open(Arc::clone(&disk), dir, segment_bytes).map_err(err)?;
    let (sm, _view) = MetaStateMachine::open(disk, dir).map_err(err)?;
    Ok((log, sm))
}

/// A fresh in-memory disk per store.
struct Mem {
    segment_bytes: u64,
}

impl StoreBuilder<TypeConfig, LogStore, MetaStateMachine, ()> for Mem {
    async fn build(&self) -> Result<((), LogStore, MetaStateMachine), StorageError<NodeId>> {
        let (log, sm) = open(
            Arc::new(MemDisk::new()),
            Path::new("/raft"),
            self.segment_bytes,
        )?;
        Ok(((), log, sm))
    }
}

/// A fresh folder on the real file system per store, removed when the suite drops it.
struct Files;

impl StoreBuilder<TypeConfig, LogStore, MetaStateMachine, TempDir> for Files {
    async fn build(&self) -> Result<(TempDir, LogStore, MetaStateMachine), StorageError<NodeId>> {
        let dir = TempDir::new("suite");
        let (log, sm) = open(Arc::new(FileDisk::new()), &dir.path, 4096)?;
        Ok((dir, log, sm))
    }
}

/// Runs the suite (which builds its own runtimes) on a thread, under a deadline.
fn run<B, G>(builder: B) -> Result<(), StorageError<NodeId>>
where
    B: StoreBuilder<TypeConfig, LogStore, MetaStateMachine, G> + 'static,
    G: Send + Sync + 'static,
{
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(Suite::test_all(builder));
    });
    rx.recv_timeout(Duration::from_secs(120))
        .expect("the suite finished in time (a panic is printed above)")
}

#[test]
fn openraft_suite_on_mem_disk() -> Result<(), StorageError<NodeId>> {
    run(Mem {
        segment_bytes: 8 << 20,
    })
}

#[test]
fn openraft_suite_with_a_segment_per_entry() -> Result<(), StorageError<NodeId>> {
    // Every append rolls the segment, so purge and truncate work across files.
    run(Mem { segment_bytes: 1 })
}

#[test]
fn openraft_suite_on_file_disk() -> Result<(), StorageError<NodeId>> {
    run(Files)
}

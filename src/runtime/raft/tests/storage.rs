//! Crash recovery of the log store and the state machine.

use std::path::Path;
use std::sync::Arc;

use openraft::storage::{RaftLogStorage, RaftLogStorageExt, RaftStateMachine};
use openraft::{RaftLogReader, RaftSnapshotBuilder, Vote};

use super::harness::{
    add_vhost, bind, blank, bounded, declare_queue, log_id, normal, TempDir, DIR,
};
use crate::runtime::file_disk::FileDisk;
use crate::runtime::raft::log_store::LogStore;
use crate::runtime::raft::state_machine::MetaStateMachine;
use crate::runtime::raft::types::Rejected;
use crate::runtime::raft::PersistError;
use crate::store::{Disk, MemDisk};

fn open_log(disk: &MemDisk, segment_bytes: u64) -> Result<LogStore, PersistError> {
    LogStore::open(Arc::new(disk.clone()), Path::new(DIR), segment_bytes)
}

async fn indexes(log: &mut LogStore) -> Vec<u64> {
    let entries = log.try_get_log_entries(..).await.expect("read log");
    entries.iter().map(|e| e.log_id.index).collect()
}

#[tokio::test]
async fn acknowledged_log_survives_power_loss_across_purge_and_truncate() {
    bounded(async {
        let disk = MemDisk::new();
        // Small segments: about two entries each, so purge and truncate span files.
        let mut log = open_log(&disk, 60).expect("open");
        log.blocking_append((0..20).map(|i| blank(1, i)))
            .await
            .expect("append");
        log.save_vote(&Vote::new(3, 2)).await.expect("vote");
        log.purge(log_id(1, 5)).await.expect("purge");
        log.truncate(log_id(1, 15)).await.expect("truncate");
        log.blocking_append((15..18).map(|i| blank(2, i)))
            .await
            .expect("append");
        drop(log);
        disk.crash();

        let mut log = open_log(&disk, 60).expect("reopen");
        assert_eq!(indexes(&mut log).await, (6..18).collect::<Vec<_>>());
        let state = log.get_log_state().await.expect("state");
        assert_eq!(state.last_purged_log_id, Some(log_id(1, 5)));
        assert_eq!(state.last_log_id, Some(log_id(2, 17)));
        assert_eq!(log.read_vote().await.expect("vote"), Some(Vote::new(3, 2)));
        let names = disk.list(Path::new(DIR)).expect("list");
        assert!(
            !names.contains(&"log-00000000000000000000".to_string()),
            "purged segments are removed: {names:?}"
        );
    })
    .await;
}

#[tokio::test]
async fn a_torn_tail_is_cut_and_the_log_goes_on() {
    bounded(async {
        let disk = MemDisk::new();
        let mut log = open_log(&disk, 1 << 20).expect("open");
        log.blocking_append((0..5).map(|i| blank(1, i)))
            .await
            .expect("append");
        drop(log);
        // A crash in the middle of the next append: half a record reached the platter.
        let seg = Path::new(DIR).join("log-00000000000000000000");
        let mut torn = crate::runtime::raft::persist::frame(&[1, 2, 3, 4, 5, 6, 7, 8]);
        torn.truncate(10);
        disk.append(&seg, &torn).expect("append torn");
        disk.sync(&seg).expect("sync");

        let mut log = open_log(&disk, 1 << 20).expect("reopen");
        assert_eq!(indexes(&mut log).await, vec![0, 1, 2, 3, 4]);
        log.blocking_append([blank(1, 5)])
            .await
            .expect("append after cut");
        drop(log);
        disk.crash();
        let mut log = open_log(&disk, 1 << 20).expect("reopen again");
        assert_eq!(indexes(&mut log).await, vec![0, 1, 2, 3, 4, 5]);
    })
    .await;
}

#[tokio::test]
async fn damage_before_the_tail_refuses_to_open() {
    bounded(async {
        let disk = MemDisk::new();
        let mut log = open_log(&disk, 1).expect("open");
        log.blocking_append((0..3).map(|i| blank(1, i)))
            .await
            .expect("append");
        drop(log);
        disk.corrupt(&Path::new(DIR).join("log-00000000000000000000"), 10);
        assert!(matches!(
            open_log(&disk, 1),
            Err(PersistError::Corrupt { .. })
        ));
    })
    .await;
}

#[tokio::test]
async fn a_failed_fsync_is_never_acknowledged() {
    bounded(async {
        let disk = MemDisk::new();
        let mut log = open_log(&disk, 1 << 20).expect("open");
        disk.fail_next_sync();
        assert!(log.blocking_append([blank(1, 0)]).await.is_err());
    })
    .await;
}

#[tokio::test]
async fn file_disk_log_survives_a_restart() {
    bounded(async {
        let dir = TempDir::new("log");
        let open = || LogStore::open(Arc::new(FileDisk::new()), &dir.path, 100);
        let mut log = open().expect("open");
        log.blocking_append((0..10).map(|i| normal(1, i, declare_queue(&format!("q{i}")))))
            .await
            .expect("append");
        log.save_vote(&Vote::new(1, 1)).await.expect("vote");
        log.save_committed(Some(log_id(1, 9)))
            .await
            .expect("committed");
        log.purge(log_id(1, 3)).await.expect("purge");
        // No shutdown: the process just stops.
        drop(log);

        let mut log = open().expect("reopen");
        assert_eq!(indexes(&mut log).await, (4..10).collect::<Vec<_>>());
        assert_eq!(log.read_vote().await.expect("vote"), Some(Vote::new(1, 1)));
        assert_eq!(
            log.read_committed().await.expect("committed"),
            Some(log_id(1, 9))
        );
    })
    .await;
}

#[tokio::test]
async fn snapshot_restores_state_and_digest_after_power_loss() {
    bounded(async {
        let disk = MemDisk::new();
        let open = || MetaStateMachine::open(Arc::new(disk.clone()), Path::new(DIR));
        let (mut sm, view) = open().expect("open");
        let replies = sm
            .apply([
                normal(1, 0, add_vhost()),
                normal(1, 1, declare_queue("q")),
                normal(1, 2, bind("q")),
            ])
            .await
            .expect("apply");
        assert!(replies.iter().all(|r| r.outcome.is_ok()));
        let before = view.borrow().clone();
        let snap = sm
            .get_snapshot_builder()
            .await
            .build_snapshot()
            .await
            .expect("snapshot");
        assert_eq!(snap.meta.last_log_id, Some(log_id(1, 2)));
        drop(sm);
        disk.crash();

        let (mut sm, view) = open().expect("reopen");
        let after = view.borrow().clone();
        assert_eq!(after.applied_index, Some(2));
        assert_eq!(after.digest, before.digest);
        assert_eq!(after.state, before.state);
        let (applied, _) = sm.applied_state().await.expect("applied state");
        assert_eq!(applied, Some(log_id(1, 2)));
    })
    .await;
}

#[tokio::test]
async fn a_rejected_command_is_applied_as_a_refusal_that_changes_nothing() {
    bounded(async {
        let disk = MemDisk::new();
        let (mut sm, view) = MetaStateMachine::open(Arc::new(disk), Path::new(DIR)).expect("open");
        sm.apply([normal(1, 0, add_vhost())]).await.expect("apply");
        let before = view.borrow().clone();
        let replies = sm
            .apply([normal(1, 1, bind("missing"))])
            .await
            .expect("apply");
        let err: Rejected = replies[0].outcome.clone().expect_err("refused");
        assert_eq!(err.code, 404, "{err}");
        let after = view.borrow().clone();
        assert_eq!(after.state, before.state);
        assert_eq!(
            after.applied_index,
            Some(1),
            "the entry is applied all the same"
        );
        assert_ne!(
            after.digest, before.digest,
            "the refusal is part of the applied history"
        );
    })
    .await;
}

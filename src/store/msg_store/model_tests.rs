//! Model-based test: random sequences of writes, removes, flushes, syncs, compactions, clean
//! reopens, crashes and injected faults, checked against a `BTreeMap` model after every step.
//!
//! The model holds, per id, its reference count and whether a sync has covered its write.
//! After every step each live id reads back its bytes with the right count and nothing else
//! is stored. After a crash every synced id must still be there; an unsynced one may or may
//! not be (the model then follows the store, as the queue indexes would).

use std::collections::BTreeMap;

use proptest::prelude::*;

use super::tests::{body, config, dir, id};
use super::*;
use crate::store::disk::Disk;
use crate::store::mem_disk::MemDisk;

const IDS: u32 = 12;
const LIMIT: u64 = 512;

#[derive(Debug, Clone)]
enum Op {
    Write(u32),
    Remove(u32),
    Flush,
    Sync,
    Compact,
    /// Clean close and open.
    Reopen,
    /// Power loss and open.
    Crash,
    /// Write, then a flush whose append stores half its bytes.
    ShortWrite(u32),
    /// A sync whose fsync fails; the store stops and is restarted.
    FailSync,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        8 => (0..IDS).prop_map(Op::Write),
        5 => (0..IDS).prop_map(Op::Remove),
        2 => Just(Op::Flush),
        2 => Just(Op::Sync),
        2 => Just(Op::Compact),
        1 => Just(Op::Reopen),
        1 => Just(Op::Crash),
        1 => (0..IDS).prop_map(Op::ShortWrite),
        1 => Just(Op::FailSync),
    ]
}

/// Each id has one body (one id, one body), between 0 and 199 bytes.
fn msg(n: u32) -> Vec<u8> {
    body(n, (n as usize * 53) % 200)
}

struct Harness {
    disk: MemDisk,
    /// Always `Some` between steps; taken while the store is closed or crashed.
    store: Option<MsgStore<MemDisk>>,
    /// id → (count, durable).
    model: BTreeMap<u32, (u32, bool)>,
}

impl Harness {
    fn new() -> Harness {
        let disk = MemDisk::new();
        let (store, _) = MsgStore::open(disk.clone(), dir(), config(LIMIT)).expect("open");
        Harness {
            disk,
            store: Some(store),
            model: BTreeMap::new(),
        }
    }

    fn store(&mut self) -> &mut MsgStore<MemDisk> {
        self.store.as_mut().expect("open between steps")
    }

    fn all_durable(&mut self) {
        for v in self.model.values_mut() {
            v.1 = true;
        }
    }

    fn write(&mut self, n: u32) -> Result<(), TestCaseError> {
        prop_assert!(self.store().write(id(n), &msg(n)).is_ok());
        self.model.entry(n).or_insert((0, false)).0 += 1;
        Ok(())
    }

    fn crash_and_recover(&mut self) -> Result<(), TestCaseError> {
        drop(self.store.take());
        self.disk.crash();
        let opened = MsgStore::open(self.disk.clone(), dir(), config(LIMIT));
        let (mut store, report) = opened.map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert!(!report.clean);
        prop_assert!(report.damaged.is_empty(), "{:?}", report.damaged);
        let mut lost = Vec::new();
        for (n, (_, durable)) in &self.model {
            if !store.contains(id(*n)) {
                prop_assert!(!durable, "synced id {} lost in a crash", n);
                lost.push(*n);
            }
        }
        for n in lost {
            self.model.remove(&n);
        }
        let counts = self.model.iter().map(|(n, (c, _))| (id(*n), *c));
        let refs = store.set_ref_counts(counts);
        let refs = refs.map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert!(refs.missing.is_empty());
        // What survived is on disk, synced: durable from now on.
        self.store = Some(store);
        self.all_durable();
        Ok(())
    }

    fn step(&mut self, op: &Op) -> Result<(), TestCaseError> {
        match *op {
            Op::Write(n) => self.write(n)?,
            Op::Remove(n) => {
                let r = self.store().remove(id(n));
                let r = r.map_err(|e| TestCaseError::fail(e.to_string()))?;
                match self.model.get_mut(&n) {
                    None => prop_assert_eq!(r, Removed::Unknown),
                    Some((c, _)) if *c > 1 => {
                        *c -= 1;
                        prop_assert_eq!(r, Removed::Decremented { ref_count: *c });
                    }
                    Some(_) => {
                        let gone = matches!(r, Removed::Cancelled | Removed::Garbage { .. });
                        prop_assert!(gone, "{:?}", r);
                        self.model.remove(&n);
                    }
                }
            }
            Op::Flush => prop_assert!(self.store().flush().is_ok()),
            Op::Sync => {
                prop_assert!(self.store().sync().is_ok());
                self.all_durable();
            }
            Op::Compact => {
                let r = self.store().compact();
                prop_assert!(r.is_ok(), "{:?}", r);
                self.all_durable();
            }
            Op::Reopen => {
                let store = self.store.take().expect("open between steps");
                prop_assert!(store.close().is_ok());
                let opened = MsgStore::open(self.disk.clone(), dir(), config(LIMIT));
                let (store, report) = opened.map_err(|e| TestCaseError::fail(e.to_string()))?;
                prop_assert!(report.clean);
                self.store = Some(store);
                self.all_durable();
            }
            Op::Crash => self.crash_and_recover()?,
            Op::ShortWrite(n) => {
                self.write(n)?;
                if self.store().buffered_bytes() > 0 {
                    self.disk.short_next_write();
                    let r = self.store().flush();
                    prop_assert!(
                        matches!(r, Err(MsgStoreError::Disk(DiskError::ShortWrite { .. }))),
                        "{:?}",
                        r
                    );
                    prop_assert!(!self.store().is_failed());
                }
            }
            Op::FailSync => {
                if self.store().needs_sync() {
                    self.disk.fail_next_sync();
                    prop_assert!(self.store().sync().is_err());
                    prop_assert!(self.store().is_failed());
                    prop_assert!(matches!(
                        self.store().write(id(0), &msg(0)),
                        Err(MsgStoreError::Failed)
                    ));
                    self.crash_and_recover()?;
                }
            }
        }
        self.check()
    }

    fn check(&self) -> Result<(), TestCaseError> {
        let store = self.store.as_ref().expect("open between steps");
        prop_assert_eq!(store.len(), self.model.len());
        for n in 0..IDS {
            let got = store.read(id(n));
            let got = got.map_err(|e| TestCaseError::fail(e.to_string()))?;
            match self.model.get(&n) {
                Some((count, _)) => {
                    prop_assert_eq!(store.ref_count(id(n)), *count);
                    prop_assert_eq!(got, Some(msg(n)), "id {}", n);
                }
                None => prop_assert_eq!(got, None, "id {} should be gone", n),
            }
        }
        for (file, summary) in store.index().files() {
            prop_assert!(summary.valid_bytes <= summary.total_bytes, "file {}", file);
            let len = self.disk.len(&dir().join(file_name(file)));
            let len = len.map_err(|e| TestCaseError::fail(e.to_string()))?;
            prop_assert_eq!(len.unwrap_or(0), summary.total_bytes, "file {}", file);
        }
        Ok(())
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn the_store_agrees_with_a_map(ops in prop::collection::vec(op(), 1..80)) {
        let mut h = Harness::new();
        for op in &ops {
            h.step(op)?;
        }
    }
}

//! The read log's rules, stepped with explicit time, and a property test against a model
//! of leases granted by this leader and by others.

use super::*;
use proptest::prelude::*;

const W: u64 = 3_850;

fn at(ms: u64) -> Instant {
    Instant::from_millis(ms)
}

fn known(nodes: &[NodeId]) -> Readers {
    Readers::Known(nodes.iter().copied().collect())
}

#[test]
fn the_nodes_whose_reads_arrived_within_the_window_are_named() {
    let mut log = ReadLog::new();
    log.handle_read(4, 1, at(0));
    log.handle_read(4, 2, at(1_200));
    log.handle_read(4, 3, at(5_000));
    assert_eq!(log.readers(4, at(5_000), W), known(&[2, 3]));
    // The window is inclusive: a read that arrived exactly a window ago still counts.
    assert_eq!(log.readers(4, at(1_200 + W), W), known(&[2, 3]));
    assert_eq!(log.readers(4, at(1_201 + W), W), known(&[3]));
    assert!(!log.readers(4, at(10_000), W).may_hold_lease(3));
}

#[test]
fn a_leader_names_nobody_for_sure_in_the_first_window_of_its_term() {
    let mut log = ReadLog::new();
    log.handle_read(7, 2, at(100));
    assert_eq!(log.readers(7, at(100), W), Readers::Unknown);
    assert_eq!(log.readers(7, at(100 + W - 1), W), Readers::Unknown);
    assert_eq!(log.readers(7, at(100 + W), W), known(&[2]));
    assert_eq!(log.readers(7, at(101 + W), W), known(&[]));
    assert!(Readers::Unknown.may_hold_lease(9));
}

#[test]
fn a_new_term_starts_afresh_and_a_stale_term_is_not_believed() {
    let mut log = ReadLog::new();
    log.handle_read(1, 2, at(0));
    log.handle_read(1, 3, at(9_000));
    assert_eq!(log.readers(1, at(9_000), W), known(&[3]));
    log.handle_read(2, 2, at(10_000));
    assert_eq!(log.readers(2, at(10_000), W), Readers::Unknown);
    assert_eq!(log.readers(2, at(20_000), W), known(&[]));
    // A report of the earlier term changes nothing and is answered Unknown.
    log.handle_read(1, 3, at(20_000));
    assert_eq!(log.readers(1, at(20_000), W), Readers::Unknown);
    assert_eq!(log.readers(2, at(20_000), W), known(&[]));
}

#[derive(Debug, Clone)]
enum Ev {
    /// Time passes.
    Wait(u64),
    /// A read from a node arrives here (only while this node leads).
    Read(NodeId),
    /// Another leader serves a node a read (only while this node does not lead).
    Elsewhere(NodeId),
    /// This node steps down.
    StepDown,
    /// This node leads again, in a later term.
    Lead,
    /// An entry commits here: the nodes that may hold a lease must all be named.
    Commit,
}

fn ev() -> impl Strategy<Value = Ev> {
    prop_oneof![
        4 => (1u64..2_000).prop_map(Ev::Wait),
        4 => (1u64..=5).prop_map(Ev::Read),
        2 => (1u64..=5).prop_map(Ev::Elsewhere),
        1 => Just(Ev::StepDown),
        1 => Just(Ev::Lead),
        3 => Just(Ev::Commit),
    ]
}

proptest! {
    /// A lease granted by a read lasts at most the window after the read arrived, whoever
    /// served it; at every commit, every node whose lease may still run is named.
    #[test]
    fn every_node_that_may_hold_a_lease_is_named(events in prop::collection::vec(ev(), 1..80)) {
        let mut log = ReadLog::new();
        let mut now = 0u64;
        let mut term = 1u64;
        let mut leading = true;
        let mut last_read: BTreeMap<NodeId, u64> = BTreeMap::new();
        for e in events {
            match e {
                Ev::Wait(ms) => now += ms,
                Ev::Read(n) if leading => {
                    log.handle_read(term, n, at(now));
                    last_read.insert(n, now);
                }
                Ev::Elsewhere(n) if !leading => {
                    last_read.insert(n, now);
                }
                Ev::StepDown => leading = false,
                Ev::Lead if !leading => {
                    // Elected after every read the old leader served.
                    now += 1;
                    term += 1;
                    leading = true;
                }
                Ev::Commit if leading => {
                    let readers = log.readers(term, at(now), W);
                    for (&n, &read) in &last_read {
                        if now < read + W {
                            prop_assert!(
                                readers.may_hold_lease(n),
                                "node {n} read at {read}, may route until {}, not named at {now}: {readers:?}",
                                read + W
                            );
                        }
                    }
                }
                _ => {}
            }
        }
    }
}

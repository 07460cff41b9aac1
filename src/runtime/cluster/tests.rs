//! Cluster mode's unit tests.

use std::collections::BTreeSet;

use amq_protocol::types::{AMQPValue, FieldTable};
use rand::rngs::StdRng;
use rand::SeedableRng;

use super::*;
use crate::meta::{MetaState, QueueDef};

fn state_with(nodes: &[NodeId], queues: &[(&str, NodeId)]) -> MetaState {
    let mut s = MetaState::default();
    s.apply(&Command::AddVhost { name: "/".into() }).unwrap();
    for &id in nodes {
        s.apply(&Command::RegisterNode(NodeRecord {
            id,
            name: format!("n{id}"),
            amqp: String::new(),
            admin: String::new(),
            link: String::new(),
            incarnation: 0,
        }))
        .unwrap();
    }
    for (name, home) in queues {
        s.apply(&Command::DeclareQueue(def(
            name,
            FieldTable::default(),
            *home,
        )))
        .unwrap();
    }
    s
}

fn def(name: &str, arguments: FieldTable, home: NodeId) -> QueueDef {
    QueueDef {
        vhost: "/".into(),
        name: name.into(),
        durable: true,
        exclusive_owner: None,
        auto_delete: false,
        arguments,
        home,
    }
}

fn locator_arg(value: &str) -> FieldTable {
    let mut t = FieldTable::default();
    t.insert(
        "x-queue-master-locator".into(),
        AMQPValue::LongString(value.into()),
    );
    t
}

#[test]
fn the_locator_comes_from_the_argument_then_the_policy() {
    let mut s = state_with(&[1, 2], &[]);
    assert_eq!(
        Locator::of(&def("q", FieldTable::default(), 0), &s),
        Locator::ClientLocal
    );
    assert_eq!(
        Locator::of(&def("q", locator_arg("min-masters"), 0), &s),
        Locator::MinMasters
    );
    s.apply(&Command::SetPolicy {
        policy: crate::meta::policy::Policy {
            vhost: "/".into(),
            name: "spread".into(),
            pattern: "^spread".into(),
            compiled: Default::default(),
            apply_to: crate::meta::policy::ApplyTo::Queues,
            priority: 0,
            definition: [(
                "queue-master-locator".to_string(),
                crate::meta::policy::PolicyValue::Str("random".into()),
            )]
            .into(),
        },
        operator: false,
    })
    .unwrap();
    assert_eq!(
        Locator::of(&def("spread.1", FieldTable::default(), 0), &s),
        Locator::Random
    );
    assert_eq!(
        Locator::of(&def("spread.1", locator_arg("client-local"), 0), &s),
        Locator::ClientLocal,
        "the argument wins over the policy"
    );
    let mut exclusive = def("spread.2", locator_arg("min-masters"), 0);
    exclusive.exclusive_owner = Some(1);
    assert_eq!(Locator::of(&exclusive, &s), Locator::ClientLocal);
}

#[test]
fn min_masters_picks_the_live_node_with_the_fewest_queues() {
    let s = state_with(
        &[1, 2, 3],
        &[("a", 1), ("b", 1), ("c", 2), ("d", 3), ("e", 3)],
    );
    let mut rng = StdRng::seed_from_u64(1);
    assert_eq!(Locator::MinMasters.place(1, &[1, 2, 3], &s, &mut rng), 2);
    assert_eq!(
        Locator::MinMasters.place(1, &[1, 3], &s, &mut rng),
        1,
        "a down node is not a candidate; ties go to the lowest id"
    );
    assert_eq!(Locator::ClientLocal.place(3, &[1, 2, 3], &s, &mut rng), 3);
    let picks: BTreeSet<NodeId> = (0..64)
        .map(|_| Locator::Random.place(1, &[1, 2, 3], &s, &mut rng))
        .collect();
    assert_eq!(picks, BTreeSet::from([1, 2, 3]));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registered_nodes_become_voters_up_to_five_then_learners() {
    use crate::runtime::raft::tests::harness::{self, fast_config};
    harness::bounded(async {
        let mut c = harness::Cluster::new(3, fast_config()).await;
        for id in 4..=6 {
            c.disks.insert(id, crate::store::MemDisk::new());
            c.start(id).await;
        }
        let leader = c.leader(&[], Duration::from_secs(10)).await;
        c.propose(Command::AddVhost { name: "/".into() }, &[]).await;
        for id in 1..=6 {
            let r = c
                .propose(
                    Command::RegisterNode(NodeRecord {
                        id,
                        name: format!("n{id}"),
                        amqp: String::new(),
                        admin: String::new(),
                        link: format!("node-{id}"),
                        incarnation: 0,
                    }),
                    &[],
                )
                .await;
            assert!(r.outcome.is_ok());
        }
        let tasks: Vec<_> = c
            .nodes
            .values()
            .map(|n| tokio::spawn(reconcile_membership(n.clone())))
            .collect();
        let node = c.nodes[&leader].clone();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        loop {
            let m = node.membership();
            if m.voters.len() == MAX_VOTERS && m.learners.len() == 1 {
                break;
            }
            assert!(tokio::time::Instant::now() < deadline, "{m:?}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        // Forgetting a voter promotes the learner in its place.
        let forgotten = *node
            .membership()
            .voters
            .keys()
            .find(|&&id| id != leader)
            .expect("a voter");
        c.propose(Command::ForgetNode { id: forgotten }, &[]).await;
        loop {
            let m = node.membership();
            if m.voters.len() == MAX_VOTERS
                && m.learners.is_empty()
                && !m.voters.contains_key(&forgotten)
            {
                break;
            }
            assert!(tokio::time::Instant::now() < deadline, "{m:?}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        for t in tasks {
            t.abort();
        }
    })
    .await;
}

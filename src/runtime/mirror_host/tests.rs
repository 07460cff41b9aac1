//! The mirror host's unit tests: held rounds, roles.

use super::*;

#[test]
fn held_rounds_come_back_in_order_from_memory_then_the_file() {
    let dir = std::env::temp_dir().join(format!("warren-held-{}", std::process::id()));
    let path = dir.join("q.hold");
    let mut held = Held::with_limit(path.clone(), 10);
    let batches: Vec<Bytes> = (0..20u8)
        .map(|i| Bytes::from(vec![i; (i as usize) % 7]))
        .collect();
    for b in &batches {
        held.push(b.clone()).expect("held");
    }
    assert!(path.exists(), "past the limit, rounds go to the file");
    assert_eq!(held.drain().expect("read back"), batches);
    assert!(!path.exists(), "the file goes once read back");
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn a_master_with_mirrors_masters_and_a_listed_node_mirrors() {
    use crate::config::Config;
    use crate::meta::state::{MirrorRecord, NodeRecord, QueueDef};
    let broker = Broker::new(&Config::default(), 1, 1 << 30, 0).with_node_id(1);
    let mut state = MetaState::default();
    state
        .apply(&Command::AddVhost { name: "/".into() })
        .unwrap();
    for id in 1..=3 {
        state
            .apply(&Command::RegisterNode(NodeRecord {
                id,
                name: format!("n{id}"),
                amqp: String::new(),
                admin: String::new(),
                link: String::new(),
                incarnation: 0,
            }))
            .unwrap();
    }
    for (name, exclusive) in [("d", None), ("x", Some(1 << 40))] {
        state
            .apply(&Command::DeclareQueue(QueueDef {
                vhost: "/".into(),
                name: name.into(),
                durable: false,
                exclusive_owner: exclusive,
                auto_delete: false,
                arguments: Default::default(),
                home: 1,
            }))
            .unwrap();
    }
    let key = ("/".to_string(), "d".to_string());
    assert_eq!(
        role_of(&state, &broker, &key, 1),
        Role::None,
        "no mirrors yet"
    );
    state
        .apply(&Command::SetMirrors {
            vhost: "/".into(),
            queue: "d".into(),
            expected_version: 0,
            mirrors: vec![MirrorRecord {
                node: 2,
                since: 0,
                synchronised: false,
            }],
        })
        .unwrap();
    broker.follow(
        std::sync::Arc::new(state.clone()),
        crate::time::Instant::default(),
    );
    assert_eq!(role_of(&state, &broker, &key, 1), Role::Master);
    assert_eq!(role_of(&state, &broker, &key, 2), Role::Mirror);
    assert_eq!(role_of(&state, &broker, &key, 3), Role::None);
    let x = ("/".to_string(), "x".to_string());
    assert_eq!(role_of(&state, &broker, &x, 1), Role::None, "exclusive");
    // Promoted to node 2, whose broker does not run the queue: it adopts its copy.
    let other = Broker::new(&Config::default(), 1, 1 << 30, 0)
        .with_durability(std::sync::Arc::new(crate::broker::Durability::default()))
        .with_node_id(2);
    let mut before = state.clone();
    before
        .apply(&Command::PromoteMirror {
            vhost: "/".into(),
            queue: "d".into(),
            expected_epoch: 0,
            node: 2,
        })
        .unwrap();
    other.follow(
        std::sync::Arc::new(state.clone()),
        crate::time::Instant::default(),
    );
    other.follow(
        std::sync::Arc::new(before.clone()),
        crate::time::Instant::default(),
    );
    assert!(
        other.queue("/", "d").is_none(),
        "a queue that moved in is not created empty"
    );
    assert_eq!(role_of(&before, &other, &key, 2), Role::Adopt);
}

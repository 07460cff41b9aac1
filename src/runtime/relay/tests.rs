//! The relay's unit tests: message batches on the wire, and the answer to a barrier.

use super::wire::{encode, encode_one};
use super::*;
/// Messages sent alone (a broker cancel, a settle sent again, an abandoned get) decode
/// as the batch the receiver expects.
#[test]
fn a_message_sent_alone_decodes_as_a_batch_of_one() {
    let msg = RelayMsg::GetAbandoned {
        conn: 7,
        channel: 3,
        request: 512,
    };
    let batch: Vec<RelayMsg> = bincode::deserialize(&encode_one(&msg)).expect("a batch of one");
    assert!(matches!(
        batch.as_slice(),
        [RelayMsg::GetAbandoned {
            conn: 7,
            channel: 3,
            request: 512
        }]
    ));
    // What the two senders did before: not a batch.
    assert!(bincode::deserialize::<Vec<RelayMsg>>(&encode(&[&msg])).is_err());
}

/// Node links that reach nobody; they keep the service the relay installs, so a test can
/// hand it requests as a peer would.
#[derive(Default)]
struct Unlinked {
    service: Mutex<Option<Arc<dyn crate::runtime::node_link::transport::BrokerService>>>,
}

impl BrokerLinks for Unlinked {
    fn send_broker(&self, node: NodeId, _: Vec<u8>) -> crate::runtime::node_link::SendBroker<'_> {
        Box::pin(async move {
            Err(crate::runtime::raft::TransportError::Unreachable {
                node,
                reason: "no links in this test".into(),
            })
        })
    }

    fn serve_broker(&self, service: Arc<dyn crate::runtime::node_link::transport::BrokerService>) {
        *lock(&self.service) = Some(service);
    }
}

/// A relay for a node whose broker has followed the metadata to the index `applied`
/// holds; the service it serves peers with.
fn served(
    applied: watch::Receiver<u64>,
) -> (
    Arc<Relay>,
    Arc<dyn crate::runtime::node_link::transport::BrokerService>,
) {
    let config = crate::config::Config::for_tests(std::path::Path::new("/nonexistent"));
    let broker = Arc::new(Broker::new(&config, 7, 1 << 30, 0));
    let links = Arc::new(Unlinked::default());
    let facts = Arc::new(crate::runtime::node_stats::NodeFacts {
        started: std::time::Instant::now(),
        disk_free_limit: 0,
        config_file: None,
        data_dir: String::new(),
        listeners: std::sync::OnceLock::new(),
        links: std::sync::OnceLock::new(),
    });
    let relay = Relay::install(
        broker.clone(),
        links.clone(),
        Arc::new(crate::runtime::conn_task::LocalMeta::new(broker)),
        Clock::start(),
        applied,
        facts,
    );
    let service = lock(&links.service)
        .clone()
        .expect("the relay serves its peers");
    (relay, service)
}

/// Asks `service` for a barrier at `index`, as node 2 would; whether it answered
/// "followed".
async fn barrier_answer(
    service: &Arc<dyn crate::runtime::node_link::transport::BrokerService>,
    index: u64,
) -> bool {
    let payload = encode_one(&RelayMsg::Barrier { index });
    let bytes = match service.handle(2, bytes::Bytes::from(payload)) {
        crate::runtime::node_link::transport::BrokerReply::Now(b) => b,
        crate::runtime::node_link::transport::BrokerReply::Later(f) => f.await,
    };
    let replies: Vec<wire::RelayReply> = bincode::deserialize(&bytes).expect("replies");
    assert_eq!(replies.len(), 1);
    matches!(replies[0], wire::RelayReply::Counts(0, 0, 0))
}

/// A node asked to follow the metadata to an index answers "followed" once it has, and
/// not after its wait ran out while it was still behind (it said "followed" then too, and
/// the asker answered its client as if the node routed by the change).
#[tokio::test(start_paused = true)]
async fn a_barrier_says_followed_only_once_the_node_has_followed() {
    let (applied_tx, applied) = watch::channel(3u64);
    let (_relay, service) = served(applied);
    assert!(barrier_answer(&service, 3).await, "already followed");
    // Behind, and it catches up while the barrier waits.
    let caught_up = {
        let service = service.clone();
        tokio::spawn(async move { barrier_answer(&service, 5).await })
    };
    tokio::time::sleep(std::time::Duration::from_secs(2)).await;
    applied_tx.send_replace(5);
    assert!(caught_up.await.expect("task"), "followed after catching up");
    // Behind for longer than the wait: not followed.
    assert!(
        !barrier_answer(&service, 9).await,
        "still behind at the wait's end"
    );
}

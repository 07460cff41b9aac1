//! The Prometheus endpoint over real HTTP against real nodes: RabbitMQ's metric names with
//! the values AMQP traffic makes, aggregated and per object, the text formats, and the
//! Raft, mirror and GM metrics of a three-process cluster.

mod common;

use std::collections::BTreeMap;

use common::*;
use lapin::options::{
    BasicAckOptions, BasicGetOptions, BasicPublishOptions, ConfirmSelectOptions,
    QueueDeclareOptions,
};
use lapin::types::FieldTable;
use lapin::BasicProperties;

/// GET `url` with an optional `Accept`: (status, content type, body).
async fn get(url: String, accept: Option<&'static str>) -> (u16, String, String) {
    tokio::task::spawn_blocking(move || {
        let mut req = ureq::get(&url);
        if let Some(a) = accept {
            req = req.set("Accept", a);
        }
        let resp = match req.call() {
            Ok(r) => r,
            Err(ureq::Error::Status(_, r)) => r,
            Err(e) => panic!("GET {url}: {e}"),
        };
        let status = resp.status();
        let ctype = resp.header("content-type").unwrap_or("").to_string();
        (status, ctype, resp.into_string().expect("body"))
    })
    .await
    .expect("http task")
}

/// Every sample of a scrape, `series` (name and labels as written) to value; checks the
/// text's shape on the way: each sample's family was announced by a `# TYPE` line first.
fn samples(text: &str) -> BTreeMap<String, f64> {
    let mut typed: Vec<String> = Vec::new();
    let mut out = BTreeMap::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let name = rest
                .split(' ')
                .next()
                .expect("a TYPE line names its family");
            typed.push(name.to_string());
            continue;
        }
        if line.starts_with('#') || line.is_empty() {
            continue;
        }
        let (series, value) = line.rsplit_once(' ').expect("a sample line has a value");
        let name = series.split('{').next().expect("a name");
        assert!(
            typed.iter().any(|t| name.starts_with(t.as_str())),
            "sample `{line}` comes before its # TYPE line"
        );
        let v: f64 = value
            .parse()
            .unwrap_or_else(|_| panic!("bad value in `{line}`"));
        out.insert(series.to_string(), v);
    }
    out
}

fn at(s: &BTreeMap<String, f64>, series: &str) -> f64 {
    *s.get(series)
        .unwrap_or_else(|| panic!("no sample `{series}` in {:?}", s.keys().collect::<Vec<_>>()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_follow_amqp_traffic_with_rabbitmqs_names() {
    let node = TestNode::start().await;
    let base = format!("http://{}", node.prometheus_addr());
    let conn = node.connect().await;
    let ch = open_channel(&conn).await;
    within(
        "confirm.select",
        ch.confirm_select(ConfirmSelectOptions::default()),
    )
    .await
    .expect("confirm.select");
    let durable = QueueDeclareOptions {
        durable: true,
        ..QueueDeclareOptions::default()
    };
    declare_queue_with(&ch, "pm1", durable, FieldTable::default()).await;
    declare_queue(&ch, "pm2").await;
    // Persistent messages in a durable queue: fsynced before they are confirmed.
    let persistent = BasicProperties::default().with_delivery_mode(2);
    for _ in 0..5 {
        let c = publish_confirmed_with(
            &ch,
            "",
            "pm1",
            b"12345678",
            BasicPublishOptions::default(),
            persistent.clone(),
        )
        .await;
        assert!(c.is_ack());
    }
    publish_confirmed(&ch, "", "pm2", b"x").await;
    // One fetched and acked, one fetched with no-ack: 3 ready in pm1, 1 in pm2.
    let m = within(
        "basic.get",
        ch.basic_get("pm1".into(), BasicGetOptions { no_ack: false }),
    )
    .await
    .expect("get")
    .expect("a message");
    within("ack", m.delivery.ack(BasicAckOptions::default()))
        .await
        .expect("ack");
    within(
        "basic.get",
        ch.basic_get("pm1".into(), BasicGetOptions { no_ack: true }),
    )
    .await
    .expect("get")
    .expect("a message");

    let (status, ctype, text) = get(format!("{base}/metrics"), None).await;
    assert_eq!(status, 200);
    assert_eq!(ctype, "text/plain; version=0.0.4; charset=utf-8");
    let s = samples(&text);
    assert_eq!(at(&s, "rabbitmq_queues"), 2.0);
    assert_eq!(at(&s, "rabbitmq_connections"), 1.0);
    assert_eq!(at(&s, "rabbitmq_channels"), 1.0);
    assert_eq!(at(&s, "rabbitmq_queue_messages_ready"), 4.0);
    assert_eq!(at(&s, "rabbitmq_queue_messages_ready_bytes"), 25.0);
    assert_eq!(at(&s, "rabbitmq_queues_declared_total"), 2.0);
    assert_eq!(at(&s, "rabbitmq_queues_created_total"), 2.0);
    assert_eq!(at(&s, "rabbitmq_connections_opened_total"), 1.0);
    let g = |name: &str| at(&s, &format!("{name}{{protocol=\"amqp091\"}}"));
    assert_eq!(g("rabbitmq_global_messages_received_total"), 6.0);
    assert_eq!(g("rabbitmq_global_messages_received_confirm_total"), 6.0);
    assert_eq!(g("rabbitmq_global_messages_routed_total"), 6.0);
    assert_eq!(g("rabbitmq_global_messages_confirmed_total"), 6.0);
    assert_eq!(
        g("rabbitmq_global_messages_delivered_get_manual_ack_total"),
        1.0
    );
    assert_eq!(
        g("rabbitmq_global_messages_delivered_get_auto_ack_total"),
        1.0
    );
    assert_eq!(g("rabbitmq_global_messages_delivered_total"), 2.0);
    assert_eq!(g("rabbitmq_global_messages_acknowledged_total"), 1.0);
    assert_eq!(at(&s, "warren_confirm_latency_seconds_count"), 6.0);
    assert!(
        at(&s, "warren_fsync_latency_seconds_count") > 0.0,
        "persistent messages of durable queues were fsynced"
    );
    assert!(
        !s.contains_key("warren_raft_term"),
        "a single node has no Raft group"
    );
    assert!(!text.contains("queue=\""), "no object labels in /metrics");

    // Per object: the same queues, labelled.
    let (status, _, text) = get(format!("{base}/metrics/per-object"), None).await;
    assert_eq!(status, 200);
    let s = samples(&text);
    assert_eq!(
        at(
            &s,
            "rabbitmq_queue_messages_ready{vhost=\"/\",queue=\"pm1\"}"
        ),
        3.0
    );
    assert_eq!(
        at(
            &s,
            "rabbitmq_queue_messages_ready{vhost=\"/\",queue=\"pm2\"}"
        ),
        1.0
    );

    // OpenMetrics when asked for; other paths are not found.
    let (status, ctype, text) = get(
        format!("{base}/metrics"),
        Some("application/openmetrics-text; version=1.0.0"),
    )
    .await;
    assert_eq!(status, 200);
    assert!(ctype.starts_with("application/openmetrics-text"), "{ctype}");
    assert!(text.ends_with("# EOF\n"));
    assert_eq!(get(format!("{base}/nothing"), None).await.0, 404);

    // A closed connection is counted and gone from the gauges.
    within("connection.close", conn.close(200, "bye".into()))
        .await
        .expect("close");
    eventually("the connection is gone from the gauges", || {
        let url = format!("{base}/metrics");
        async move {
            let s = samples(&get(url, None).await.2);
            at(&s, "rabbitmq_connections") == 0.0
                && at(&s, "rabbitmq_connections_closed_total") == 1.0
                && at(&s, "rabbitmq_channels_closed_total") == 1.0
        }
    })
    .await;
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_node_reports_raft_mirrors_and_gm_laps() {
    use common::procs;
    let cluster = procs::Cluster::start("prometheus").await;
    cluster.set_ha_policy(procs::ALL_AUTOMATIC).await;
    let conn = procs::connect(&cluster.node(1).amqp_uri()).await;
    let ch = procs::channel(&conn).await;
    procs::declare(&ch, "ha.pm", true, procs::locator("client-local"))
        .await
        .expect("declare on node 1");
    within(
        "confirm.select",
        ch.confirm_select(ConfirmSelectOptions::default()),
    )
    .await
    .expect("confirm.select");
    let url = format!("http://{}:15692/metrics/per-object", cluster.node(1).ip);
    // Mirrors on nodes 2 and 3, synchronised (an empty queue syncs at once).
    eventually("two synchronised mirrors in the metrics", || {
        let url = url.clone();
        async move {
            let s = samples(&get(url, None).await.2);
            s.get("warren_queue_mirrors_synchronised{vhost=\"/\",queue=\"ha.pm\"}") == Some(&2.0)
        }
    })
    .await;
    for _ in 0..20 {
        assert!(procs::publish_acked(&ch, "", "ha.pm", b"m").await);
    }
    let s = samples(&get(url.clone(), None).await.2);
    assert_eq!(
        at(&s, "warren_queue_mirrors{vhost=\"/\",queue=\"ha.pm\"}"),
        2.0
    );
    assert_eq!(
        at(
            &s,
            "rabbitmq_queue_messages_ready{vhost=\"/\",queue=\"ha.pm\"}"
        ),
        20.0
    );
    // Confirmed publishes to a mirrored queue went around the ring.
    assert!(at(&s, "warren_gm_lap_latency_seconds_count") > 0.0);
    assert!(at(&s, "warren_raft_term") >= 1.0);
    assert!(at(&s, "warren_raft_commit_index") >= 1.0);
    let leader = at(&s, "warren_raft_leader_id");
    assert!((1.0..=3.0).contains(&leader), "leader {leader}");
    // Exactly one node says it leads, and every node names the same leader.
    let mut leaders = 0.0;
    for id in 1..=3 {
        let url = format!("http://{}:15692/metrics", cluster.node(id).ip);
        let s = samples(&get(url, None).await.2);
        leaders += at(&s, "warren_raft_is_leader");
        assert_eq!(at(&s, "warren_raft_leader_id"), leader, "node {id}");
        let me = format!("rabbitmq_identity_info{{rabbitmq_node=\"warren{id}@test\"");
        assert!(
            s.keys().any(|k| k.starts_with(&me)),
            "node {id} names itself"
        );
    }
    assert_eq!(leaders, 1.0);
}

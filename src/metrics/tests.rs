use super::*;
use proptest::prelude::*;

fn sample(queues: Vec<QueueSample>) -> Sample {
    Sample {
        node: "n1".into(),
        cluster: "c".into(),
        version: "0.1.0",
        rabbitmq_version: "3.10.8",
        connections: 2,
        channels: 3,
        consumers: 1,
        queues,
        resident_memory_bytes: 1000,
        memory_limit_bytes: 5000,
        memory_alarm: false,
        open_fds: Some(12),
        max_fds: Some(1024),
        disk_free_limit_bytes: 50,
        uptime_seconds: 1.5,
        raft: None,
    }
}

fn q(vhost: &str, name: &str, ready: u64, unacked: u64) -> QueueSample {
    QueueSample {
        vhost: vhost.into(),
        name: name.into(),
        ready,
        unacked,
        consumers: 1,
        ..Default::default()
    }
}

/// The value of the sample line that starts with `series` followed by a space.
fn value(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
        .and_then(|v| v.trim().parse().ok())
}

#[test]
fn aggregated_queue_metrics_sum_the_queues_without_labels() {
    let s = sample(vec![q("/", "a", 3, 1), q("v", "b", 4, 2)]);
    let t = render(
        &Metrics::default(),
        &s,
        Detail::Aggregated,
        Format::Prometheus,
    );
    assert_eq!(value(&t, "rabbitmq_queue_messages_ready"), Some(7.0));
    assert_eq!(value(&t, "rabbitmq_queue_messages_unacked"), Some(3.0));
    assert_eq!(value(&t, "rabbitmq_queue_messages"), Some(10.0));
    assert_eq!(value(&t, "rabbitmq_queues"), Some(2.0));
    assert_eq!(value(&t, "rabbitmq_connections"), Some(2.0));
    assert_eq!(value(&t, "rabbitmq_channels"), Some(3.0));
    assert!(
        !t.contains("queue=\""),
        "aggregated output has no queue labels:\n{t}"
    );
}

#[test]
fn per_object_queue_metrics_carry_vhost_and_queue_labels() {
    let s = sample(vec![q("/", "a", 3, 1), q("v", "b", 4, 2)]);
    let t = render(
        &Metrics::default(),
        &s,
        Detail::PerObject,
        Format::Prometheus,
    );
    assert_eq!(
        value(&t, "rabbitmq_queue_messages_ready{vhost=\"/\",queue=\"a\"}"),
        Some(3.0)
    );
    assert_eq!(
        value(&t, "rabbitmq_queue_messages{vhost=\"v\",queue=\"b\"}"),
        Some(6.0)
    );
}

#[test]
fn counters_end_in_total_and_global_ones_carry_the_protocol() {
    let m = Metrics::default();
    m.received.inc_by(5);
    m.confirmed.inc_by(4);
    m.delivered_consume_manual_ack.inc_by(2);
    m.delivered_get_auto_ack.inc_by(1);
    m.connections_opened.inc();
    let t = render(&m, &sample(vec![]), Detail::Aggregated, Format::Prometheus);
    assert_eq!(
        value(
            &t,
            "rabbitmq_global_messages_received_total{protocol=\"amqp091\"}"
        ),
        Some(5.0)
    );
    assert_eq!(
        value(
            &t,
            "rabbitmq_global_messages_confirmed_total{protocol=\"amqp091\"}"
        ),
        Some(4.0)
    );
    assert_eq!(
        value(
            &t,
            "rabbitmq_global_messages_delivered_total{protocol=\"amqp091\"}"
        ),
        Some(3.0)
    );
    assert_eq!(value(&t, "rabbitmq_connections_opened_total"), Some(1.0));
    assert!(
        t.contains("# TYPE rabbitmq_connections_opened_total counter"),
        "{t}"
    );
}

#[test]
fn histograms_count_observations_into_buckets() {
    let m = Metrics::default();
    m.confirm_latency.observe(0.002);
    m.confirm_latency.observe(0.2);
    let t = render(&m, &sample(vec![]), Detail::Aggregated, Format::Prometheus);
    assert_eq!(value(&t, "warren_confirm_latency_seconds_count"), Some(2.0));
    assert_eq!(
        value(&t, "warren_confirm_latency_seconds_bucket{le=\"0.001\"}"),
        Some(0.0)
    );
    assert_eq!(
        value(&t, "warren_confirm_latency_seconds_bucket{le=\"0.0025\"}"),
        Some(1.0)
    );
    assert_eq!(
        value(&t, "warren_confirm_latency_seconds_bucket{le=\"+Inf\"}"),
        Some(2.0)
    );
}

#[test]
fn raft_and_sync_metrics_appear_when_known() {
    let m = Metrics::default();
    let mut s = sample(vec![]);
    let t = render(&m, &s, Detail::Aggregated, Format::Prometheus);
    assert!(
        !t.contains("warren_raft_term"),
        "a single node has no Raft metrics"
    );
    s.raft = Some(RaftSample {
        node_id: 2,
        term: 7,
        applied_index: 40,
        last_log_index: 41,
        leader: Some(2),
    });
    m.sync_progress("/", "ha.q", 100, 250);
    let t = render(&m, &s, Detail::Aggregated, Format::Prometheus);
    assert_eq!(value(&t, "warren_raft_term"), Some(7.0));
    assert_eq!(value(&t, "warren_raft_commit_index"), Some(40.0));
    assert_eq!(value(&t, "warren_raft_is_leader"), Some(1.0));
    assert_eq!(
        value(
            &t,
            "warren_mirror_sync_sequence_remaining{vhost=\"/\",queue=\"ha.q\"}"
        ),
        Some(150.0)
    );
    m.sync_ended("/", "ha.q");
    let t = render(&m, &s, Detail::Aggregated, Format::Prometheus);
    assert!(!t.contains("queue=\"ha.q\""), "an ended sync is gone:\n{t}");
}

#[test]
fn openmetrics_is_served_when_asked_for_and_ends_with_eof() {
    assert_eq!(Format::from_accept(None), Format::Prometheus);
    assert_eq!(Format::from_accept(Some("text/plain")), Format::Prometheus);
    let f = Format::from_accept(Some(
        "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5",
    ));
    assert_eq!(f, Format::OpenMetrics);
    let t = render(&Metrics::default(), &sample(vec![]), Detail::Aggregated, f);
    assert!(t.ends_with("# EOF\n"), "{t}");
    let t = render(
        &Metrics::default(),
        &sample(vec![]),
        Detail::Aggregated,
        Format::Prometheus,
    );
    assert!(!t.contains("# EOF"));
}

proptest! {
    /// Whatever the queues, the aggregated figure is the sum of the per-object ones.
    #[test]
    fn aggregated_is_the_sum_of_per_object(
        counts in proptest::collection::vec((0u64..1_000_000, 0u64..1_000_000), 0..20)
    ) {
        let queues: Vec<QueueSample> = counts
            .iter()
            .enumerate()
            .map(|(i, (r, u))| q("/", &format!("q{i}"), *r, *u))
            .collect();
        let s = sample(queues);
        let m = Metrics::default();
        let agg = render(&m, &s, Detail::Aggregated, Format::Prometheus);
        let per = render(&m, &s, Detail::PerObject, Format::Prometheus);
        let total: f64 = per
            .lines()
            .filter(|l| l.starts_with("rabbitmq_queue_messages_ready{"))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum();
        let expected: u64 = counts.iter().map(|(r, _)| r).sum();
        prop_assert_eq!(value(&agg, "rabbitmq_queue_messages_ready"), Some(expected as f64));
        prop_assert_eq!(total, expected as f64);
    }
}

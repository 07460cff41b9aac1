//! Prometheus metrics under the names of RabbitMQ's `rabbitmq_prometheus` plugin, so the
//! stock RabbitMQ Grafana dashboards work against Warren, plus Warren's own (`warren_*`).
//!
//! Sans-IO: the cores count into a shared [`Metrics`] (atomic counters and histograms), and
//! a scrape renders them with a [`Sample`], what the node holds at that moment
//! ([`render`]). The driver ([`crate::runtime::prometheus`]) reads the sample and serves the
//! text. As in RabbitMQ, `/metrics` aggregates (queue metrics summed over the queues this
//! node is master of, no object labels) and `/metrics/per-object` labels each queue's with
//! `vhost` and `queue`. The text is Prometheus' format 0.0.4, or OpenMetrics 1.0 when the
//! scraper asks for it.
//!
//! The encoding is `prometheus-client`'s; metrics are registered afresh for each scrape
//! (counters and histograms by clone, sharing their values), so nothing but the render
//! holds the registry.

mod io;
mod sample;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Mutex;

use prometheus_client::encoding::{prometheus_text, text};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

pub use io::{FileKind, IoCounters, IoSnapshot};
pub use sample::{QueueSample, RaftSample, Sample};

/// Bucket bounds (seconds) of the latency histograms: 100 µs to 10 s.
const LATENCY_BUCKETS: [f64; 14] = [
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 2.5, 10.0,
];

/// What the node counts as it runs; shared by every connection, queue and driver.
#[derive(Debug)]
pub struct Metrics {
    /// Publishes received (`rabbitmq_global_messages_received_total`).
    pub received: Counter,
    /// Publishes received on confirm-mode channels.
    pub received_confirm: Counter,
    /// Publishes routed to at least one queue.
    pub routed: Counter,
    /// Unroutable publishes dropped (not `mandatory`).
    pub unroutable_dropped: Counter,
    /// Unroutable publishes returned (`mandatory`).
    pub unroutable_returned: Counter,
    /// Publisher confirms sent (acks, not nacks).
    pub confirmed: Counter,
    /// Deliveries to consumers that ack.
    pub delivered_consume_manual_ack: Counter,
    /// Deliveries to no-ack consumers.
    pub delivered_consume_auto_ack: Counter,
    /// `basic.get` answers that need an ack.
    pub delivered_get_manual_ack: Counter,
    /// `basic.get` answers with `no_ack`.
    pub delivered_get_auto_ack: Counter,
    /// `basic.get` on an empty queue.
    pub get_empty: Counter,
    /// Deliveries flagged `redelivered`.
    pub redelivered: Counter,
    /// Deliveries acknowledged by clients.
    pub acknowledged: Counter,
    /// AMQP connections accepted.
    pub connections_opened: Counter,
    /// AMQP connections ended.
    pub connections_closed: Counter,
    /// Channels opened.
    pub channels_opened: Counter,
    /// Channels closed.
    pub channels_closed: Counter,
    /// `queue.declare` methods answered with declare-ok.
    pub queues_declared: Counter,
    /// Queue processes started on this node.
    pub queues_created: Counter,
    /// Queue processes deleted on this node.
    pub queues_deleted: Counter,
    /// Logins tried.
    pub auth_attempts: Counter,
    /// Logins that succeeded.
    pub auth_attempts_succeeded: Counter,
    /// Logins refused.
    pub auth_attempts_failed: Counter,
    /// From a publish to its confirm (the cores' millisecond clock: sub-millisecond confirms
    /// count as 0).
    pub confirm_latency: Histogram,
    /// One fsync of the message store or a queue index.
    pub fsync_latency: Histogram,
    /// From a GM broadcast to its lap's end back at the sender.
    pub gm_lap_latency: Histogram,
    /// The storage's file I/O.
    pub io: IoCounters,
    /// Messages written to disk by queues (persistent ones, and transient ones paged out).
    pub disk_writes: Counter,
    /// Messages read back from disk by queues (paged in, or a body read from a store).
    pub disk_reads: Counter,
    /// Free bytes on the data directory's disk, as last measured (-1: not yet).
    pub disk_free_bytes: AtomicI64,
    /// Whether free disk space is below `disk_free_limit_bytes` (1) or not (0).
    pub disk_alarm: AtomicI64,
    /// Running mirror syncs this node is master for: (vhost, queue) to (next sequence
    /// number to copy, the sequence number the copy stops below).
    syncs: Mutex<BTreeMap<(String, String), (u64, u64)>>,
}

impl Default for Metrics {
    fn default() -> Metrics {
        let latency = || Histogram::new(LATENCY_BUCKETS);
        Metrics {
            received: Counter::default(),
            received_confirm: Counter::default(),
            routed: Counter::default(),
            unroutable_dropped: Counter::default(),
            unroutable_returned: Counter::default(),
            confirmed: Counter::default(),
            delivered_consume_manual_ack: Counter::default(),
            delivered_consume_auto_ack: Counter::default(),
            delivered_get_manual_ack: Counter::default(),
            delivered_get_auto_ack: Counter::default(),
            get_empty: Counter::default(),
            redelivered: Counter::default(),
            acknowledged: Counter::default(),
            connections_opened: Counter::default(),
            connections_closed: Counter::default(),
            channels_opened: Counter::default(),
            channels_closed: Counter::default(),
            queues_declared: Counter::default(),
            queues_created: Counter::default(),
            queues_deleted: Counter::default(),
            auth_attempts: Counter::default(),
            auth_attempts_succeeded: Counter::default(),
            auth_attempts_failed: Counter::default(),
            confirm_latency: latency(),
            fsync_latency: latency(),
            gm_lap_latency: latency(),
            io: IoCounters::default(),
            disk_writes: Counter::default(),
            disk_reads: Counter::default(),
            disk_free_bytes: AtomicI64::new(-1),
            disk_alarm: AtomicI64::new(0),
            syncs: Mutex::default(),
        }
    }
}

impl Metrics {
    /// A sync of `queue`'s mirror has copied everything below `next` of what it copies
    /// (sequence numbers below `below`).
    pub fn sync_progress(&self, vhost: &str, queue: &str, next: u64, below: u64) {
        self.lock_syncs()
            .insert((vhost.to_string(), queue.to_string()), (next, below));
    }

    /// The sync of `queue`'s mirror ended (done or stopped).
    pub fn sync_ended(&self, vhost: &str, queue: &str) {
        self.lock_syncs()
            .remove(&(vhost.to_string(), queue.to_string()));
    }

    /// Sequence numbers the running sync of `queue`'s mirror still has to copy, when this
    /// node (its master's) runs one; what `warren_mirror_sync_sequence_remaining` shows.
    pub fn sync_remaining(&self, vhost: &str, queue: &str) -> Option<u64> {
        self.lock_syncs()
            .get(&(vhost.to_string(), queue.to_string()))
            .map(|(next, below)| below.saturating_sub(*next))
    }

    fn lock_syncs(&self) -> std::sync::MutexGuard<'_, BTreeMap<(String, String), (u64, u64)>> {
        self.syncs.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Which endpoint is scraped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Detail {
    /// `/metrics`: queue metrics summed, no object labels.
    Aggregated,
    /// `/metrics/per-object`: one sample per queue, labelled `vhost` and `queue`.
    PerObject,
}

/// The text format of a scrape.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// Prometheus' text format 0.0.4 (RabbitMQ's default).
    Prometheus,
    /// OpenMetrics 1.0 text.
    OpenMetrics,
}

impl Format {
    /// The format a scraper's `Accept` header asks for: OpenMetrics when it names it.
    pub fn from_accept(accept: Option<&str>) -> Format {
        match accept {
            Some(a) if a.contains("application/openmetrics-text") => Format::OpenMetrics,
            _ => Format::Prometheus,
        }
    }

    /// The `Content-Type` of the answer.
    pub fn content_type(self) -> &'static str {
        match self {
            Format::Prometheus => prometheus_text::CONTENT_TYPE,
            Format::OpenMetrics => "application/openmetrics-text; version=1.0.0; charset=utf-8",
        }
    }
}

type Labels = Vec<(&'static str, String)>;

/// Registers metrics under their full names, each family once.
struct Builder {
    registry: Registry,
}

impl Builder {
    fn gauge(&mut self, name: &str, help: &str, value: i64) {
        let g: Gauge = Gauge::default();
        g.set(value);
        self.registry.register(name, help, g);
    }

    fn gauge_f64(&mut self, name: &str, help: &str, value: f64) {
        let g: Gauge<f64, std::sync::atomic::AtomicU64> = Gauge::default();
        g.set(value);
        self.registry.register(name, help, g);
    }

    /// `name` without `_total` (the encoder adds it).
    fn counter(&mut self, name: &str, help: &str, c: &Counter) {
        self.registry.register(name, help, c.clone());
    }

    /// As [`Builder::counter`], of seconds.
    fn counter_f64(&mut self, name: &str, help: &str, c: &io::Seconds) {
        self.registry.register(name, help, c.clone());
    }

    fn labelled_counter(&mut self, name: &str, help: &str, rows: &[(Labels, u64)]) {
        let f: Family<Labels, Counter> = Family::default();
        for (labels, v) in rows {
            f.get_or_create(labels).inc_by(*v);
        }
        self.registry.register(name, help, f);
    }

    fn labelled_gauge(&mut self, name: &str, help: &str, rows: &[(Labels, i64)]) {
        let f: Family<Labels, Gauge> = Family::default();
        for (labels, v) in rows {
            f.get_or_create(labels).set(*v);
        }
        self.registry.register(name, help, f);
    }

    fn histogram(&mut self, name: &str, help: &str, h: &Histogram) {
        self.registry.register(name, help, h.clone());
    }
}

fn amqp() -> Labels {
    vec![("protocol", "amqp091".to_string())]
}

fn n(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

/// The scrape's text: `metrics`' counts with `sample`'s state.
pub fn render(metrics: &Metrics, sample: &Sample, detail: Detail, format: Format) -> String {
    let mut b = Builder {
        registry: Registry::default(),
    };
    node_metrics(&mut b, metrics, sample);
    queue_metrics(&mut b, sample, detail);
    global_metrics(&mut b, metrics);
    io::io_metrics(&mut b, &metrics.io);
    warren_metrics(&mut b, metrics, sample);
    let mut out = String::new();
    let written = match format {
        Format::Prometheus => prometheus_text::encode(&mut out, &b.registry),
        Format::OpenMetrics => text::encode(&mut out, &b.registry),
    };
    // Writing to a String cannot fail; a failure would be a label the encoder refused,
    // which the fixed names here never are.
    debug_assert!(written.is_ok(), "metrics encoding failed");
    out
}

fn node_metrics(b: &mut Builder, m: &Metrics, s: &Sample) {
    let identity: Labels = vec![
        ("rabbitmq_node", s.node.clone()),
        ("rabbitmq_cluster", s.cluster.clone()),
    ];
    b.labelled_gauge(
        "rabbitmq_identity_info",
        "The node and cluster this scrape describes",
        &[(identity, 1)],
    );
    let build: Labels = vec![
        ("rabbitmq_version", s.rabbitmq_version.to_string()),
        ("warren_version", s.version.to_string()),
    ];
    b.labelled_gauge(
        "rabbitmq_build_info",
        "The versions this node runs",
        &[(build, 1)],
    );
    b.gauge(
        "rabbitmq_connections",
        "AMQP connections open on this node",
        n(s.connections),
    );
    b.gauge(
        "rabbitmq_channels",
        "Channels open on this node",
        n(s.channels),
    );
    b.gauge(
        "rabbitmq_consumers",
        "Consumers on this node's channels",
        n(s.consumers),
    );
    b.gauge(
        "rabbitmq_queues",
        "Queues this node is master of",
        n(s.queues.len() as u64),
    );
    b.counter(
        "rabbitmq_connections_opened",
        "AMQP connections accepted",
        &m.connections_opened,
    );
    b.counter(
        "rabbitmq_connections_closed",
        "AMQP connections ended",
        &m.connections_closed,
    );
    b.counter(
        "rabbitmq_channels_opened",
        "Channels opened",
        &m.channels_opened,
    );
    b.counter(
        "rabbitmq_channels_closed",
        "Channels closed",
        &m.channels_closed,
    );
    b.counter(
        "rabbitmq_queues_declared",
        "queue.declare methods answered",
        &m.queues_declared,
    );
    b.counter(
        "rabbitmq_queues_created",
        "Queues started on this node",
        &m.queues_created,
    );
    b.counter(
        "rabbitmq_queues_deleted",
        "Queues deleted on this node",
        &m.queues_deleted,
    );
    b.counter("rabbitmq_auth_attempts", "Logins tried", &m.auth_attempts);
    b.counter(
        "rabbitmq_auth_attempts_succeeded",
        "Logins that succeeded",
        &m.auth_attempts_succeeded,
    );
    b.counter(
        "rabbitmq_auth_attempts_failed",
        "Logins refused",
        &m.auth_attempts_failed,
    );
    b.gauge(
        "rabbitmq_process_resident_memory_bytes",
        "Resident memory of the node process",
        n(s.resident_memory_bytes),
    );
    b.gauge(
        "rabbitmq_resident_memory_limit_bytes",
        "Memory high watermark: publishers are blocked above it",
        n(s.memory_limit_bytes),
    );
    if let Some(fds) = s.open_fds {
        b.gauge("rabbitmq_process_open_fds", "Open file descriptors", n(fds));
    }
    if let Some(max) = s.max_fds {
        b.gauge("rabbitmq_process_max_fds", "File descriptor limit", n(max));
    }
    b.gauge(
        "rabbitmq_disk_space_available_bytes",
        "Free bytes on the data directory's disk",
        m.disk_free_bytes.load(Ordering::Relaxed),
    );
    b.gauge(
        "rabbitmq_disk_space_available_limit_bytes",
        "Free disk space below which publishers are blocked",
        n(s.disk_free_limit_bytes),
    );
    b.gauge(
        "rabbitmq_alarms_free_disk_space_watermark",
        "1 while the free disk space alarm is set",
        m.disk_alarm.load(Ordering::Relaxed),
    );
    b.gauge(
        "rabbitmq_alarms_memory_used_watermark",
        "1 while the memory alarm is set",
        i64::from(s.memory_alarm),
    );
    b.gauge(
        "rabbitmq_alarms_file_descriptor_limit",
        "1 while the file descriptor alarm is set (Warren raises none)",
        0,
    );
    b.gauge_f64(
        "rabbitmq_erlang_uptime_seconds",
        "Seconds since the node started (the name RabbitMQ's dashboards read)",
        s.uptime_seconds,
    );
}

fn queue_metrics(b: &mut Builder, s: &Sample, detail: Detail) {
    type Pick = fn(&QueueSample) -> u64;
    let metrics: [(&str, &str, Pick); 7] = [
        (
            "rabbitmq_queue_messages_ready",
            "Messages ready for delivery",
            |q| q.ready,
        ),
        (
            "rabbitmq_queue_messages_unacked",
            "Messages delivered and not yet acknowledged",
            |q| q.unacked,
        ),
        (
            "rabbitmq_queue_messages",
            "Messages ready and unacknowledged",
            |q| q.ready + q.unacked,
        ),
        ("rabbitmq_queue_consumers", "Consumers on the queue", |q| {
            q.consumers
        }),
        (
            "rabbitmq_queue_messages_ready_bytes",
            "Body bytes of the ready messages",
            |q| q.ready_bytes,
        ),
        (
            "warren_queue_mirrors",
            "Mirrors of the queue (besides its master)",
            |q| q.mirrors,
        ),
        (
            "warren_queue_mirrors_synchronised",
            "Mirrors recorded synchronised",
            |q| q.synchronised_mirrors,
        ),
    ];
    for (name, help, pick) in metrics {
        match detail {
            Detail::Aggregated => {
                b.gauge(name, help, n(s.queues.iter().map(pick).sum()));
            }
            Detail::PerObject => {
                let rows: Vec<(Labels, i64)> = s
                    .queues
                    .iter()
                    .map(|q| {
                        let labels = vec![("vhost", q.vhost.clone()), ("queue", q.name.clone())];
                        (labels, n(pick(q)))
                    })
                    .collect();
                b.labelled_gauge(name, help, &rows);
            }
        }
    }
}

fn global_metrics(b: &mut Builder, m: &Metrics) {
    let one = |c: &Counter| vec![(amqp(), c.get())];
    let counters: [(&str, &str, &Counter); 13] = [
        (
            "rabbitmq_global_messages_received",
            "Messages published to the node",
            &m.received,
        ),
        (
            "rabbitmq_global_messages_received_confirm",
            "Messages published on confirm-mode channels",
            &m.received_confirm,
        ),
        (
            "rabbitmq_global_messages_routed",
            "Messages routed to a queue",
            &m.routed,
        ),
        (
            "rabbitmq_global_messages_unroutable_dropped",
            "Unroutable messages dropped",
            &m.unroutable_dropped,
        ),
        (
            "rabbitmq_global_messages_unroutable_returned",
            "Unroutable messages returned to the publisher",
            &m.unroutable_returned,
        ),
        (
            "rabbitmq_global_messages_confirmed",
            "Publisher confirms sent",
            &m.confirmed,
        ),
        (
            "rabbitmq_global_messages_delivered_consume_manual_ack",
            "Deliveries to consumers that acknowledge",
            &m.delivered_consume_manual_ack,
        ),
        (
            "rabbitmq_global_messages_delivered_consume_auto_ack",
            "Deliveries to no-ack consumers",
            &m.delivered_consume_auto_ack,
        ),
        (
            "rabbitmq_global_messages_delivered_get_manual_ack",
            "Messages fetched with basic.get, to be acknowledged",
            &m.delivered_get_manual_ack,
        ),
        (
            "rabbitmq_global_messages_delivered_get_auto_ack",
            "Messages fetched with basic.get and no-ack",
            &m.delivered_get_auto_ack,
        ),
        (
            "rabbitmq_global_messages_get_empty",
            "basic.get on an empty queue",
            &m.get_empty,
        ),
        (
            "rabbitmq_global_messages_redelivered",
            "Deliveries flagged redelivered",
            &m.redelivered,
        ),
        (
            "rabbitmq_global_messages_acknowledged",
            "Deliveries acknowledged by clients",
            &m.acknowledged,
        ),
    ];
    for (name, help, c) in counters {
        b.labelled_counter(name, help, &one(c));
    }
    let delivered = m.delivered_consume_manual_ack.get()
        + m.delivered_consume_auto_ack.get()
        + m.delivered_get_manual_ack.get()
        + m.delivered_get_auto_ack.get();
    b.labelled_counter(
        "rabbitmq_global_messages_delivered",
        "Messages delivered to consumers and basic.get",
        &[(amqp(), delivered)],
    );
}

fn warren_metrics(b: &mut Builder, m: &Metrics, s: &Sample) {
    b.histogram(
        "warren_confirm_latency_seconds",
        "From a publish to its publisher confirm",
        &m.confirm_latency,
    );
    b.histogram(
        "warren_fsync_latency_seconds",
        "One fsync of the message store or a queue index",
        &m.fsync_latency,
    );
    b.histogram(
        "warren_gm_lap_latency_seconds",
        "From a GM broadcast to the end of its lap around the ring",
        &m.gm_lap_latency,
    );
    if let Some(r) = &s.raft {
        b.gauge(
            "warren_raft_term",
            "The metadata Raft group's current term",
            n(r.term),
        );
        b.gauge(
            "warren_raft_commit_index",
            "The highest metadata log index committed and applied on this node",
            n(r.applied_index),
        );
        b.gauge(
            "warren_raft_last_log_index",
            "The highest metadata log index written on this node",
            n(r.last_log_index),
        );
        b.gauge(
            "warren_raft_leader_id",
            "The node id of the leader this node knows (0: none)",
            n(r.leader.unwrap_or(0)),
        );
        b.gauge(
            "warren_raft_is_leader",
            "1 on the metadata leader",
            i64::from(r.leader == Some(r.node_id)),
        );
    }
    let syncing: Vec<(Labels, i64)> = m
        .lock_syncs()
        .iter()
        .map(|((vhost, queue), (next, below))| {
            let labels = vec![("vhost", vhost.clone()), ("queue", queue.clone())];
            (labels, n(below.saturating_sub(*next)))
        })
        .collect();
    b.labelled_gauge(
        "warren_mirror_sync_sequence_remaining",
        "Sequence numbers a running mirror sync still has to copy (an upper bound on its messages)",
        &syncing,
    );
}

#[cfg(test)]
mod tests;

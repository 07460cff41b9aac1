//! The mirror scenario's session clients: real AMQP connections ([`AmqpConn`]) to the nodes'
//! own sessions (`session::Connection` behind `runtime::conn_task`), each to a node drawn at
//! random, so most publishes and deliveries cross the relay to the queue's master and back.
//! Publishers (confirms, persistent messages) and a consumer (manual acks) use their own
//! durable queue under the same `ha-mode` policy as the rest of the scenario, and meet the
//! same faults.
//!
//! In one run in three an operator ([`run_redeclarer`]) deletes the queue and declares it
//! again, one to three times, through a node drawn at random, while the others publish and
//! consume through theirs: a publish routed by a node whose metadata is behind the
//! re-declare must still reach the new queue, or be refused.
//!
//! Checked on what these clients saw, the session's view of design §1:
//! - **S1** every confirmed message is delivered at least once (the drain waits for them),
//!   except one sent before the last re-declare-ok: a delete may have taken it. Publishes
//!   are mandatory: **S4** none sent after the last re-declare-ok comes back unroutable,
//!   but through a node some failure detector held down while that delete and re-declare ran
//!   (they do not wait for it, and it routes by what it had until it catches up);
//! - **S2** a message delivered twice carries `redelivered` on every delivery after the
//!   first;
//! - **S3** each publisher connection's messages, first deliveries without `redelivered`,
//!   come in the order published (a publisher that reconnects may be overtaken by what
//!   its old connection still had in flight: order holds per connection, as in RabbitMQ).

use std::collections::{BTreeMap, BTreeSet};
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use warren::runtime::raft::NodeId;

use crate::amqp_client::{AmqpConn, Incoming};
use crate::trace::Trace;
use crate::{lock, now_ms};

/// The session clients' queue (matched by the scenario's `^ha\.` policy).
pub const QUEUE: &str = "ha.s";
/// The port each node's AMQP listener binds.
pub const AMQP_PORT: u16 = 5672;
/// Heartbeat negotiated (seconds): the node and the client each give up a silent peer.
const HEARTBEAT_S: u16 = 2;
/// A connection silent this long is given up by the client (two heartbeats).
const SILENT_MS: u64 = 4_000;
/// Publishes in flight per publisher.
const IN_FLIGHT: usize = 4;
/// The longest a connect, declare, confirm.select or consume may take.
const SETUP_MS: u64 = 3_000;

/// Node `node`'s AMQP address.
pub fn amqp_addr(node: NodeId) -> String {
    format!("{}:{AMQP_PORT}", crate::scenario::host(node))
}

/// A message: its publisher, the publisher's connection, its number on that publisher.
type Key = (u32, u32, u64);

fn body(key: Key) -> Vec<u8> {
    let mut b = Vec::with_capacity(16);
    b.extend_from_slice(&key.0.to_be_bytes());
    b.extend_from_slice(&key.1.to_be_bytes());
    b.extend_from_slice(&key.2.to_be_bytes());
    b
}

fn key_of(b: &[u8]) -> Option<Key> {
    let p = u32::from_be_bytes(b.get(0..4)?.try_into().ok()?);
    let c = u32::from_be_bytes(b.get(4..8)?.try_into().ok()?);
    let n = u64::from_be_bytes(b.get(8..16)?.try_into().ok()?);
    (b.len() == 16).then_some((p, c, n))
}

/// What the session clients saw.
#[derive(Default)]
pub struct SessionRecords {
    /// Confirmed: the message, the node the publisher was connected to, when it was sent.
    confirms: Mutex<Vec<(Key, NodeId, u64)>>,
    /// Returned unroutable (mandatory): the message, when it was sent, the node it was
    /// sent through.
    returns: Mutex<Vec<(Key, u64, NodeId)>>,
    /// Failure detectors' verdicts: when, whose, on which node, down (or up again).
    verdicts: Mutex<Vec<(u64, NodeId, NodeId, bool)>>,
    /// The operator's deletes: when each began and when its queue's re-declare was
    /// answered (`u64::MAX` while it has not been).
    deletes: Mutex<Vec<(u64, u64)>>,
    /// Delivered, in the order the consumer got them: the message, redelivered, the node.
    deliveries: Mutex<Vec<(Key, bool, NodeId)>>,
    nacks: Mutex<u64>,
    /// The consumer saw every confirmed message once the publishers were done.
    pub drained: AtomicBool,
}

impl SessionRecords {
    /// At `at`, `observer`'s failure detector gave `node` up (`down`) or heard it again.
    pub fn held_down(&self, at: u64, observer: NodeId, node: NodeId, down: bool) {
        lock(&self.verdicts).push((at, observer, node, down));
    }

    /// The nodes some failure detector held down at some time in `[from, to]`.
    fn down_during(&self, from: u64, to: u64) -> BTreeSet<NodeId> {
        let mut since: BTreeMap<(NodeId, NodeId), u64> = BTreeMap::new();
        let mut found = BTreeSet::new();
        for &(at, observer, node, down) in lock(&self.verdicts).iter() {
            if down {
                since.entry((observer, node)).or_insert(at);
            } else if let Some(d) = since.remove(&(observer, node)) {
                if d <= to && at >= from {
                    found.insert(node);
                }
            }
        }
        found.extend(since.iter().filter(|(_, &d)| d <= to).map(|((_, n), _)| *n));
        found
    }

    /// The time after which nothing deleted the queue: the last re-declare-ok (0: never
    /// deleted; `u64::MAX`: a delete whose re-declare was never answered).
    fn last_redeclare(&self) -> u64 {
        lock(&self.deletes).iter().map(|d| d.1).max().unwrap_or(0)
    }

    /// Confirmed messages never delivered that must be (S1).
    pub fn missing(&self) -> Vec<Key> {
        let after = self.last_redeclare();
        let seen: BTreeSet<Key> = lock(&self.deliveries).iter().map(|d| d.0).collect();
        let returned: BTreeSet<Key> = lock(&self.returns).iter().map(|r| r.0).collect();
        lock(&self.confirms)
            .iter()
            .filter(|c| c.2 > after && !returned.contains(&c.0))
            .map(|c| c.0)
            .filter(|k| !seen.contains(k))
            .collect()
    }

    /// Violations of S1-S3, as failure lines.
    pub fn check(&self) -> Vec<String> {
        let mut failures = Vec::new();
        let missing = self.missing();
        if !missing.is_empty() {
            failures.push(format!(
                "S1: {} confirmed session messages never delivered: {:?}",
                missing.len(),
                &missing[..missing.len().min(20)]
            ));
        }
        let after = self.last_redeclare();
        // A node held down while the last delete and re-declare ran is not waited for by
        // them (it may be cut off or down): until it catches up it routes by what it had,
        // as a partitioned RabbitMQ node does.
        let since = lock(&self.deletes).iter().map(|d| d.0).max().unwrap_or(0);
        let stale = self.down_during(since, after);
        let late: Vec<Key> = lock(&self.returns)
            .iter()
            .filter(|r| r.1 > after && !stale.contains(&r.2))
            .map(|r| r.0)
            .collect();
        if !late.is_empty() {
            failures.push(format!(
                "S4: {} session messages returned unroutable though sent after the last re-declare-ok (+{after}ms): {:?}",
                late.len(),
                &late[..late.len().min(20)]
            ));
        }
        let deliveries = lock(&self.deliveries).clone();
        let mut delivered: BTreeSet<Key> = BTreeSet::new();
        let mut last: BTreeMap<(u32, u32), u64> = BTreeMap::new();
        for (key, redelivered, node) in &deliveries {
            let first = delivered.insert(*key);
            if !first && !redelivered {
                failures.push(format!(
                    "S2: session message {key:?} delivered again by n{node} without redelivered"
                ));
            }
            if first && !redelivered {
                let prev = last.insert((key.0, key.1), key.2);
                if prev.is_some_and(|p| p > key.2) {
                    failures.push(format!(
                        "S3: session message {key:?} (n{node}) after #{} of its connection",
                        prev.unwrap_or(0)
                    ));
                }
            }
        }
        failures
    }

    /// Figures for the trace.
    pub fn summary(&self) -> String {
        format!(
            "session clients: {} confirmed, {} nacked, {} returned, {} deliveries, {} deletes",
            lock(&self.confirms).len(),
            lock(&self.nacks),
            lock(&self.returns).len(),
            lock(&self.deliveries).len(),
            lock(&self.deletes).len()
        )
    }
}

/// Connects to `node` and sets the channel up with `setup`, within [`SETUP_MS`].
async fn connect(node: NodeId) -> Result<AmqpConn, String> {
    match tokio::time::timeout(
        Duration::from_millis(SETUP_MS),
        AmqpConn::open(&amqp_addr(node), HEARTBEAT_S),
    )
    .await
    {
        Ok(Ok(c)) => Ok(c),
        Ok(Err(e)) => Err(e.to_string()),
        Err(_) => Err("connect timed out".into()),
    }
}

async fn within<T>(f: impl std::future::Future<Output = std::io::Result<T>>) -> Result<T, String> {
    match tokio::time::timeout(Duration::from_millis(SETUP_MS), f).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(e.to_string()),
        Err(_) => Err("timed out".into()),
    }
}

/// A publisher: connects to a node at random, declares the queue (half the time),
/// publishes persistent messages with confirms, up to [`IN_FLIGHT`] at once, until
/// `until_ms`; a connection that fails or falls silent is replaced by one to another
/// node. Every publish is a new message (what was unconfirmed is not resent).
pub async fn run_publisher(
    p: u32,
    seed: u64,
    until_ms: u64,
    hosts: Rc<dyn Fn() -> u64>,
    records: Arc<SessionRecords>,
    trace: Trace,
) {
    let mut rng = StdRng::seed_from_u64(seed ^ 0x5e55 ^ (u64::from(p) << 32));
    let mut conn_no = 0u32;
    while now_ms() < until_ms {
        let node = rng.gen_range(1..=hosts());
        let setup = async {
            let mut c = connect(node).await?;
            if rng.gen_bool(0.5) {
                within(c.declare_durable(QUEUE)).await?;
            }
            within(c.confirm_select()).await?;
            Ok::<_, String>(c)
        };
        let mut c = match setup.await {
            Ok(c) => c,
            Err(e) => {
                trace.log(format!("sp{p} cannot use n{node}: {e}"));
                tokio::time::sleep(Duration::from_millis(rng.gen_range(100..300))).await;
                continue;
            }
        };
        conn_no += 1;
        trace.log(format!("sp{p} connected to n{node} (connection {conn_no})"));
        let why = publish_on(&mut c, p, conn_no, node, until_ms, &mut rng, &records).await;
        trace.log(format!("sp{p} leaves n{node}: {why}"));
    }
}

async fn publish_on(
    c: &mut AmqpConn,
    p: u32,
    conn_no: u32,
    node: NodeId,
    until_ms: u64,
    rng: &mut StdRng,
    records: &SessionRecords,
) -> String {
    // Tag -> (message number, when sent).
    let mut outstanding: BTreeMap<u64, (u64, u64)> = BTreeMap::new();
    let (mut next_tag, mut n) = (0u64, 0u64);
    let mut last_read = now_ms();
    let mut next_send = last_read;
    let mut next_beat = last_read + 1_000;
    loop {
        let now = now_ms();
        if now >= until_ms && outstanding.is_empty() {
            return "done".into();
        }
        if now.saturating_sub(last_read) > SILENT_MS {
            return format!("silent, {} unconfirmed", outstanding.len());
        }
        if now >= next_beat {
            if let Err(e) = c.heartbeat().await {
                return e.to_string();
            }
            next_beat = now + 1_000;
        }
        let may_send = now < until_ms && outstanding.len() < IN_FLIGHT;
        if may_send && now >= next_send {
            n += 1;
            next_tag += 1;
            if let Err(e) = c.publish(QUEUE, body((p, conn_no, n)), true).await {
                return e.to_string();
            }
            outstanding.insert(next_tag, (n, now));
            next_send = now + rng.gen_range(5..40);
        }
        let mut wake = next_beat.min(last_read + SILENT_MS + 1);
        if may_send {
            wake = wake.min(next_send);
        }
        tokio::select! {
            r = c.fill() => match r {
                Ok(true) => last_read = now_ms(),
                Ok(false) => return "closed by the node".into(),
                Err(e) => return e.to_string(),
            },
            _ = tokio::time::sleep(Duration::from_millis(wake.saturating_sub(now).max(1))) => {}
        }
        loop {
            let event = match c.next_event() {
                Ok(Some(e)) => e,
                Ok(None) => break,
                Err(e) => return e.to_string(),
            };
            let (tag, multiple, confirmed) = match event {
                Incoming::Returned { body } => {
                    if let Some(key) = key_of(&body) {
                        // Its confirm follows; when it was sent is in `outstanding`.
                        let sent = outstanding
                            .values()
                            .find(|(n, _)| (p, conn_no, *n) == key)
                            .map_or(now_ms(), |v| v.1);
                        lock(&records.returns).push((key, sent, node));
                    }
                    continue;
                }
                Incoming::Ack { tag, multiple } => (tag, multiple, true),
                Incoming::Nack { tag, multiple } => (tag, multiple, false),
                Incoming::Closed(code, text) => return format!("closed: {code} {text}"),
                _ => continue,
            };
            let taken: Vec<(u64, u64)> = if multiple {
                let rest = outstanding.split_off(&(tag + 1));
                let done = std::mem::replace(&mut outstanding, rest);
                done.into_values().collect()
            } else {
                outstanding.remove(&tag).into_iter().collect()
            };
            if confirmed {
                lock(&records.confirms).extend(
                    taken
                        .into_iter()
                        .map(|(n, sent)| ((p, conn_no, n), node, sent)),
                );
            } else {
                *lock(&records.nacks) += taken.len() as u64;
            }
        }
    }
}

/// The consumer: connects to a node at random, consumes with manual acks (prefetch 16)
/// until the node cancels the consumer or the connection fails, then reconnects; once
/// `draining` and every confirmed message was seen, it is done.
pub async fn run_consumer(
    seed: u64,
    hosts: Rc<dyn Fn() -> u64>,
    draining: Rc<dyn Fn() -> bool>,
    records: Arc<SessionRecords>,
    trace: Trace,
) {
    let mut rng = StdRng::seed_from_u64(seed ^ 0x5ec0);
    loop {
        if draining() && records.missing().is_empty() {
            trace.log("sc drained: every confirmed session message seen");
            records.drained.store(true, Ordering::SeqCst);
            return;
        }
        let node = rng.gen_range(1..=hosts());
        let setup = async {
            let mut c = connect(node).await?;
            within(c.consume(QUEUE, 16)).await?;
            Ok::<_, String>(c)
        };
        let mut c = match setup.await {
            Ok(c) => c,
            Err(e) => {
                trace.log(format!("sc cannot use n{node}: {e}"));
                tokio::time::sleep(Duration::from_millis(rng.gen_range(100..300))).await;
                continue;
            }
        };
        trace.log(format!("sc consuming through n{node}"));
        let why = consume_on(&mut c, node, &mut rng, &*draining, &records).await;
        trace.log(format!("sc leaves n{node}: {why}"));
    }
}

async fn consume_on(
    c: &mut AmqpConn,
    node: NodeId,
    rng: &mut StdRng,
    draining: &dyn Fn() -> bool,
    records: &SessionRecords,
) -> String {
    let mut last_read = now_ms();
    let mut next_beat = last_read + 1_000;
    loop {
        let now = now_ms();
        if draining() && records.missing().is_empty() {
            return "drained".into();
        }
        if now.saturating_sub(last_read) > SILENT_MS {
            return "silent".into();
        }
        if now >= next_beat {
            if let Err(e) = c.heartbeat().await {
                return e.to_string();
            }
            next_beat = now + 1_000;
        }
        tokio::select! {
            r = c.fill() => match r {
                Ok(true) => last_read = now_ms(),
                Ok(false) => return "closed by the node".into(),
                Err(e) => return e.to_string(),
            },
            _ = tokio::time::sleep(Duration::from_millis(200)) => {}
        }
        loop {
            let event = match c.next_event() {
                Ok(Some(e)) => e,
                Ok(None) => break,
                Err(e) => return e.to_string(),
            };
            match event {
                Incoming::Deliver {
                    tag,
                    redelivered,
                    body,
                } => {
                    if let Some(key) = key_of(&body) {
                        lock(&records.deliveries).push((key, redelivered, node));
                    }
                    // Now and then an ack is late (it may cross a failover).
                    if rng.gen_bool(0.03) {
                        tokio::time::sleep(Duration::from_millis(rng.gen_range(50..500))).await;
                    }
                    if let Err(e) = c.ack(tag).await {
                        return e.to_string();
                    }
                }
                Incoming::Cancelled => return "consumer cancelled by the node".into(),
                Incoming::Closed(code, text) => return format!("closed: {code} {text}"),
                _ => {}
            }
        }
    }
}

/// Whether seed `seed`'s operator deletes and re-declares the session queue (one run in
/// three; drawn apart from the scenario's own schedule, which stays as it was).
pub fn redeclares(seed: u64) -> bool {
    StdRng::seed_from_u64(seed ^ 0xde1e7e).gen_ratio(1, 3)
}

/// The operator: one to three times between 2 s and `until_ms - 3 s`, deletes the queue
/// through a node drawn at random and declares it again, both retried through other nodes
/// until the declare is answered (a delete that may or may not have happened is sent
/// again). Each delete is recorded from when it began until its re-declare-ok.
pub async fn run_redeclarer(
    seed: u64,
    until_ms: u64,
    hosts: Rc<dyn Fn() -> u64>,
    records: Arc<SessionRecords>,
    trace: Trace,
) {
    let mut rng = StdRng::seed_from_u64(seed ^ 0xde1e7e ^ 1);
    let mut times: Vec<u64> = (0..rng.gen_range(1..=3))
        .map(|_| rng.gen_range(2_000..until_ms.saturating_sub(3_000).max(2_001)))
        .collect();
    times.sort_unstable();
    for at in times {
        let now = now_ms();
        if at > now {
            tokio::time::sleep(Duration::from_millis(at - now)).await;
        }
        let d = {
            let mut deletes = lock(&records.deletes);
            deletes.push((now_ms(), u64::MAX));
            deletes.len() - 1
        };
        let mut deleted = false;
        while now_ms() < until_ms + 20_000 {
            let node = rng.gen_range(1..=hosts());
            let step = async {
                let mut c = connect(node).await?;
                if !deleted {
                    let n = within(c.delete_queue(QUEUE)).await?;
                    deleted = true;
                    trace.log(format!("so deleted {QUEUE} through n{node} ({n} messages)"));
                }
                within(c.declare_durable(QUEUE)).await?;
                Ok::<_, String>(())
            };
            match step.await {
                Ok(()) => {
                    lock(&records.deletes)[d].1 = now_ms();
                    trace.log(format!("so declared {QUEUE} again through n{node}"));
                    break;
                }
                Err(e) => {
                    trace.log(format!("so cannot use n{node}: {e}"));
                    tokio::time::sleep(Duration::from_millis(rng.gen_range(100..300))).await;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn records(confirms: &[Key], deliveries: &[(Key, bool)]) -> SessionRecords {
        let r = SessionRecords::default();
        lock(&r.confirms).extend(confirms.iter().map(|k| (*k, 1, k.2 * 100)));
        lock(&r.deliveries).extend(deliveries.iter().map(|(k, red)| (*k, *red, 2)));
        r
    }

    #[test]
    fn a_clean_run_passes() {
        let r = records(
            &[(0, 1, 1), (0, 1, 2)],
            &[((0, 1, 1), false), ((0, 1, 2), false), ((0, 1, 2), true)],
        );
        assert_eq!(r.check(), Vec::<String>::new());
    }

    #[test]
    fn a_confirmed_message_never_delivered_is_s1() {
        let r = records(&[(0, 1, 1), (0, 1, 2)], &[((0, 1, 1), false)]);
        let f = r.check();
        assert_eq!(f.len(), 1);
        assert!(f[0].starts_with("S1: 1 confirmed"), "{f:?}");
        assert_eq!(r.missing(), vec![(0, 1, 2)]);
    }

    #[test]
    fn a_second_delivery_without_redelivered_is_s2() {
        let r = records(&[(0, 1, 1)], &[((0, 1, 1), false), ((0, 1, 1), false)]);
        let f = r.check();
        assert_eq!(f.len(), 1);
        assert!(f[0].starts_with("S2:"), "{f:?}");
    }

    #[test]
    fn reordering_within_a_connection_is_s3_across_connections_it_is_not() {
        let r = records(&[], &[((0, 1, 2), false), ((0, 1, 1), false)]);
        let f = r.check();
        assert_eq!(f.len(), 1);
        assert!(f[0].starts_with("S3:"), "{f:?}");
        let r = records(&[], &[((0, 2, 1), false), ((0, 1, 5), false)]);
        assert_eq!(r.check(), Vec::<String>::new());
    }

    #[test]
    fn a_delete_excuses_what_was_sent_before_its_redeclare_answered() {
        // Sent at 100, 200, 300: deleted from 150 until 250.
        let r = records(&[(0, 1, 1), (0, 1, 2), (0, 1, 3)], &[]);
        lock(&r.deletes).push((150, 250));
        assert_eq!(r.missing(), vec![(0, 1, 3)]);
        let f = r.check();
        assert_eq!(f.len(), 1);
        assert!(f[0].starts_with("S1: 1 confirmed"), "{f:?}");
        // A re-declare never answered excuses everything.
        lock(&r.deletes).push((280, u64::MAX));
        assert_eq!(r.missing(), Vec::<Key>::new());
    }

    #[test]
    fn a_return_after_the_last_redeclare_is_s4_before_it_is_not() {
        let r = records(&[(0, 1, 1), (0, 1, 3)], &[]);
        lock(&r.deletes).push((150, 250));
        lock(&r.returns).push(((0, 1, 1), 100, 1));
        let f = r.check();
        assert_eq!(f.len(), 1);
        assert!(f[0].starts_with("S1: 1 confirmed"), "{f:?}");
        lock(&r.returns).push(((0, 1, 3), 300, 2));
        // Returned: no longer missing, but returned though the queue existed.
        assert_eq!(r.missing(), Vec::<Key>::new());
        let f = r.check();
        assert_eq!(f.len(), 1);
        assert!(f[0].starts_with("S4: 1 session messages returned"), "{f:?}");
        // Unless its node was held down while the delete and re-declare ran: the
        // re-declare did not wait for it. Down and heard again before, it counts.
        r.held_down(100, 1, 2, true);
        r.held_down(140, 1, 2, false);
        assert_eq!(r.check().len(), 1);
        // Down before the delete began and still down during it.
        r.held_down(120, 3, 2, true);
        r.held_down(160, 3, 2, false);
        assert_eq!(r.check(), Vec::<String>::new());
    }

    #[test]
    fn message_bodies_round_trip() {
        assert_eq!(key_of(&body((3, 4, 5))), Some((3, 4, 5)));
        assert_eq!(key_of(&[0; 12]), None);
    }
}

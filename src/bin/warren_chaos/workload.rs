//! The AMQP clients (lapin): confirmed publishers on every node and a transactional one,
//! consumers with manual acks
//! (some rejects with requeue), a `basic.get` poller, and the final drain. Every client
//! reconnects to any node that answers when its connection drops; a publish whose confirm
//! never came is recorded as unknown, never as confirmed.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, Context, Result};
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicGetOptions, BasicPublishOptions, BasicQosOptions,
    BasicRejectOptions, ConfirmSelectOptions, QueueDeclareOptions,
};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tokio::sync::mpsc;

use super::history::{self, Delivery, History, Outcome, Published};
use super::returns;

/// Publishes in flight per publisher before it waits for their confirms.
const WINDOW: u64 = 10;
/// A confirm not come by then is unknown (and the connection is given up).
const CONFIRM_TIMEOUT: Duration = Duration::from_secs(30);
/// A publish the client library has not taken by then is unknown (the connection is given up).
const PUBLISH_TIMEOUT: Duration = Duration::from_secs(10);
/// An ack or reject lapin has not written by then is given up with its connection. lapin
/// resolves one once the frame is on the socket, so a wait this long is not the broker's
/// backpressure (a consumer writes at most a prefetch's worth of small frames).
const SETTLE_TIMEOUT: Duration = Duration::from_secs(10);

/// What every client shares.
#[derive(Clone)]
pub struct Ctx {
    pub uris: Arc<Vec<String>>,
    pub history: Arc<History>,
    pub stop: Arc<AtomicBool>,
    /// Stops the consumers and the getter only (set before `stop`).
    pub takers_stop: Arc<AtomicBool>,
    pub streams: Arc<AtomicU64>,
}

/// The dead-letter stream's source (`--dead-letters`): no consumer; its messages expire
/// after [`DL_TTL_MS`] into [`DL_TARGET`], whose master is on another node.
pub const DL_SOURCE: usize = 100;
/// The dead-letter stream's target queue.
pub const DL_TARGET: usize = 101;
/// The source's `x-message-ttl`.
pub const DL_TTL_MS: i64 = 200;

pub fn queue_name(q: usize) -> String {
    match q {
        DL_SOURCE => "ha.dl.source".to_string(),
        DL_TARGET => "ha.dl.target".to_string(),
        _ => format!("ha.q{q}"),
    }
}

impl Ctx {
    fn stopping(&self) -> bool {
        self.stop.load(Ordering::Relaxed)
    }

    /// Whether the consumers and the getter must stop.
    fn takers_stopping(&self) -> bool {
        self.stopping() || self.takers_stop.load(Ordering::Relaxed)
    }

    /// Connects to node `first` or, failing that, the next ones in turn; (node, connection).
    pub async fn connect(&self, first: usize) -> Option<(usize, Connection)> {
        let n = self.uris.len();
        for k in 0..n {
            let i = (first + k) % n;
            let c = tokio::time::timeout(
                Duration::from_secs(3),
                Connection::connect(&self.uris[i], ConnectionProperties::default()),
            )
            .await;
            if let Ok(Ok(conn)) = c {
                return Some((i, conn));
            }
        }
        None
    }
}

async fn close(conn: Connection) {
    let _ = tokio::time::timeout(Duration::from_secs(2), conn.close(200, "bye".into())).await;
}

/// How a publisher learns that the broker took its messages.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Publisher confirms, [`WINDOW`] in flight.
    Confirms,
    /// Transactions of [`WINDOW`] publishes each: `tx.commit-ok` is the broker's word that
    /// all of them are kept.
    Tx,
}

/// A publisher to `ha.q<queue>`, preferring node `home`; messages whose sequence number is
/// 3 mod 4 are transient, the rest persistent (all of them to [`DL_SOURCE`]: a dead letter
/// keeps its delivery mode, and the checker's transient excuse follows the source queue's
/// master only).
pub async fn publisher(ctx: Ctx, id: u32, home: usize, queue: usize, mode: Mode) {
    let mut seq = 0u64;
    let mut session = 0u32;
    let mut first = home;
    while !ctx.stopping() {
        let Some((node, conn)) = ctx.connect(first).await else {
            tokio::time::sleep(Duration::from_millis(200)).await;
            continue;
        };
        // Next time, start from the home node again (it may be back).
        first = home;
        let Ok(Ok(ch)) = tokio::time::timeout(Duration::from_secs(5), async {
            let ch = conn.create_channel().await?;
            match mode {
                Mode::Confirms => ch.confirm_select(ConfirmSelectOptions::default()).await?,
                Mode::Tx => ch.tx_select().await?,
            }
            Ok::<Channel, lapin::Error>(ch)
        })
        .await
        else {
            close(conn).await;
            first = node + 1;
            tokio::time::sleep(Duration::from_millis(200)).await;
            continue;
        };
        session += 1;
        ctx.history.session_start(id, session, node);
        match mode {
            Mode::Confirms => publish_session(&ctx, &ch, id, session, queue, &mut seq).await,
            Mode::Tx => tx_session(&ctx, &ch, id, session, queue, &mut seq).await,
        }
        ctx.history.session_end(id, session);
        close(conn).await;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Publishes on one channel until it breaks or the run stops.
async fn publish_session(
    ctx: &Ctx,
    ch: &Channel,
    id: u32,
    session: u32,
    queue: usize,
    seq: &mut u64,
) {
    while !ctx.stopping() {
        let mut confirms = Vec::new();
        let mut broken = false;
        for _ in 0..WINDOW {
            match publish_next(ctx, ch, id, session, queue, seq).await {
                (s, Some(c)) => confirms.push((s, c)),
                (s, None) => {
                    ctx.history.outcome(id, s, Outcome::Unknown);
                    broken = true;
                    break;
                }
            }
        }
        // One deadline for the window, so a stuck connection is given up in bounded time.
        let deadline = tokio::time::Instant::now() + CONFIRM_TIMEOUT;
        let mut answered = Vec::new();
        for (s, c) in confirms {
            if broken {
                // The connection is going: what is left would only time out.
                answered.push((s, None));
                continue;
            }
            match tokio::time::timeout_at(deadline, c).await {
                Ok(Ok(c)) => answered.push((s, Some((c, Instant::now())))),
                _ => {
                    answered.push((s, None));
                    broken = true;
                }
            }
        }
        // A return rides on whichever confirm lapin completes next: its body names the
        // publish it answers (`returns`).
        let returned = returns::returned(
            answered
                .iter()
                .filter_map(|(_, a)| a.as_ref().map(|(c, _)| c)),
            |body| {
                history::parse(body)
                    .filter(|&(p, sess, _)| p == id && sess == session)
                    .map(|(_, _, s)| s)
            },
        );
        let mut nacked = false;
        for (s, a) in answered {
            let outcome = match a {
                _ if returned.contains(&s) => Outcome::Returned,
                Some((c, at)) if c.is_ack() => Outcome::Ack(at),
                Some(_) => {
                    nacked = true;
                    Outcome::Nack
                }
                None => Outcome::Unknown,
            };
            ctx.history.outcome(id, s, outcome);
        }
        if broken {
            return;
        }
        if nacked {
            // The queue is between masters: nacks are right; no need to spin.
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// Numbers, records and publishes the next message (`mandatory`; 3 mod 4 transient):
/// its sequence number, and its confirm, or `None` when the client library did not take
/// the publish in time. Bounded: a blocked connection (connection.blocked, a node's alarm)
/// holds the publish, and the run must still end.
async fn publish_next(
    ctx: &Ctx,
    ch: &Channel,
    id: u32,
    session: u32,
    queue: usize,
    seq: &mut u64,
) -> (
    u64,
    Option<impl std::future::Future<Output = lapin::Result<lapin::Confirmation>>>,
) {
    let s = *seq;
    *seq += 1;
    let persistent = s % 4 != 3 || queue == DL_SOURCE;
    ctx.history.sent(
        id,
        s,
        Published {
            session,
            queue,
            persistent,
            sent: Instant::now(),
            outcome: Outcome::Pending,
        },
    );
    let props = BasicProperties::default().with_delivery_mode(if persistent { 2 } else { 1 });
    let published = tokio::time::timeout(
        PUBLISH_TIMEOUT,
        ch.basic_publish(
            "".into(),
            queue_name(queue).as_str().into(),
            // Mandatory: a publish no queue took (the name free between a delete and the
            // re-declare, or not yet known to this node) comes back as a return, not as a
            // plain ack the checker would count as confirmed.
            BasicPublishOptions {
                mandatory: true,
                ..Default::default()
            },
            &history::body(id, session, s),
            props,
        ),
    )
    .await;
    match published {
        Ok(Ok(c)) => (s, Some(c)),
        _ => (s, None),
    }
}

/// Publishes transactions on one channel until it breaks or the run stops. A message is
/// kept once its `tx.commit-ok` came and no `basic.return` said it went nowhere; a commit
/// that failed or never answered leaves its messages unknown.
async fn tx_session(ctx: &Ctx, ch: &Channel, id: u32, session: u32, queue: usize, seq: &mut u64) {
    while !ctx.stopping() {
        let mut batch = Vec::new();
        for _ in 0..WINDOW {
            let (s, published) = publish_next(ctx, ch, id, session, queue, seq).await;
            batch.push(s);
            if published.is_none() {
                for s in batch {
                    ctx.history.outcome(id, s, Outcome::Unknown);
                }
                return;
            }
        }
        let committed = tokio::time::timeout(CONFIRM_TIMEOUT, ch.tx_commit()).await;
        if !matches!(committed, Ok(Ok(()))) {
            for s in batch {
                ctx.history.outcome(id, s, Outcome::Unknown);
            }
            return;
        }
        let at = Instant::now();
        // Returns come before the commit-ok; outside confirm mode lapin keeps them for
        // `wait_for_confirms`, which then only drains them.
        let returned: Vec<u64> = match ch.wait_for_confirms().await {
            Ok(msgs) => msgs
                .iter()
                .filter_map(|m| history::parse(&m.delivery.data).map(|(_, _, s)| s))
                .collect(),
            Err(_) => {
                for s in batch {
                    ctx.history.outcome(id, s, Outcome::Unknown);
                }
                return;
            }
        };
        for s in batch {
            let outcome = if returned.contains(&s) {
                Outcome::Returned
            } else {
                Outcome::Ack(at)
            };
            ctx.history.outcome(id, s, outcome);
        }
    }
}

/// Records a delivered body; false when it is not one of ours.
fn record(ctx: &Ctx, data: &[u8], stream: u64, redelivered: bool) -> bool {
    let Some((publisher, session, seq)) = history::parse(data) else {
        ctx.history.error(format!(
            "a delivery with a foreign body of {} bytes",
            data.len()
        ));
        return false;
    };
    ctx.history.delivered(Delivery {
        publisher,
        session,
        seq,
        stream,
        redelivered,
        at: Some(Instant::now()),
    });
    true
}

/// A consumer of `ha.q<queue>` with manual acks, preferring node `home`; rejects about one
/// delivery in 40 with requeue.
pub async fn consumer(ctx: Ctx, seed: u64, home: usize, queue: usize) {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut first = home;
    while !ctx.takers_stopping() {
        let Some((node, conn)) = ctx.connect(first).await else {
            tokio::time::sleep(Duration::from_millis(200)).await;
            continue;
        };
        first = home;
        if let Err(_e) = consume_session(&ctx, &conn, node, queue, &mut rng).await {
            first = node + 1;
        }
        close(conn).await;
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

async fn consume_session(
    ctx: &Ctx,
    conn: &Connection,
    node: usize,
    queue: usize,
    rng: &mut StdRng,
) -> Result<()> {
    let stream = ctx.streams.fetch_add(1, Ordering::Relaxed);
    ctx.history
        .stream_start(stream, node, format!("consumer of {}", queue_name(queue)));
    let ch = tokio::time::timeout(Duration::from_secs(5), async {
        let ch = conn.create_channel().await?;
        ch.basic_qos(50, BasicQosOptions::default()).await?;
        Ok::<Channel, lapin::Error>(ch)
    })
    .await??;
    let consumer = tokio::time::timeout(
        Duration::from_secs(10),
        ch.basic_consume(
            queue_name(queue).as_str().into(),
            format!("chaos-{stream}").as_str().into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        ),
    )
    .await??;
    let (tx, mut rx) = mpsc::unbounded_channel();
    // The delegate runs as lapin dispatches, in order.
    consumer.set_delegate(move |d: lapin::message::DeliveryResult| {
        let _ = tx.send(d);
        std::future::ready(())
    });
    while !ctx.takers_stopping() {
        let d = match tokio::time::timeout(Duration::from_millis(300), rx.recv()).await {
            Err(_) => continue,
            Ok(None) | Ok(Some(Ok(None))) => return Err(anyhow!("consumer cancelled")),
            Ok(Some(Err(e))) => return Err(e.into()),
            Ok(Some(Ok(Some(d)))) => d,
        };
        record(ctx, &d.data, stream, d.redelivered);
        let reject = rng.gen_range(0..40) == 0;
        let settle = async {
            if reject {
                d.reject(BasicRejectOptions { requeue: true }).await
            } else {
                d.ack(BasicAckOptions::default()).await
            }
        };
        settle_within(ctx, conn, stream, node, settle).await?;
    }
    Ok(())
}

/// Waits for an ack or reject to be written, for at most [`SETTLE_TIMEOUT`]; a stall is
/// recorded with the connection's state and ends the session.
async fn settle_within(
    ctx: &Ctx,
    conn: &Connection,
    stream: u64,
    node: usize,
    settle: impl std::future::Future<Output = lapin::Result<bool>>,
) -> Result<()> {
    match tokio::time::timeout(SETTLE_TIMEOUT, settle).await {
        Ok(r) => r.map(drop).context("ack"),
        Err(_) => {
            let st = conn.status();
            ctx.history.stall(format!(
                "stream {stream} (node{}): an ack was not written within {SETTLE_TIMEOUT:?}; \
                 connection connected={} blocked={} closing={} closed={} errored={}",
                node + 1,
                st.connected(),
                st.blocked(),
                st.closing(),
                st.closed(),
                st.errored()
            ));
            Err(anyhow!("ack stalled"))
        }
    }
}

/// Now and then a `basic.get` (manual ack) on either queue, through any node.
pub async fn getter(ctx: Ctx, seed: u64) {
    let mut rng = StdRng::seed_from_u64(seed);
    let n = ctx.uris.len();
    while !ctx.takers_stopping() {
        let Some((node, conn)) = ctx.connect(rng.gen_range(0..n)).await else {
            tokio::time::sleep(Duration::from_millis(200)).await;
            continue;
        };
        let stream = ctx.streams.fetch_add(1, Ordering::Relaxed);
        ctx.history.stream_start(stream, node, "getter".to_string());
        let r: Result<()> = async {
            let ch = tokio::time::timeout(Duration::from_secs(5), conn.create_channel()).await??;
            while !ctx.takers_stopping() {
                tokio::time::sleep(Duration::from_millis(rng.gen_range(100..400))).await;
                let q = queue_name(rng.gen_range(0..super::schedule::QUEUES));
                let got = tokio::time::timeout(
                    Duration::from_secs(10),
                    ch.basic_get(q.as_str().into(), BasicGetOptions { no_ack: false }),
                )
                .await??;
                if let Some(m) = got {
                    record(&ctx, &m.delivery.data, stream, m.delivery.redelivered);
                    let ack = m.delivery.ack(BasicAckOptions::default());
                    settle_within(&ctx, &conn, stream, node, ack).await?;
                }
            }
            Ok(())
        }
        .await;
        let _ = r;
        close(conn).await;
    }
}

/// Consumes `queue` through node `node` (manual acks, each recorded) until a passive
/// declare says it is empty and nothing came for a while; how many were taken.
pub async fn drain(ctx: &Ctx, node: usize, queue: &str, deadline: Instant) -> Result<u64> {
    let conn = Connection::connect(&ctx.uris[node], ConnectionProperties::default())
        .await
        .context("connect for the drain")?;
    let stream = ctx.streams.fetch_add(1, Ordering::Relaxed);
    ctx.history
        .stream_start(stream, node, format!("drain of {queue}"));
    let r = async {
        let ch = conn.create_channel().await?;
        ch.basic_qos(500, BasicQosOptions::default()).await?;
        let counter = conn.create_channel().await?;
        let consumer = ch
            .basic_consume(
                queue.into(),
                "chaos-drain".into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await?;
        let (tx, mut rx) = mpsc::unbounded_channel();
        consumer.set_delegate(move |d: lapin::message::DeliveryResult| {
            let _ = tx.send(d);
            std::future::ready(())
        });
        let mut taken = 0u64;
        loop {
            match tokio::time::timeout(Duration::from_millis(700), rx.recv()).await {
                Ok(Some(Ok(Some(d)))) => {
                    record(ctx, &d.data, stream, d.redelivered);
                    d.ack(BasicAckOptions::default()).await?;
                    taken += 1;
                    continue;
                }
                Ok(Some(Err(e))) => return Err(anyhow::Error::from(e).context("drain consumer")),
                Ok(None) | Ok(Some(Ok(None))) => return Err(anyhow!("drain consumer cancelled")),
                Err(_) => {}
            }
            // Idle: the queue's count (ready messages) says whether it is done; a master
            // without its lease hands out nothing for a while, so idle alone says nothing.
            let q = counter
                .queue_declare(
                    queue.into(),
                    QueueDeclareOptions {
                        passive: true,
                        ..Default::default()
                    },
                    FieldTable::default(),
                )
                .await?;
            if q.message_count() == 0 {
                return Ok(taken);
            }
            if Instant::now() > deadline {
                return Err(anyhow!(
                    "{queue} still holds {} messages at the drain's deadline",
                    q.message_count()
                ));
            }
        }
    }
    .await;
    close(conn).await;
    r
}

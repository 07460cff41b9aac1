//! What the run did and saw, recorded as it happens and judged afterwards by the checker:
//! every publish and its outcome, every delivery, publisher sessions, queue delete/re-declare
//! cycles, restarts of queue masters' nodes, and the partitions with their timings.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Instant;

/// What the broker answered to one publish.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Outcome {
    Pending,
    Ack(Instant),
    Nack,
    /// Came back with a `basic.return` (mandatory, unroutable; matched by its body): the broker
    /// said no queue took it.
    Returned,
    /// No answer: the connection dropped or the confirm did not come in time.
    Unknown,
}

#[derive(Clone, Debug)]
pub struct Published {
    pub session: u32,
    pub queue: usize,
    pub persistent: bool,
    pub sent: Instant,
    pub outcome: Outcome,
}

/// One message handed to a client (consumer, `basic.get` or the final drain).
#[derive(Clone, Debug)]
pub struct Delivery {
    pub publisher: u32,
    pub session: u32,
    pub seq: u64,
    /// The client connection (channel) that received it: order is judged per stream.
    pub stream: u64,
    pub redelivered: bool,
    /// When the client got it (None in the checker's unit tests).
    pub at: Option<Instant>,
}

/// A publisher's connection: which node, from when to when.
#[derive(Clone, Debug)]
pub struct Session {
    pub publisher: u32,
    pub session: u32,
    pub node: usize,
    pub start: Instant,
    pub end: Option<Instant>,
}

/// A delete and re-declare of a queue: `done` is the re-declare's declare-ok.
#[derive(Clone, Debug)]
pub struct Redeclare {
    pub queue: usize,
    pub done: Option<Instant>,
}

/// A minority partition (both ways) and what it needs to judge majority liveness.
#[derive(Clone, Debug)]
pub struct PartitionRec {
    pub minority: Vec<usize>,
    pub cut: Instant,
    pub heal: Option<Instant>,
    /// Queues whose master or a synchronised mirror was on the majority side at the cut.
    pub eligible_queues: Vec<usize>,
    /// When a majority node first listed every eligible queue mastered on the majority side
    /// with no synchronised mirror on the minority (the minority recorded down, promotions done).
    pub settled: Option<Instant>,
}

#[derive(Default)]
pub struct Inner {
    /// Per publisher, per sequence number.
    pub published: HashMap<u32, Vec<Published>>,
    pub deliveries: Vec<Delivery>,
    pub sessions: Vec<Session>,
    /// Per stream: which node it was connected to and what it consumed (for the reasons).
    pub streams: HashMap<u64, (usize, String)>,
    pub redeclares: Vec<Redeclare>,
    /// (queue, when): the queue's master's node was restarted (or the whole cluster was).
    pub master_restarts: Vec<(usize, Instant)>,
    pub partitions: Vec<PartitionRec>,
    /// When the faults were over and every node served again.
    pub faults_end: Option<Instant>,
    /// Problems the workload hit that are failures by themselves.
    pub errors: Vec<String>,
    /// Client calls that never returned and were given up (bug 8 in docs/reliability.md):
    /// not failures by themselves, since the checkers still judge every message, but named.
    pub stalls: Vec<String>,
    /// When the schedule started: the run log's times count from here.
    pub t0: Option<Instant>,
}

impl Inner {
    /// `t` as the run log writes times: seconds since the schedule started.
    pub fn at(&self, t: Instant) -> String {
        match self.t0 {
            Some(t0) if t >= t0 => format!("+{:.3}s", (t - t0).as_secs_f64()),
            Some(t0) => format!("-{:.3}s", (t0 - t).as_secs_f64()),
            None => "?".to_string(),
        }
    }
}

#[derive(Default)]
pub struct History {
    pub inner: Mutex<Inner>,
}

impl History {
    pub fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Records a publish about to be sent; its sequence number must be the next one.
    pub fn sent(&self, publisher: u32, seq: u64, p: Published) {
        let mut h = self.lock();
        let v = h.published.entry(publisher).or_default();
        debug_assert_eq!(v.len() as u64, seq);
        v.push(p);
    }

    pub fn outcome(&self, publisher: u32, seq: u64, outcome: Outcome) {
        if let Some(p) = self
            .lock()
            .published
            .get_mut(&publisher)
            .and_then(|v| v.get_mut(seq as usize))
        {
            p.outcome = outcome;
        }
    }

    pub fn delivered(&self, d: Delivery) {
        self.lock().deliveries.push(d);
    }

    pub fn stream_start(&self, stream: u64, node: usize, what: String) {
        self.lock().streams.insert(stream, (node, what));
    }

    pub fn session_start(&self, publisher: u32, session: u32, node: usize) {
        self.lock().sessions.push(Session {
            publisher,
            session,
            node,
            start: Instant::now(),
            end: None,
        });
    }

    pub fn session_end(&self, publisher: u32, session: u32) {
        let now = Instant::now();
        for s in self.lock().sessions.iter_mut() {
            if s.publisher == publisher && s.session == session && s.end.is_none() {
                s.end = Some(now);
            }
        }
    }

    pub fn error(&self, e: String) {
        self.lock().errors.push(e);
    }

    pub fn stall(&self, what: String) {
        let mut h = self.lock();
        let at = h.at(Instant::now());
        h.stalls.push(format!("{at} {what}"));
    }
}

/// A message body: publisher id, session, sequence number, then padding.
pub fn body(publisher: u32, session: u32, seq: u64) -> Vec<u8> {
    let mut b = Vec::with_capacity(64);
    b.extend_from_slice(&publisher.to_be_bytes());
    b.extend_from_slice(&session.to_be_bytes());
    b.extend_from_slice(&seq.to_be_bytes());
    b.resize(64, b'.');
    b
}

/// (publisher, session, seq) from a body this tool wrote.
pub fn parse(body: &[u8]) -> Option<(u32, u32, u64)> {
    if body.len() < 16 {
        return None;
    }
    Some((
        u32::from_be_bytes(body[0..4].try_into().ok()?),
        u32::from_be_bytes(body[4..8].try_into().ok()?),
        u64::from_be_bytes(body[8..16].try_into().ok()?),
    ))
}

//! Runs a scenario against a broker over raw frames and writes down what came back, one line
//! per frame, so that two brokers' answers compare as text.

use std::net::SocketAddr;
use std::time::Duration;

use amq_protocol::frame::AMQPFrame;
use amq_protocol::protocol::{basic, channel as chan, connection, exchange, AMQPClass};
use amq_protocol::types::FieldTable;

use super::common::{RawClient, RawOpts};

/// How long a step may wait for its answer before "no answer" is written down.
const ANSWER: Duration = Duration::from_secs(5);

/// What an asynchronous step waits for.
#[derive(Clone, Copy, Debug)]
pub enum Then {
    /// A barrier: a passive declare of `amq.direct` on the same channel (unrecorded), so
    /// everything the step caused on the channel before it is written down.
    Barrier,
    /// This many frames the broker sends on its own on the channel (confirms, deliveries,
    /// returns): for what comes asynchronously, where a barrier's answer could overtake it.
    Await(usize),
}

/// One client action.
#[derive(Clone, Debug)]
pub enum Step {
    /// A synchronous method: waits for its reply (or a close) on the channel.
    Call { conn: usize, ch: u16, m: AMQPClass },
    /// An asynchronous method, then [`Then`].
    Cast {
        conn: usize,
        ch: u16,
        m: AMQPClass,
        then: Then,
    },
    /// basic.publish with its content, then a barrier as for [`Step::Cast`].
    Publish {
        conn: usize,
        ch: u16,
        exchange: String,
        routing_key: String,
        mandatory: bool,
        properties: Box<amq_protocol::protocol::BasicProperties>,
        body: Vec<u8>,
        then: Then,
    },
    /// Waits for `n` frames the broker sends on its own (deliveries, confirms, returns,
    /// cancels) on the channel, each with its content.
    Await { conn: usize, ch: u16, n: usize },
    /// Raw bytes on the socket (what no client library sends), then reads until the
    /// broker answers something or closes.
    Raw { conn: usize, bytes: Vec<u8> },
    /// As [`Step::Raw`], on a connection that has not shaken hands: a connection whose
    /// first step is a `Hello` starts with nothing sent, so the scenario writes the
    /// protocol header and the handshake's methods itself.
    Hello { conn: usize, bytes: Vec<u8> },
    /// A request to the management HTTP API as `guest` (policies, operator policies): the
    /// status and the body's `error` field are written down, not the reason's words, which
    /// are Erlang terms in RabbitMQ's.
    Http {
        method: &'static str,
        path: String,
        body: Option<String>,
    },
}

/// Where a broker listens: AMQP, and the management HTTP API for [`Step::Http`].
#[derive(Clone, Copy, Debug)]
pub struct Target {
    pub amqp: SocketAddr,
    pub http: SocketAddr,
}

struct Conn {
    client: RawClient,
    /// The broker closed the connection: later steps on it are not run.
    gone: bool,
    /// Channels the broker closed: opened again (unrecorded) before a later step uses them,
    /// so one error does not hide what the rest of the scenario shows.
    closed: Vec<u16>,
}

/// Runs `steps` against `target`; each step's frames, formatted.
pub async fn run(target: Target, steps: &[Step]) -> Vec<Vec<String>> {
    let addr = target.amqp;
    let mut conns: Vec<Option<Conn>> = Vec::new();
    let mut out = Vec::new();
    for step in steps {
        if let Step::Http { method, path, body } = step {
            out.push(vec![http(target.http, method, path, body.clone()).await]);
            continue;
        }
        let k = match step {
            Step::Call { conn, .. }
            | Step::Cast { conn, .. }
            | Step::Publish { conn, .. }
            | Step::Await { conn, .. }
            | Step::Raw { conn, .. }
            | Step::Hello { conn, .. } => *conn,
            Step::Http { .. } => unreachable!("answered above"),
        };
        if conns.len() <= k {
            conns.resize_with(k + 1, || None);
        }
        if conns[k].is_none() {
            conns[k] = Some(match step {
                Step::Hello { .. } => Conn {
                    client: RawClient::connect(addr).await,
                    gone: false,
                    closed: Vec::new(),
                },
                _ => open(addr).await,
            });
        }
        let c = conns[k].as_mut().expect("opened above");
        if c.gone {
            out.push(vec!["(connection closed earlier)".to_string()]);
            continue;
        }
        let mut lines = Vec::new();
        let ch = match step {
            Step::Call { ch, .. }
            | Step::Cast { ch, .. }
            | Step::Publish { ch, .. }
            | Step::Await { ch, .. } => Some(*ch),
            Step::Raw { .. } | Step::Hello { .. } | Step::Http { .. } => None,
        };
        if let Some(ch) = ch.filter(|ch| c.closed.contains(ch)) {
            c.closed.retain(|x| *x != ch);
            c.client.open_channel(ch).await;
        }
        match step {
            Step::Call { ch, m, .. } => {
                c.client.send_method(*ch, m.clone()).await;
                read(c, *ch, Until::Reply(class_of(m)), &mut lines).await;
            }
            Step::Cast { ch, m, then, .. } => {
                send_then(c, *ch, vec![AMQPFrame::Method(*ch, m.clone())], *then).await;
                read(c, *ch, until(*then), &mut lines).await;
            }
            Step::Publish {
                ch,
                exchange: x,
                routing_key,
                mandatory,
                properties,
                body,
                then,
                ..
            } => {
                let mut frames = vec![
                    AMQPFrame::Method(
                        *ch,
                        AMQPClass::Basic(basic::AMQPMethod::Publish(basic::Publish {
                            exchange: x.as_str().into(),
                            routing_key: routing_key.as_str().into(),
                            mandatory: *mandatory,
                            immediate: false,
                        })),
                    ),
                    AMQPFrame::Header(
                        *ch,
                        amq_protocol::frame::AMQPContentHeader {
                            class_id: 60,
                            body_size: body.len() as u64,
                            properties: (**properties).clone(),
                        },
                    ),
                ];
                if !body.is_empty() {
                    frames.push(AMQPFrame::Body(*ch, body.clone()));
                }
                send_then(c, *ch, frames, *then).await;
                read(c, *ch, until(*then), &mut lines).await;
            }
            Step::Await { ch, n, .. } => {
                read(c, *ch, Until::Async(*n), &mut lines).await;
            }
            Step::Raw { bytes, .. } | Step::Hello { bytes, .. } => {
                let _ = c.client.try_write_bytes(bytes).await;
                read(c, 0, Until::Anything, &mut lines).await;
            }
            Step::Http { .. } => unreachable!("answered above"),
        }
        out.push(lines);
    }
    out
}

/// One management API request: `http STATUS`, and the body's `error` when it has one.
async fn http(addr: SocketAddr, method: &'static str, path: &str, body: Option<String>) -> String {
    let url = format!("http://{addr}/api{path}");
    tokio::task::spawn_blocking(move || {
        let req = ureq::request(method, &url)
            .set("Authorization", &warren::mgmt::basic_auth("guest", "guest"))
            .timeout(ANSWER);
        let result = match &body {
            Some(b) => req.set("Content-Type", "application/json").send_string(b),
            None => req.call(),
        };
        let resp = match result {
            Ok(r) | Err(ureq::Error::Status(_, r)) => r,
            Err(e) => return format!("(http failed: {e})"),
        };
        let status = resp.status();
        let error = resp
            .into_string()
            .ok()
            .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
            .and_then(|v| v.get("error").and_then(|e| e.as_str()).map(String::from));
        match error {
            Some(e) => format!("http {status} {e}"),
            None => format!("http {status}"),
        }
    })
    .await
    .expect("http task")
}

async fn open(addr: SocketAddr) -> Conn {
    let opts = RawOpts {
        heartbeat: Some(0),
        ..RawOpts::default()
    };
    let (mut client, _, _) = RawClient::handshake(addr, &opts).await;
    // Channel 1 is open on every connection; scenarios open others themselves.
    client.open_channel(1).await;
    Conn {
        client,
        gone: false,
        closed: Vec::new(),
    }
}

fn until(then: Then) -> Until {
    match then {
        Then::Barrier => Until::Barrier,
        Then::Await(n) => Until::Async(n),
    }
}

async fn send_then(c: &mut Conn, ch: u16, mut frames: Vec<AMQPFrame>, then: Then) {
    if let Then::Barrier = then {
        frames.push(AMQPFrame::Method(ch, barrier()));
    }
    let mut bytes = Vec::new();
    for f in &frames {
        bytes.extend(super::common::encode(f));
    }
    let _ = c.client.try_write_bytes(&bytes).await;
}

fn barrier() -> AMQPClass {
    AMQPClass::Exchange(exchange::AMQPMethod::Declare(exchange::Declare {
        exchange: "amq.direct".into(),
        kind: "direct".into(),
        passive: true,
        durable: false,
        auto_delete: false,
        internal: false,
        nowait: false,
        arguments: FieldTable::default(),
    }))
}

enum Until {
    /// A method of this class on the channel that is not one the broker sends on its own.
    Reply(u16),
    /// The barrier's declare-ok (not written down).
    Barrier,
    /// This many frames the broker sends on its own.
    Async(usize),
    /// Any frame, or the end of the connection.
    Anything,
}

fn class_of(m: &AMQPClass) -> u16 {
    m.get_amqp_class_id()
}

/// basic.deliver, basic.return, basic.ack / nack from the broker, basic.cancel from the
/// broker: methods that answer nothing.
fn is_async(m: &AMQPClass) -> bool {
    matches!(
        m,
        AMQPClass::Basic(
            basic::AMQPMethod::Deliver(_)
                | basic::AMQPMethod::Return(_)
                | basic::AMQPMethod::Ack(_)
                | basic::AMQPMethod::Nack(_)
                | basic::AMQPMethod::Cancel(_)
        )
    )
}

async fn read(c: &mut Conn, ch: u16, until: Until, lines: &mut Vec<String>) {
    let mut seen_async = 0;
    loop {
        if let Until::Async(n) = until {
            if seen_async >= n {
                return;
            }
        }
        let frame = match c.client.read_frame_or_header_for(ANSWER).await {
            Err(()) => {
                lines.push("(no answer)".to_string());
                return;
            }
            Ok(None) => {
                lines.push("(socket closed)".to_string());
                c.gone = true;
                return;
            }
            Ok(Some(Err(header))) => {
                // A refused protocol header: the broker names the one it speaks, and
                // whether it then closes is the next line.
                lines.push(format!("(protocol header {header:?})"));
                continue;
            }
            Ok(Some(Ok(f))) => f,
        };
        match frame {
            AMQPFrame::Heartbeat => continue,
            AMQPFrame::Method(0, AMQPClass::Connection(connection::AMQPMethod::Start(start))) => {
                lines.push(start_line(&start));
                return;
            }
            AMQPFrame::Method(0, AMQPClass::Connection(connection::AMQPMethod::Close(close))) => {
                lines.push(normalize(&format!("0 connection.close {close:?}")));
                let ok =
                    AMQPClass::Connection(connection::AMQPMethod::CloseOk(connection::CloseOk {}));
                let _ = c
                    .client
                    .try_write_bytes(&super::common::encode(&AMQPFrame::Method(0, ok)))
                    .await;
                c.gone = true;
                return;
            }
            AMQPFrame::Method(n, AMQPClass::Channel(chan::AMQPMethod::Close(close))) => {
                lines.push(normalize(&format!("{n} channel.close {close:?}")));
                let ok = AMQPClass::Channel(chan::AMQPMethod::CloseOk(chan::CloseOk {}));
                let _ = c
                    .client
                    .try_write_bytes(&super::common::encode(&AMQPFrame::Method(n, ok)))
                    .await;
                c.closed.push(n);
                if n == ch || matches!(until, Until::Anything) {
                    return;
                }
            }
            AMQPFrame::Method(n, AMQPClass::Exchange(exchange::AMQPMethod::DeclareOk(_)))
                if n == ch && matches!(until, Until::Barrier) =>
            {
                return
            }
            AMQPFrame::Method(n, m) => {
                lines.push(normalize(&format!("{n} {m:?}")));
                if carries_content(&m) {
                    read_content(c, lines).await;
                }
                let reply = !is_async(&m);
                if is_async(&m) && n == ch {
                    seen_async += 1;
                }
                match until {
                    Until::Reply(class) if n == ch && reply && class_of(&m) == class => return,
                    Until::Anything => return,
                    _ => {}
                }
            }
            AMQPFrame::Header(n, h) => {
                lines.push(normalize(&format!(
                    "{n} header size={} {:?}",
                    h.body_size, h.properties
                )));
            }
            AMQPFrame::Body(n, b) => {
                lines.push(format!("{n} body {:?}", String::from_utf8_lossy(&b)));
            }
            other => {
                lines.push(normalize(&format!("{other:?}")));
                if matches!(until, Until::Anything) {
                    return;
                }
            }
        }
    }
}

/// connection.start without what names the broker (product, version, platform, texts):
/// the protocol version, mechanisms, locales, which properties there are and the
/// capabilities with their values.
fn start_line(start: &connection::Start) -> String {
    let props = start.server_properties.inner();
    let keys: Vec<String> = props.keys().map(|k| k.to_string()).collect();
    let caps: Vec<String> = match props.get("capabilities") {
        Some(amq_protocol::types::AMQPValue::FieldTable(t)) => t
            .inner()
            .iter()
            .map(|(k, v)| format!("{k}={v:?}"))
            .collect(),
        _ => Vec::new(),
    };
    format!(
        "0 connection.start {}-{} mechanisms={:?} locales={:?} properties={keys:?} capabilities={caps:?}",
        start.version_major,
        start.version_minor,
        String::from_utf8_lossy(start.mechanisms.as_bytes()),
        String::from_utf8_lossy(start.locales.as_bytes()),
    )
}

fn carries_content(m: &AMQPClass) -> bool {
    matches!(
        m,
        AMQPClass::Basic(
            basic::AMQPMethod::GetOk(_)
                | basic::AMQPMethod::Deliver(_)
                | basic::AMQPMethod::Return(_)
        )
    )
}

/// The header and body frames that follow a content-carrying method.
async fn read_content(c: &mut Conn, lines: &mut Vec<String>) {
    let mut left = None;
    while left != Some(0) {
        match c.client.read_frame_for(ANSWER).await {
            Ok(Some(AMQPFrame::Header(n, h))) => {
                lines.push(normalize(&format!(
                    "{n} header size={} {:?}",
                    h.body_size, h.properties
                )));
                left = Some(h.body_size);
            }
            Ok(Some(AMQPFrame::Body(n, b))) => {
                lines.push(format!("{n} body {:?}", String::from_utf8_lossy(&b)));
                left = left.map(|l| l.saturating_sub(b.len() as u64));
            }
            Ok(Some(AMQPFrame::Heartbeat)) => continue,
            Ok(Some(other)) => {
                lines.push(normalize(&format!("(expected content) {other:?}")));
                return;
            }
            Ok(None) | Err(()) => {
                lines.push("(content missing)".to_string());
                return;
            }
        }
    }
}

/// Names the broker makes up (queue names, consumer tags) and times are not compared.
fn normalize(s: &str) -> String {
    use std::sync::OnceLock;
    static RULES: OnceLock<Vec<(regex::Regex, &'static str)>> = OnceLock::new();
    let rules = RULES.get_or_init(|| {
        vec![
            (
                regex::Regex::new(r"amq\.gen-[A-Za-z0-9_\-]+").expect("regex"),
                "amq.gen-*",
            ),
            (
                regex::Regex::new(r"amq\.ctag-[A-Za-z0-9_\-]+").expect("regex"),
                "amq.ctag-*",
            ),
            (
                regex::Regex::new(r#"ShortString\("time"\): Timestamp\(\d+\)"#).expect("regex"),
                r#"ShortString("time"): Timestamp(*)"#,
            ),
        ]
    });
    let mut s = s.to_string();
    for (re, with) in rules {
        s = re.replace_all(&s, *with).into_owned();
    }
    s
}

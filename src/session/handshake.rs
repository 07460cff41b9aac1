//! The connection handshake: protocol header, start / start-ok (PLAIN, AMQPLAIN, and
//! EXTERNAL on TLS connections: [`super::external`]), tune / tune-ok negotiation as RabbitMQ
//! does it, and open.

use amq_protocol::protocol::{connection as conn, AMQPClass};
use amq_protocol::types::{AMQPValue, FieldTable};

use super::connection::{Connection, SessionConfig};
use super::external::{self, Refusal, EXTERNAL};
use super::permissions::Permissions;
use crate::amqp::frame::{FRAME_MIN_SIZE, PROTOCOL_HEADER};
use crate::amqp::reply_code::{access_refused, command_invalid, not_allowed, syntax_error};
use crate::amqp::AmqpError;
use crate::broker::registry::{ConnectionLimits, LimitReached};
use crate::meta::{limits, MetaState};

/// Capabilities the client announced in `client_properties.capabilities`.
#[derive(Debug, Clone, Copy, Default)]
pub struct ClientCapabilities {
    /// Understands broker-sent basic.cancel.
    pub consumer_cancel_notify: bool,
    /// Understands connection.blocked / unblocked.
    pub connection_blocked: bool,
    /// Wants connection.close (403) on a refused login rather than a closed socket.
    pub authentication_failure_close: bool,
}

/// AMQP 0-9's header, which RabbitMQ answers as 0-9-1 (the two differ in nothing a
/// 0-9 client relies on).
const PROTOCOL_HEADER_0_9: &[u8; 8] = b"AMQP\x01\x01\x00\x09";

/// `None`: need more bytes; `Some(Ok)`: a 0-9-1 or 0-9 header (both 8 bytes); `Some(Err)`:
/// anything else, 0-8 included (RabbitMQ speaks 0-8 too; Warren answers with the header it
/// speaks and closes, as the spec asks).
pub fn check_protocol_header(data: &[u8]) -> Option<Result<(), ()>> {
    let n = data.len().min(PROTOCOL_HEADER.len());
    let known = [PROTOCOL_HEADER, PROTOCOL_HEADER_0_9];
    if !known.iter().any(|h| data[..n] == h[..n]) {
        return Some(Err(()));
    }
    if n < PROTOCOL_HEADER.len() {
        return None;
    }
    Some(Ok(()))
}

fn table(entries: Vec<(&str, AMQPValue)>) -> FieldTable {
    let mut t = FieldTable::default();
    for (k, v) in entries {
        t.insert(k.into(), v);
    }
    t
}

fn lstr(s: &str) -> AMQPValue {
    AMQPValue::LongString(s.as_bytes().to_vec().into())
}

/// Sends connection.start with Warren's server properties.
pub fn send_start(c: &mut Connection) {
    let caps = table(
        [
            "publisher_confirms",
            "exchange_exchange_bindings",
            "basic.nack",
            "consumer_cancel_notify",
            "connection.blocked",
            "authentication_failure_close",
            "per_consumer_qos",
            "consumer_priorities",
            "direct_reply_to",
        ]
        .into_iter()
        .map(|k| (k, AMQPValue::Boolean(true)))
        .collect(),
    );
    let props = table(vec![
        ("capabilities", AMQPValue::FieldTable(caps)),
        ("product", lstr("Warren")),
        ("version", lstr(env!("CARGO_PKG_VERSION"))),
        ("platform", lstr("Rust")),
        ("cluster_name", lstr(&c.cfg.node_name)),
        ("copyright", lstr("The Warren authors")),
        (
            "information",
            lstr("A RabbitMQ-compatible AMQP 0-9-1 broker"),
        ),
    ]);
    c.send_method(
        0,
        AMQPClass::Connection(conn::AMQPMethod::Start(conn::Start {
            version_major: 0,
            version_minor: 9,
            server_properties: props,
            mechanisms: external::mechanisms(c.peer().tls.as_ref()).into(),
            locales: "en_US".into(),
        })),
    );
}

fn credentials(mechanism: &str, response: &[u8]) -> Result<(String, String), AmqpError> {
    match mechanism {
        "PLAIN" => {
            // authzid \0 authcid \0 password
            let mut parts = response.split(|b| *b == 0);
            let (_, user, pass) = (parts.next(), parts.next(), parts.next());
            match (user, pass, parts.next()) {
                (Some(u), Some(p), None) => Ok((
                    String::from_utf8_lossy(u).into_owned(),
                    String::from_utf8_lossy(p).into_owned(),
                )),
                _ => Err(syntax_error("malformed PLAIN response")),
            }
        }
        "AMQPLAIN" => {
            // A field table without its length prefix.
            let mut buf = (response.len() as u32).to_be_bytes().to_vec();
            buf.extend_from_slice(response);
            let t = amq_protocol::types::parsing::parse_field_table(&buf[..])
                .map_err(|_| syntax_error("malformed AMQPLAIN response"))?
                .1;
            let get = |k: &str| t.inner().get(k).and_then(crate::meta::args::string);
            match (get("LOGIN"), get("PASSWORD")) {
                (Some(u), Some(p)) => Ok((u, p)),
                _ => Err(syntax_error("AMQPLAIN response lacks LOGIN or PASSWORD")),
            }
        }
        other => Err(command_invalid(format!(
            "unknown authentication mechanism '{other}'"
        ))),
    }
}

/// Authenticates start-ok and sends tune.
pub fn handle_start_ok(
    c: &mut Connection,
    s: conn::StartOk,
    now: crate::time::Instant,
) -> Result<(), AmqpError> {
    if let Some(AMQPValue::FieldTable(caps)) = s.client_properties.inner().get("capabilities") {
        let flag = |k: &str| matches!(caps.inner().get(k), Some(AMQPValue::Boolean(true)));
        c.caps.consumer_cancel_notify = flag("consumer_cancel_notify");
        c.caps.connection_blocked = flag("connection.blocked");
        c.caps.authentication_failure_close = flag("authentication_failure_close");
    }
    let mechanism = s.mechanism.as_str().to_string();
    let refused = || {
        access_refused(format!(
            "Login was refused using authentication mechanism {mechanism}. For details see the broker logfile."
        ))
    };
    let source = c.peer().host.clone();
    if c.broker.login_throttle().is_blocked(&source, now) {
        // Refused unchecked, with the answer a wrong password gets: a guesser learns nothing.
        tracing::warn!(conn = c.id, source = %source, "login refused: too many failed logins from this address");
        c.broker.metrics().auth_attempts.inc();
        c.broker.metrics().auth_attempts_failed.inc();
        return Err(refused());
    }
    let snapshot = c.snapshot();
    let (user, ok) = if mechanism == EXTERNAL {
        // The certificate vouches for the user: it must exist, no password is checked.
        match external::login(c.peer().tls.as_ref()) {
            Ok(name) => (name.to_string(), snapshot.users.contains_key(name)),
            Err(Refusal::NotTls) => {
                return Err(command_invalid(format!(
                    "invalid authentication mechanism '{EXTERNAL}'"
                )))
            }
            Err(why) => {
                tracing::warn!(conn = c.id, reason = %why, "EXTERNAL login refused");
                (String::new(), false)
            }
        }
    } else {
        let (user, password) = credentials(&mechanism, s.response.as_bytes())?;
        let ok = snapshot
            .users
            .get(&user)
            .is_some_and(|u| u.password_matches(&password));
        (user, ok)
    };
    let metrics = c.broker.metrics();
    metrics.auth_attempts.inc();
    if ok {
        metrics.auth_attempts_succeeded.inc();
    } else {
        metrics.auth_attempts_failed.inc();
    }
    if !ok {
        tracing::warn!(conn = c.id, user = %user, source = %source, "authentication failed");
        c.broker.login_throttle().handle_failure(&source, now);
        return Err(refused());
    }
    if c.cfg.loopback_users.iter().any(|u| u == &user) && !c.peer().is_loopback {
        // RabbitMQ refuses it as a failed login, with the same words to the client.
        tracing::warn!(conn = c.id, user = %user, source = %source, "login refused: user '{user}' can only connect via localhost");
        return Err(refused());
    }
    c.user = user;
    c.auth_mechanism = mechanism;
    c.client_properties = s.client_properties;
    c.send_method(
        0,
        AMQPClass::Connection(conn::AMQPMethod::Tune(conn::Tune {
            channel_max: c.cfg.channel_max,
            frame_max: c.cfg.frame_max,
            heartbeat: c.cfg.heartbeat_s,
        })),
    );
    Ok(())
}

/// RabbitMQ's tune-ok rules: a client may ask for less than the server offered but not
/// more, and not below the minimum (4096 octets, 1 channel). 0 means "no limit", which a
/// server with a limit refuses. A refusal closes the socket (see `Connection`).
pub fn negotiate_tune(cfg: &SessionConfig, t: &conn::TuneOk) -> Result<(u16, u32, u16), AmqpError> {
    negotiated("frame_max", FRAME_MIN_SIZE, cfg.frame_max, t.frame_max)?;
    negotiated(
        "channel_max",
        1,
        cfg.channel_max as u32,
        t.channel_max as u32,
    )?;
    Ok((t.channel_max, t.frame_max, t.heartbeat))
}

/// RabbitMQ's `validate_negotiated_integer_value`, with its words.
fn negotiated(field: &str, min: u32, server: u32, client: u32) -> Result<(), AmqpError> {
    if client != 0 && client < min {
        return Err(not_allowed(format!(
            "negotiated {field} = {client} is lower than the minimum allowed value ({min})"
        )));
    }
    if server != 0 && (client == 0 || client > server) {
        return Err(not_allowed(format!(
            "negotiated {field} = {client} is higher than the maximum allowed value ({server})"
        )));
    }
    Ok(())
}

/// connection.open: the vhost must exist, its and the user's `max-connections` must leave
/// room, and the user must have permissions there (in RabbitMQ's order: the limits are
/// checked before the permissions). On success the connection is listed.
pub fn handle_open(c: &mut Connection, snapshot: &MetaState, vhost: &str) -> Result<(), AmqpError> {
    if snapshot.vhost(vhost).is_none() {
        return Err(not_allowed(format!("vhost {vhost} not found")));
    }
    c.vhost = vhost.to_string();
    // Listing and counting happen together in the registry, so the last place of a limit
    // goes to one connection only.
    let limits = ConnectionLimits {
        vhost_max: snapshot.vhost_limit(vhost, limits::MAX_CONNECTIONS),
        user_max: snapshot.user_limit(&c.user, limits::MAX_CONNECTIONS),
    };
    if let Err(reached) = c.list(limits) {
        return Err(not_allowed(match reached {
            LimitReached::Vhost(n) => format!(
                "access to vhost '{vhost}' refused for user '{}': connection limit ({n}) is reached",
                c.user
            ),
            LimitReached::User(n) => format!(
                "Connection refused for user '{}': user connection limit ({n}) is reached",
                c.user
            ),
        }));
    }
    // A refusal from here on closes the connection, and its teardown takes the listing off.
    let Some(p) = snapshot.permission(&c.user, vhost) else {
        return Err(not_allowed(format!(
            "access to vhost '{vhost}' refused for user '{}'",
            c.user
        )));
    };
    c.permissions = Some(Permissions::new(&c.user, vhost, Some(p)));
    c.send_method(
        0,
        AMQPClass::Connection(conn::AMQPMethod::OpenOk(conn::OpenOk {})),
    );
    Ok(())
}

//! Carries out a management request's [`Direct`] work over an AMQP connection to this
//! node, as the request's user: what RabbitMQ's management plugin does with its direct
//! connection (`rabbit_mgmt_util:with_channel`). The connection is a real client's (lapin
//! over loopback TCP), so the work goes through the session, the relay and the mirrors like
//! any client's, and shows in `/api/connections` while it lasts (named
//! [`CONNECTION_NAME`]).

use std::net::SocketAddr;
use std::time::Duration;

use lapin::options::{
    BasicGetOptions, BasicPublishOptions, BasicRejectOptions, ConfirmSelectOptions,
    QueueDeclareOptions, QueuePurgeOptions,
};
use lapin::types::FieldTable;
use lapin::{Channel, Confirmation, Connection, ConnectionProperties};

use crate::mgmt::direct::{Direct, DirectOp, DirectOutcome, Fetched, ALIVENESS_PAYLOAD};

/// The `connection_name` client property of these connections.
pub const CONNECTION_NAME: &str = "warren management (HTTP API)";

/// How long one request's AMQP work may take (a publish to a mirrored queue waits for its
/// confirm; a queue between masters can hold that up for a failover).
const DEADLINE: Duration = Duration::from_secs(30);

/// Does `d` against the AMQP listener at `amqp` (an unspecified address means loopback).
pub async fn run(amqp: SocketAddr, d: &Direct) -> DirectOutcome {
    match tokio::time::timeout(DEADLINE, session(amqp, d)).await {
        Ok(Ok(outcome)) => outcome,
        Ok(Err(e)) => outcome_of(&e),
        Err(_) => DirectOutcome::Failed(format!("no answer within {DEADLINE:?}")),
    }
}

fn uri(amqp: SocketAddr, d: &Direct) -> String {
    let enc = |s: &str| {
        percent_encoding::utf8_percent_encode(s, percent_encoding::NON_ALPHANUMERIC).to_string()
    };
    let ip = if amqp.ip().is_unspecified() {
        match amqp {
            SocketAddr::V4(_) => "127.0.0.1".to_string(),
            SocketAddr::V6(_) => "[::1]".to_string(),
        }
    } else if amqp.is_ipv6() {
        format!("[{}]", amqp.ip())
    } else {
        amqp.ip().to_string()
    };
    format!(
        "amqp://{}:{}@{ip}:{}/{}",
        enc(&d.user),
        enc(&d.password),
        amqp.port(),
        enc(&d.vhost)
    )
}

async fn session(amqp: SocketAddr, d: &Direct) -> Result<DirectOutcome, lapin::Error> {
    let props = ConnectionProperties::default().with_connection_name(CONNECTION_NAME.into());
    let conn = Connection::connect(&uri(amqp, d), props).await?;
    let ch = conn.create_channel().await?;
    let outcome = work(&ch, &d.op).await;
    // Closing the channel requeues what `ack_requeue_true` left unacked.
    let _ = conn.close(200, "OK".into()).await;
    outcome
}

async fn work(ch: &Channel, op: &DirectOp) -> Result<DirectOutcome, lapin::Error> {
    match op {
        DirectOp::Publish {
            exchange,
            routing_key,
            properties,
            payload,
        } => {
            ch.confirm_select(ConfirmSelectOptions::default()).await?;
            let confirm = ch
                .basic_publish(
                    exchange.as_str().into(),
                    routing_key.as_str().into(),
                    BasicPublishOptions {
                        mandatory: true,
                        ..Default::default()
                    },
                    payload,
                    (**properties).clone(),
                )
                .await?
                .await?;
            Ok(match confirm {
                Confirmation::Ack(returned) => DirectOutcome::Published {
                    routed: returned.is_none(),
                },
                Confirmation::Nack(_) | Confirmation::NotRequested => DirectOutcome::Rejected,
            })
        }
        DirectOp::Get {
            queue,
            count,
            ackmode,
            ..
        } => {
            let mut got = Vec::new();
            let mut tags = Vec::new();
            // Rejects come after all the gets: a requeued message would be got again.
            for _ in 0..*count {
                let Some(m) = ch
                    .basic_get(
                        queue.as_str().into(),
                        BasicGetOptions {
                            no_ack: ackmode.no_ack(),
                        },
                    )
                    .await?
                else {
                    break;
                };
                tags.push(m.delivery.delivery_tag);
                got.push(Fetched {
                    redelivered: m.delivery.redelivered,
                    exchange: m.delivery.exchange.to_string(),
                    routing_key: m.delivery.routing_key.to_string(),
                    message_count: m.message_count,
                    properties: m.delivery.properties.clone(),
                    payload: m.delivery.data,
                });
            }
            if let Some(requeue) = ackmode.reject() {
                for tag in tags {
                    ch.basic_reject(tag, BasicRejectOptions { requeue }).await?;
                }
            }
            Ok(DirectOutcome::Got(got))
        }
        DirectOp::Purge { queue } => {
            ch.queue_purge(queue.as_str().into(), QueuePurgeOptions::default())
                .await?;
            Ok(DirectOutcome::Purged)
        }
        DirectOp::Aliveness => {
            let q = crate::mgmt::direct::ALIVENESS_QUEUE;
            ch.queue_declare(
                q.into(),
                QueueDeclareOptions::default(),
                FieldTable::default(),
            )
            .await?;
            // Confirmed before the get: the queue may be another node's.
            ch.confirm_select(ConfirmSelectOptions::default()).await?;
            ch.basic_publish(
                "".into(),
                q.into(),
                BasicPublishOptions::default(),
                ALIVENESS_PAYLOAD,
                Default::default(),
            )
            .await?
            .await?;
            let got = ch
                .basic_get(q.into(), BasicGetOptions { no_ack: true })
                .await?;
            Ok(DirectOutcome::Alive(got.map(|m| m.delivery.data)))
        }
    }
}

/// A lapin error as the broker's close (its code and text), or a failure.
fn outcome_of(e: &lapin::Error) -> DirectOutcome {
    match e.kind() {
        lapin::ErrorKind::ProtocolError(amqp) => DirectOutcome::Closed {
            code: amqp.get_id(),
            text: amqp.get_message().to_string(),
        },
        _ => DirectOutcome::Failed(e.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_uri_names_the_vhost_and_credentials_encoded_and_loopback_for_any() {
        let d = Direct {
            vhost: "/".into(),
            user: "a b".into(),
            password: "p@ss:1".into(),
            op: DirectOp::Aliveness,
        };
        assert_eq!(
            uri("0.0.0.0:5672".parse().unwrap(), &d),
            "amqp://a%20b:p%40ss%3A1@127.0.0.1:5672/%2F"
        );
        assert_eq!(
            uri("[::1]:5673".parse().unwrap(), &d),
            "amqp://a%20b:p%40ss%3A1@[::1]:5673/%2F"
        );
    }
}

//! A node's listeners and HTTP contexts as RabbitMQ 3.10's overview and node objects show
//! them: each listener's protocol, bound address, port and socket options, and a context per
//! web endpoint (the management API and console, the Prometheus endpoint).

use serde_json::{json, Value};

use crate::broker::node_stats::ListenerInfo;

/// `listeners[]`: one listener of `node`.
pub fn listener_json(node: &str, l: &ListenerInfo) -> Value {
    json!({
        "node": node,
        "protocol": l.protocol,
        "ip_address": l.addr.ip,
        "port": l.addr.port,
        "socket_opts": socket_opts(&l.protocol, l.addr.port),
    })
}

/// The options a listener's sockets have. AMQP: tokio's listen backlog and `TCP_NODELAY`
/// on every accepted connection (RabbitMQ lists its Erlang `tcp_listen_options`); the web
/// listeners: their port, as RabbitMQ lists Cowboy's; others none.
fn socket_opts(protocol: &str, port: u16) -> Value {
    match protocol {
        "amqp" | "amqp/ssl" => json!({"backlog": 1024, "nodelay": true}),
        "http" | "https" | "http/prometheus" => json!({"port": port}),
        _ => json!([]),
    }
}

/// `contexts`: the web endpoints of `node` among its `listeners`, as RabbitMQ lists each
/// plugin's context (the port as a string, as RabbitMQ writes it).
pub fn contexts_json<'a>(
    node: &str,
    listeners: impl IntoIterator<Item = &'a ListenerInfo>,
) -> Vec<Value> {
    listeners
        .into_iter()
        .filter_map(|l| {
            let description = match l.protocol.as_str() {
                "http" | "https" => "RabbitMQ Management",
                "http/prometheus" => "RabbitMQ Prometheus",
                _ => return None,
            };
            let mut c = json!({
                "node": node,
                "description": description,
                "path": "/",
                "port": l.addr.port.to_string(),
            });
            if l.protocol == "https" {
                c["ssl"] = json!(true);
            }
            Some(c)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::broker::node_stats::Endpoint;

    fn listener(protocol: &str, ip: &str, port: u16) -> ListenerInfo {
        ListenerInfo {
            protocol: protocol.to_string(),
            addr: Endpoint {
                ip: ip.to_string(),
                port,
            },
        }
    }

    #[test]
    fn listeners_and_contexts_carry_address_port_and_options() {
        let amqp = listener("amqp", "127.0.0.1", 5672);
        assert_eq!(
            listener_json("n1", &amqp),
            json!({"node": "n1", "protocol": "amqp", "ip_address": "127.0.0.1", "port": 5672,
                   "socket_opts": {"backlog": 1024, "nodelay": true}})
        );
        let clustering = listener("clustering", "::", 25672);
        assert_eq!(listener_json("n1", &clustering)["ip_address"], json!("::"));
        assert_eq!(listener_json("n1", &clustering)["socket_opts"], json!([]));
        let web = [
            amqp,
            listener("http", "127.0.0.1", 15672),
            listener("https", "127.0.0.1", 15671),
            listener("http/prometheus", "127.0.0.1", 15692),
        ];
        assert_eq!(
            contexts_json("n1", &web),
            vec![
                json!({"node": "n1", "description": "RabbitMQ Management", "path": "/", "port": "15672"}),
                json!({"node": "n1", "description": "RabbitMQ Management", "path": "/", "port": "15671", "ssl": true}),
                json!({"node": "n1", "description": "RabbitMQ Prometheus", "path": "/", "port": "15692"}),
            ]
        );
    }
}

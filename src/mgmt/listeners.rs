//! A node's listeners and HTTP contexts as RabbitMQ 3.10's overview and node objects show
//! them: each listener's protocol, bound address, port and socket options, and a context per
//! web endpoint (the management API and console, the Prometheus endpoint).

use std::net::SocketAddr;

use serde_json::{json, Value};

/// `listeners[]`: one listener of `node`.
pub fn listener_json(node: &str, protocol: &str, addr: SocketAddr) -> Value {
    json!({
        "node": node,
        "protocol": protocol,
        "ip_address": addr.ip().to_string(),
        "port": addr.port(),
        "socket_opts": socket_opts(protocol, addr.port()),
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
    listeners: impl IntoIterator<Item = (&'a str, SocketAddr)>,
) -> Vec<Value> {
    listeners
        .into_iter()
        .filter_map(|(protocol, addr)| {
            let description = match protocol {
                "http" | "https" => "RabbitMQ Management",
                "http/prometheus" => "RabbitMQ Prometheus",
                _ => return None,
            };
            let mut c = json!({
                "node": node,
                "description": description,
                "path": "/",
                "port": addr.port().to_string(),
            });
            if protocol == "https" {
                c["ssl"] = json!(true);
            }
            Some(c)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn listeners_and_contexts_carry_address_port_and_options() {
        let addr: SocketAddr = "127.0.0.1:5672".parse().unwrap();
        assert_eq!(
            listener_json("n1", "amqp", addr),
            json!({"node": "n1", "protocol": "amqp", "ip_address": "127.0.0.1", "port": 5672,
                   "socket_opts": {"backlog": 1024, "nodelay": true}})
        );
        let v6: SocketAddr = "[::]:25672".parse().unwrap();
        assert_eq!(
            listener_json("n1", "clustering", v6)["ip_address"],
            json!("::")
        );
        assert_eq!(
            listener_json("n1", "clustering", v6)["socket_opts"],
            json!([])
        );
        let web = [
            ("amqp", addr),
            ("http", "127.0.0.1:15672".parse().unwrap()),
            ("https", "127.0.0.1:15671".parse().unwrap()),
            ("http/prometheus", "127.0.0.1:15692".parse().unwrap()),
        ];
        assert_eq!(
            contexts_json("n1", web),
            vec![
                json!({"node": "n1", "description": "RabbitMQ Management", "path": "/", "port": "15672"}),
                json!({"node": "n1", "description": "RabbitMQ Management", "path": "/", "port": "15671", "ssl": true}),
                json!({"node": "n1", "description": "RabbitMQ Prometheus", "path": "/", "port": "15692"}),
            ]
        );
    }
}

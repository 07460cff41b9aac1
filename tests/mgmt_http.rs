//! The management HTTP API over real HTTP against a real node: every endpoint's success and
//! failure codes, basic auth and tags, and counts that follow AMQP traffic.

mod common;

use common::*;
use serde_json::{json, Value};

/// One HTTP exchange: (status, JSON body or Null, the named response header).
fn http(
    base: &str,
    method: &str,
    path: &str,
    auth: Option<(&str, &str)>,
    body: Option<&str>,
) -> (u16, Value, Option<String>) {
    let mut req = ureq::request(method, &format!("{base}{path}"));
    if let Some((u, p)) = auth {
        req = req.set("Authorization", &warren::mgmt::basic_auth(u, p));
    }
    let result = match body {
        Some(b) => req.set("Content-Type", "application/json").send_string(b),
        None => req.call(),
    };
    let resp = match result {
        Ok(r) => r,
        Err(ureq::Error::Status(_, r)) => r,
        Err(e) => panic!("{method} {path}: {e}"),
    };
    let status = resp.status();
    let header = resp
        .header("www-authenticate")
        .or(resp.header("location"))
        .map(String::from);
    let text = resp.into_string().expect("body");
    let json = if text.is_empty() {
        Value::Null
    } else {
        serde_json::from_str(&text).expect("JSON body")
    };
    (status, json, header)
}

struct Api {
    base: String,
}

impl Api {
    async fn call(&self, method: &str, path: &str, body: Option<&str>) -> (u16, Value) {
        self.call_as(("guest", "guest"), method, path, body).await
    }

    async fn call_as(
        &self,
        auth: (&str, &str),
        method: &str,
        path: &str,
        body: Option<&str>,
    ) -> (u16, Value) {
        let (base, method, path) = (self.base.clone(), method.to_string(), path.to_string());
        let (u, p) = (auth.0.to_string(), auth.1.to_string());
        let body = body.map(String::from);
        let (s, v, _) = tokio::task::spawn_blocking(move || {
            http(&base, &method, &path, Some((&u, &p)), body.as_deref())
        })
        .await
        .expect("http task");
        (s, v)
    }
}

async fn start() -> (TestNode, Api) {
    let node = TestNode::start_with(|c| {
        add_user(c, "mon", "pw", Some(("/", ".*", ".*", ".*")));
        c.users.last_mut().unwrap().tags = vec!["monitoring".into()];
        add_user(c, "amqp_only", "pw", Some(("/", ".*", ".*", ".*")));
    })
    .await;
    let api = Api {
        base: format!("http://{}", node.mgmt_addr()),
    };
    (node, api)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auth_is_basic_against_warren_users_with_rabbitmq_401s() {
    let (node, api) = start().await;
    let base = api.base.clone();
    let (s, body, header) =
        tokio::task::spawn_blocking(move || http(&base, "GET", "/api/overview", None, None))
            .await
            .unwrap();
    assert_eq!((s, body), (401, Value::Null));
    assert_eq!(
        header.as_deref(),
        Some("Basic realm=\"RabbitMQ Management\"")
    );
    let (s, body) = api
        .call_as(("guest", "wrong"), "GET", "/api/whoami", None)
        .await;
    assert_eq!(s, 401);
    assert_eq!(
        body,
        json!({"error": "not_authorised", "reason": "Login failed"})
    );
    let (s, body) = api
        .call_as(("amqp_only", "pw"), "GET", "/api/whoami", None)
        .await;
    assert_eq!(s, 401);
    assert_eq!(body["reason"], "Not management user");
    let (s, body) = api.call_as(("mon", "pw"), "GET", "/api/users", None).await;
    assert_eq!(
        (s, body["reason"].clone()),
        (401, json!("Not administrator user"))
    );
    assert_eq!(
        api.call_as(("mon", "pw"), "GET", "/api/nodes", None)
            .await
            .0,
        200
    );
    let (s, body) = api.call("GET", "/api/whoami", None).await;
    assert_eq!(
        (s, body),
        (200, json!({"name": "guest", "tags": ["administrator"]}))
    );
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_endpoint_answers_with_rabbitmq_codes() {
    let (node, api) = start().await;
    // overview, nodes
    let (s, o) = api.call("GET", "/api/overview", None).await;
    assert_eq!(s, 200);
    assert_eq!(o["product_name"], "Warren");
    let (s, n) = api.call("GET", "/api/nodes", None).await;
    assert_eq!((s, n[0]["running"].clone()), (200, json!(true)));
    // vhosts
    assert_eq!(api.call("PUT", "/api/vhosts/v1", None).await.0, 201);
    assert_eq!(api.call("PUT", "/api/vhosts/v1", None).await.0, 204);
    assert_eq!(api.call("GET", "/api/vhosts/v1", None).await.0, 200);
    assert_eq!(
        api.call("GET", "/api/vhosts", None)
            .await
            .1
            .as_array()
            .unwrap()
            .len(),
        2
    );
    assert_eq!(api.call("DELETE", "/api/vhosts/v1", None).await.0, 204);
    let (s, body) = api.call("DELETE", "/api/vhosts/v1", None).await;
    assert_eq!(
        (s, body),
        (
            404,
            json!({"error": "Object Not Found", "reason": "Not Found"})
        )
    );
    // users
    let alice = r#"{"password":"secret","tags":"management"}"#;
    assert_eq!(
        api.call("PUT", "/api/users/alice", Some(alice)).await.0,
        201
    );
    assert_eq!(
        api.call("PUT", "/api/users/alice", Some(alice)).await.0,
        204
    );
    assert_eq!(api.call("PUT", "/api/users/bob", Some("{")).await.0, 400);
    assert_eq!(api.call("PUT", "/api/users/bob", Some("{}")).await.0, 400);
    let (s, u) = api.call("GET", "/api/users/alice", None).await;
    assert_eq!((s, u["tags"].clone()), (200, json!(["management"])));
    // alice logs in over HTTP and AMQP with the password set over HTTP.
    let perms = r#"{"configure":".*","write":".*","read":".*"}"#;
    assert_eq!(
        api.call("PUT", "/api/permissions/%2F/alice", Some(perms))
            .await
            .0,
        201
    );
    assert_eq!(
        api.call("PUT", "/api/permissions/%2F/alice", Some(perms))
            .await
            .0,
        204
    );
    let (s, p) = api.call("GET", "/api/permissions/%2F/alice", None).await;
    assert_eq!((s, p["configure"].clone()), (200, json!(".*")));
    assert_eq!(
        api.call("GET", "/api/permissions/%2F/nobody", None).await.0,
        404
    );
    assert!(
        api.call("GET", "/api/permissions", None)
            .await
            .1
            .as_array()
            .unwrap()
            .len()
            >= 3
    );
    let (s, w) = api
        .call_as(("alice", "secret"), "GET", "/api/whoami", None)
        .await;
    assert_eq!((s, w["name"].clone()), (200, json!("alice")));
    let conn = node
        .connect_uri(&node.uri_for("alice", "secret", "/"))
        .await;
    // exchanges
    let x = r#"{"type":"fanout","durable":true}"#;
    assert_eq!(
        api.call("PUT", "/api/exchanges/%2F/x1", Some(x)).await.0,
        201
    );
    assert_eq!(
        api.call("PUT", "/api/exchanges/%2F/x1", Some(x)).await.0,
        204
    );
    assert_eq!(
        api.call("PUT", "/api/exchanges/%2F/x1", Some(r#"{"type":"direct"}"#))
            .await
            .0,
        400
    );
    assert_eq!(
        api.call("GET", "/api/exchanges/%2F/x1", None).await.1["type"],
        "fanout"
    );
    assert_eq!(
        api.call("GET", "/api/exchanges/%2F/nope", None).await.0,
        404
    );
    assert_eq!(api.call("GET", "/api/exchanges/nowhere", None).await.0, 404);
    // queues
    let q = r#"{"durable":true,"arguments":{"x-max-length":100}}"#;
    assert_eq!(api.call("PUT", "/api/queues/%2F/q1", Some(q)).await.0, 201);
    assert_eq!(api.call("PUT", "/api/queues/%2F/q1", Some(q)).await.0, 204);
    assert!(queue_exists(&conn, "q1").await);
    // bindings
    let (s, _) = api
        .call(
            "POST",
            "/api/bindings/%2F/e/x1/q/q1",
            Some(r#"{"routing_key":"r"}"#),
        )
        .await;
    assert_eq!(s, 201);
    let (_, b) = api.call("GET", "/api/bindings/%2F/e/x1/q/q1", None).await;
    assert_eq!(b[0]["properties_key"], "r");
    assert_eq!(
        api.call("POST", "/api/bindings/%2F/e/x1/q/none", Some("{}"))
            .await
            .0,
        404
    );
    // a message published over AMQP through the binding shows in the counts.
    let ch = open_channel(&conn).await;
    publish(&ch, "x1", "", b"hello").await;
    wait_count(&ch, "q1", 1).await;
    let (s, q1) = api.call("GET", "/api/queues/%2F/q1", None).await;
    assert_eq!(s, 200);
    assert_eq!(q1["messages"], 1);
    assert_eq!(q1["messages_ready"], 1);
    assert_eq!(q1["arguments"], json!({"x-max-length": 100}));
    assert_eq!(q1["state"], "running");
    assert_eq!(
        api.call("GET", "/api/overview", None).await.1["queue_totals"]["messages"],
        1
    );
    assert_eq!(api.call("GET", "/api/queues/%2F/none", None).await.0, 404);
    // policies
    let pol = r#"{"pattern":"^q","definition":{"max-length":5},"apply-to":"queues"}"#;
    assert_eq!(
        api.call("PUT", "/api/policies/%2F/cap", Some(pol)).await.0,
        201
    );
    assert_eq!(
        api.call("PUT", "/api/policies/%2F/cap", Some(pol)).await.0,
        204
    );
    assert_eq!(
        api.call("PUT", "/api/policies/%2F/bad", Some("{}")).await.0,
        400
    );
    assert_eq!(
        api.call("GET", "/api/queues/%2F/q1", None).await.1["policy"],
        "cap"
    );
    assert_eq!(
        api.call("GET", "/api/policies/%2F/cap", None).await.1["definition"],
        json!({"max-length": 5})
    );
    assert_eq!(
        api.call("DELETE", "/api/policies/%2F/cap", None).await.0,
        204
    );
    assert_eq!(
        api.call("DELETE", "/api/policies/%2F/cap", None).await.0,
        404
    );
    // deletes
    assert_eq!(
        api.call("DELETE", "/api/bindings/%2F/e/x1/q/q1/r", None)
            .await
            .0,
        204
    );
    assert_eq!(api.call("DELETE", "/api/queues/%2F/q1", None).await.0, 204);
    assert_eq!(api.call("DELETE", "/api/queues/%2F/q1", None).await.0, 404);
    assert_eq!(
        api.call("DELETE", "/api/exchanges/%2F/x1", None).await.0,
        204
    );
    assert_eq!(
        api.call("DELETE", "/api/exchanges/%2F/x1", None).await.0,
        404
    );
    assert_eq!(api.call("DELETE", "/api/users/alice", None).await.0, 204);
    assert_eq!(api.call("DELETE", "/api/users/alice", None).await.0, 404);
    assert_eq!(api.call("GET", "/api/no-such-thing", None).await.0, 404);
    assert_eq!(api.call("PATCH", "/api/overview", None).await.0, 405);
    node.shutdown().await;
}

/// GET `path` without credentials: status, `Content-Type`, body.
fn fetch(base: &str, path: &str) -> (u16, String, String) {
    let resp = match ureq::get(&format!("{base}{path}")).call() {
        Ok(r) => r,
        Err(ureq::Error::Status(_, r)) => r,
        Err(e) => panic!("GET {path}: {e}"),
    };
    let status = resp.status();
    let kind = resp.header("content-type").unwrap_or_default().to_string();
    (status, kind, resp.into_string().expect("body"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_console_is_served_at_the_root_without_credentials() {
    let (node, api) = start().await;
    let base = api.base.clone();
    let answers = tokio::task::spawn_blocking(move || {
        ["/", "/app.js", "/console.css", "/nothing.html"].map(|p| fetch(&base, p))
    })
    .await
    .expect("http task");
    let [(s, kind, page), (js_status, js, _), (css_status, css, _), (missing, _, _)] = answers;
    assert_eq!((s, kind.as_str()), (200, "text/html; charset=utf-8"));
    assert!(page.contains("<script src=\"app.js\""), "{page}");
    assert_eq!(
        (js_status, js.as_str()),
        (200, "text/javascript; charset=utf-8")
    );
    assert_eq!((css_status, css.as_str()), (200, "text/css; charset=utf-8"));
    assert_eq!(
        missing, 404,
        "a mistyped page is 404, not a password prompt"
    );
    // The API still wants credentials.
    let (s, _) = api
        .call_as(("guest", "wrong"), "GET", "/api/overview", None)
        .await;
    assert_eq!(s, 401);
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_empty_listen_turns_the_listener_off() {
    let node = TestNode::start_with(|c| c.management.listen = String::new()).await;
    let mut node = node;
    let node = node.take_node();
    assert_eq!(node.mgmt_addr(), None);
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn definitions_export_and_import_over_http() {
    let (node, api) = start().await;
    let x = r#"{"type":"topic","durable":true}"#;
    assert_eq!(
        api.call("PUT", "/api/exchanges/%2F/dx", Some(x)).await.0,
        201
    );
    assert_eq!(
        api.call("PUT", "/api/queues/%2F/dq", Some("{}")).await.0,
        201
    );
    let bind = r#"{"routing_key":"a.*"}"#;
    assert_eq!(
        api.call("POST", "/api/bindings/%2F/e/dx/q/dq", Some(bind))
            .await
            .0,
        201
    );
    let (s, defs) = api.call("GET", "/api/definitions", None).await;
    assert_eq!(s, 200);
    assert_eq!(defs["queues"][0]["name"], "dq");
    assert_eq!(
        api.call_as(("mon", "pw"), "GET", "/api/definitions", None)
            .await
            .0,
        401
    );
    // Deleted, then imported back from the export.
    assert_eq!(api.call("DELETE", "/api/queues/%2F/dq", None).await.0, 204);
    assert_eq!(
        api.call("DELETE", "/api/exchanges/%2F/dx", None).await.0,
        204
    );
    let text = defs.to_string();
    assert_eq!(
        api.call("POST", "/api/definitions", Some(&text)).await.0,
        204
    );
    let (_, b) = api.call("GET", "/api/bindings/%2F/e/dx/q/dq", None).await;
    assert_eq!(b[0]["routing_key"], "a.*");
    assert_eq!(
        api.call("POST", "/api/definitions", Some("{]")).await.0,
        400
    );
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn any_node_of_a_cluster_answers_for_the_whole_cluster() {
    use common::procs;
    let cluster = procs::Cluster::start("mgmt").await;
    let api = |id: u64| Api {
        base: format!("http://{}:15672", cluster.node(id).ip),
    };
    // A queue on node 1 with messages in it, published over AMQP on node 1.
    let conn = procs::connect(&cluster.node(1).amqp_uri()).await;
    let ch = procs::channel(&conn).await;
    procs::declare(&ch, "on1", true, procs::locator("client-local"))
        .await
        .expect("declare on node 1");
    within(
        "confirm.select",
        ch.confirm_select(lapin::options::ConfirmSelectOptions::default()),
    )
    .await
    .expect("confirm.select");
    for _ in 0..3 {
        assert!(procs::publish_acked(&ch, "", "on1", b"m").await);
    }
    // Node 3 lists it with node 1's live counts.
    let (s, q) = api(3).call("GET", "/api/queues/%2F/on1", None).await;
    assert_eq!(s, 200);
    assert_eq!(q["node"], "warren1@test");
    assert_eq!(q["messages"], 3);
    // Every node sees the three nodes running.
    let (s, nodes) = api(2).call("GET", "/api/nodes", None).await;
    assert_eq!(s, 200);
    assert_eq!(nodes.as_array().unwrap().len(), 3, "{nodes}");
    assert!(nodes
        .as_array()
        .unwrap()
        .iter()
        .all(|n| n["running"] == true));
    // A change made through node 2 is committed through Raft and seen on node 3.
    assert_eq!(api(2).call("PUT", "/api/vhosts/shared", None).await.0, 201);
    // (Node 3 applies the Raft entry a moment after the leader answers node 2.)
    let api3 = api(3);
    eventually("node 3 sees the vhost", || async {
        api3.call("GET", "/api/vhosts/shared", None).await.0 == 200
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_checks_follow_alarms_listeners_and_cluster_state() {
    use common::procs;
    let mut cluster = procs::Cluster::start("health").await;
    let bases: Vec<String> = (1..=3)
        .map(|id| format!("http://{}:15672", cluster.node(id).ip))
        .collect();
    let api = |id: u64| Api {
        base: bases[id as usize - 1].clone(),
    };
    for check in [
        "alarms",
        "local-alarms",
        "virtual-hosts",
        "node-is-quorum-critical",
        "node-is-mirror-sync-critical",
        "port-listener/5672",
        "port-listener/15692",
        "protocol-listener/amqp",
        "protocol-listener/clustering",
    ] {
        let (s, b) = api(1)
            .call("GET", &format!("/api/health/checks/{check}"), None)
            .await;
        assert_eq!((s, &b["status"]), (200, &json!("ok")), "{check}: {b}");
    }
    let (s, b) = api(1)
        .call("GET", "/api/health/checks/port-listener/4", None)
        .await;
    assert_eq!((s, &b["missing"]), (503, &json!(4)), "{b}");
    // A queue mastered on node 1 with its mirrors synchronised: not sync-critical.
    cluster.set_ha_policy(procs::ALL_AUTOMATIC).await;
    let conn = procs::connect(&cluster.node(1).amqp_uri()).await;
    let ch = procs::channel(&conn).await;
    procs::declare(&ch, "ha.h", true, procs::locator("client-local"))
        .await
        .expect("declare on node 1");
    eventually("both mirrors synchronised", || async {
        let (_, q) = api(1).call("GET", "/api/queues/%2F/ha.h", None).await;
        q["synchronised_slave_nodes"]
            .as_array()
            .is_some_and(|a| a.len() == 2)
    })
    .await;
    assert_eq!(
        api(1)
            .call(
                "GET",
                "/api/health/checks/node-is-mirror-sync-critical",
                None
            )
            .await
            .0,
        200
    );
    // Queue actions: a sync of the mirrored queue commits through Raft (a refused command
    // would be a 400), as does its cancel.
    for action in ["sync", "cancel_sync"] {
        let body = format!(r#"{{"action":"{action}"}}"#);
        let (s, b) = api(2)
            .call("POST", "/api/queues/%2F/ha.h/actions", Some(&body))
            .await;
        assert_eq!(s, 204, "{action}: {b}");
    }
    drop(ch);
    drop(conn);
    // Node 3 dies: stopping node 1 now would leave the metadata without a majority, and
    // node 1's queue with one synchronised mirror (node 2) still up.
    cluster.nodes[2].kill();
    eventually("node 1 is quorum-critical once node 3 is down", || async {
        let (s, b) = api(1)
            .call("GET", "/api/health/checks/node-is-quorum-critical", None)
            .await;
        s == 503 && b["status"] == "failed"
    })
    .await;
    assert_eq!(
        api(1)
            .call(
                "GET",
                "/api/health/checks/node-is-mirror-sync-critical",
                None
            )
            .await
            .0,
        200
    );
    // Node 2 dies too: no synchronised mirror on a running node is left.
    cluster.nodes[1].kill();
    eventually(
        "node 1 is mirror-sync-critical once both mirrors' nodes are down",
        || async {
            let (s, b) = api(1)
                .call(
                    "GET",
                    "/api/health/checks/node-is-mirror-sync-critical",
                    None,
                )
                .await;
            s == 503 && b["queues"] == json!([{"name": "ha.h", "vhost": "/"}])
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_channels_and_consumers_are_listed_with_rabbitmqs_fields() {
    let (node, api) = start().await;
    let conn = node.connect().await;
    let ch = open_channel(&conn).await;
    declare_queue(&ch, "lq").await;
    within(
        "basic.qos",
        ch.basic_qos(7, lapin::options::BasicQosOptions::default()),
    )
    .await
    .expect("qos");
    // Kept: lapin cancels a consumer whose handle is dropped.
    let _consumer = within(
        "basic.consume",
        ch.basic_consume(
            "lq".into(),
            "ctag1".into(),
            lapin::options::BasicConsumeOptions::default(),
            lapin::types::FieldTable::default(),
        ),
    )
    .await
    .expect("consume");
    let (s, conns) = api.call("GET", "/api/connections", None).await;
    assert_eq!(s, 200);
    let c = &conns[0];
    assert_eq!(conns.as_array().unwrap().len(), 1, "{conns}");
    assert_eq!(
        (
            &c["user"],
            &c["vhost"],
            &c["channels"],
            &c["protocol"],
            &c["state"]
        ),
        (
            &json!("guest"),
            &json!("/"),
            &json!(1),
            &json!("AMQP 0-9-1"),
            &json!("running")
        )
    );
    let name = c["name"].as_str().unwrap().to_string();
    assert!(name.contains(" -> "), "{name}");
    assert!(c["client_properties"]["product"].is_string(), "{c}");
    let enc = name.replace(' ', "%20").replace('>', "%3E");
    let (s, one) = api
        .call("GET", &format!("/api/connections/{enc}"), None)
        .await;
    assert_eq!((s, &one["name"]), (200, &json!(name)));
    let (s, chans) = api
        .call("GET", &format!("/api/connections/{enc}/channels"), None)
        .await;
    assert_eq!(s, 200);
    assert_eq!(
        (
            &chans[0]["number"],
            &chans[0]["prefetch_count"],
            &chans[0]["consumer_count"]
        ),
        (&json!(1), &json!(7), &json!(1))
    );
    assert_eq!(chans[0]["connection_details"]["name"], json!(name));
    let (_, all) = api.call("GET", "/api/channels", None).await;
    assert_eq!(all.as_array().unwrap().len(), 1);
    let (s, cons) = api.call("GET", "/api/consumers/%2F", None).await;
    assert_eq!(s, 200);
    assert_eq!(
        (
            &cons[0]["consumer_tag"],
            &cons[0]["queue"],
            &cons[0]["ack_required"]
        ),
        (
            &json!("ctag1"),
            &json!({"name": "lq", "vhost": "/"}),
            &json!(true)
        )
    );
    assert_eq!(cons[0]["channel_details"]["connection_name"], json!(name));
    // A monitoring user sees them too; a missing one is 404; a missing vhost 404.
    let (s, m) = api
        .call_as(("mon", "pw"), "GET", "/api/vhosts/%2F/connections", None)
        .await;
    assert_eq!((s, m.as_array().unwrap().len()), (200, 1));
    assert_eq!(api.call("GET", "/api/connections/nope", None).await.0, 404);
    assert_eq!(api.call("GET", "/api/consumers/nope", None).await.0, 404);
    // Gone from the listings once closed.
    within("close", conn.close(200, "bye".into()))
        .await
        .expect("close");
    eventually("the connection is gone from the listing", || async {
        let (_, c) = api.call("GET", "/api/connections", None).await;
        c.as_array().is_some_and(|a| a.is_empty())
    })
    .await;
    node.shutdown().await;
}

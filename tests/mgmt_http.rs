//! The management HTTP API over real HTTP against a real node: every endpoint's success and
//! failure codes, basic auth and tags, and counts that follow AMQP traffic.

mod common;

use amq_protocol::protocol::{connection, AMQPClass};
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

fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("a clock after 1970")
        .as_millis() as u64
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
        json!({"error": "not_authorized", "reason": "Login failed"})
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
    // Its listeners with the addresses they are bound to, and its web context.
    let listener = |protocol: &str| {
        o["listeners"]
            .as_array()
            .and_then(|l| l.iter().find(|x| x["protocol"] == protocol))
            .unwrap_or_else(|| panic!("no {protocol} listener in {o}"))
            .clone()
    };
    let amqp = listener("amqp");
    assert_eq!(
        (
            &amqp["ip_address"],
            &amqp["port"],
            &amqp["socket_opts"]["nodelay"]
        ),
        (
            &json!(node.addr.ip().to_string()),
            &json!(node.addr.port()),
            &json!(true)
        ),
        "{o}"
    );
    let http = listener("http");
    assert_eq!(http["port"], node.mgmt_addr().port(), "{o}");
    let prometheus = listener("http/prometheus");
    assert_eq!(
        o["contexts"],
        json!([{"node": o["node"], "description": "RabbitMQ Management", "path": "/",
                "port": node.mgmt_addr().port().to_string()},
               {"node": o["node"], "description": "RabbitMQ Prometheus", "path": "/",
                "port": prometheus["port"].to_string()}])
    );
    let (s, n) = api.call("GET", "/api/nodes", None).await;
    assert_eq!((s, n[0]["running"].clone()), (200, json!(true)));
    assert_eq!(n[0]["contexts"], o["contexts"]);
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
    // A file of RabbitMQ 3.11 on gives vhosts their description and tags (at the top, or
    // in `metadata`).
    let newer = r#"{"vhosts":[
        {"name":"v311","description":"from 3.11","tags":["x"],"default_queue_type":"classic"},
        {"name":"v312","metadata":{"description":"in metadata","tags":["y","z"]}}]}"#;
    assert_eq!(
        api.call("POST", "/api/definitions", Some(newer)).await.0,
        204
    );
    for (name, description, tags) in [
        ("v311", "from 3.11", json!(["x"])),
        ("v312", "in metadata", json!(["y", "z"])),
    ] {
        let (s, v) = api.call("GET", &format!("/api/vhosts/{name}"), None).await;
        assert_eq!(s, 200, "{v}");
        assert_eq!(
            (&v["description"], &v["tags"]),
            (&json!(description), &tags)
        );
    }
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_vhosts_definitions_export_and_import_over_http() {
    let (node, api) = start().await;
    for (path, body) in [
        ("/api/vhosts/src", "{}"),
        ("/api/vhosts/dst", "{}"),
        ("/api/exchanges/src/events", r#"{"type":"topic"}"#),
        ("/api/exchanges/src/audit", r#"{"type":"fanout"}"#),
        (
            "/api/queues/src/orders",
            r#"{"arguments":{"x-max-length":10}}"#,
        ),
        (
            "/api/policies/src/cap",
            r#"{"pattern":"^orders$","definition":{"max-length":5}}"#,
        ),
    ] {
        assert_eq!(api.call("PUT", path, Some(body)).await.0, 201, "{path}");
    }
    for (path, key) in [
        ("/api/bindings/src/e/events/q/orders", "order.*"),
        ("/api/bindings/src/e/events/e/audit", "#"),
    ] {
        let body = format!(r#"{{"routing_key":"{key}"}}"#);
        assert_eq!(api.call("POST", path, Some(&body)).await.0, 201, "{path}");
    }
    let (s, defs) = api.call("GET", "/api/definitions/src", None).await;
    assert_eq!(s, 200);
    assert_eq!(
        defs["queues"],
        json!([{"name": "orders", "durable": true,
        "auto_delete": false, "arguments": {"x-max-length": 10}}])
    );
    assert_eq!(defs["bindings"].as_array().unwrap().len(), 2);
    assert!(defs["bindings"][0].get("vhost").is_none());
    // Into another vhost: the same objects there, and they route.
    let text = defs.to_string();
    assert_eq!(
        api.call("POST", "/api/definitions/dst", Some(&text))
            .await
            .0,
        204
    );
    let (_, q) = api.call("GET", "/api/queues/dst/orders", None).await;
    assert_eq!(
        (q["policy"].clone(), q["arguments"].clone()),
        (json!("cap"), json!({"x-max-length": 10}))
    );
    let (_, b) = api
        .call("GET", "/api/bindings/dst/e/events/e/audit", None)
        .await;
    assert_eq!(b[0]["routing_key"], "#");
    let publish =
        r#"{"properties":{},"routing_key":"order.1","payload":"x","payload_encoding":"string"}"#;
    let (s, routed) = api
        .call("POST", "/api/exchanges/dst/events/publish", Some(publish))
        .await;
    assert_eq!((s, routed), (200, json!({"routed": true})));
    let (s, _) = api.call("GET", "/api/definitions/nowhere", None).await;
    assert_eq!(s, 400);
    let (s, _) = api
        .call("POST", "/api/definitions/nowhere", Some("{}"))
        .await;
    assert_eq!(s, 404);
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleting_permissions_takes_a_users_access_to_a_vhost() {
    let (node, api) = start().await;
    assert_eq!(api.call("PUT", "/api/vhosts/pv", Some("{}")).await.0, 201);
    let all = r#"{"configure":".*","write":".*","read":".*"}"#;
    assert_eq!(
        api.call("PUT", "/api/permissions/pv/mon", Some(all))
            .await
            .0,
        201
    );
    let (s, list) = api.call("GET", "/api/vhosts/pv/permissions", None).await;
    // The creator (guest) and mon.
    assert_eq!((s, list.as_array().unwrap().len()), (200, 2));
    let (_, mine) = api.call("GET", "/api/users/mon/permissions", None).await;
    assert_eq!(mine.as_array().unwrap().len(), 2);
    let mon_uri = node.uri_for("mon", "pw", "pv");
    let conn = node.connect_uri(&mon_uri).await;
    drop(conn);
    assert_eq!(
        api.call("DELETE", "/api/permissions/pv/mon", None).await.0,
        204
    );
    assert_eq!(
        api.call("GET", "/api/permissions/pv/mon", None).await.0,
        404
    );
    assert_eq!(
        api.call("DELETE", "/api/permissions/pv/mon", None).await.0,
        404
    );
    // Without permissions, mon cannot open the vhost over AMQP any more.
    assert!(node.try_connect_uri(&mon_uri).await.is_err());
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
    // With node 1's figures: three 1-byte persistent messages in RAM.
    assert_eq!(
        (
            &q["message_bytes"],
            &q["messages_persistent"],
            &q["message_bytes_persistent"],
            &q["messages_ram"],
            &q["messages_paged_out"]
        ),
        (&json!(3), &json!(3), &json!(3), &json!(3), &json!(0)),
        "{q}"
    );
    // And so does its listing of the vhost (counts fetched for that vhost alone).
    let (s, list) = api(3).call("GET", "/api/queues/%2F", None).await;
    assert_eq!(s, 200);
    let on1: Vec<&Value> = list
        .as_array()
        .unwrap()
        .iter()
        .filter(|q| q["name"] == "on1")
        .collect();
    assert_eq!(on1.len(), 1, "{list}");
    assert_eq!(on1[0]["messages"], 3, "{list}");
    assert_eq!(on1[0]["message_bytes_ready"], 3, "{list}");
    // Published through node 3's API, fetched through node 2's: both relayed to node 1.
    let (s, r) = api(3)
        .call(
            "POST",
            "/api/exchanges/%2F/amq.default/publish",
            Some(r#"{"properties":{},"routing_key":"on1","payload":"via3","payload_encoding":"string"}"#),
        )
        .await;
    assert_eq!((s, r), (200, json!({"routed": true})));
    let (s, got) = api(2)
        .call(
            "POST",
            "/api/queues/%2F/on1/get",
            Some(r#"{"count":10,"ackmode":"ack_requeue_true","encoding":"auto"}"#),
        )
        .await;
    assert_eq!(s, 200, "{got}");
    let payloads: Vec<&str> = got
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["payload"].as_str().unwrap())
        .collect();
    assert_eq!(payloads, ["m", "m", "m", "via3"]);
    // Node 3 shows a consumer on node 1 in the queue's `consumer_details`.
    procs::declare(&ch, "on1c", true, procs::locator("client-local"))
        .await
        .expect("declare on1c");
    let _consumer = within(
        "basic.consume",
        ch.basic_consume(
            "on1c".into(),
            "c-on1".into(),
            lapin::options::BasicConsumeOptions {
                exclusive: true,
                ..lapin::options::BasicConsumeOptions::default()
            },
            lapin::types::FieldTable::default(),
        ),
    )
    .await
    .expect("consume");
    // (Node 3 applies the declare's Raft entry a moment after node 1 answers it.)
    let api3 = api(3);
    eventually("node 3 knows on1c", || async {
        api3.call("GET", "/api/queues/%2F/on1c", None).await.0 == 200
    })
    .await;
    let (s, q) = api3.call("GET", "/api/queues/%2F/on1c", None).await;
    assert_eq!(s, 200, "{q}");
    let details = q["consumer_details"].as_array().expect("consumer_details");
    assert_eq!(details.len(), 1, "{q}");
    assert_eq!(
        (
            &details[0]["consumer_tag"],
            &details[0]["channel_details"]["node"]
        ),
        (&json!("c-on1"), &json!("warren1@test")),
        "{q}"
    );
    // Node 1's exclusive consumer, in node 1's figures (the relay carries them).
    assert_eq!(q["exclusive_consumer_tag"], "c-on1", "{q}");
    // Node 3's overview lists every node's listeners, each at its own address.
    let (s, o) = api(3).call("GET", "/api/overview", None).await;
    assert_eq!(s, 200);
    let amqp: Vec<(String, String)> = o["listeners"]
        .as_array()
        .expect("listeners")
        .iter()
        .filter(|l| l["protocol"] == "amqp")
        .map(|l| {
            (
                l["node"].as_str().unwrap_or_default().to_string(),
                l["ip_address"].as_str().unwrap_or_default().to_string(),
            )
        })
        .collect();
    let want: Vec<(String, String)> = (1..=3)
        .map(|i| (format!("warren{i}@test"), cluster.node(i).ip.to_string()))
        .collect();
    let mut got = amqp.clone();
    got.sort();
    assert_eq!(got, want, "{o}");
    // Node 1's node object, as node 3 shows it, carries node 1's web context.
    let (_, n1) = api(3).call("GET", "/api/nodes/warren1@test", None).await;
    assert_eq!(n1["contexts"][0]["node"], "warren1@test", "{n1}");
    assert_eq!(n1["contexts"][0]["port"], "15672", "{n1}");
    // Node 3 lists node 1's client connection (and its channel), naming node 1.
    let (s, conns) = api(3).call("GET", "/api/connections", None).await;
    assert_eq!(s, 200);
    let on1: Vec<&Value> = conns
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| c["node"] == "warren1@test")
        .collect();
    assert_eq!(on1.len(), 1, "{conns}");
    // Its start time and socket counts came over the node link with it.
    assert!(on1[0]["connected_at"].as_u64() > Some(0), "{conns}");
    assert!(on1[0]["recv_oct"].as_u64() > Some(0), "{conns}");
    assert!(on1[0]["send_cnt"].as_u64() > Some(0), "{conns}");
    let name = on1[0]["name"].as_str().unwrap().to_string();
    let (_, chans) = api(3).call("GET", "/api/channels", None).await;
    assert!(
        chans
            .as_array()
            .unwrap()
            .iter()
            .any(|c| c["node"] == "warren1@test" && c["connection_details"]["name"] == name),
        "{chans}"
    );
    // Closed through node 2's API: node 1 closes it.
    let enc = name.replace(' ', "%20").replace('>', "%3E");
    let (s, _) = api(2)
        .call("DELETE", &format!("/api/connections/{enc}"), None)
        .await;
    assert_eq!(s, 204);
    let api1 = api(1);
    eventually("node 1's connection is gone", || async {
        let (_, c) = api1.call("GET", "/api/connections", None).await;
        !c.as_array()
            .unwrap()
            .iter()
            .any(|c| c["name"] == name.as_str())
    })
    .await;
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

/// `GET /api/nodes` on any node shows every running node's own figures, fetched from that
/// node over the node links: its process id, files, sockets and descriptors. A node that is
/// down shows name, type and `running: false` only, as a stopped node in RabbitMQ.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_node_object_carries_that_nodes_own_figures() {
    use common::procs;
    let mut cluster = procs::Cluster::start("nodes").await;
    let api2 = Api {
        base: format!("http://{}:15672", cluster.node(2).ip),
    };
    // Two clients on node 3, none elsewhere.
    let _c1 = procs::connect(&cluster.node(3).amqp_uri()).await;
    let _c2 = procs::connect(&cluster.node(3).amqp_uri()).await;
    let (s, nodes) = api2.call("GET", "/api/nodes", None).await;
    assert_eq!(s, 200);
    let nodes = nodes.as_array().expect("a list").clone();
    assert_eq!(nodes.len(), 3, "{nodes:?}");
    for id in 1..=3u64 {
        let proc = cluster.node(id);
        let n = nodes
            .iter()
            .find(|n| n["name"] == format!("warren{id}@test"))
            .unwrap_or_else(|| panic!("node {id} listed: {nodes:?}"));
        let pid = proc.child.as_ref().expect("running").id();
        assert_eq!(n["os_pid"], json!(pid.to_string()), "node {id}: {n}");
        let config = std::fs::canonicalize(&proc.config).expect("config path");
        assert_eq!(
            n["config_files"],
            json!([config.display().to_string()]),
            "{n}"
        );
        let data = cluster.dir.join(format!("data{id}"));
        assert_eq!(n["db_dir"], json!(data.display().to_string()), "{n}");
        assert_eq!(
            n["sockets_used"],
            json!(if id == 3 { 2 } else { 0 }),
            "node {id}: {n}"
        );
        let fds = n["fd_used"].as_u64().expect("fd_used");
        assert!(
            fds > 2 && fds < n["fd_total"].as_u64().expect("fd_total"),
            "{n}"
        );
        assert!(n["mem_used"].as_u64().expect("mem_used") > 1 << 20, "{n}");
        assert!(n["uptime"].as_u64().expect("uptime") > 0, "{n}");
        assert_eq!(n["running"], true);
        // Each node's own storage I/O counts (their values: the single-node test).
        for f in ["io_write_count", "io_sync_count", "msg_store_write_count"] {
            assert!(n[f].is_u64(), "{f} of node {id}: {n}");
        }
        assert_eq!(n["contexts"][0]["port"], "15672", "{n}");
        // Its links to the two others, each at the other's address, bytes both ways.
        let mut links: Vec<(String, String)> = n["cluster_links"]
            .as_array()
            .unwrap_or_else(|| panic!("cluster_links of node {id}: {n}"))
            .iter()
            .map(|l| {
                assert!(l["send_bytes"].as_u64() > Some(0), "{l}");
                assert!(l["recv_bytes"].as_u64() > Some(0), "{l}");
                assert_eq!(l["sock_addr"], json!(proc.ip.to_string()), "{l}");
                (
                    l["name"].as_str().unwrap_or_default().to_string(),
                    l["peer_addr"].as_str().unwrap_or_default().to_string(),
                )
            })
            .collect();
        links.sort();
        let others: Vec<(String, String)> = (1..=3u64)
            .filter(|&j| j != id)
            .map(|j| (format!("warren{j}@test"), cluster.node(j).ip.to_string()))
            .collect();
        assert_eq!(links, others, "node {id}: {n}");
    }
    // Node 3 killed: once it is recorded down it is listed stopped, without figures.
    cluster.nodes[2].kill();
    eventually("node 3 listed as stopped", || async {
        let (_, nodes) = api2.call("GET", "/api/nodes/warren3@test", None).await;
        nodes["running"] == false
    })
    .await;
    let (_, n3) = api2.call("GET", "/api/nodes/warren3@test", None).await;
    assert_eq!(
        n3,
        json!({"name": "warren3@test", "type": "disc", "running": false})
    );
    let (_, n2) = api2.call("GET", "/api/nodes/warren2@test", None).await;
    assert!(n2["mem_used"].as_u64().is_some(), "{n2}");
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
    let before_ms = unix_ms();
    let conn = node.connect().await;
    let after_ms = unix_ms();
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
    // When it was accepted (wall clock, ms), and its socket's traffic: the handshake and
    // the methods so far, then two 20 kB bodies in (the first unroutable) and one out.
    let at = c["connected_at"].as_u64().expect("connected_at");
    assert!(
        (before_ms..=after_ms).contains(&at),
        "{at} not in {before_ms}..={after_ms}"
    );
    let octets = |c: &Value| (c["recv_oct"].as_u64(), c["send_oct"].as_u64());
    let (Some(recv0), Some(sent0)) = octets(c) else {
        panic!("no octet counts in {c}");
    };
    assert!(recv0 > 8 && sent0 > 0, "{c}");
    assert!(
        c["recv_cnt"].as_u64() >= Some(1) && c["send_cnt"].as_u64() >= Some(1),
        "{c}"
    );
    let body = vec![7u8; 20_000];
    publish(&ch, "", "lq-bytes", &body).await;
    declare_queue(&ch, "lq-bytes").await;
    publish(&ch, "", "lq-bytes", &body).await;
    let got = get(&ch, "lq-bytes", true).await.expect("the message");
    assert_eq!(got.delivery.data.len(), body.len());
    // (A write is counted once the call returns, which can be after the client has read
    // its bytes.)
    eventually("two bodies in and one out are counted", || async {
        let (_, conns) = api.call("GET", "/api/connections", None).await;
        let (Some(recv1), Some(sent1)) = octets(&conns[0]) else {
            panic!("no octet counts in {conns}");
        };
        recv1 >= recv0 + 40_000 && sent1 >= sent0 + 20_000
    })
    .await;
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
    // The channel's and the queue's own objects carry the consumer as /api/consumers
    // shows it (RabbitMQ's `consumer_details`); the channel listing does not.
    let chan = chans[0]["name"].as_str().unwrap().replace(' ', "%20");
    let chan = chan
        .replace('>', "%3E")
        .replace('(', "%28")
        .replace(')', "%29");
    let (s, one) = api
        .call("GET", &format!("/api/channels/{chan}"), None)
        .await;
    assert_eq!(s, 200, "{one}");
    assert_eq!(one["consumer_details"], json!([cons[0].clone()]), "{one}");
    assert_eq!(cons[0]["prefetch_count"], json!(7));
    assert!(all[0].get("consumer_details").is_none(), "{all}");
    let (s, q) = api.call("GET", "/api/queues/%2F/lq", None).await;
    assert_eq!(s, 200, "{q}");
    assert_eq!(q["consumer_details"], json!([cons[0].clone()]), "{q}");
    declare_queue(&ch, "idle").await;
    let (_, q) = api.call("GET", "/api/queues/%2F/idle", None).await;
    assert_eq!(q["consumer_details"], json!([]), "{q}");
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

/// `head_message_timestamp`, `exclusive_consumer_tag` and `single_active_consumer_tag`, as
/// RabbitMQ 3.10 shows them, on a queue's page and in the listing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queue_shows_its_head_timestamp_and_its_exclusive_or_active_consumer() {
    use lapin::options::{BasicConsumeOptions, BasicPublishOptions};
    use lapin::BasicProperties;
    let node = TestNode::start().await;
    let api = Api {
        base: format!("http://{}", node.mgmt_addr()),
    };
    let conn = node.connect().await;
    let ch = confirm_channel(&conn).await;
    for (name, body) in [
        ("ts", r#"{"durable":true}"#),
        ("excl", r#"{"durable":true}"#),
        (
            "sac",
            r#"{"durable":true,"arguments":{"x-single-active-consumer":true}}"#,
        ),
    ] {
        let path = format!("/api/queues/%2F/{name}");
        assert_eq!(api.call("PUT", &path, Some(body)).await.0, 201);
    }
    for stamp in [1_700_000_000u64, 1_600_000_000] {
        let confirm = within(
            "basic.publish",
            ch.basic_publish(
                "".into(),
                "ts".into(),
                BasicPublishOptions::default(),
                b"m",
                BasicProperties::default().with_timestamp(stamp),
            ),
        )
        .await
        .expect("publish");
        within("confirm", confirm).await.expect("confirm");
    }
    let page = |name: &'static str| {
        let api = &api;
        async move {
            let (s, q) = api
                .call("GET", &format!("/api/queues/%2F/{name}"), None)
                .await;
            assert_eq!(s, 200, "{q}");
            q
        }
    };
    assert_eq!(page("ts").await["head_message_timestamp"], 1_700_000_000u64);
    // The head goes out unacknowledged: the smaller of the next one's and its.
    get(&ch, "ts", false).await.expect("the head");
    assert_eq!(page("ts").await["head_message_timestamp"], 1_600_000_000u64);
    let consume = |queue: &'static str, tag: &'static str, exclusive: bool| {
        let ch = ch.clone();
        async move {
            within(
                "basic.consume",
                ch.basic_consume(
                    queue.into(),
                    tag.into(),
                    BasicConsumeOptions {
                        exclusive,
                        ..BasicConsumeOptions::default()
                    },
                    lapin::types::FieldTable::default(),
                ),
            )
            .await
            .expect("consume")
        }
    };
    let _solo = consume("excl", "solo", true).await;
    let _one = consume("sac", "one", false).await;
    let _two = consume("sac", "two", false).await;
    let tags = |q: &Value| {
        (
            q["exclusive_consumer_tag"].clone(),
            q["single_active_consumer_tag"].clone(),
        )
    };
    assert_eq!(tags(&page("excl").await), (json!("solo"), Value::Null));
    assert_eq!(tags(&page("sac").await), (Value::Null, json!("one")));
    assert_eq!(tags(&page("ts").await), (Value::Null, Value::Null));
    // The listing, written apart from the page, shows the same.
    let (s, list) = api.call("GET", "/api/queues/%2F", None).await;
    assert_eq!(s, 200);
    let row = |name: &str| {
        list.as_array()
            .and_then(|l| l.iter().find(|q| q["name"] == name))
            .unwrap_or_else(|| panic!("{name} not in {list}"))
            .clone()
    };
    assert_eq!(tags(&row("excl")), (json!("solo"), Value::Null));
    assert_eq!(tags(&row("sac")), (Value::Null, json!("one")));
    assert_eq!(row("ts")["head_message_timestamp"], 1_600_000_000u64);
    assert_eq!(row("ts")["recoverable_slaves"], Value::Null);
}

/// A node object counts its storage's file I/O (RabbitMQ's `io_*`, `msg_store_*` and
/// `queue_index_*` fields), and its Prometheus endpoint shows the same counters.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_object_counts_its_storage_io() {
    use lapin::{options::BasicPublishOptions, BasicProperties};
    let node = TestNode::start().await;
    let api = Api {
        base: format!("http://{}", node.mgmt_addr()),
    };
    let conn = node.connect().await;
    let ch = confirm_channel(&conn).await;
    assert_eq!(
        api.call("PUT", "/api/queues/%2F/io", Some(r#"{"durable":true}"#))
            .await
            .0,
        201
    );
    let io = |n: &Value, f: &str| n[f].as_u64().unwrap_or_else(|| panic!("no {f} in {n}"));
    let (_, before) = api.call("GET", "/api/nodes", None).await;
    // Persistent messages over the index's embedding limit: each goes to the message
    // store, its record to the queue index, and both are fsynced before the confirm.
    for _ in 0..3 {
        let confirm = within(
            "basic.publish",
            ch.basic_publish(
                "".into(),
                "io".into(),
                BasicPublishOptions::default(),
                &[7u8; 8192],
                BasicProperties::default().with_delivery_mode(2),
            ),
        )
        .await
        .expect("publish");
        within("confirm", confirm).await.expect("confirm");
    }
    let (s, after) = api.call("GET", "/api/nodes", None).await;
    assert_eq!(s, 200);
    let (b, a) = (&before[0], &after[0]);
    for f in [
        "io_write_count",
        "io_sync_count",
        "msg_store_write_count",
        "queue_index_write_count",
    ] {
        assert!(io(a, f) > io(b, f), "{f}: {b} then {a}");
    }
    assert!(
        io(a, "io_write_bytes") >= io(b, "io_write_bytes") + 3 * 8192,
        "{b} then {a}"
    );
    assert!(a["io_write_avg_time"].as_f64().is_some(), "{a}");
    // The same counters, under RabbitMQ's Prometheus names.
    let (_, o) = api.call("GET", "/api/overview", None).await;
    let port = o["listeners"]
        .as_array()
        .and_then(|l| l.iter().find(|x| x["protocol"] == "http/prometheus"))
        .and_then(|x| x["port"].as_u64())
        .unwrap_or_else(|| panic!("no prometheus listener in {o}"));
    let metrics = tokio::task::spawn_blocking(move || {
        let mut s = std::net::TcpStream::connect(("127.0.0.1", port as u16)).expect("connect");
        use std::io::{Read, Write};
        s.write_all(b"GET /metrics HTTP/1.0\r\n\r\n")
            .expect("request");
        let mut text = String::new();
        s.read_to_string(&mut text).expect("answer");
        text
    })
    .await
    .expect("scrape");
    let value = |name: &str| -> u64 {
        metrics
            .lines()
            .find_map(|l| l.strip_prefix(&format!("{name} ")))
            .and_then(|v| v.trim().parse::<f64>().ok())
            .unwrap_or_else(|| panic!("no {name} in the scrape")) as u64
    };
    assert!(value("rabbitmq_io_write_ops_total") >= io(a, "io_write_count"));
    assert!(value("rabbitmq_msg_store_write_total") >= io(a, "msg_store_write_count"));
    assert!(value("rabbitmq_queue_index_write_ops_total") >= io(a, "queue_index_write_count"));
    assert!(value("rabbitmq_io_sync_ops_total") >= io(a, "io_sync_count"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queues_figures_count_bytes_persistence_ram_and_paging() {
    use lapin::{options::BasicPublishOptions, BasicProperties};
    // A paging queue keeps one message at its head in RAM.
    let node = TestNode::start_with(|c| c.storage.queue_paging_head_messages = 1).await;
    let api = Api {
        base: format!("http://{}", node.mgmt_addr()),
    };
    let conn = node.connect().await;
    let ch = confirm_channel(&conn).await;
    for (name, body) in [
        ("figs", r#"{"durable":true}"#),
        (
            "figs-lazy",
            r#"{"durable":true,"arguments":{"x-queue-mode":"lazy"}}"#,
        ),
    ] {
        let path = format!("/api/queues/%2F/{name}");
        assert_eq!(api.call("PUT", &path, Some(body)).await.0, 201);
    }
    let persistent = BasicProperties::default().with_delivery_mode(2);
    let transient = BasicProperties::default().with_delivery_mode(1);
    let publish = |queue: &'static str, body: Vec<u8>, props: BasicProperties| {
        let ch = ch.clone();
        async move {
            let confirm = within(
                "basic.publish",
                ch.basic_publish(
                    "".into(),
                    queue.into(),
                    BasicPublishOptions::default(),
                    &body,
                    props,
                ),
            )
            .await
            .expect("publish");
            within("confirm", confirm).await.expect("confirm");
        }
    };
    publish("figs", vec![1u8; 1000], persistent.clone()).await;
    publish("figs", vec![2u8; 500], transient).await;
    // The persistent head goes out unacknowledged; the transient one stays ready.
    let got = get(&ch, "figs", false).await.expect("the head");
    assert_eq!(got.delivery.data.len(), 1000);
    let (s, q) = api.call("GET", "/api/queues/%2F/figs", None).await;
    assert_eq!(s, 200, "{q}");
    let field = |q: &Value, f: &str| q[f].as_u64().unwrap_or_else(|| panic!("no {f} in {q}"));
    let expected = [
        ("messages", 2),
        ("messages_ready", 1),
        ("messages_unacknowledged", 1),
        ("message_bytes", 1500),
        ("message_bytes_ready", 500),
        ("message_bytes_unacknowledged", 1000),
        ("messages_persistent", 1),
        ("message_bytes_persistent", 1000),
        ("messages_ram", 2),
        ("messages_ready_ram", 1),
        ("messages_unacknowledged_ram", 1),
        ("message_bytes_ram", 1500),
        ("messages_paged_out", 0),
        ("message_bytes_paged_out", 0),
    ];
    for (f, n) in expected {
        assert_eq!(field(&q, f), n, "{f} in {q}");
    }
    // The listing carries the same figures.
    let (_, list) = api.call("GET", "/api/queues/%2F", None).await;
    let row = list
        .as_array()
        .and_then(|l| l.iter().find(|q| q["name"] == "figs"))
        .unwrap_or_else(|| panic!("figs not in {list}"));
    assert_eq!(field(row, "message_bytes_unacknowledged"), 1000, "{row}");
    // A lazy queue pages out all but its head: those messages leave RAM once on disk.
    for _ in 0..4 {
        publish("figs-lazy", vec![3u8; 2000], persistent.clone()).await;
    }
    let lazy = "/api/queues/%2F/figs-lazy";
    eventually("the lazy queue's messages are paged out", || async {
        let (_, q) = api.call("GET", lazy, None).await;
        q["messages_paged_out"] == 3
    })
    .await;
    let (_, q) = api.call("GET", lazy, None).await;
    for (f, n) in [
        ("messages", 4),
        ("messages_ram", 1),
        ("message_bytes_ram", 2000),
        ("message_bytes_paged_out", 6000),
        ("messages_persistent", 4),
        ("message_bytes", 8000),
    ] {
        assert_eq!(field(&q, f), n, "{f} in {q}");
    }
    // The overview counts messages written to disk (five persistent ones so far) and
    // read back from it: the three paged out, as they go out.
    let stat = |o: &Value, f: &str| {
        o["message_stats"][f]
            .as_u64()
            .unwrap_or_else(|| panic!("no message_stats.{f} in {o}"))
    };
    let (_, o) = api.call("GET", "/api/overview", None).await;
    assert_eq!(stat(&o, "disk_writes"), 5, "{o}");
    let reads = stat(&o, "disk_reads");
    for _ in 0..4 {
        get(&ch, "figs-lazy", true)
            .await
            .expect("a lazy queue's message");
    }
    let (_, o) = api.call("GET", "/api/overview", None).await;
    assert_eq!(stat(&o, "disk_reads"), reads + 3, "{o}");
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publish_get_purge_and_aliveness_go_over_an_amqp_channel() {
    let (node, api) = start().await;
    assert_eq!(
        api.call("PUT", "/api/queues/%2F/pq", Some(r#"{"durable":true}"#))
            .await
            .0,
        201
    );
    let publish = |key: &str, payload: &str, enc: &str| {
        format!(
            r#"{{"properties":{{"delivery_mode":2,"headers":{{"h":"v"}},"message_id":"m1"}},
                "routing_key":"{key}","payload":"{payload}","payload_encoding":"{enc}"}}"#
        )
    };
    let path = "/api/exchanges/%2F/amq.default/publish";
    let (s, body) = api
        .call("POST", path, Some(&publish("pq", "hello", "string")))
        .await;
    assert_eq!((s, body), (200, json!({"routed": true})));
    // Binary, base64-encoded (0xff 0xfe is not UTF-8: it comes back as base64).
    let (s, body) = api
        .call("POST", path, Some(&publish("pq", "//4=", "base64")))
        .await;
    assert_eq!((s, body), (200, json!({"routed": true})));
    let (s, body) = api
        .call("POST", path, Some(&publish("nowhere", "x", "string")))
        .await;
    assert_eq!((s, body), (200, json!({"routed": false})));
    let (s, _) = api
        .call(
            "POST",
            "/api/exchanges/%2F/missing/publish",
            Some(&publish("pq", "x", "string")),
        )
        .await;
    assert_eq!(s, 404);
    let (s, body) = api
        .call(
            "POST",
            path,
            Some(r#"{"properties":{},"routing_key":"pq"}"#),
        )
        .await;
    assert_eq!(s, 400, "{body}");

    // ack_requeue_true: both shown, both still there afterwards.
    let get = |ackmode: &str| {
        format!(r#"{{"count":5,"ackmode":"{ackmode}","encoding":"auto","truncate":50000}}"#)
    };
    let (s, got) = api
        .call(
            "POST",
            "/api/queues/%2F/pq/get",
            Some(&get("ack_requeue_true")),
        )
        .await;
    assert_eq!(s, 200, "{got}");
    let got = got.as_array().expect("a list").clone();
    assert_eq!(got.len(), 2, "{got:?}");
    assert_eq!(
        got[0],
        json!({"payload_bytes": 5, "redelivered": false, "exchange": "", "routing_key": "pq",
               "message_count": 1,
               "properties": {"delivery_mode": 2, "headers": {"h": "v"}, "message_id": "m1"},
               "payload": "hello", "payload_encoding": "string"})
    );
    assert_eq!(
        (&got[1]["payload"], &got[1]["payload_encoding"]),
        (&json!("//4="), &json!("base64"))
    );
    // ack_requeue_false takes them (now redelivered).
    let (s, got) = api
        .call(
            "POST",
            "/api/queues/%2F/pq/get",
            Some(&get("ack_requeue_false")),
        )
        .await;
    assert_eq!(s, 200);
    assert_eq!(got.as_array().unwrap().len(), 2, "{got}");
    assert_eq!(got[0]["redelivered"], true);
    let (_, got) = api
        .call(
            "POST",
            "/api/queues/%2F/pq/get",
            Some(&get("ack_requeue_false")),
        )
        .await;
    assert_eq!(got, json!([]));

    // Purge.
    for _ in 0..3 {
        api.call("POST", path, Some(&publish("pq", "p", "string")))
            .await;
    }
    let (_, q) = api.call("GET", "/api/queues/%2F/pq", None).await;
    assert_eq!(q["messages"], 3, "{q}");
    assert_eq!(
        api.call("DELETE", "/api/queues/%2F/pq/contents", None)
            .await
            .0,
        204
    );
    let (_, q) = api.call("GET", "/api/queues/%2F/pq", None).await;
    assert_eq!(q["messages"], 0, "{q}");
    assert_eq!(
        api.call("DELETE", "/api/queues/%2F/missing/contents", None)
            .await
            .0,
        404
    );
    let (s, body) = api
        .call(
            "POST",
            "/api/queues/%2F/pq/get",
            Some(r#"{"count":1,"encoding":"auto"}"#),
        )
        .await;
    assert_eq!(s, 400, "{body}");

    // The aliveness test.
    let (s, body) = api.call("GET", "/api/aliveness-test/%2F", None).await;
    assert_eq!((s, body), (200, json!({"status": "ok"})));
    assert_eq!(
        api.call("GET", "/api/aliveness-test/nope", None).await.0,
        404
    );
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_channel_error_of_the_work_is_a_400_naming_the_amqp_code() {
    let node = TestNode::start_with(|c| {
        add_user(c, "ro", "pw", Some(("/", "^$", "^$", "^$")));
        c.users.last_mut().unwrap().tags = vec!["management".into()];
    })
    .await;
    let api = Api {
        base: format!("http://{}", node.mgmt_addr()),
    };
    assert_eq!(api.call("PUT", "/api/queues/%2F/locked", None).await.0, 201);
    // No read permission on the queue: the channel's 403 comes back as RabbitMQ shows it.
    let (s, body) = api
        .call_as(
            ("ro", "pw"),
            "POST",
            "/api/queues/%2F/locked/get",
            Some(r#"{"count":1,"ackmode":"ack_requeue_true","encoding":"auto"}"#),
        )
        .await;
    assert_eq!(s, 400, "{body}");
    let reason = body["reason"].as_str().unwrap_or_default().to_string();
    assert!(
        reason == "403 ACCESS_REFUSED - read access to queue 'locked' in vhost '/' refused for user 'ro'",
        "{body}"
    );
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleting_a_connection_closes_it_with_connection_forced() {
    let (node, api) = start().await;
    // A raw client: the connection.close it is sent is read as is.
    let (mut raw, _, _) = RawClient::handshake(node.addr, &RawOpts::default()).await;
    let (_, conns) = api.call("GET", "/api/connections", None).await;
    let name = conns[0]["name"].as_str().expect("a connection").to_string();
    let enc = name.replace(' ', "%20").replace('>', "%3E");
    let path = format!("/api/connections/{enc}");
    // A monitoring user that does not own it may not close it.
    let (s, body) = api.call_as(("mon", "pw"), "DELETE", &path, None).await;
    assert_eq!(
        (s, &body["reason"]),
        (401, &json!("User not authorised to access object"))
    );
    let base = api.base.clone();
    let status = tokio::task::spawn_blocking(move || {
        ureq::delete(&format!("{base}{path}"))
            .set("Authorization", &warren::mgmt::basic_auth("guest", "guest"))
            .set("X-Reason", "maintenance")
            .call()
            .map(|r| r.status())
            .unwrap_or_else(|e| panic!("DELETE: {e}"))
    })
    .await
    .unwrap();
    assert_eq!(status, 204);
    let close = within("connection.close", async {
        loop {
            match raw.next_method().await {
                Some((0, AMQPClass::Connection(connection::AMQPMethod::Close(c)))) => break c,
                Some(_) => continue,
                None => panic!("the socket closed without connection.close"),
            }
        }
    })
    .await;
    assert_eq!(
        (close.reply_code, close.reply_text.as_str()),
        (320, "CONNECTION_FORCED - maintenance")
    );
    eventually("the connection is gone from the listing", || async {
        let (_, c) = api.call("GET", "/api/connections", None).await;
        c.as_array().is_some_and(|a| a.is_empty())
    })
    .await;
    assert_eq!(
        api.call("DELETE", "/api/connections/nope", None).await.0,
        404
    );
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn users_vhosts_and_permissions_made_at_run_time_survive_a_restart() {
    let (node, api) = start().await;
    assert_eq!(
        api.call(
            "PUT",
            "/api/vhosts/rt",
            Some(r#"{"description":"run time","tags":"a, b"}"#)
        )
        .await
        .0,
        201
    );
    // A PUT of an existing vhost replaces what it gives and keeps the rest.
    assert_eq!(
        api.call("PUT", "/api/vhosts/rt", Some(r#"{"tags":["c","a"]}"#))
            .await
            .0,
        204
    );
    assert_eq!(
        api.call("PUT", "/api/vhosts/rt", Some(r#"{"description":7}"#))
            .await
            .0,
        400
    );
    assert_eq!(
        api.call(
            "PUT",
            "/api/users/rtu",
            Some(r#"{"password":"s3cret","tags":"management"}"#)
        )
        .await
        .0,
        201
    );
    assert_eq!(
        api.call(
            "PUT",
            "/api/permissions/rt/rtu",
            Some(r#"{"configure":".*","write":".*","read":".*"}"#)
        )
        .await
        .0,
        201
    );
    assert_eq!(
        api.call_as(
            ("rtu", "s3cret"),
            "PUT",
            "/api/queues/rt/kept",
            Some(r#"{"durable":true}"#)
        )
        .await
        .0,
        201
    );
    // A user of the config file whose password changed at run time keeps the new one.
    assert_eq!(
        api.call(
            "PUT",
            "/api/users/mon",
            Some(r#"{"password":"changed","tags":"monitoring"}"#)
        )
        .await
        .0,
        204
    );
    let node = node.restart().await;
    let api = Api {
        base: format!("http://{}", node.mgmt_addr()),
    };
    let (s, v) = api.call("GET", "/api/vhosts/rt", None).await;
    assert_eq!(s, 200);
    assert_eq!(
        (&v["description"], &v["tags"], &v["metadata"]),
        (
            &json!("run time"),
            &json!(["c", "a"]),
            &json!({"description": "run time", "tags": ["c", "a"]})
        ),
        "{v}"
    );
    let (s, perm) = api.call("GET", "/api/permissions/rt/rtu", None).await;
    assert_eq!((s, &perm["write"]), (200, &json!(".*")));
    let (s, q) = api
        .call_as(("rtu", "s3cret"), "GET", "/api/queues/rt/kept", None)
        .await;
    assert_eq!((s, &q["durable"]), (200, &json!(true)), "{q}");
    assert_eq!(
        api.call_as(("mon", "changed"), "GET", "/api/whoami", None)
            .await
            .0,
        200
    );
    // The user logs in over AMQP to the vhost made at run time.
    let conn = node
        .connect_uri(&format!("amqp://rtu:s3cret@{}/rt", node.addr))
        .await;
    assert!(conn.status().connected());
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operator_policies_are_for_administrators_and_cap_queues() {
    let (node, api) = start().await;
    let path = "/api/operator-policies/%2F/cap";
    let body = r#"{"pattern":"^op\\.","definition":{"max-length":2},"apply-to":"queues"}"#;
    let (s, b) = api.call_as(("mon", "pw"), "PUT", path, Some(body)).await;
    assert_eq!((s, &b["reason"]), (401, &json!("Not administrator user")));
    assert_eq!(api.call("PUT", path, Some(body)).await.0, 201);
    assert_eq!(api.call("PUT", path, Some(body)).await.0, 204);
    let (s, list) = api.call("GET", "/api/operator-policies", None).await;
    assert_eq!(s, 200);
    assert_eq!(
        list,
        json!([{"vhost": "/", "name": "cap", "pattern": "^op\\.", "apply-to": "queues",
                "definition": {"max-length": 2}, "priority": 0}])
    );
    // Not a user policy.
    assert_eq!(api.call("GET", "/api/policies/%2F/cap", None).await.0, 404);
    assert_eq!(api.call("PUT", "/api/queues/%2F/op.q", None).await.0, 201);
    let (_, q) = api.call("GET", "/api/queues/%2F/op.q", None).await;
    assert_eq!(q["operator_policy"], "cap", "{q}");
    for _ in 0..3 {
        api.call(
            "POST",
            "/api/exchanges/%2F/amq.default/publish",
            Some(r#"{"properties":{},"routing_key":"op.q","payload":"x","payload_encoding":"string"}"#),
        )
        .await;
    }
    let (_, q) = api.call("GET", "/api/queues/%2F/op.q", None).await;
    assert_eq!(q["messages"], 2, "the operator policy caps the queue: {q}");
    assert_eq!(api.call("DELETE", path, None).await.0, 204);
    assert_eq!(api.call("GET", path, None).await.0, 404);
    assert_eq!(api.call("DELETE", path, None).await.0, 404);
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vhost_and_user_limits_over_http_are_enforced_on_amqp() {
    let (node, api) = start().await;
    let one = Some(r#"{"value": 1}"#);
    // Administrators only, for changes; RabbitMQ's 401 first.
    let (s, body) = api
        .call_as(
            ("mon", "pw"),
            "PUT",
            "/api/vhost-limits/%2F/max-queues",
            one,
        )
        .await;
    assert_eq!(
        (s, body),
        (
            401,
            json!({"error": "not_authorised", "reason": "Not administrator user"})
        )
    );
    assert_eq!(
        api.call("PUT", "/api/vhost-limits/%2F/max-queues", one)
            .await
            .0,
        204
    );
    assert_eq!(
        api.call("PUT", "/api/user-limits/guest/max-channels", one)
            .await
            .0,
        204
    );
    assert_eq!(
        api.call("GET", "/api/vhost-limits/%2F", None).await,
        (200, json!([{"vhost": "/", "value": {"max-queues": 1}}]))
    );
    assert_eq!(
        api.call_as(("mon", "pw"), "GET", "/api/user-limits", None)
            .await,
        (
            200,
            json!([{"user": "guest", "value": {"max-channels": 1}}])
        )
    );
    assert_eq!(
        api.call("PUT", "/api/vhost-limits/nowhere/max-queues", one)
            .await,
        (
            404,
            json!({"error": "not_found", "reason": "vhost_not_found"})
        )
    );
    assert_eq!(
        api.call(
            "PUT",
            "/api/user-limits/guest/max-channels",
            Some(r#"{"value": "x"}"#)
        )
        .await
        .0,
        400
    );
    // In force on AMQP: one channel, then a connection error; one queue, then a channel
    // error.
    let conn = node.connect().await;
    let _ch = open_channel(&conn).await;
    assert_code(conn.create_channel().await, 530, "max-channels 1");
    let (_conn, ch) = node.channel().await;
    declare_queue(&ch, "limited").await;
    let res = ch
        .queue_declare(
            "over".into(),
            lapin::options::QueueDeclareOptions::default(),
            lapin::types::FieldTable::default(),
        )
        .await;
    assert_code(res, 406, "max-queues 1");
    // Deleting the limits lifts them.
    for path in [
        "/api/vhost-limits/%2F/max-queues",
        "/api/user-limits/guest/max-channels",
    ] {
        assert_eq!(api.call("DELETE", path, None).await.0, 204, "{path}");
    }
    assert_eq!(
        api.call("GET", "/api/vhost-limits", None).await,
        (200, json!([]))
    );
    let (_conn, ch) = node.channel().await;
    declare_queue(&ch, "over").await;
    node.shutdown().await;
}

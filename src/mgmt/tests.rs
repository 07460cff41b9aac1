//! Unit tests of the management core: exact status and JSON per endpoint, auth and tags.

use serde_json::json;

use super::*;
use crate::config::Config;
use crate::meta::state::{Permission, User};

fn node() -> NodeInfo {
    NodeInfo {
        name: "warren@test".into(),
    }
}

fn broker() -> Broker {
    let b = Broker::new(&Config::default(), 1, 1 << 30, 0);
    for (name, tags) in [
        ("admin", vec!["administrator"]),
        ("mon", vec!["monitoring"]),
        ("pm", vec!["policymaker"]),
        ("mgr", vec!["management"]),
        ("plain", vec![]),
    ] {
        b.apply(
            &Command::PutUser(User {
                name: name.into(),
                password: "pw".into(),
                tags: tags.into_iter().map(String::from).collect(),
            }),
            Instant::from_millis(0),
        )
        .unwrap();
    }
    b.apply(
        &Command::AddVhost {
            name: "other".into(),
        },
        Instant::from_millis(0),
    )
    .unwrap();
    for user in ["pm", "mgr", "admin"] {
        b.apply(
            &Command::SetPermissions(Permission {
                user: user.into(),
                vhost: "/".into(),
                configure: ".*".into(),
                write: ".*".into(),
                read: ".*".into(),
            }),
            Instant::from_millis(0),
        )
        .unwrap();
    }
    b
}

fn call(b: &Broker, user: &str, method: Method, path: &str, body: &str) -> Response {
    let counts = RemoteCountsByVhost::new();
    let loopback = vec!["guest".to_string()];
    let ctx = Context {
        broker: b,
        node: &node(),
        loopback_users: &loopback,
        remote_counts: &counts,
        listeners: &[("amqp", 5672), ("http", 15672)],
        remote_sessions: &[],
    };
    let req = Request::new(method, path, Some(basic_auth(user, "pw"))).with_body(body.as_bytes());
    handle(&ctx, &req, Instant::from_millis(0))
}

/// A GET with no `Authorization` header.
fn without_credentials(b: &Broker, path: &str) -> Response {
    let counts = RemoteCountsByVhost::new();
    let ctx = Context {
        broker: b,
        node: &node(),
        loopback_users: &[],
        remote_counts: &counts,
        listeners: &[("amqp", 5672), ("http", 15672)],
        remote_sessions: &[],
    };
    handle(
        &ctx,
        &Request::new(Method::Get, path, None),
        Instant::from_millis(0),
    )
}

fn get(b: &Broker, user: &str, path: &str) -> Response {
    call(b, user, Method::Get, path, "")
}

#[test]
fn no_credentials_is_401_with_the_basic_realm() {
    let r = without_credentials(&broker(), "/api/overview");
    assert_eq!(r.status, 401);
    assert_eq!(
        r.headers,
        vec![(
            "www-authenticate",
            "Basic realm=\"RabbitMQ Management\"".to_string()
        )]
    );
}

#[test]
fn a_path_outside_the_api_is_404_without_asking_for_credentials() {
    let r = without_credentials(&broker(), "/nothing.html");
    assert_eq!(r, Response::not_found());
}

#[test]
fn bad_password_is_401_login_failed() {
    let b = broker();
    let counts = RemoteCountsByVhost::new();
    let ctx = Context {
        broker: &b,
        node: &node(),
        loopback_users: &[],
        remote_counts: &counts,
        listeners: &[("amqp", 5672), ("http", 15672)],
        remote_sessions: &[],
    };
    let req = Request::new(
        Method::Get,
        "/api/whoami",
        Some(basic_auth("admin", "nope")),
    );
    let r = handle(&ctx, &req, Instant::from_millis(0));
    assert_eq!(r.status, 401);
    assert_eq!(
        r.body,
        Some(json!({"error": "not_authorised", "reason": "Login failed"}))
    );
}

#[test]
fn a_user_without_management_tags_is_refused() {
    let r = get(&broker(), "plain", "/api/whoami");
    assert_eq!(r.status, 401);
    assert_eq!(
        r.body,
        Some(json!({"error": "not_authorised", "reason": "Not management user"}))
    );
}

#[test]
fn loopback_users_are_refused_from_elsewhere() {
    let b = broker();
    let counts = RemoteCountsByVhost::new();
    let lb = vec!["admin".to_string()];
    let ctx = Context {
        broker: &b,
        node: &node(),
        loopback_users: &lb,
        remote_counts: &counts,
        listeners: &[("amqp", 5672), ("http", 15672)],
        remote_sessions: &[],
    };
    let mut req = Request::new(Method::Get, "/api/whoami", Some(basic_auth("admin", "pw")));
    req.peer_loopback = false;
    assert_eq!(handle(&ctx, &req, Instant::from_millis(0)).status, 401);
}

#[test]
fn whoami_names_the_user_and_tags() {
    let r = get(&broker(), "mon", "/api/whoami");
    assert_eq!(r.status, 200);
    assert_eq!(r.body, Some(json!({"name": "mon", "tags": ["monitoring"]})));
}

#[test]
fn tags_grant_what_they_grant_in_rabbitmq() {
    let b = broker();
    // users and permissions: administrators only.
    for user in ["mon", "pm", "mgr"] {
        assert_eq!(get(&b, user, "/api/users").status, 401, "{user}");
        assert_eq!(get(&b, user, "/api/permissions").status, 401, "{user}");
    }
    assert_eq!(
        get(&b, "mgr", "/api/users").body,
        Some(json!({"error": "not_authorised", "reason": "Not administrator user"}))
    );
    // nodes: monitoring and administrator.
    assert_eq!(get(&b, "mon", "/api/nodes").status, 200);
    assert_eq!(get(&b, "mgr", "/api/nodes").status, 401);
    // policies: policymaker and administrator.
    assert_eq!(get(&b, "pm", "/api/policies").status, 200);
    assert_eq!(get(&b, "mgr", "/api/policies").status, 401);
    // vhosts: monitoring sees all, management only where it has permissions.
    assert_eq!(
        get(&b, "mon", "/api/vhosts")
            .body
            .unwrap()
            .as_array()
            .unwrap()
            .len(),
        2
    );
    assert_eq!(
        get(&b, "mgr", "/api/vhosts").body,
        Some(json!([{"name": "/", "description": "", "tags": [], "tracing": false}]))
    );
    assert_eq!(get(&b, "mgr", "/api/queues/other").status, 401);
    // vhost changes: administrators only.
    assert_eq!(
        call(&b, "mon", Method::Put, "/api/vhosts/new", "").status,
        401
    );
}

#[test]
fn vhosts_put_creates_201_then_204_and_delete_204_then_404() {
    let b = broker();
    assert_eq!(
        call(&b, "admin", Method::Put, "/api/vhosts/v1", "").status,
        201
    );
    assert_eq!(
        call(&b, "admin", Method::Put, "/api/vhosts/v1", "").status,
        204
    );
    assert_eq!(
        get(&b, "admin", "/api/vhosts/v1").body,
        Some(json!({"name": "v1", "description": "", "tags": [], "tracing": false}))
    );
    assert_eq!(
        call(&b, "admin", Method::Delete, "/api/vhosts/v1", "").status,
        204
    );
    let r = call(&b, "admin", Method::Delete, "/api/vhosts/v1", "");
    assert_eq!(r.status, 404);
    assert_eq!(
        r.body,
        Some(json!({"error": "Object Not Found", "reason": "Not Found"}))
    );
    assert_eq!(get(&b, "admin", "/api/vhosts/v1").status, 404);
}

#[test]
fn users_put_get_delete() {
    let b = broker();
    let r = call(
        &b,
        "admin",
        Method::Put,
        "/api/users/alice",
        r#"{"password":"s3","tags":"monitoring,management"}"#,
    );
    assert_eq!(r.status, 201);
    assert_eq!(
        get(&b, "admin", "/api/users/alice").body,
        Some(
            json!({"name": "alice", "tags": ["monitoring", "management"], "limits": {},
                    "password_hash": get(&b, "admin", "/api/users/alice").body.unwrap()["password_hash"],
                    "hashing_algorithm": "rabbit_password_hashing_sha256"})
        )
    );
    // alice can now log in with the new password.
    assert_eq!(
        call(&b, "alice", Method::Get, "/api/whoami", "").status,
        401
    );
    assert_eq!(
        call(
            &b,
            "admin",
            Method::Put,
            "/api/users/alice",
            r#"{"password":"pw"}"#
        )
        .status,
        204
    );
    assert_eq!(get(&b, "alice", "/api/whoami").status, 200);
    // Kept as a salted hash, never as given.
    let stored = b.snapshot().users["alice"].password.clone();
    assert!(
        stored.starts_with("\u{0}rabbit_password_hashing_sha256:"),
        "{stored:?}"
    );
    assert_eq!(
        call(&b, "admin", Method::Put, "/api/users/bob", "{}").status,
        400
    );
    assert_eq!(
        call(&b, "admin", Method::Put, "/api/users/bob", "{not json").status,
        400
    );
    assert_eq!(
        call(
            &b,
            "admin",
            Method::Put,
            "/api/users/bob",
            r#"{"password_hash":"x"}"#
        )
        .status,
        400
    );
    assert_eq!(
        call(&b, "admin", Method::Delete, "/api/users/alice", "").status,
        204
    );
    assert_eq!(
        call(&b, "admin", Method::Delete, "/api/users/alice", "").status,
        404
    );
    assert_eq!(get(&b, "admin", "/api/users/alice").status, 404);
}

#[test]
fn permissions_put_and_get() {
    let b = broker();
    let body = r#"{"configure":"^a","write":".*","read":""}"#;
    assert_eq!(
        call(&b, "admin", Method::Put, "/api/permissions/other/mon", body).status,
        201
    );
    assert_eq!(
        call(&b, "admin", Method::Put, "/api/permissions/other/mon", body).status,
        204
    );
    assert_eq!(
        get(&b, "admin", "/api/permissions/other/mon").body,
        Some(
            json!({"user": "mon", "vhost": "other", "configure": "^a", "write": ".*", "read": ""})
        )
    );
    assert_eq!(
        call(
            &b,
            "admin",
            Method::Put,
            "/api/permissions/other/mon",
            r#"{"configure":"("}"#
        )
        .status,
        400
    );
    assert_eq!(
        call(
            &b,
            "admin",
            Method::Put,
            "/api/permissions/other/mon",
            r#"{"configure":"(","write":"","read":""}"#
        )
        .status,
        400
    );
    assert_eq!(get(&b, "admin", "/api/permissions/nowhere/mon").status, 404);
    assert_eq!(get(&b, "admin", "/api/permissions/other/pm").status, 404);
}

#[test]
fn queues_put_lists_with_rabbitmq_fields_and_delete() {
    let b = broker();
    let r = call(
        &b,
        "mgr",
        Method::Put,
        "/api/queues/%2F/q1",
        r#"{"durable":true,"arguments":{"x-max-length":5}}"#,
    );
    assert_eq!(r.status, 201, "{}", r.body_text());
    assert_eq!(
        call(
            &b,
            "mgr",
            Method::Put,
            "/api/queues/%2F/q1",
            r#"{"durable":true,"arguments":{"x-max-length":5}}"#
        )
        .status,
        204
    );
    // Inequivalent redeclaration: 400 with the broker's reason.
    let r = call(
        &b,
        "mgr",
        Method::Put,
        "/api/queues/%2F/q1",
        r#"{"durable":false}"#,
    );
    assert_eq!(r.status, 400);
    assert_eq!(r.body.unwrap()["error"], "bad_request");
    let r = get(&b, "mgr", "/api/queues/%2F/q1");
    assert_eq!(r.status, 200);
    assert_eq!(
        r.body,
        Some(json!({
            "name": "q1", "vhost": "/", "durable": true, "auto_delete": false, "exclusive": false,
            "arguments": {"x-max-length": 5}, "node": "warren@test", "messages": 0,
            "messages_ready": 0, "messages_unacknowledged": 0, "consumers": 0, "policy": null,
            "operator_policy": null, "effective_policy_definition": {}, "slave_nodes": [],
            "synchronised_slave_nodes": [], "state": "running",
            // Warren's extension (`ring`): an unmirrored queue has no ring.
            "gm_ring": [], "epoch": 0, "sync_running": false
        }))
    );
    assert_eq!(
        get(&b, "mgr", "/api/queues")
            .body
            .unwrap()
            .as_array()
            .unwrap()
            .len(),
        1
    );
    assert_eq!(
        get(&b, "mgr", "/api/queues/%2F")
            .body
            .unwrap()
            .as_array()
            .unwrap()
            .len(),
        1
    );
    assert_eq!(get(&b, "mgr", "/api/queues/nowhere").status, 404);
    assert_eq!(
        call(
            &b,
            "mgr",
            Method::Put,
            "/api/queues/%2F/q2",
            r#"{"durable":"maybe"}"#
        )
        .status,
        400
    );
    assert_eq!(
        call(&b, "mgr", Method::Delete, "/api/queues/%2F/q1", "").status,
        204
    );
    assert_eq!(
        call(&b, "mgr", Method::Delete, "/api/queues/%2F/q1", "").status,
        404
    );
    assert_eq!(get(&b, "mgr", "/api/queues/%2F/q1").status, 404);
    assert_eq!(
        call(&b, "mgr", Method::Post, "/api/queues/%2F/q1", "").status,
        405
    );
}

#[test]
fn exchanges_put_get_delete() {
    let b = broker();
    assert_eq!(
        call(
            &b,
            "mgr",
            Method::Put,
            "/api/exchanges/%2F/x1",
            r#"{"type":"topic","durable":true}"#
        )
        .status,
        201
    );
    assert_eq!(
        get(&b, "mgr", "/api/exchanges/%2F/x1").body,
        Some(
            json!({"name": "x1", "vhost": "/", "type": "topic", "durable": true,
                    "auto_delete": false, "internal": false, "arguments": {}, "policy": null,
                    "user_who_performed_action": ""})
        )
    );
    assert_eq!(
        get(&b, "mgr", "/api/exchanges/%2F/amq.default")
            .body
            .unwrap()["type"],
        "direct"
    );
    assert_eq!(
        call(&b, "mgr", Method::Put, "/api/exchanges/%2F/x2", "{}").status,
        400
    );
    assert_eq!(
        call(
            &b,
            "mgr",
            Method::Put,
            "/api/exchanges/%2F/x2",
            r#"{"type":"nope"}"#
        )
        .status,
        400
    );
    assert_eq!(
        call(&b, "mgr", Method::Delete, "/api/exchanges/%2F/x1", "").status,
        204
    );
    assert_eq!(
        call(&b, "mgr", Method::Delete, "/api/exchanges/%2F/x1", "").status,
        404
    );
}

#[test]
fn bindings_post_list_and_delete_by_properties_key() {
    let b = broker();
    call(&b, "mgr", Method::Put, "/api/queues/%2F/q", "{}");
    call(
        &b,
        "mgr",
        Method::Put,
        "/api/exchanges/%2F/x",
        r#"{"type":"direct"}"#,
    );
    let r = call(
        &b,
        "mgr",
        Method::Post,
        "/api/bindings/%2F/e/x/q/q",
        r#"{"routing_key":"k"}"#,
    );
    assert_eq!(r.status, 201);
    assert_eq!(
        r.headers,
        vec![("location", "/api/bindings/%2F/e/x/q/q/k".to_string())]
    );
    assert_eq!(
        get(&b, "mgr", "/api/bindings/%2F/e/x/q/q").body,
        Some(
            json!([{"source": "x", "vhost": "/", "destination": "q", "destination_type": "queue",
                     "routing_key": "k", "arguments": {}, "properties_key": "k"}])
        )
    );
    assert_eq!(
        call(
            &b,
            "mgr",
            Method::Post,
            "/api/bindings/%2F/e/x/q/missing",
            "{}"
        )
        .status,
        404
    );
    assert_eq!(
        get(&b, "mgr", "/api/bindings/%2F")
            .body
            .unwrap()
            .as_array()
            .unwrap()
            .len(),
        2
    );
    assert_eq!(
        call(&b, "mgr", Method::Delete, "/api/bindings/%2F/e/x/q/q/k", "").status,
        204
    );
    assert_eq!(
        call(&b, "mgr", Method::Delete, "/api/bindings/%2F/e/x/q/q/k", "").status,
        404
    );
}

#[test]
fn policies_put_get_delete() {
    let b = broker();
    let body =
        r#"{"pattern":"^q","definition":{"max-length":10},"priority":1,"apply-to":"queues"}"#;
    assert_eq!(
        call(&b, "pm", Method::Put, "/api/policies/%2F/cap", body).status,
        201
    );
    assert_eq!(
        call(&b, "pm", Method::Put, "/api/policies/%2F/cap", body).status,
        204
    );
    assert_eq!(
        get(&b, "pm", "/api/policies/%2F/cap").body,
        Some(
            json!({"vhost": "/", "name": "cap", "pattern": "^q", "apply-to": "queues",
                    "definition": {"max-length": 10}, "priority": 1})
        )
    );
    assert_eq!(
        call(
            &b,
            "pm",
            Method::Put,
            "/api/policies/%2F/bad",
            r#"{"pattern":"x"}"#
        )
        .status,
        400
    );
    assert_eq!(
        call(
            &b,
            "pm",
            Method::Put,
            "/api/policies/%2F/bad",
            r#"{"pattern":"x","definition":{"no-such-key":1}}"#
        )
        .status,
        400
    );
    assert_eq!(
        call(&b, "mgr", Method::Put, "/api/policies/%2F/cap", body).status,
        401
    );
    assert_eq!(
        call(&b, "pm", Method::Delete, "/api/policies/%2F/cap", "").status,
        204
    );
    assert_eq!(
        call(&b, "pm", Method::Delete, "/api/policies/%2F/cap", "").status,
        404
    );
}

#[test]
fn overview_and_nodes() {
    let b = broker();
    call(&b, "admin", Method::Put, "/api/queues/%2F/q", "{}");
    let o = get(&b, "admin", "/api/overview").body.unwrap();
    assert_eq!(o["object_totals"]["queues"], 1);
    assert_eq!(o["queue_totals"]["messages"], 0);
    assert_eq!(o["node"], "warren@test");
    assert_eq!(o["message_stats"]["publish"], 0, "this node's counters");
    assert_eq!(o["message_stats"]["deliver_get"], 0);
    assert_eq!(
        get(&b, "admin", "/api/nodes").body,
        Some(json!([{"name": "warren@test", "type": "disc", "running": true}]))
    );
    assert_eq!(get(&b, "admin", "/api/nodes/warren@test").status, 200);
    assert_eq!(get(&b, "admin", "/api/nodes/other").status, 404);
    assert_eq!(get(&b, "admin", "/api/nothing").status, 404);
    assert_eq!(
        call(&b, "admin", Method::Put, "/api/overview", "").status,
        405
    );
}

#[test]
fn definitions_export_and_import_round_trip() {
    let b = broker();
    call(&b, "admin", Method::Put, "/api/vhosts/v", "");
    let all = r#"{"configure":".*","write":".*","read":".*"}"#;
    assert_eq!(
        call(&b, "admin", Method::Put, "/api/permissions/v/admin", all).status,
        201
    );
    call(
        &b,
        "admin",
        Method::Put,
        "/api/queues/v/q",
        r#"{"arguments":{"x-max-length":3}}"#,
    );
    call(
        &b,
        "admin",
        Method::Put,
        "/api/exchanges/v/x",
        r#"{"type":"topic"}"#,
    );
    call(
        &b,
        "admin",
        Method::Post,
        "/api/bindings/v/e/x/q/q",
        r#"{"routing_key":"a.#"}"#,
    );
    let pol = r#"{"pattern":"^q","definition":{"max-length":10}}"#;
    call(&b, "admin", Method::Put, "/api/policies/v/cap", pol);
    let r = get(&b, "admin", "/api/definitions");
    assert_eq!(r.status, 200);
    let d = r.body.unwrap();
    assert_eq!(d["rabbit_version"], "3.10.8");
    assert_eq!(
        d["queues"],
        json!([{"name": "q", "vhost": "v", "durable": true,
        "auto_delete": false, "arguments": {"x-max-length": 3}}])
    );
    assert_eq!(
        d["exchanges"],
        json!([{"name": "x", "vhost": "v", "type": "topic",
        "durable": true, "auto_delete": false, "internal": false, "arguments": {}}])
    );
    assert_eq!(
        d["bindings"],
        json!([{"source": "x", "vhost": "v", "destination": "q",
        "destination_type": "queue", "routing_key": "a.#", "arguments": {}}])
    );
    assert_eq!(d["policies"][0]["apply-to"], "all");
    // Imported into an empty broker, the export recreates everything, users' passwords too.
    let fresh = Broker::new(&Config::default(), 1, 1 << 30, 0);
    let counts = RemoteCountsByVhost::new();
    let ctx = Context {
        broker: &fresh,
        node: &node(),
        loopback_users: &[],
        remote_counts: &counts,
        listeners: &[("amqp", 5672), ("http", 15672)],
        remote_sessions: &[],
    };
    let req = Request::new(
        Method::Post,
        "/api/definitions",
        Some(basic_auth("guest", "guest")),
    )
    .with_body(d.to_string().as_bytes());
    let r = handle(&ctx, &req, Instant::from_millis(0));
    assert_eq!(r.status, 204, "{}", r.body_text());
    assert_eq!(get(&fresh, "mon", "/api/whoami").status, 200);
    let again = get(&fresh, "admin", "/api/definitions").body.unwrap();
    for k in [
        "users",
        "vhosts",
        "permissions",
        "policies",
        "queues",
        "exchanges",
        "bindings",
    ] {
        assert_eq!(again[k], d[k], "{k}");
    }
    // Refusals: a bad body, a bad definition, a non-administrator.
    assert_eq!(
        call(&b, "admin", Method::Post, "/api/definitions", "[").status,
        400
    );
    let bad = r#"{"queues":[{"name":"q","vhost":"v","durable":"yes"}]}"#;
    assert_eq!(
        call(&b, "admin", Method::Post, "/api/definitions", bad).status,
        400
    );
    assert_eq!(get(&b, "mon", "/api/definitions").status, 401);
}

#[test]
fn a_rabbitmq_3_10_export_imports() {
    // The shape RabbitMQ 3.10.8 exports (tags as a list, vhost metadata, extra members).
    let export = r#"{"rabbit_version":"3.10.8","rabbitmq_version":"3.10.8",
      "product_name":"RabbitMQ","product_version":"3.10.8",
      "users":[{"name":"ops","password_hash":"kI3GCqW5JLMJa4iX1lo7X4D6XbYqlLgxIs30+P6tENUV2POR",
                "hashing_algorithm":"rabbit_password_hashing_sha256","tags":["administrator"],"limits":{}}],
      "vhosts":[{"name":"/","limits":[],"metadata":{"description":"Default virtual host","tags":[]}},
                {"name":"app","limits":[],"metadata":{"description":"","tags":[]}}],
      "permissions":[{"user":"ops","vhost":"app","configure":".*","write":".*","read":".*"}],
      "topic_permissions":[],"parameters":[],"global_parameters":[{"name":"internal_cluster_id","value":"rabbitmq-cluster-id-x"}],
      "policies":[{"vhost":"app","name":"ha","pattern":"^ha\\.","apply-to":"queues","definition":{"ha-mode":"all"},"priority":0}],
      "queues":[{"name":"ha.orders","vhost":"app","durable":true,"auto_delete":false,"arguments":{"x-queue-type":"classic"}}],
      "exchanges":[{"name":"events","vhost":"app","type":"topic","durable":true,"auto_delete":false,"internal":false,"arguments":{}}],
      "bindings":[{"source":"events","vhost":"app","destination":"ha.orders","destination_type":"queue","routing_key":"order.*","arguments":{}}]}"#;
    let b = broker();
    let r = call(&b, "admin", Method::Post, "/api/definitions", export);
    assert_eq!(r.status, 204, "{}", r.body_text());
    let q = get(&b, "admin", "/api/queues/app/ha.orders").body.unwrap();
    assert_eq!(q["policy"], "ha");
    assert_eq!(
        get(&b, "admin", "/api/bindings/app/e/events/q/ha.orders")
            .body
            .unwrap()
            .as_array()
            .unwrap()
            .len(),
        1
    );
    assert_eq!(
        get(&b, "admin", "/api/users/ops").body.unwrap()["password_hash"],
        "kI3GCqW5JLMJa4iX1lo7X4D6XbYqlLgxIs30+P6tENUV2POR"
    );
}

#[test]
fn health_checks_are_routed_for_any_management_user() {
    let b = broker();
    let r = get(&b, "mgr", "/api/health/checks/local-alarms");
    assert_eq!(r, Response::ok(json!({"status": "ok"})));
    assert_eq!(
        get(&b, "mon", "/api/health/checks/virtual-hosts").status,
        200
    );
    assert_eq!(get(&b, "admin", "/api/health/checks/nope").status, 404);
    assert_eq!(get(&b, "plain", "/api/health/checks/alarms").status, 401);
    assert_eq!(
        call(&b, "admin", Method::Post, "/api/health/checks/alarms", "").status,
        405
    );
}

#[test]
fn listings_take_columns_sort_and_pages() {
    let b = broker();
    let r = get(
        &b,
        "admin",
        "/api/exchanges/%2F?columns=name&sort=name&sort_reverse=true",
    );
    let names: Vec<&str> = r
        .body
        .as_ref()
        .unwrap()
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["name"].as_str().unwrap())
        .collect();
    let mut sorted = names.clone();
    sorted.sort();
    sorted.reverse();
    assert_eq!(names, sorted);
    assert_eq!(
        r.body.as_ref().unwrap()[0].as_object().unwrap().len(),
        1,
        "only the name"
    );
    let r = get(&b, "admin", "/api/vhosts?page=1&page_size=1&columns=name");
    assert_eq!(r.body.unwrap()["total_count"], 2);
}

#[test]
fn queue_actions_sync_mirrored_queues_and_refuse_unknown_ones() {
    let b = broker();
    b.apply(
        &Command::DeclareQueue(crate::meta::state::QueueDef {
            vhost: "/".into(),
            name: "q".into(),
            durable: true,
            exclusive_owner: None,
            auto_delete: false,
            arguments: Default::default(),
            home: 0,
        }),
        Instant::from_millis(0),
    )
    .unwrap();
    let post = |user: &str, path: &str, body: &str| call(&b, user, Method::Post, path, body);
    // Unmirrored: nothing to sync, 204 at once (RabbitMQ 3.10.8 answers the same).
    assert_eq!(
        post("admin", "/api/queues/%2F/q/actions", r#"{"action":"sync"}"#).status,
        204
    );
    assert_eq!(
        post(
            "admin",
            "/api/queues/%2F/q/actions",
            r#"{"action":"cancel_sync"}"#
        )
        .status,
        204
    );
    let r = post(
        "admin",
        "/api/queues/%2F/q/actions",
        r#"{"action":"bogus"}"#,
    );
    assert_eq!(
        r,
        Response {
            status: 400,
            body: Some(json!({"error": "bad_request", "reason": ["unknown", "bogus"]})),
            headers: Vec::new(),
        }
    );
    assert_eq!(
        post(
            "admin",
            "/api/queues/%2F/nope/actions",
            r#"{"action":"sync"}"#
        )
        .status,
        404
    );
    assert_eq!(
        post("mon", "/api/queues/%2F/q/actions", r#"{"action":"sync"}"#).status,
        401
    );
    assert_eq!(get(&b, "admin", "/api/queues/%2F/q/actions").status, 405);
}

/// A broker on cluster node 1 with nodes 1-3 (`warren1`..`warren3`), the queue `ha.q`
/// mastered on node 1 with mirrors on node 2 (synchronised) and 3 (not), and its GM group
/// of `slots`.
fn mirrored(slots: Vec<crate::gm::Slot>) -> Broker {
    use crate::meta::state::{MirrorRecord, NodeRecord, QueueDef};
    let b = broker().with_node_id(1);
    let now = Instant::from_millis(0);
    for id in 1..=3 {
        let node = NodeRecord {
            id,
            name: format!("warren{id}@h"),
            amqp: String::new(),
            admin: String::new(),
            link: String::new(),
            incarnation: 0,
        };
        b.apply(&Command::RegisterNode(node), now).unwrap();
    }
    let queue = QueueDef {
        vhost: "/".into(),
        name: "ha.q".into(),
        durable: true,
        exclusive_owner: None,
        auto_delete: false,
        arguments: Default::default(),
        home: 1,
    };
    b.apply(&Command::DeclareQueue(queue), now).unwrap();
    let mirror = |node, synchronised| MirrorRecord {
        node,
        since: 0,
        synchronised,
    };
    let set = Command::SetMirrors {
        vhost: "/".into(),
        queue: "ha.q".into(),
        expected_version: 0,
        mirrors: vec![mirror(2, true), mirror(3, false)],
    };
    b.apply(&set, now).unwrap();
    let incarnation = b.snapshot().mirror_sets[&("/".to_string(), "ha.q".to_string())].incarnation;
    let group = Command::GmGroup {
        name: crate::mirror::message::group_name("/", "ha.q", incarnation),
        expected_version: 0,
        members: slots,
    };
    b.apply(&group, now).unwrap();
    b
}

fn alive(node: u64) -> crate::gm::Slot {
    crate::gm::Slot::Alive(crate::gm::MemberId { node, since: 1 })
}

#[test]
fn one_queue_carries_its_gm_ring_in_ring_order_with_sync_state() {
    // Ring order 1, 3, 2: the drawing follows the group record, not node order.
    let b = mirrored(vec![alive(1), alive(3), alive(2)]);
    b.metrics().sync_progress("/", "ha.q", 40, 100);
    let q = get(&b, "admin", "/api/queues/%2F/ha.q").body.unwrap();
    assert_eq!(q["epoch"], 0);
    assert_eq!(q["sync_running"], true);
    assert_eq!(
        q["gm_ring"],
        json!([
            {"node": "warren1@h", "role": "master", "state": "synchronised",
             "sync_remaining": 0, "gm_member": "alive"},
            {"node": "warren3@h", "role": "mirror", "state": "syncing",
             "sync_remaining": 60, "gm_member": "alive"},
            {"node": "warren2@h", "role": "mirror", "state": "synchronised",
             "sync_remaining": 0, "gm_member": "alive"},
        ])
    );
    // Listings stay RabbitMQ's: the ring is on the single queue only.
    let list = get(&b, "admin", "/api/queues/%2F").body.unwrap();
    assert!(list[0].get("gm_ring").is_none(), "{list}");
}

#[test]
fn a_ring_member_of_a_down_node_or_a_dead_member_is_down() {
    use crate::gm::{MemberId, Slot};
    // Node 3's first member died; its new one has not joined the group yet.
    let dead = Slot::Dead(MemberId { node: 3, since: 0 });
    let b = mirrored(vec![alive(1), dead, alive(2)]);
    b.set_down_nodes([2].into());
    let q = get(&b, "admin", "/api/queues/%2F/ha.q").body.unwrap();
    assert_eq!(
        q["sync_running"], false,
        "the master's node knows no copy runs"
    );
    assert_eq!(
        q["gm_ring"],
        json!([
            {"node": "warren1@h", "role": "master", "state": "synchronised",
             "sync_remaining": 0, "gm_member": "alive"},
            {"node": "warren3@h", "role": "mirror", "state": "down",
             "sync_remaining": null, "gm_member": "dead"},
            {"node": "warren2@h", "role": "mirror", "state": "down",
             "sync_remaining": null, "gm_member": "alive"},
        ])
    );
}

#[test]
fn sync_progress_is_null_where_the_master_does_not_run() {
    let b = mirrored(vec![alive(1), alive(2)]);
    let b = b.with_node_id(2);
    b.metrics().sync_progress("/", "ha.q", 40, 100);
    let q = get(&b, "admin", "/api/queues/%2F/ha.q").body.unwrap();
    assert_eq!(q["sync_running"], Value::Null);
    // Node 3's mirror has no member in the group yet: it comes after the ring.
    assert_eq!(
        q["gm_ring"][2],
        json!({"node": "warren3@h", "role": "mirror", "state": "syncing",
               "sync_remaining": null, "gm_member": null})
    );
}

#[test]
fn an_unmirrored_queue_has_an_empty_ring() {
    let b = broker();
    call(&b, "admin", Method::Put, "/api/queues/%2F/plain", "{}");
    let q = get(&b, "admin", "/api/queues/%2F/plain").body.unwrap();
    assert_eq!(
        (&q["gm_ring"], &q["epoch"], &q["sync_running"]),
        (&json!([]), &json!(0), &json!(false))
    );
}

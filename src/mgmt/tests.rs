//! Unit tests of the management core: exact status and JSON per endpoint, auth and tags.

use serde_json::json;

use super::*;
use crate::config::Config;
use crate::meta::state::{Permission, User};
use crate::mgmt::health::loopback as on_loopback;

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

/// `req` answered on a single node, a body written as text parsed into `body` (so a
/// listing written as text must be JSON, and compares as a value).
fn answered(ctx: &Context<'_>, req: &Request) -> Response {
    let mut r = handle(ctx, req, Instant::from_millis(0));
    if let Some(raw) = r.raw.take() {
        assert!(r.body.is_none(), "a body and a text body");
        r.body = Some(serde_json::from_slice(&raw).expect("a text body is JSON"));
    }
    r
}

fn call(b: &Broker, user: &str, method: Method, path: &str, body: &str) -> Response {
    let counts = RemoteCountsByVhost::new();
    let loopback = vec!["guest".to_string()];
    let ctx = Context {
        broker: b,
        node: &node(),
        loopback_users: &loopback,
        remote_counts: &counts,
        listeners: &[on_loopback("amqp", 5672), on_loopback("http", 15672)],
        remote_sessions: &[],
        node_stats: &Default::default(),
    };
    let req = Request::new(method, path, Some(basic_auth(user, "pw"))).with_body(body.as_bytes());
    answered(&ctx, &req)
}

/// A GET with no `Authorization` header.
fn without_credentials(b: &Broker, path: &str) -> Response {
    let counts = RemoteCountsByVhost::new();
    let ctx = Context {
        broker: b,
        node: &node(),
        loopback_users: &[],
        remote_counts: &counts,
        listeners: &[on_loopback("amqp", 5672), on_loopback("http", 15672)],
        remote_sessions: &[],
        node_stats: &Default::default(),
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
        listeners: &[on_loopback("amqp", 5672), on_loopback("http", 15672)],
        remote_sessions: &[],
        node_stats: &Default::default(),
    };
    let req = Request::new(
        Method::Get,
        "/api/whoami",
        Some(basic_auth("admin", "nope")),
    );
    let r = answered(&ctx, &req);
    assert_eq!(r.status, 401);
    assert_eq!(
        r.body,
        Some(json!({"error": "not_authorized", "reason": "Login failed"}))
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
        listeners: &[on_loopback("amqp", 5672), on_loopback("http", 15672)],
        remote_sessions: &[],
        node_stats: &Default::default(),
    };
    let mut req = Request::new(Method::Get, "/api/whoami", Some(basic_auth("admin", "pw")));
    req.peer_loopback = false;
    assert_eq!(answered(&ctx, &req).status, 401);
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
    // policies: listed for any management user in its vhosts, as in RabbitMQ 3.10; one
    // policy for policymakers and administrators.
    let pol = r#"{"pattern":"^q","definition":{"max-length":5}}"#;
    assert_eq!(
        call(&b, "pm", Method::Put, "/api/policies/%2F/p", pol).status,
        201
    );
    assert_eq!(get(&b, "pm", "/api/policies").status, 200);
    assert_eq!(
        get(&b, "mgr", "/api/policies/%2F").body.unwrap()[0]["name"],
        "p"
    );
    assert_eq!(get(&b, "mgr", "/api/policies/other").status, 401);
    let refused = json!({"error": "not_authorised",
                         "reason": "User not authorised to access object"});
    assert_eq!(
        get(&b, "mgr", "/api/policies/%2F/p").body,
        Some(refused.clone())
    );
    assert_eq!(
        call(&b, "mgr", Method::Put, "/api/policies/%2F/p", pol).body,
        Some(refused)
    );
    assert_eq!(get(&b, "pm", "/api/policies/%2F/p").status, 200);
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
    let mine = get(&b, "mgr", "/api/vhosts").body.unwrap();
    assert_eq!(mine.as_array().unwrap().len(), 1);
    assert_eq!(mine[0]["name"], "/");
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
        Some(json!({"name": "v1", "description": "", "tags": [],
                    "metadata": {"description": "", "tags": []},
                    "default_queue_type": "undefined", "tracing": false,
                    "cluster_state": {"warren@test": "running"},
                    "messages": 0, "messages_ready": 0, "messages_unacknowledged": 0}))
    );
    // As in RabbitMQ, the vhost's creator was given every permission in it.
    assert_eq!(
        get(&b, "admin", "/api/permissions/v1/admin").body.unwrap()["configure"],
        ".*"
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
            r#"{"password":"pw","tags":"management"}"#
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
    // As RabbitMQ 3.10: `tags` is required; no password means none (alice loses hers).
    assert_eq!(
        call(&b, "admin", Method::Put, "/api/users/bob", "{}").body,
        Some(json!({"error": "bad_request", "reason": "tags_not_present"}))
    );
    assert_eq!(
        call(
            &b,
            "admin",
            Method::Put,
            "/api/users/alice",
            r#"{"tags":"management"}"#
        )
        .status,
        204
    );
    assert_eq!(
        get(&b, "alice", "/api/whoami").body.unwrap()["reason"],
        "Login failed"
    );
    assert_eq!(
        get(&b, "admin", "/api/users/alice").body.unwrap()["password_hash"],
        ""
    );
    assert_eq!(
        call(
            &b,
            "admin",
            Method::Put,
            "/api/users/carol",
            r#"{"tags":[]}"#
        )
        .status,
        201
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
            r#"{"password_hash":"x","tags":""}"#
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

/// A queue listing (written as text) shows each queue as its own page does (built as a
/// value), and takes the listing parameters as the value listings do.
#[test]
fn queue_listings_match_queue_pages_and_take_the_listing_parameters() {
    let b = broker();
    let put = |path: &str, body: &str| {
        let r = call(&b, "admin", Method::Put, path, body);
        assert!(r.status == 201 || r.status == 204, "{path}: {r:?}");
    };
    put(
        "/api/policies/%2F/lim",
        r#"{"pattern":"^b","definition":{"max-length":7,"queue-mode":"lazy"},"apply-to":"queues"}"#,
    );
    // A name that needs escaping, arguments of every kind, a policy, a plain queue.
    put(
        "/api/queues/%2F/al%22pha%5C%C3%BC",
        r#"{"durable":true,"arguments":{"x-max-length":5,"x-queue-mode":"lazy","x-t":{"k":[1,"two",true]}}}"#,
    );
    put(
        "/api/queues/%2F/beta",
        r#"{"durable":false,"auto_delete":true}"#,
    );
    put("/api/queues/%2F/gamma", r#"{"durable":true}"#);
    let odd = "al\"pha\\\u{fc}";
    let listing = get(&b, "admin", "/api/queues").body.unwrap();
    let listed = listing.as_array().unwrap();
    assert_eq!(listed.len(), 3);
    for q in listed {
        let name = q["name"].as_str().unwrap();
        let path = format!("/api/queues/%2F/{}", encode(name));
        let mut page = get(&b, "admin", &path).body.unwrap();
        let o = page.as_object_mut().unwrap();
        // Warren's and RabbitMQ's single-queue extras.
        for extra in ["gm_ring", "epoch", "sync_running", "consumer_details"] {
            assert!(o.remove(extra).is_some(), "{extra}");
        }
        assert_eq!(q, &page, "{name}");
    }
    assert_eq!(listed[0]["name"], odd);
    assert_eq!(
        listed[0]["arguments"]["x-t"],
        json!({"k": [1, "two", true]})
    );
    assert_eq!(
        listed[1]["effective_policy_definition"],
        json!({"max-length": 7, "queue-mode": "lazy"})
    );
    assert_eq!(listed[1]["policy"], "lim");
    // Columns, sorting, pages, the name filter.
    assert_eq!(
        get(&b, "admin", "/api/queues?columns=name,durable").body,
        Some(json!([{"name": odd, "durable": true},
                    {"name": "beta", "durable": false},
                    {"name": "gamma", "durable": true}]))
    );
    assert_eq!(
        get(
            &b,
            "admin",
            "/api/queues/%2F?page=2&page_size=2&columns=name&sort=name&sort_reverse=true"
        )
        .body,
        Some(
            json!({"filtered_count": 3, "item_count": 1, "items": [{"name": odd}],
                    "page": 2, "page_count": 2, "page_size": 2, "total_count": 3})
        )
    );
    assert_eq!(
        get(
            &b,
            "admin",
            "/api/queues?page=1&name=MM&columns=name,vhost&sort=durable"
        )
        .body,
        Some(
            json!({"filtered_count": 1, "item_count": 1, "items": [{"name": "gamma", "vhost": "/"}],
                    "page": 1, "page_count": 1, "page_size": 100, "total_count": 3})
        )
    );
    assert_eq!(
        get(&b, "admin", "/api/queues?sort=durable&columns=name").body,
        Some(json!([{"name": "beta"}, {"name": odd}, {"name": "gamma"}]))
    );
    let r = get(&b, "admin", "/api/queues?page=3&page_size=2");
    assert_eq!(r.status, 400);
    assert_eq!(r.body.unwrap()["error"], "page_out_of_range");
    let r = get(&b, "admin", "/api/queues?page=1&name=(&use_regex=true");
    assert_eq!(r.status, 400);
}

fn encode(name: &str) -> String {
    percent_encoding::utf8_percent_encode(name, percent_encoding::NON_ALPHANUMERIC).to_string()
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
            "messages_ram": 0, "messages_ready_ram": 0, "messages_unacknowledged_ram": 0,
            "messages_persistent": 0, "messages_paged_out": 0, "message_bytes": 0,
            "message_bytes_ready": 0, "message_bytes_unacknowledged": 0,
            "message_bytes_ram": 0, "message_bytes_persistent": 0,
            "message_bytes_paged_out": 0,
            "operator_policy": null, "effective_policy_definition": {}, "state": "running",
            "type": "classic", "consumer_details": [], "exclusive_consumer_tag": null,
            "single_active_consumer_tag": null, "head_message_timestamp": null,
            "recoverable_slaves": null,
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
                    "auto_delete": false, "internal": false, "arguments": {},
                    "user_who_performed_action": ""})
        )
    );
    assert_eq!(
        get(&b, "mgr", "/api/exchanges/%2F/amq.default")
            .body
            .unwrap()["type"],
        "direct"
    );
    // No type: a direct exchange, as RabbitMQ declares it.
    assert_eq!(
        call(&b, "mgr", Method::Put, "/api/exchanges/%2F/x2", "{}").status,
        201
    );
    assert_eq!(
        get(&b, "mgr", "/api/exchanges/%2F/x2").body.unwrap()["type"],
        "direct"
    );
    assert_eq!(
        call(
            &b,
            "mgr",
            Method::Put,
            "/api/exchanges/%2F/x3",
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
    // The vhost's creator has every permission in it already.
    let all = r#"{"configure":".*","write":".*","read":".*"}"#;
    assert_eq!(
        call(&b, "admin", Method::Put, "/api/permissions/v/admin", all).status,
        204
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
        listeners: &[on_loopback("amqp", 5672), on_loopback("http", 15672)],
        remote_sessions: &[],
        node_stats: &Default::default(),
    };
    let req = Request::new(
        Method::Post,
        "/api/definitions",
        Some(basic_auth("guest", "guest")),
    )
    .with_body(d.to_string().as_bytes());
    let r = answered(&ctx, &req);
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
            raw: None,
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
        mirrors: vec![mirror(2, false), mirror(3, false)],
    };
    b.apply(&set, now).unwrap();
    let incarnation = b.snapshot().mirror_sets[&("/".to_string(), "ha.q".to_string())].incarnation;
    let group = Command::GmGroup {
        name: crate::mirror::message::group_name("/", "ha.q", incarnation),
        expected_version: 0,
        members: slots,
    };
    b.apply(&group, now).unwrap();
    // Node 2's member (every caller has it alive) acknowledged its sync.
    let synced = Command::MarkSynchronised {
        vhost: "/".into(),
        queue: "ha.q".into(),
        incarnation,
        epoch: 0,
        member: crate::gm::MemberId { node: 2, since: 1 },
    };
    b.apply(&synced, now).unwrap();
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
    b.set_down_nodes([2].into(), Instant::default());
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

#[test]
fn permissions_are_deleted_and_listed_per_vhost_and_per_user() {
    let b = broker();
    let all = r#"{"configure":".*","write":".*","read":".*"}"#;
    assert_eq!(
        call(&b, "admin", Method::Put, "/api/permissions/other/mgr", all).status,
        201
    );
    // RabbitMQ's 400 for a PUT naming a missing vhost or user (GET and DELETE: 404).
    for path in [
        "/api/permissions/other/nobody",
        "/api/permissions/nowhere/mgr",
    ] {
        assert_eq!(
            call(&b, "admin", Method::Put, path, all).body,
            Some(json!({"error": "bad_request", "reason": "vhost_or_user_not_found"})),
            "{path}"
        );
        assert_eq!(call(&b, "admin", Method::Delete, path, "").status, 404);
    }
    let users = |r: Response| -> Vec<String> {
        r.body
            .unwrap()
            .as_array()
            .unwrap()
            .iter()
            .map(|p| {
                format!(
                    "{}@{}",
                    p["user"].as_str().unwrap(),
                    p["vhost"].as_str().unwrap()
                )
            })
            .collect()
    };
    assert_eq!(
        users(get(&b, "admin", "/api/users/mgr/permissions")),
        ["mgr@/", "mgr@other"]
    );
    assert_eq!(
        users(get(&b, "admin", "/api/vhosts/other/permissions")),
        ["mgr@other"]
    );
    assert_eq!(
        get(&b, "admin", "/api/users/nobody/permissions").status,
        404
    );
    assert_eq!(
        get(&b, "admin", "/api/vhosts/nowhere/permissions").status,
        404
    );
    assert_eq!(get(&b, "mon", "/api/vhosts/other/permissions").status, 401);
    // DELETE: 204, then the permissions are gone (404), and only those.
    assert_eq!(
        call(
            &b,
            "admin",
            Method::Delete,
            "/api/permissions/other/mgr",
            ""
        )
        .status,
        204
    );
    assert_eq!(get(&b, "admin", "/api/permissions/other/mgr").status, 404);
    assert_eq!(
        call(
            &b,
            "admin",
            Method::Delete,
            "/api/permissions/other/mgr",
            ""
        )
        .status,
        404
    );
    assert_eq!(get(&b, "admin", "/api/permissions/%2F/mgr").status, 200);
    assert_eq!(
        call(&b, "mon", Method::Delete, "/api/permissions/%2F/mgr", "").status,
        401
    );
    // Users without any permission: mon and plain (and no one else).
    let names: Vec<Value> = get(&b, "admin", "/api/users/without-permissions")
        .body
        .unwrap()
        .as_array()
        .unwrap()
        .iter()
        .map(|u| u["name"].clone())
        .collect();
    assert_eq!(names, [json!("mon"), json!("plain")]);
    assert_eq!(
        get(&b, "admin", "/api/topic-permissions").body,
        Some(json!([]))
    );
    assert_eq!(get(&b, "mgr", "/api/topic-permissions").status, 401);
}

#[test]
fn exchange_to_exchange_bindings_and_the_bindings_of_one_object() {
    let b = broker();
    for (x, kind) in [("src", "topic"), ("dst", "fanout")] {
        let body = format!(r#"{{"type":"{kind}"}}"#);
        assert_eq!(
            call(
                &b,
                "mgr",
                Method::Put,
                &format!("/api/exchanges/%2F/{x}"),
                &body
            )
            .status,
            201
        );
    }
    call(&b, "mgr", Method::Put, "/api/queues/%2F/q", "{}");
    call(
        &b,
        "mgr",
        Method::Post,
        "/api/bindings/%2F/e/dst/q/q",
        r#"{"routing_key":""}"#,
    );
    let r = call(
        &b,
        "mgr",
        Method::Post,
        "/api/bindings/%2F/e/src/e/dst",
        r#"{"routing_key":"b.*"}"#,
    );
    assert_eq!(r.status, 201);
    assert_eq!(
        r.headers,
        vec![(
            "location",
            "/api/bindings/%2F/e/src/e/dst/b%2E%252A".to_string()
        )]
    );
    let e2e = json!({"source": "src", "vhost": "/", "destination": "dst",
                     "destination_type": "exchange", "routing_key": "b.*",
                     "arguments": {}, "properties_key": "b.%2A"});
    assert_eq!(
        get(&b, "mgr", "/api/bindings/%2F/e/src/e/dst").body,
        Some(json!([e2e]))
    );
    // One binding, found by its properties_key (as sent, or decoded once more).
    assert_eq!(
        get(&b, "mgr", "/api/bindings/%2F/e/src/e/dst/b.%252A").body,
        Some(e2e.clone())
    );
    assert_eq!(
        get(&b, "mgr", "/api/exchanges/%2F/src/bindings/source").body,
        Some(json!([e2e]))
    );
    let to_dst = get(&b, "mgr", "/api/exchanges/%2F/dst/bindings/destination")
        .body
        .unwrap();
    assert_eq!(to_dst, json!([e2e]));
    let from_dst = get(&b, "mgr", "/api/exchanges/%2F/dst/bindings/source")
        .body
        .unwrap();
    assert_eq!(from_dst[0]["destination"], "q");
    // A queue's bindings: the default exchange's first, then dst's.
    let q = get(&b, "mgr", "/api/queues/%2F/q/bindings").body.unwrap();
    let sources: Vec<&str> = q
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b["source"].as_str().unwrap())
        .collect();
    assert_eq!(sources, ["", "dst"]);
    for path in [
        "/api/exchanges/%2F/none/bindings/source",
        "/api/queues/%2F/none/bindings",
        "/api/bindings/%2F/e/src/e/none",
    ] {
        assert_eq!(get(&b, "mgr", path).status, 404, "{path}");
    }
    // A missing end: RabbitMQ's 404 naming it.
    assert_eq!(
        call(
            &b,
            "mgr",
            Method::Post,
            "/api/bindings/%2F/e/src/e/none",
            "{}"
        )
        .body,
        Some(json!({"error": "not_found", "reason": "no exchange 'none' in vhost '/'"}))
    );
    assert_eq!(
        call(
            &b,
            "mgr",
            Method::Post,
            "/api/bindings/%2F/e/none/q/q",
            "{}"
        )
        .body,
        Some(json!({"error": "not_found", "reason": "no exchange 'none' in vhost '/'"}))
    );
    assert_eq!(
        call(
            &b,
            "mgr",
            Method::Post,
            "/api/bindings/%2F/e/src/q/none",
            "{}"
        )
        .body,
        Some(json!({"error": "not_found", "reason": "no queue 'none' in vhost '/'"}))
    );
    assert_eq!(
        call(
            &b,
            "mgr",
            Method::Delete,
            "/api/bindings/%2F/e/src/e/dst/b.%2A",
            ""
        )
        .status,
        204
    );
    assert_eq!(
        get(&b, "mgr", "/api/bindings/%2F/e/src/e/dst").body,
        Some(json!([]))
    );
}

#[test]
fn one_vhosts_definitions_export_and_import_into_another_vhost() {
    let b = broker();
    for (path, body) in [
        ("/api/vhosts/v", ""),
        ("/api/exchanges/v/x", r#"{"type":"topic","durable":false}"#),
        (
            "/api/queues/v/q",
            r#"{"durable":true,"arguments":{"x-max-length":3}}"#,
        ),
        ("/api/queues/v/t", r#"{"durable":false,"auto_delete":true}"#),
        (
            "/api/policies/v/cap",
            r#"{"pattern":"^q","definition":{"max-length":10}}"#,
        ),
        (
            "/api/operator-policies/v/op",
            r#"{"pattern":"^","definition":{"max-length":99},"apply-to":"queues"}"#,
        ),
        ("/api/vhosts/w", ""),
    ] {
        assert_eq!(
            call(&b, "admin", Method::Put, path, body).status,
            201,
            "{path}"
        );
    }
    call(
        &b,
        "admin",
        Method::Post,
        "/api/bindings/v/e/x/q/q",
        r#"{"routing_key":"a.#"}"#,
    );
    let r = get(&b, "admin", "/api/definitions/v");
    assert_eq!(r.status, 200);
    let d = r.body.unwrap();
    // RabbitMQ 3.10's shape: no `vhost` on queues, exchanges and bindings; non-durable
    // objects too; operator policies as parameters.
    assert_eq!(
        d,
        json!({
            "rabbit_version": "3.10.8",
            "parameters": [{"vhost": "v", "component": "operator_policy", "name": "op",
                            "value": {"pattern": "^", "apply-to": "queues",
                                      "definition": {"max-length": 99}, "priority": 0}}],
            "policies": [{"vhost": "v", "name": "cap", "pattern": "^q", "apply-to": "all",
                          "definition": {"max-length": 10}, "priority": 0}],
            "queues": [
                {"name": "q", "durable": true, "auto_delete": false,
                 "arguments": {"x-max-length": 3}},
                {"name": "t", "durable": false, "auto_delete": true, "arguments": {}}
            ],
            "exchanges": [{"name": "x", "type": "topic", "durable": false,
                           "auto_delete": false, "internal": false, "arguments": {}}],
            "bindings": [{"source": "x", "destination": "q", "destination_type": "queue",
                          "routing_key": "a.#", "arguments": {}}],
        })
    );
    // The whole export carries the operator policy too, as a parameter.
    let all = get(&b, "admin", "/api/definitions").body.unwrap();
    assert_eq!(all["parameters"], d["parameters"]);
    assert_eq!(
        all["vhosts"],
        json!([{"name": "/"}, {"name": "other"}, {"name": "v"}, {"name": "w"}])
    );
    // Imported into w: the same objects, in w.
    let r = call(
        &b,
        "admin",
        Method::Post,
        "/api/definitions/w",
        &d.to_string(),
    );
    assert_eq!(r.status, 204, "{}", r.body_text());
    let mut again = get(&b, "admin", "/api/definitions/w").body.unwrap();
    for list in ["parameters", "policies"] {
        for item in again[list].as_array_mut().unwrap() {
            assert_eq!(item["vhost"], "w");
            item["vhost"] = json!("v");
        }
    }
    assert_eq!(again, d);
    // An existing queue is kept as it is, as RabbitMQ does; users and vhosts are ignored.
    let other = r#"{"queues":[{"name":"q","durable":false}],
                    "users":[{"name":"eve","password":"x","tags":""}],
                    "vhosts":[{"name":"elsewhere"}]}"#;
    assert_eq!(
        call(&b, "admin", Method::Post, "/api/definitions/w", other).status,
        204
    );
    assert_eq!(
        get(&b, "admin", "/api/queues/w/q").body.unwrap()["durable"],
        true
    );
    assert_eq!(get(&b, "admin", "/api/users/eve").status, 404);
    assert_eq!(get(&b, "admin", "/api/vhosts/elsewhere").status, 404);
    // A missing vhost: RabbitMQ's 400 to a GET, 404 to a POST; administrators only.
    assert_eq!(
        get(&b, "admin", "/api/definitions/nowhere").body,
        Some(json!({"error": "bad_request", "reason": "vhost_not_found"}))
    );
    let r = call(&b, "admin", Method::Post, "/api/definitions/nowhere", "{}");
    assert_eq!(
        (r.status, r.body),
        (
            404,
            Some(json!({"error": "not_found", "reason": "vhost_not_found"}))
        )
    );
    assert_eq!(get(&b, "mon", "/api/definitions/v").status, 401);
    assert_eq!(
        call(&b, "admin", Method::Post, "/api/definitions/w", "[").status,
        400
    );
}

#[test]
fn parameters_list_operator_policies_and_the_rest_is_empty() {
    let b = broker();
    let op = r#"{"pattern":"^","definition":{"max-length":9}}"#;
    assert_eq!(
        call(
            &b,
            "admin",
            Method::Put,
            "/api/operator-policies/%2F/op",
            op
        )
        .status,
        201
    );
    let param = json!({"vhost": "/", "component": "operator_policy", "name": "op",
                       "value": {"pattern": "^", "apply-to": "all",
                                 "definition": {"max-length": 9}, "priority": 0}});
    for path in [
        "/api/parameters",
        "/api/parameters/operator_policy",
        "/api/parameters/operator_policy/%2F",
    ] {
        assert_eq!(get(&b, "admin", path).body, Some(json!([param])), "{path}");
    }
    assert_eq!(
        get(&b, "admin", "/api/parameters/operator_policy/%2F/op").body,
        Some(param)
    );
    assert_eq!(
        get(&b, "admin", "/api/parameters/federation-upstream").body,
        Some(json!([]))
    );
    assert_eq!(
        get(&b, "admin", "/api/parameters/operator_policy/%2F/none").status,
        404
    );
    assert_eq!(get(&b, "mgr", "/api/parameters").status, 401);
    assert_eq!(
        get(&b, "pm", "/api/parameters/operator_policy/other").status,
        401
    );
    assert_eq!(
        get(&b, "pm", "/api/global-parameters").body,
        Some(json!([]))
    );
    assert_eq!(get(&b, "mgr", "/api/vhost-limits").body, Some(json!([])));
    assert_eq!(get(&b, "mgr", "/api/vhost-limits/other").status, 401);
    assert_eq!(get(&b, "mgr", "/api/extensions").body, Some(json!([])));
    assert_eq!(
        get(&b, "mgr", "/api/cluster-name").body,
        Some(json!({"name": "warren@test"}))
    );
}

#[test]
fn vhost_limits_are_put_listed_and_deleted_by_administrators() {
    let b = broker();
    let put = |user: &str, path: &str, body: &str| call(&b, user, Method::Put, path, body);
    assert_eq!(
        put(
            "mgr",
            "/api/vhost-limits/%2F/max-connections",
            r#"{"value":1}"#
        )
        .body,
        Some(json!({"error": "not_authorised", "reason": "Not administrator user"}))
    );
    assert_eq!(
        put(
            "admin",
            "/api/vhost-limits/nowhere/max-queues",
            r#"{"value":1}"#
        )
        .body,
        Some(json!({"error": "not_found", "reason": "vhost_not_found"}))
    );
    for (name, value) in [("max-connections", 10), ("max-queues", 3)] {
        let body = format!(r#"{{"value":{value}}}"#);
        let r = put("admin", &format!("/api/vhost-limits/%2F/{name}"), &body);
        assert_eq!(r.status, 204, "{:?}", r.body);
    }
    let listed = json!([{"vhost": "/", "value": {"max-connections": 10, "max-queues": 3}}]);
    assert_eq!(
        get(&b, "mgr", "/api/vhost-limits").body,
        Some(listed.clone())
    );
    assert_eq!(get(&b, "mgr", "/api/vhost-limits/%2F").body, Some(listed));
    // A vhost the caller does not see is left out of the listing.
    put(
        "admin",
        "/api/vhost-limits/other/max-queues",
        r#"{"value":0}"#,
    );
    assert_eq!(
        get(&b, "mgr", "/api/vhost-limits")
            .body
            .unwrap()
            .as_array()
            .unwrap()
            .len(),
        1
    );
    assert_eq!(
        get(&b, "admin", "/api/vhost-limits")
            .body
            .unwrap()
            .as_array()
            .unwrap()
            .len(),
        2
    );
    for (body, status) in [
        (r#"{"value":"x"}"#, 400),
        (r#"{}"#, 400),
        (r#"{"value":-1}"#, 204),
    ] {
        assert_eq!(
            put("admin", "/api/vhost-limits/%2F/max-queues", body).status,
            status,
            "{body}"
        );
    }
    assert_eq!(
        put(
            "admin",
            "/api/vhost-limits/%2F/max-channels",
            r#"{"value":1}"#
        )
        .status,
        400
    );
    assert_eq!(
        get(&b, "admin", "/api/vhost-limits/%2F/max-queues").status,
        405
    );
    let r = call(
        &b,
        "admin",
        Method::Delete,
        "/api/vhost-limits/%2F/max-connections",
        "",
    );
    assert_eq!(r.status, 204);
    assert_eq!(
        get(&b, "mgr", "/api/vhost-limits/%2F").body,
        Some(json!([{"vhost": "/", "value": {"max-queues": -1}}]))
    );
    // And the definitions carry them as RabbitMQ's `vhost-limits` parameters.
    let defs = get(&b, "admin", "/api/definitions").body.unwrap();
    let params: Vec<&serde_json::Value> = defs["parameters"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|p| p["component"] == "vhost-limits")
        .collect();
    assert_eq!(
        params,
        [
            &json!({"vhost": "/", "component": "vhost-limits", "name": "limits", "value": {"max-queues": -1}}),
            &json!({"vhost": "other", "component": "vhost-limits", "name": "limits", "value": {"max-queues": 0}}),
        ]
    );
}

#[test]
fn user_limits_are_put_listed_deleted_and_shown_on_the_user() {
    let b = broker();
    let put = |user: &str, path: &str, body: &str| call(&b, user, Method::Put, path, body);
    assert_eq!(
        put("mon", "/api/user-limits/mgr/max-channels", r#"{"value":2}"#).status,
        401
    );
    assert_eq!(
        put(
            "admin",
            "/api/user-limits/nobody/max-channels",
            r#"{"value":2}"#
        )
        .body,
        Some(json!({"error": "not_found", "reason": "user_not_found"}))
    );
    assert_eq!(
        put(
            "admin",
            "/api/user-limits/mgr/max-channels",
            r#"{"value":2}"#
        )
        .status,
        204
    );
    assert_eq!(
        put(
            "admin",
            "/api/user-limits/mgr/max-connections",
            r#"{"value":5}"#
        )
        .status,
        204
    );
    assert_eq!(
        put("admin", "/api/user-limits/mgr/max-queues", r#"{"value":5}"#).status,
        400
    );
    let value = json!({"max-channels": 2, "max-connections": 5});
    assert_eq!(
        get(&b, "mgr", "/api/user-limits").body,
        Some(json!([{"user": "mgr", "value": value}]))
    );
    assert_eq!(
        get(&b, "mgr", "/api/user-limits/admin").body,
        Some(json!([]))
    );
    assert_eq!(get(&b, "mgr", "/api/user-limits/nobody").status, 404);
    assert_eq!(
        get(&b, "admin", "/api/users/mgr").body.unwrap()["limits"],
        value
    );
    let defs = get(&b, "admin", "/api/definitions").body.unwrap();
    let mgr = defs["users"]
        .as_array()
        .unwrap()
        .iter()
        .find(|u| u["name"] == "mgr")
        .unwrap();
    assert_eq!(mgr["limits"], value);
    let r = call(
        &b,
        "admin",
        Method::Delete,
        "/api/user-limits/mgr/max-channels",
        "",
    );
    assert_eq!(r.status, 204);
    assert_eq!(
        get(&b, "admin", "/api/user-limits/mgr").body,
        Some(json!([{"user": "mgr", "value": {"max-connections": 5}}]))
    );
}

#[test]
fn definitions_import_limits_after_the_queues_they_cover() {
    let b = broker();
    let file = json!({
        "users": [{"name": "lim", "password": "pw", "tags": "", "limits": {"max-channels": 1}}],
        "vhosts": [{"name": "lv"}],
        "parameters": [{"vhost": "lv", "component": "vhost-limits", "name": "limits",
                        "value": {"max-queues": 1}}],
        "queues": [
            {"name": "q1", "vhost": "lv", "durable": true, "auto_delete": false, "arguments": {}},
            {"name": "q2", "vhost": "lv", "durable": true, "auto_delete": false, "arguments": {}}
        ]
    });
    let r = call(
        &b,
        "admin",
        Method::Post,
        "/api/definitions",
        &file.to_string(),
    );
    assert_eq!(r.status, 204, "{:?}", r.body);
    let meta = b.snapshot();
    assert_eq!(meta.vhost("lv").unwrap().queues.len(), 2);
    assert_eq!(meta.vhost_limit("lv", "max-queues"), Some(1));
    assert_eq!(meta.user_limit("lim", "max-channels"), Some(1));
}

#[test]
fn a_get_fetches_other_nodes_counts_for_the_queues_it_shows_only() {
    let q = |v: &str, n: &str| Some(CountsScope::Queue(v.into(), n.into()));
    assert_eq!(counts_scope("/api/queues"), Some(CountsScope::All));
    assert_eq!(counts_scope("/api/overview"), Some(CountsScope::All));
    assert_eq!(counts_scope("/api/vhosts/"), Some(CountsScope::All));
    assert_eq!(
        counts_scope("/api/queues/%2F"),
        Some(CountsScope::Vhost("/".into()))
    );
    assert_eq!(
        counts_scope("/api/vhosts/v1"),
        Some(CountsScope::Vhost("v1".into()))
    );
    assert_eq!(counts_scope("/api/queues/%2F/a%2Fb"), q("/", "a/b"));
    assert_eq!(counts_scope("/api/queues/%2F/q/bindings"), None);
    assert_eq!(counts_scope("/api/exchanges"), None);
    assert_eq!(counts_scope("/metrics"), None);
}

#[test]
fn a_single_queue_page_is_the_queues_row_of_the_listing() {
    let b = broker();
    for name in ["a", "b", "c"] {
        assert_eq!(
            call(
                &b,
                "admin",
                Method::Put,
                &format!("/api/queues/%2F/{name}"),
                "{}"
            )
            .status,
            201
        );
    }
    let listing = get(&b, "admin", "/api/queues/%2F").body.expect("listing");
    let b_row = listing
        .as_array()
        .expect("array")
        .iter()
        .find(|q| q["name"] == "b")
        .cloned()
        .expect("b listed");
    let page = get(&b, "admin", "/api/queues/%2F/b").body.expect("page");
    // The page adds Warren's ring fields to the listing's row.
    for (k, v) in b_row.as_object().expect("object") {
        assert_eq!(&page[k], v, "field {k}");
    }
    assert_eq!(get(&b, "admin", "/api/queues/%2F/nope").status, 404);
}

/// A node that answered shows its figures as RabbitMQ's fields (units, types and names the
/// management UI and rabbitmqadmin read); EXTERNAL is enabled only with an AMQPS listener.
#[test]
fn a_node_that_answered_shows_its_figures() {
    let b = broker();
    let stats = crate::broker::node_stats::NodeStats {
        mem_used: 50 << 20,
        mem_limit: 400 << 20,
        mem_alarm: false,
        disk_free: Some(7 << 30),
        disk_free_limit: 50_000_000,
        disk_free_alarm: true,
        fd_used: Some(42),
        fd_total: Some(1024),
        sockets_used: 3,
        uptime_ms: 61_000,
        os_pid: 4321,
        processors: 2,
        config_file: Some("/etc/warren/warren.toml".into()),
        db_dir: "/var/lib/warren".into(),
        listeners: Vec::new(),
        io: crate::metrics::IoSnapshot {
            write_count: 10,
            write_bytes: 4096,
            write_avg_ms: 0.25,
            msg_store_write_count: 4,
            ..Default::default()
        },
        cluster_links: vec![crate::broker::node_stats::ClusterLink {
            name: "warren2@test".into(),
            sock: Some(crate::broker::node_stats::Endpoint {
                ip: "127.0.0.1".into(),
                port: 40000,
            }),
            peer: Some(crate::broker::node_stats::Endpoint {
                ip: "127.0.0.2".into(),
                port: 25672,
            }),
            send_bytes: 1000,
            recv_bytes: 2000,
        }],
    };
    let counts = RemoteCountsByVhost::new();
    // The node's listeners as it reported them (not this node's: the object is the
    // reporting node's).
    let answer = |listeners: &[crate::mgmt::health::Listener]| {
        let mut stats = stats.clone();
        stats.listeners = listeners.to_vec();
        let figures = [("warren@test".to_string(), stats)].into_iter().collect();
        let ctx = Context {
            broker: &b,
            node: &node(),
            loopback_users: &[],
            remote_counts: &counts,
            listeners: &[],
            remote_sessions: &[],
            node_stats: &figures,
        };
        let req = Request::new(
            Method::Get,
            "/api/nodes/warren@test",
            Some(basic_auth("admin", "pw")),
        );
        answered(&ctx, &req).body.expect("a body")
    };
    let n = answer(&[on_loopback("amqp", 5672)]);
    for (field, value) in [
        ("name", json!("warren@test")),
        ("running", json!(true)),
        ("mem_used", json!(52_428_800)),
        ("mem_limit", json!(419_430_400)),
        ("mem_alarm", json!(false)),
        ("disk_free", json!(7_516_192_768u64)),
        ("disk_free_limit", json!(50_000_000)),
        ("disk_free_alarm", json!(true)),
        ("fd_used", json!(42)),
        ("fd_total", json!(1024)),
        ("sockets_used", json!(3)),
        ("sockets_total", json!(1024)),
        ("uptime", json!(61_000)),
        ("os_pid", json!("4321")),
        ("processors", json!(2)),
        ("partitions", json!([])),
        ("rates_mode", json!("none")),
        ("config_files", json!(["/etc/warren/warren.toml"])),
        ("db_dir", json!("/var/lib/warren")),
        ("log_files", json!(["<stdout>"])),
        ("io_write_count", json!(10)),
        ("io_write_bytes", json!(4096)),
        ("io_write_avg_time", json!(0.25)),
        ("msg_store_write_count", json!(4)),
        ("io_sync_count", json!(0)),
        (
            "cluster_links",
            json!([{"name": "warren2@test", "peer_addr": "127.0.0.2", "peer_port": 25672,
                    "sock_addr": "127.0.0.1", "sock_port": 40000, "send_bytes": 1000,
                    "recv_bytes": 2000, "stats": {"send_bytes": 1000, "recv_bytes": 2000}}]),
        ),
    ] {
        assert_eq!(n[field], value, "{field}");
    }
    let names = |key: &str, n: &Value| -> Vec<(String, bool)> {
        n[key]
            .as_array()
            .expect("a list")
            .iter()
            .map(|m| {
                (
                    m["name"].as_str().unwrap().to_string(),
                    m["enabled"] == true,
                )
            })
            .collect()
    };
    assert_eq!(
        names("exchange_types", &n),
        ["headers", "direct", "topic", "fanout"].map(|t| (t.to_string(), true))
    );
    assert_eq!(
        names("auth_mechanisms", &n),
        [("PLAIN", true), ("AMQPLAIN", true), ("EXTERNAL", false)].map(|(m, e)| (m.to_string(), e))
    );
    assert_eq!(n["contexts"], json!([]));
    let with_tls = answer(&[
        on_loopback("amqp", 5672),
        on_loopback("amqp/ssl", 5671),
        on_loopback("http", 15672),
    ]);
    assert_eq!(with_tls["auth_mechanisms"][2]["enabled"], true);
    assert_eq!(
        with_tls["contexts"],
        json!([{"node": "warren@test", "description": "RabbitMQ Management", "path": "/",
                "port": "15672"}])
    );
}

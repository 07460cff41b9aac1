//! Runtime parameters and limits as RabbitMQ 3.10 lists them. RabbitMQ keeps operator
//! policies as parameters of component `operator_policy`, so
//! `/api/parameters[/{component}[/{vhost}[/{name}]]]` lists Warren's operator policies that
//! way; Warren has no other component (no federation, no shovels) and no global parameters
//! (`/api/global-parameters` is empty). Only GET: operator policies are changed through
//! `/api/operator-policies`.
//!
//! Vhost and user limits ([`crate::meta::limits`]) have RabbitMQ's own endpoints:
//! `/api/vhost-limits[/{vhost}]` and `/api/user-limits[/{user}]` list them to any
//! management user (`is_authorized_vhost_visible`; RabbitMQ lists every user's limits to
//! them too), and `PUT`/`DELETE /api/vhost-limits/{vhost}/{name}` and
//! `/api/user-limits/{user}/{name}` with `{"value": N}` change one limit, for
//! administrators only (`rabbit_mgmt_wm_limit`, `rabbit_mgmt_wm_user_limit`).

use serde_json::{json, Value};

use super::definitions::operator_policy_parameter;
use super::resources::{body_object, commit, not_authorised_object, reply, vhost_refused};
use super::{Caller, Handled, Method, Request, Response};
use crate::meta::limits::{self, LimitScope};
use crate::meta::{Command, MetaState};

/// The component Warren has.
const OPERATOR_POLICY: &str = "operator_policy";

/// `/api/parameters[/{component}[/{vhost}[/{name}]]]` (policymakers; the vhosts they have
/// access to, every vhost for administrators).
pub fn list(meta: &MetaState, caller: &Caller, path: &[&str]) -> Response {
    if !caller.tags.policymaker {
        return not_authorised_object();
    }
    let (component, vhost, name) = match path {
        [] => (None, None, None),
        [c] => (Some(*c), None, None),
        [c, v] => (Some(*c), Some(*v), None),
        [c, v, n] => (Some(*c), Some(*v), Some(*n)),
        _ => return Response::not_found(),
    };
    if let Some(v) = vhost {
        if meta.vhost(v).is_none() {
            return Response::not_found();
        }
        if !caller.tags.administrator && !caller.can_access(meta, v) {
            return vhost_refused();
        }
    }
    // Another component has no parameters here.
    let known = component.is_none_or(|c| c == OPERATOR_POLICY);
    let items: Vec<Value> = meta
        .vhosts
        .values()
        .filter(|v| known && vhost.is_none_or(|n| v.name == n))
        .filter(|v| caller.tags.administrator || caller.can_access(meta, &v.name))
        .flat_map(|v| v.operator_policies.values())
        .filter(|p| name.is_none_or(|n| p.name == n))
        .map(operator_policy_parameter)
        .collect();
    match name {
        None => Response::ok(Value::Array(items)),
        Some(_) => items
            .into_iter()
            .next()
            .map_or_else(Response::not_found, Response::ok),
    }
}

/// `/api/global-parameters`: none in Warren (policymakers).
pub fn global(caller: &Caller) -> Response {
    if !caller.tags.policymaker {
        return not_authorised_object();
    }
    Response::ok(json!([]))
}

/// `/api/vhost-limits[/{vhost}]`: `[{"vhost": .., "value": {..}}]` for the vhosts the caller
/// sees (404 for a missing vhost, 401 for one the user may not see).
pub fn vhost_limits(meta: &MetaState, caller: &Caller, vhost: Option<&str>) -> Response {
    if let Some(v) = vhost {
        if meta.vhost(v).is_none() {
            return Response::not_found();
        }
        if !caller.sees_vhost(meta, v) {
            return vhost_refused();
        }
    }
    let items: Vec<Value> = meta
        .vhost_limits
        .iter()
        .filter(|(v, _)| vhost.is_none_or(|n| n == v.as_str()))
        .filter(|(v, _)| caller.sees_vhost(meta, v))
        .map(|(v, l)| json!({"vhost": v, "value": limits::to_json(l)}))
        .collect();
    Response::ok(Value::Array(items))
}

/// `/api/user-limits[/{user}]`: `[{"user": .., "value": {..}}]` (404 for a missing user).
pub fn user_limits(meta: &MetaState, user: Option<&str>) -> Response {
    if user.is_some_and(|u| !meta.users.contains_key(u)) {
        return Response::not_found();
    }
    let items: Vec<Value> = meta
        .user_limits
        .iter()
        .filter(|(u, _)| user.is_none_or(|n| n == u.as_str()))
        .map(|(u, l)| json!({"user": u, "value": limits::to_json(l)}))
        .collect();
    Response::ok(Value::Array(items))
}

/// `PUT` / `DELETE /api/vhost-limits/{vhost}/{name}` and `/api/user-limits/{user}/{name}`:
/// administrators only (401 first, as RabbitMQ authorises before it looks); a missing
/// vhost or user is 404 `vhost_not_found` / `user_not_found`; `PUT {"value": N}` updates
/// that one limit and answers 204, as does `DELETE`; other methods 405.
pub fn change(
    meta: &MetaState,
    caller: &Caller,
    req: &Request,
    scope: LimitScope,
    name: &str,
) -> Handled {
    if !matches!(req.method, Method::Put | Method::Delete) {
        return reply(Response::empty(405));
    }
    if !caller.tags.administrator {
        return reply(Response::not_authorised("Not administrator user"));
    }
    let missing = match &scope {
        LimitScope::Vhost(v) => meta.vhost(v).is_none().then_some("vhost_not_found"),
        LimitScope::User(u) => (!meta.users.contains_key(u)).then_some("user_not_found"),
    };
    if let Some(reason) = missing {
        return reply(Response::error(404, "not_found", reason));
    }
    if req.method == Method::Delete {
        let name = Some(name.to_string());
        return commit(
            vec![Command::ClearLimits { scope, name }],
            Response::empty(204),
        );
    }
    let body = match body_object(req) {
        Ok(b) => b,
        Err(r) => return reply(r),
    };
    let Some(value) = body.get("value") else {
        return reply(Response::bad_request("key_missing: value"));
    };
    let given = match limits::parse_json(&json!({ name: value })) {
        Ok(l) => l,
        Err(e) => return reply(Response::bad_request(e)),
    };
    if let Err(e) = scope.validate(&given) {
        return reply(Response::bad_request(e.to_string()));
    }
    let set = Command::SetLimits {
        scope,
        limits: given,
        replace: false,
    };
    commit(vec![set], Response::empty(204))
}

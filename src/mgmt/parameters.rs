//! Runtime parameters and limits as RabbitMQ 3.10 lists them. RabbitMQ keeps operator
//! policies as parameters of component `operator_policy`, so
//! `/api/parameters[/{component}[/{vhost}[/{name}]]]` lists Warren's operator policies that
//! way; Warren has no other component (no federation, no shovels), no global parameters
//! (`/api/global-parameters` is empty) and no vhost limits (`/api/vhost-limits` is empty).
//! Only GET: operator policies are changed through `/api/operator-policies`.

use serde_json::{json, Value};

use super::definitions::operator_policy_parameter;
use super::resources::{not_authorised_object, vhost_refused};
use super::{Caller, Response};
use crate::meta::MetaState;

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

/// `/api/vhost-limits[/{vhost}]`: none in Warren (404 for a missing vhost, 401 for one the
/// user may not see).
pub fn vhost_limits(meta: &MetaState, caller: &Caller, vhost: Option<&str>) -> Response {
    if let Some(v) = vhost {
        if meta.vhost(v).is_none() {
            return Response::not_found();
        }
        if !caller.sees_vhost(meta, v) {
            return vhost_refused();
        }
    }
    Response::ok(json!([]))
}

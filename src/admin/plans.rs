//! Plans: what a request does. A listing is answered at once ([`super::listing`]); a change
//! is checked against the metadata snapshot and returned as the [`Command`] to commit
//! ([`Handled::Commit`]), which the node's runtime commits through its `MetaCommit` (Raft on a
//! clustered node) before it answers.

use super::json;
use super::listing::{self, missing_owner};
use super::mirrors;
use super::requests::{NodeInfo, RemoteCounts, Request, Response};
use super::wire::Auth;
use crate::broker::Broker;
use crate::meta::limits::{self, LimitScope};
use crate::meta::policy::{ApplyTo, Policy};
use crate::meta::state::{Permission, User};
use crate::meta::Command;
use crate::time::Instant;

/// The tag a user needs to use the admin endpoint.
pub const ADMIN_TAG: &str = "administrator";

/// Checks credentials: the password must match and the user carry the `administrator` tag.
/// The refusal text does not say which of the two failed.
pub fn authenticate(broker: &Broker, auth: &Auth) -> Response {
    let meta = broker.snapshot();
    let ok = meta.users.get(&auth.user).is_some_and(|u| {
        u.password_matches(&auth.password) && u.tags.iter().any(|t| t == ADMIN_TAG)
    });
    if ok {
        Response::done(format!("authenticated as '{}'", auth.user))
    } else {
        Response::refused(format!(
            "authentication failed for user '{}' (bad credentials or not an administrator)",
            auth.user
        ))
    }
}

/// What a request needs: an answer now, or a metadata command to commit first.
#[derive(Debug)]
pub enum Handled {
    /// The answer.
    Reply(Response),
    /// Commit `command` (through the node's `MetaCommit`); on success answer `ok`, on
    /// refusal the error's text.
    Commit {
        /// The change.
        command: Command,
        /// The success message.
        ok: String,
    },
}

/// Handles one request on a single node: commands are applied to `broker` at once.
pub fn handle(broker: &Broker, node: &NodeInfo, request: &Request, now: Instant) -> Response {
    match plan(broker, node, request) {
        Handled::Reply(r) => r,
        Handled::Commit { command, ok } => match broker.apply(&command, now) {
            Ok(_) => Response::done(ok),
            Err(e) => Response::refused(e.to_string()),
        },
    }
}

/// Handles one request up to the metadata change it makes, if any: listings are answered
/// from `broker`; a change is checked and returned as the command to commit.
pub fn plan(broker: &Broker, node: &NodeInfo, request: &Request) -> Handled {
    plan_with_counts(broker, node, request, &RemoteCounts::new())
}

/// [`plan`], with the counts of queues of other nodes that the caller fetched.
pub fn plan_with_counts(
    broker: &Broker,
    node: &NodeInfo,
    request: &Request,
    remote_counts: &RemoteCounts,
) -> Handled {
    let mut commit = None;
    let reply = plan_inner(broker, node, request, &mut commit, remote_counts);
    match commit {
        Some((command, ok)) if reply.ok => Handled::Commit { command, ok },
        _ => Handled::Reply(reply),
    }
}

fn plan_inner(
    broker: &Broker,
    node: &NodeInfo,
    request: &Request,
    commit: &mut Option<(Command, String)>,
    remote_counts: &RemoteCounts,
) -> Response {
    let meta = broker.snapshot();
    let mut apply = |cmd: Command, ok: String| {
        *commit = Some((cmd, ok.clone()));
        Response::done(ok)
    };
    match request {
        Request::ListQueues { .. }
        | Request::ListExchanges { .. }
        | Request::ListBindings { .. }
        | Request::ListUsers
        | Request::ListVhosts { .. }
        | Request::ListPermissions { .. }
        | Request::ListPolicies { .. }
        | Request::ListLimits { .. }
        | Request::ClusterStatus
        | Request::ListConnections { .. }
        | Request::ListChannels { .. }
        | Request::ListConsumers { .. } => listing::answer(broker, node, request, remote_counts),
        Request::AddUser { name, password } => {
            if name.is_empty() {
                return Response::refused("the user name must not be empty");
            }
            if meta.users.contains_key(name) {
                return Response::refused(format!("user '{name}' already exists"));
            }
            apply(
                Command::PutUser(User {
                    name: name.clone(),
                    password: User::hash_password(password, broker.new_salt()),
                    tags: Vec::new(),
                }),
                format!("Adding user \"{name}\" ..."),
            )
        }
        Request::DeleteUser { name } => apply(
            Command::DeleteUser { name: name.clone() },
            format!("Deleting user \"{name}\" ..."),
        ),
        Request::ChangePassword { name, password } => {
            let Some(u) = meta.users.get(name) else {
                return Response::refused(format!("no user '{name}'"));
            };
            apply(
                Command::PutUser(User {
                    password: User::hash_password(password, broker.new_salt()),
                    ..u.clone()
                }),
                format!("Changing password for user \"{name}\" ..."),
            )
        }
        Request::SetUserTags { name, tags } => {
            let Some(u) = meta.users.get(name) else {
                return Response::refused(format!("no user '{name}'"));
            };
            apply(
                Command::PutUser(User {
                    tags: tags.clone(),
                    ..u.clone()
                }),
                format!(
                    "Setting tags for user \"{name}\" to [{}] ...",
                    tags.join(", ")
                ),
            )
        }
        Request::SetPermissions {
            vhost,
            user,
            configure,
            write,
            read,
        } => {
            for (what, re) in [("configure", configure), ("write", write), ("read", read)] {
                if let Err(e) = regex::Regex::new(re) {
                    return Response::refused(format!("invalid {what} regex '{re}': {e}"));
                }
            }
            apply(
                Command::SetPermissions(Permission {
                    user: user.clone(),
                    vhost: vhost.clone(),
                    configure: configure.clone(),
                    write: write.clone(),
                    read: read.clone(),
                }),
                format!("Setting permissions for user \"{user}\" in vhost \"{vhost}\" ..."),
            )
        }
        Request::ClearPermissions { vhost, user } => {
            if !meta.users.contains_key(user) {
                return Response::refused(format!("User \"{user}\" does not exist"));
            }
            if meta.vhost(vhost).is_none() {
                return Response::refused(format!("Virtual host \"{vhost}\" does not exist"));
            }
            apply(
                Command::ClearPermissions {
                    user: user.clone(),
                    vhost: vhost.clone(),
                },
                format!("Clearing permissions for user \"{user}\" in vhost \"{vhost}\" ..."),
            )
        }
        Request::SetLimits { scope, json } => {
            if let Some(refusal) = missing_owner(&meta, scope) {
                return refusal;
            }
            let limits = match serde_json::from_str(json)
                .map_err(|e| format!("JSON decoding error. Reason: {e}"))
                .and_then(|v| limits::parse_json(&v))
            {
                Ok(l) => l,
                Err(e) => return Response::refused(e),
            };
            if let Err(e) = scope.validate(&limits) {
                return Response::refused(e.to_string());
            }
            let (replace, ok) = match scope {
                LimitScope::Vhost(v) => (
                    true,
                    format!("Setting vhost limits to \"{json}\" for vhost \"{v}\" ..."),
                ),
                LimitScope::User(u) => (
                    false,
                    format!("Setting user limits to \"{json}\" for user \"{u}\" ..."),
                ),
            };
            apply(
                Command::SetLimits {
                    scope: scope.clone(),
                    limits,
                    replace,
                },
                ok,
            )
        }
        Request::ClearLimits { scope, name } => {
            if let Some(refusal) = missing_owner(&meta, scope) {
                return refusal;
            }
            let ok = match (scope, name) {
                (LimitScope::Vhost(v), _) => format!("Clearing vhost \"{v}\" limits ..."),
                (LimitScope::User(u), None) => {
                    format!("Clearing all limits for user \"{u}\" ...")
                }
                (LimitScope::User(u), Some(n)) => {
                    format!("Clearing \"{n}\" limit for user \"{u}\" ...")
                }
            };
            apply(
                Command::ClearLimits {
                    scope: scope.clone(),
                    name: name.clone(),
                },
                ok,
            )
        }
        Request::AddVhost { name } => {
            if name.is_empty() {
                return Response::refused("the vhost name must not be empty");
            }
            apply(
                Command::AddVhost { name: name.clone() },
                format!("Adding vhost \"{name}\" ..."),
            )
        }
        Request::DeleteVhost { name } => apply(
            Command::DeleteVhost { name: name.clone() },
            format!("Deleting vhost \"{name}\" ..."),
        ),
        Request::SetPolicy {
            vhost,
            name,
            pattern,
            definition,
            priority,
            apply_to,
            operator,
        } => {
            let definition = match json::parse_definition(definition) {
                Ok(d) => d,
                Err(e) => return Response::refused(format!("Could not parse JSON document: {e}")),
            };
            let Some(apply_to) = ApplyTo::parse(apply_to) else {
                return Response::refused(format!(
                    "invalid --apply-to '{apply_to}' (one of queues, exchanges, all)"
                ));
            };
            let policy = Policy {
                vhost: vhost.clone(),
                name: name.clone(),
                pattern: pattern.clone(),
                compiled: Default::default(),
                apply_to,
                priority: *priority,
                definition,
            };
            if let Err(e) = policy.validate(*operator) {
                return Response::refused(e.to_string());
            }
            let kind = if *operator {
                "operator policy"
            } else {
                "policy"
            };
            apply(
                Command::SetPolicy {
                    policy,
                    operator: *operator,
                },
                format!(
                    "Setting {kind} \"{name}\" for pattern \"{pattern}\" in vhost \"{vhost}\" ..."
                ),
            )
        }
        Request::ClearPolicy {
            vhost,
            name,
            operator,
        } => {
            let exists = meta.vhost(vhost).is_some_and(|v| {
                if *operator {
                    v.operator_policies.contains_key(name)
                } else {
                    v.policies.contains_key(name)
                }
            });
            if !exists {
                return Response::refused(format!(
                    "Parameter does not exist: no policy '{name}' in vhost '{vhost}'"
                ));
            }
            let kind = if *operator {
                "operator policy"
            } else {
                "policy"
            };
            apply(
                Command::ClearPolicy {
                    vhost: vhost.clone(),
                    name: name.clone(),
                    operator: *operator,
                },
                format!("Clearing {kind} \"{name}\" on vhost \"{vhost}\" ..."),
            )
        }
        Request::JoinCluster { .. } => {
            Response::refused("this node is not clustered: start it with a [cluster] section")
        }
        Request::ForgetClusterNode { node } => {
            let found = meta
                .nodes
                .values()
                .find(|n| n.name == *node || n.id.to_string() == *node);
            match found {
                None => Response::refused(format!("no cluster node '{node}'")),
                Some(n) if n.id == broker.node_id() => {
                    Response::refused("a node cannot forget itself; run this on another node")
                }
                Some(n) => apply(
                    Command::ForgetNode { id: n.id },
                    format!("forgot node {} ({})", n.name, n.id),
                ),
            }
        }
        Request::RegisterMember(record) => {
            if broker.node_id() == 0 {
                return Response::refused("this node is not clustered");
            }
            apply(
                Command::RegisterNode(record.clone()),
                format!("registered node {} ({})", record.name, record.id),
            )
        }
        Request::SyncQueue {
            vhost,
            queue,
            cancel,
        } => {
            let Some(v) = meta.vhost(vhost) else {
                return Response::refused(format!("no vhost '{vhost}'"));
            };
            if !v.queues.contains_key(queue) {
                return Response::refused(format!("no queue '{queue}' in vhost '{vhost}'"));
            }
            // Whether it is mirrored is the state machine's call (it refuses with "not
            // mirrored"): it sees the set as of the commit, not as of this snapshot.
            let ok = if *cancel {
                format!("Stopping synchronising queue '{queue}' in vhost '{vhost}' ...")
            } else {
                format!("Synchronising queue '{queue}' in vhost '{vhost}' ...")
            };
            apply(
                Command::SyncQueue {
                    vhost: vhost.clone(),
                    queue: queue.clone(),
                    cancel: *cancel,
                },
                ok,
            )
        }
        Request::ForcePromoteMirror { vhost, queue, node } => {
            match mirrors::force_promotion(&meta, vhost, queue, node.as_deref()) {
                Err(e) => Response::refused(e.to_string()),
                // At the epoch the choice was made at: if a promotion happened since, the
                // compare-and-set refuses this one rather than promote twice.
                Ok(p) => apply(
                    Command::PromoteMirror {
                        vhost: vhost.clone(),
                        queue: queue.clone(),
                        expected_epoch: p.epoch,
                        node: p.node,
                    },
                    format!(
                        "Promoting the mirror on node {} to master of queue '{queue}' in vhost '{vhost}' (epoch {}) ...",
                        p.name,
                        p.epoch + 1
                    ),
                ),
            }
        }
        // The definitions format is the management API's, which builds on this module.
        Request::ExportDefinitions | Request::ImportDefinitions { .. } => {
            Response::refused("definitions are exported and imported by the node's runtime")
        }
    }
}

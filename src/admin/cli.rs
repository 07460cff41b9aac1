//! Parses `rabbitmqctl`-style command arguments (`COMMAND [-p VHOST] ARGS...`) into a
//! [`Request`]. Pure, so `warrenctl` and tests share it.

use super::Request;
use crate::meta::limits::LimitScope;

/// A usage error: the text to print, naming the command's synopsis.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct UsageError(pub String);

/// The commands `warrenctl` knows, with their synopses.
pub const COMMANDS: &[(&str, &str)] = &[
    ("list_queues", "list_queues [-p VHOST] [COLUMN ...]"),
    ("list_exchanges", "list_exchanges [-p VHOST] [COLUMN ...]"),
    ("list_bindings", "list_bindings [-p VHOST] [COLUMN ...]"),
    ("list_users", "list_users"),
    ("list_vhosts", "list_vhosts [name]"),
    ("list_permissions", "list_permissions [-p VHOST]"),
    ("list_connections", "list_connections [COLUMN ...]"),
    ("list_channels", "list_channels [COLUMN ...]"),
    ("list_consumers", "list_consumers [-p VHOST] [COLUMN ...]"),
    ("list_policies", "list_policies [-p VHOST]"),
    ("list_operator_policies", "list_operator_policies [-p VHOST]"),
    ("add_user", "add_user USER PASSWORD"),
    ("delete_user", "delete_user USER"),
    ("change_password", "change_password USER PASSWORD"),
    ("set_user_tags", "set_user_tags USER [TAG ...]"),
    (
        "set_permissions",
        "set_permissions [-p VHOST] USER CONF WRITE READ",
    ),
    ("clear_permissions", "clear_permissions [-p VHOST] USER"),
    ("add_vhost", "add_vhost VHOST"),
    ("delete_vhost", "delete_vhost VHOST"),
    (
        "set_policy",
        "set_policy [-p VHOST] [--priority N] [--apply-to queues|exchanges|all] NAME PATTERN DEFINITION",
    ),
    ("clear_policy", "clear_policy [-p VHOST] NAME"),
    (
        "set_operator_policy",
        "set_operator_policy [-p VHOST] [--priority N] [--apply-to queues|exchanges|all] NAME PATTERN DEFINITION",
    ),
    ("clear_operator_policy", "clear_operator_policy [-p VHOST] NAME"),
    ("cluster_status", "cluster_status"),
    ("join_cluster", "join_cluster SEED_ADMIN_ADDRESS"),
    ("forget_cluster_node", "forget_cluster_node NODE"),
    ("sync_queue", "sync_queue [-p VHOST] QUEUE"),
    (
        "export_definitions",
        "export_definitions PATH|-  (RabbitMQ's definitions JSON, to a file or stdout)",
    ),
    (
        "import_definitions",
        "import_definitions PATH|-  (RabbitMQ's definitions JSON, from a file or stdin)",
    ),
    ("cancel_sync_queue", "cancel_sync_queue [-p VHOST] QUEUE"),
    (
        "set_vhost_limits",
        "set_vhost_limits [-p VHOST] DEFINITION  (JSON: {\"max-connections\": N, \"max-queues\": N}; negative: no limit)",
    ),
    ("clear_vhost_limits", "clear_vhost_limits [-p VHOST]"),
    ("list_vhost_limits", "list_vhost_limits [-p VHOST] [--global]"),
    (
        "set_user_limits",
        "set_user_limits USER DEFINITION  (JSON: {\"max-connections\": N, \"max-channels\": N}; negative: no limit)",
    ),
    ("clear_user_limits", "clear_user_limits USER LIMIT|all"),
    ("list_user_limits", "list_user_limits [--user USER] [--global]"),
    (
        "force_promote_mirror",
        "force_promote_mirror [-p VHOST] QUEUE [NODE]  (Warren only: promote a mirror of a queue whose master is gone, synchronised or not)",
    ),
];

fn synopsis(command: &str) -> &'static str {
    COMMANDS
        .iter()
        .find(|(c, _)| *c == command)
        .map(|(_, s)| *s)
        .unwrap_or("")
}

/// Parses `command` and its arguments.
pub fn parse(command: &str, args: &[String]) -> Result<Request, UsageError> {
    if !COMMANDS.iter().any(|(c, _)| *c == command) {
        return Err(UsageError(format!(
            "unknown command '{command}'; known commands: {}",
            COMMANDS
                .iter()
                .map(|(c, _)| *c)
                .collect::<Vec<_>>()
                .join(", ")
        )));
    }
    let usage = |why: String| UsageError(format!("{why}\nUsage: warrenctl {}", synopsis(command)));
    let mut vhost = "/".to_string();
    let mut priority: i64 = 0;
    let mut apply_to = "all".to_string();
    let mut pos: Vec<String> = Vec::new();
    let policy_cmd = command.starts_with("set_") && command.ends_with("policy");
    let takes_vhost = command.contains("queue")
        || command.contains("mirror")
        || command.contains("exchanges")
        || command.contains("bindings")
        || command.contains("consumers")
        || command.contains("permissions")
        || command.contains("polic")
        || command.contains("vhost_limits");
    let list_limits = command.starts_with("list_") && command.ends_with("_limits");
    let mut global = false;
    let mut limits_user: Option<String> = None;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut value = |name: &str| {
            it.next()
                .cloned()
                .ok_or_else(|| usage(format!("option {name} needs a value")))
        };
        match a.as_str() {
            "-p" | "--vhost" if takes_vhost => vhost = value(a)?,
            "--priority" if policy_cmd => {
                let v = value(a)?;
                priority = v
                    .parse()
                    .map_err(|_| usage(format!("--priority '{v}' is not an integer")))?;
            }
            "--apply-to" if policy_cmd => apply_to = value(a)?,
            "--global" if list_limits => global = true,
            "--user" | "-u" if command == "list_user_limits" => limits_user = Some(value(a)?),
            "--" => {
                pos.extend(it.by_ref().cloned());
                break;
            }
            s if s.starts_with('-')
                && s.len() > 1
                && !s[1..].starts_with(|c: char| c.is_ascii_digit()) =>
            {
                return Err(usage(format!("unknown option '{s}'")))
            }
            _ => pos.push(a.clone()),
        }
    }
    let exact = |n: usize| -> Result<(), UsageError> {
        if pos.len() == n {
            Ok(())
        } else {
            Err(usage(format!(
                "expected {n} argument(s), got {}",
                pos.len()
            )))
        }
    };
    Ok(match command {
        "list_queues" => Request::ListQueues {
            vhost,
            columns: pos,
        },
        "list_exchanges" => Request::ListExchanges {
            vhost,
            columns: pos,
        },
        "list_bindings" => Request::ListBindings {
            vhost,
            columns: pos,
        },
        "list_users" => {
            exact(0)?;
            Request::ListUsers
        }
        "list_vhosts" => Request::ListVhosts { columns: pos },
        "list_connections" => Request::ListConnections { columns: pos },
        "list_channels" => Request::ListChannels { columns: pos },
        "list_consumers" => Request::ListConsumers {
            vhost,
            columns: pos,
        },
        "list_permissions" => {
            exact(0)?;
            Request::ListPermissions { vhost }
        }
        "list_policies" | "list_operator_policies" => {
            exact(0)?;
            Request::ListPolicies {
                vhost,
                operator: command == "list_operator_policies",
            }
        }
        "add_user" | "change_password" => {
            exact(2)?;
            let [name, password]: [String; 2] =
                pos.try_into().map_err(|_| usage("bad arguments".into()))?;
            if command == "add_user" {
                Request::AddUser { name, password }
            } else {
                Request::ChangePassword { name, password }
            }
        }
        "delete_user" => {
            exact(1)?;
            Request::DeleteUser {
                name: pos[0].clone(),
            }
        }
        "set_user_tags" => {
            if pos.is_empty() {
                return Err(usage("expected a user name".into()));
            }
            Request::SetUserTags {
                name: pos[0].clone(),
                tags: pos[1..].to_vec(),
            }
        }
        "set_permissions" => {
            exact(4)?;
            Request::SetPermissions {
                vhost,
                user: pos[0].clone(),
                configure: pos[1].clone(),
                write: pos[2].clone(),
                read: pos[3].clone(),
            }
        }
        "set_vhost_limits" => {
            exact(1)?;
            Request::SetLimits {
                scope: LimitScope::Vhost(vhost),
                json: pos[0].clone(),
            }
        }
        "clear_vhost_limits" => {
            exact(0)?;
            Request::ClearLimits {
                scope: LimitScope::Vhost(vhost),
                name: None,
            }
        }
        "list_vhost_limits" => {
            exact(0)?;
            Request::ListLimits {
                scope: (!global).then_some(LimitScope::Vhost(vhost)),
                users: false,
            }
        }
        "set_user_limits" => {
            exact(2)?;
            Request::SetLimits {
                scope: LimitScope::User(pos[0].clone()),
                json: pos[1].clone(),
            }
        }
        "clear_user_limits" => {
            exact(2)?;
            Request::ClearLimits {
                scope: LimitScope::User(pos[0].clone()),
                name: (pos[1] != "all").then(|| pos[1].clone()),
            }
        }
        "list_user_limits" => {
            exact(0)?;
            // As rabbitmqctl: `guest` unless a user or --global is given.
            let user = limits_user.unwrap_or_else(|| "guest".to_string());
            Request::ListLimits {
                scope: (!global).then_some(LimitScope::User(user)),
                users: true,
            }
        }
        "clear_permissions" => {
            exact(1)?;
            Request::ClearPermissions {
                vhost,
                user: pos[0].clone(),
            }
        }
        "add_vhost" | "delete_vhost" => {
            exact(1)?;
            let name = pos[0].clone();
            if command == "add_vhost" {
                Request::AddVhost { name }
            } else {
                Request::DeleteVhost { name }
            }
        }
        "set_policy" | "set_operator_policy" => {
            exact(3)?;
            if !matches!(apply_to.as_str(), "queues" | "exchanges" | "all") {
                return Err(usage(format!(
                    "--apply-to '{apply_to}' must be one of queues, exchanges, all"
                )));
            }
            Request::SetPolicy {
                vhost,
                name: pos[0].clone(),
                pattern: pos[1].clone(),
                definition: pos[2].clone(),
                priority,
                apply_to,
                operator: command == "set_operator_policy",
            }
        }
        "clear_policy" | "clear_operator_policy" => {
            exact(1)?;
            Request::ClearPolicy {
                vhost,
                name: pos[0].clone(),
                operator: command == "clear_operator_policy",
            }
        }
        "cluster_status" => {
            exact(0)?;
            Request::ClusterStatus
        }
        "join_cluster" => {
            exact(1)?;
            Request::JoinCluster {
                seed: pos[0].clone(),
            }
        }
        "forget_cluster_node" => {
            exact(1)?;
            Request::ForgetClusterNode {
                node: pos[0].clone(),
            }
        }
        "sync_queue" | "cancel_sync_queue" => {
            exact(1)?;
            Request::SyncQueue {
                vhost,
                queue: pos[0].clone(),
                cancel: command == "cancel_sync_queue",
            }
        }
        "force_promote_mirror" => {
            if !(1..=2).contains(&pos.len()) {
                return Err(usage(format!(
                    "expected a queue name and at most one node, got {} argument(s)",
                    pos.len()
                )));
            }
            let mut pos = pos.into_iter();
            match (pos.next(), pos.next()) {
                (Some(queue), node) => Request::ForcePromoteMirror { vhost, queue, node },
                (None, _) => return Err(usage("expected a queue name".into())),
            }
        }
        "export_definitions" => {
            exact(1)?;
            Request::ExportDefinitions
        }
        // The file is read by `warrenctl` ([`definitions_path`]): the request carries its text.
        "import_definitions" => {
            exact(1)?;
            Request::ImportDefinitions {
                json: String::new(),
            }
        }
        _ => return Err(UsageError(format!("unknown command '{command}'"))),
    })
}

/// The file argument of `export_definitions` and `import_definitions` (`-`: stdout or
/// stdin).
pub fn definitions_path(command: &str, args: &[String]) -> Option<String> {
    matches!(command, "export_definitions" | "import_definitions")
        .then(|| args.last().cloned())
        .flatten()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(v: &[&str]) -> Vec<String> {
        v.iter().map(|x| x.to_string()).collect()
    }

    #[test]
    fn parses_policies_with_options_anywhere() {
        let r = parse(
            "set_policy",
            &s(&[
                "-p",
                "v",
                "lim",
                "^q",
                "{\"max-length\":1}",
                "--priority",
                "3",
                "--apply-to",
                "queues",
            ]),
        )
        .unwrap();
        assert_eq!(
            r,
            Request::SetPolicy {
                vhost: "v".into(),
                name: "lim".into(),
                pattern: "^q".into(),
                definition: "{\"max-length\":1}".into(),
                priority: 3,
                apply_to: "queues".into(),
                operator: false,
            }
        );
    }

    #[test]
    fn refuses_bad_usage() {
        assert!(parse("nope", &[]).is_err());
        assert!(parse("add_user", &s(&["a"])).is_err());
        assert!(parse("set_policy", &s(&["a", "b", "{}", "--priority", "x"])).is_err());
        assert!(parse("set_policy", &s(&["a", "b", "{}", "--apply-to", "x"])).is_err());
        assert!(parse("add_vhost", &s(&["-p", "x", "v"])).is_err());
        assert!(parse("list_queues", &s(&["-p"])).is_err());
        // As in rabbitmqctl, connections and channels are listed node-wide: no vhost.
        assert!(parse("list_connections", &s(&["-p", "v"])).is_err());
        assert!(parse("list_channels", &s(&["-p", "v"])).is_err());
        assert!(parse("list_consumers", &s(&["-p"])).is_err());
    }

    #[test]
    fn parses_mirrored_queue_operations() {
        assert_eq!(
            parse("sync_queue", &s(&["-p", "v", "q"])).unwrap(),
            Request::SyncQueue {
                vhost: "v".into(),
                queue: "q".into(),
                cancel: false
            }
        );
        assert_eq!(
            parse("cancel_sync_queue", &s(&["q"])).unwrap(),
            Request::SyncQueue {
                vhost: "/".into(),
                queue: "q".into(),
                cancel: true
            }
        );
        assert_eq!(
            parse("force_promote_mirror", &s(&["q"])).unwrap(),
            Request::ForcePromoteMirror {
                vhost: "/".into(),
                queue: "q".into(),
                node: None
            }
        );
        assert_eq!(
            parse(
                "force_promote_mirror",
                &s(&["q", "--vhost", "v", "rabbit@n2"])
            )
            .unwrap(),
            Request::ForcePromoteMirror {
                vhost: "v".into(),
                queue: "q".into(),
                node: Some("rabbit@n2".into())
            }
        );
        for (cmd, args) in [
            ("sync_queue", &[][..]),
            ("sync_queue", &["a", "b"][..]),
            ("cancel_sync_queue", &["-p"][..]),
            ("force_promote_mirror", &[][..]),
            ("force_promote_mirror", &["q", "n2", "n3"][..]),
            ("force_promote_mirror", &["q", "--force"][..]),
        ] {
            let e = parse(cmd, &s(args)).expect_err(cmd);
            assert!(e.0.contains("Usage: warrenctl"), "{cmd} {args:?}: {e}");
        }
        // Each new command is in the help table.
        for cmd in ["sync_queue", "cancel_sync_queue", "force_promote_mirror"] {
            assert!(COMMANDS
                .iter()
                .any(|(c, syn)| *c == cmd && syn.starts_with(cmd)));
        }
    }

    #[test]
    fn parses_the_limits_commands_as_rabbitmqctl_takes_them() {
        assert_eq!(
            parse(
                "set_vhost_limits",
                &s(&["-p", "v", r#"{"max-connections": 10}"#])
            )
            .unwrap(),
            Request::SetLimits {
                scope: LimitScope::Vhost("v".into()),
                json: r#"{"max-connections": 10}"#.into(),
            }
        );
        assert_eq!(
            parse("clear_user_limits", &s(&["alice", "all"])).unwrap(),
            Request::ClearLimits {
                scope: LimitScope::User("alice".into()),
                name: None,
            }
        );
        assert_eq!(
            parse("clear_user_limits", &s(&["alice", "max-channels"])).unwrap(),
            Request::ClearLimits {
                scope: LimitScope::User("alice".into()),
                name: Some("max-channels".into()),
            }
        );
        assert_eq!(
            parse("list_vhost_limits", &s(&["--global"])).unwrap(),
            Request::ListLimits {
                scope: None,
                users: false,
            }
        );
        assert_eq!(
            parse("list_user_limits", &s(&["--user", "bob"])).unwrap(),
            Request::ListLimits {
                scope: Some(LimitScope::User("bob".into())),
                users: true,
            }
        );
        assert!(parse("set_user_limits", &s(&["alice"])).is_err());
        assert!(parse("list_user_limits", &s(&["-p", "v"])).is_err());
    }

    #[test]
    fn parses_clear_permissions() {
        assert_eq!(
            parse("clear_permissions", &s(&["-p", "v", "alice"])).unwrap(),
            Request::ClearPermissions {
                vhost: "v".into(),
                user: "alice".into()
            }
        );
        assert!(parse("clear_permissions", &[]).is_err());
        assert!(parse("clear_permissions", &s(&["a", "b"])).is_err());
    }

    #[test]
    fn parses_live_listings() {
        assert_eq!(
            parse("list_connections", &s(&["user", "peer_port"])).unwrap(),
            Request::ListConnections {
                columns: s(&["user", "peer_port"])
            }
        );
        assert_eq!(
            parse("list_channels", &[]).unwrap(),
            Request::ListChannels { columns: vec![] }
        );
        assert_eq!(
            parse("list_consumers", &s(&["queue_name", "-p", "v"])).unwrap(),
            Request::ListConsumers {
                vhost: "v".into(),
                columns: s(&["queue_name"])
            }
        );
    }
}

//! What `warrenctl` asks ([`Request`], named after `rabbitmqctl`'s commands) and what it is
//! answered ([`Response`]: a message, or a table of columns and rows).

use serde::{Deserialize, Serialize};

use crate::meta::limits::LimitScope;

/// One admin command. `vhost` fields default to `/` as in `rabbitmqctl`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Request {
    /// `list_queues [-p VHOST] [COLUMN...]`.
    ListQueues {
        /// Vhost.
        vhost: String,
        /// Requested columns (empty: the defaults).
        columns: Vec<String>,
    },
    /// `list_exchanges [-p VHOST] [COLUMN...]`.
    ListExchanges {
        /// Vhost.
        vhost: String,
        /// Requested columns.
        columns: Vec<String>,
    },
    /// `list_bindings [-p VHOST] [COLUMN...]`.
    ListBindings {
        /// Vhost.
        vhost: String,
        /// Requested columns.
        columns: Vec<String>,
    },
    /// `list_users`.
    ListUsers,
    /// `list_vhosts [COLUMN...]`.
    ListVhosts {
        /// Requested columns.
        columns: Vec<String>,
    },
    /// `list_permissions [-p VHOST]`.
    ListPermissions {
        /// Vhost.
        vhost: String,
    },
    /// `list_policies` / `list_operator_policies [-p VHOST]`.
    ListPolicies {
        /// Vhost.
        vhost: String,
        /// Operator policies.
        operator: bool,
    },
    /// `add_user NAME PASSWORD`.
    AddUser {
        /// Name.
        name: String,
        /// Password.
        password: String,
    },
    /// `delete_user NAME`.
    DeleteUser {
        /// Name.
        name: String,
    },
    /// `change_password NAME PASSWORD`.
    ChangePassword {
        /// Name.
        name: String,
        /// New password.
        password: String,
    },
    /// `set_user_tags NAME TAG...`.
    SetUserTags {
        /// Name.
        name: String,
        /// Tags (replace the current ones).
        tags: Vec<String>,
    },
    /// `set_permissions [-p VHOST] USER CONF WRITE READ`.
    SetPermissions {
        /// Vhost.
        vhost: String,
        /// User.
        user: String,
        /// Configure regex.
        configure: String,
        /// Write regex.
        write: String,
        /// Read regex.
        read: String,
    },
    /// `add_vhost NAME`.
    AddVhost {
        /// Name.
        name: String,
    },
    /// `delete_vhost NAME`.
    DeleteVhost {
        /// Name.
        name: String,
    },
    /// `set_policy` / `set_operator_policy`.
    SetPolicy {
        /// Vhost.
        vhost: String,
        /// Name.
        name: String,
        /// Regex over resource names.
        pattern: String,
        /// The definition as JSON text (parsed by the broker side).
        definition: String,
        /// Priority.
        priority: i64,
        /// `queues`, `exchanges` or `all`.
        apply_to: String,
        /// Operator policy.
        operator: bool,
    },
    /// `clear_policy` / `clear_operator_policy`.
    ClearPolicy {
        /// Vhost.
        vhost: String,
        /// Name.
        name: String,
        /// Operator policy.
        operator: bool,
    },
    /// `cluster_status`.
    ClusterStatus,
    /// `join_cluster SEED`: this node (started with a `[cluster]` section but not among
    /// the initial members) joins the cluster of the node whose admin endpoint is `SEED`.
    JoinCluster {
        /// The seed node's admin address (`host:port`).
        seed: String,
    },
    /// `forget_cluster_node NODE`: removes a node (name or id) from the cluster for good.
    ForgetClusterNode {
        /// Node name or id.
        node: String,
    },
    /// Sent by a joining node to a member's admin endpoint: register it.
    RegisterMember(crate::meta::NodeRecord),
    /// `list_connections [COLUMN...]`: this node's open AMQP connections.
    ListConnections {
        /// Requested columns.
        columns: Vec<String>,
    },
    /// `list_channels [COLUMN...]`: this node's open channels.
    ListChannels {
        /// Requested columns.
        columns: Vec<String>,
    },
    /// `list_consumers [-p VHOST] [COLUMN...]`: consumers on this node's channels.
    ListConsumers {
        /// Vhost.
        vhost: String,
        /// Requested columns.
        columns: Vec<String>,
    },
    // New variants go last: bincode numbers variants by position, and nodes of different
    // versions exchange requests (`RegisterMember`).
    /// `sync_queue` / `cancel_sync_queue [-p VHOST] QUEUE`: asks a mirrored queue's master
    /// to copy its backlog to its unsynchronised mirrors now (or to stop).
    SyncQueue {
        /// Vhost.
        vhost: String,
        /// Queue.
        queue: String,
        /// `cancel_sync_queue`.
        cancel: bool,
    },
    /// `force_promote_mirror [-p VHOST] QUEUE [NODE]` (Warren only): makes a mirror the
    /// master of a queue whose master's node is gone, even when no mirror is synchronised
    /// (the way out of `ha-promote-on-failure: when-synced`). See [`super::mirrors::force_promotion`].
    ForcePromoteMirror {
        /// Vhost.
        vhost: String,
        /// Queue.
        queue: String,
        /// The mirror's node (name or id); none: the default choice.
        node: Option<String>,
    },
    /// `export_definitions`: RabbitMQ's definitions JSON, in the answer's message
    /// (answered by the node's runtime with [`crate::mgmt::definitions`]).
    ExportDefinitions,
    /// `import_definitions`: imports RabbitMQ's definitions JSON (the runtime plans it with
    /// [`crate::mgmt::definitions::plan_json`] and commits every command).
    ImportDefinitions {
        /// The file's text.
        json: String,
    },
    /// `clear_permissions [-p VHOST] USER`.
    ClearPermissions {
        /// Vhost.
        vhost: String,
        /// User.
        user: String,
    },
    /// `set_vhost_limits [-p VHOST] JSON` (replaces the vhost's limits) or
    /// `set_user_limits USER JSON` (updates the named ones, keeps the others), as rabbitmqctl.
    SetLimits {
        /// Whose limits.
        scope: LimitScope,
        /// The JSON object of limits, as typed.
        json: String,
    },
    /// `clear_vhost_limits [-p VHOST]` (all of them) or `clear_user_limits USER NAME|all`.
    ClearLimits {
        /// Whose limits.
        scope: LimitScope,
        /// One limit; `None`: all.
        name: Option<String>,
    },
    /// `list_vhost_limits [-p VHOST] [--global]`, `list_user_limits [--user USER] [--global]`
    /// (as rabbitmqctl: without `--global`, the vhost `/` or the user `guest` by default).
    ListLimits {
        /// One vhost's or user's; `None`: every vhost's (`users` false) or user's.
        scope: Option<LimitScope>,
        /// User limits rather than vhost limits.
        users: bool,
    },
}

/// The answer to a request (and to [`super::Auth`]).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Response {
    /// Whether the command succeeded.
    pub ok: bool,
    /// Column names of a listing (empty otherwise).
    pub columns: Vec<String>,
    /// Rows of a listing, one value per column.
    pub rows: Vec<Vec<String>>,
    /// What was done, or why it was refused.
    pub message: String,
}

impl Response {
    /// A success with a message.
    pub fn done(message: impl Into<String>) -> Response {
        Response {
            ok: true,
            message: message.into(),
            ..Response::default()
        }
    }

    /// A refusal.
    pub fn refused(message: impl Into<String>) -> Response {
        Response {
            ok: false,
            message: message.into(),
            ..Response::default()
        }
    }

    /// A table.
    pub fn table(columns: Vec<String>, rows: Vec<Vec<String>>) -> Response {
        Response {
            ok: true,
            columns,
            rows,
            message: String::new(),
        }
    }
}

/// What the handler needs beyond the broker.
#[derive(Clone, Debug)]
pub struct NodeInfo {
    /// The node's name (`pid` column, `cluster_status`).
    pub name: String,
}

/// The figures of queues other nodes run, by name (what their nodes answered), for
/// `list_queues` on a clustered node.
pub type RemoteCounts = std::collections::HashMap<String, crate::broker::QueueFigures>;

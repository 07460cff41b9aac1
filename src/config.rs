//! Node configuration: loaded from TOML, every table `deny_unknown_fields`, defaults in
//! `Default` impls. `config/warren.toml` is the documented reference; the same text is
//! embedded in the binary so a node starts with no flags at all.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use serde::Deserialize;

mod tls;
pub use tls::{CertLoginFrom, TlsConfig, TlsUse, AMQPS_PORT, MANAGEMENT_HTTPS_PORT};

/// The reference configuration, embedded so `warren` starts with no flags.
pub const EMBEDDED_DEFAULT: &str = include_str!("../config/warren.toml");

/// Errors from loading or validating a configuration.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read config file {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// The TOML did not parse, or named a key we do not know.
    #[error("invalid config {origin}: {message}")]
    Parse {
        /// Where the text came from.
        origin: String,
        /// The parser's message (names the unknown key).
        message: String,
    },
    /// A value is out of range or inconsistent.
    #[error("invalid config value `{key}`: {reason}")]
    Invalid {
        /// The key.
        key: &'static str,
        /// Why.
        reason: String,
    },
}

/// The whole node configuration.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// `[node]`: identity and data folder.
    pub node: NodeConfig,
    /// `[amqp]`: the client listener and connection negotiation.
    pub amqp: AmqpConfig,
    /// `[limits]`: memory watermark and flow-control credit.
    pub limits: LimitsConfig,
    /// `[storage]`: message store, queue index, fsync policy.
    pub storage: StorageConfig,
    /// `[admin]`: the endpoint `warrenctl` talks to.
    pub admin: AdminConfig,
    /// `[management]`: RabbitMQ's management HTTP API.
    pub management: ManagementConfig,
    /// `[prometheus]`: the Prometheus metrics endpoint.
    pub prometheus: PrometheusConfig,
    /// `[definitions]`: a definitions file imported at start.
    pub definitions: DefinitionsConfig,
    /// `[[vhosts]]`.
    pub vhosts: Vec<VhostConfig>,
    /// `[[users]]`.
    pub users: Vec<UserConfig>,
    /// `[[permissions]]`.
    pub permissions: Vec<PermissionConfig>,
    /// `[cluster]`: absent for a single node.
    pub cluster: Option<ClusterConfig>,
    /// The file this was loaded from (none for the embedded default); not a setting.
    #[serde(skip)]
    pub source: Option<PathBuf>,
}

/// `[cluster]`: this node's place in a cluster whose metadata is replicated with Raft.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClusterConfig {
    /// This node's Raft id: unique in the cluster, never reused, at least 1.
    pub node_id: u64,
    /// Shared by every node; a node link from another cluster is refused (RabbitMQ's Erlang
    /// cookie plays this part).
    pub cluster_id: String,
    /// Address of the node-link listener (Raft and broker traffic between nodes).
    pub listen: String,
    /// The nodes that form the cluster on its first boot (this one included), by id and
    /// node-link address. The lowest id initialises Raft once; a node not listed here
    /// starts alone and waits for `warrenctl join_cluster`.
    #[serde(default)]
    pub initial_members: Vec<MemberConfig>,
    /// A peer not heard from for this long is down: its transient and exclusive queues go.
    #[serde(default = "default_peer_timeout_ms")]
    pub peer_timeout_ms: u64,
    /// Node-link heartbeat interval.
    #[serde(default = "default_link_heartbeat_ms")]
    pub heartbeat_ms: u64,
    /// How long a metadata command may take to commit before the client gets an error.
    #[serde(default = "default_commit_timeout_ms")]
    pub commit_timeout_ms: u64,
    /// The routing lease: a node routes publishes only within this long of a Raft quorum
    /// read it has followed, so a routing change answered while a node's log was behind
    /// (cut off one way) cannot send a confirmed publish into a deleted queue
    /// (`docs/clustering.md`). A routing change waits for a node that has not followed it
    /// for at most 2.5 times this and 100 ms; at most a third of `commit_timeout_ms`.
    #[serde(default = "default_routing_lease_ms")]
    pub routing_lease_ms: u64,
    /// The metadata Raft group's longest election timeout, which is also its leader lease:
    /// a voter that heard the leader this recently refuses to vote for another. The
    /// shortest is half of it and the leader's heartbeat a sixth. When the leader's process
    /// is gone (its link address refuses connections) a follower calls an election as soon
    /// as this has passed since the leader was last heard, so it bounds the failover of a
    /// killed leader's node; a leader that hangs or is cut off is replaced after 1.5 to 2
    /// times this of silence.
    #[serde(default = "default_election_timeout_ms")]
    pub election_timeout_ms: u64,
    /// `[cluster.tls]`: node links over mutual TLS, checked against the cluster's CA
    /// (plaintext when absent). Every node of a cluster needs it, or none.
    #[serde(default)]
    pub tls: Option<TlsConfig>,
}

/// One `[[cluster.initial_members]]` entry.
#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct MemberConfig {
    /// Raft id.
    pub id: u64,
    /// Node-link address.
    pub link: String,
}

fn default_peer_timeout_ms() -> u64 {
    5000
}

fn default_link_heartbeat_ms() -> u64 {
    250
}

fn default_election_timeout_ms() -> u64 {
    400
}

fn default_commit_timeout_ms() -> u64 {
    10_000
}

fn default_routing_lease_ms() -> u64 {
    1500
}

/// `[node]`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct NodeConfig {
    /// Node name, shown in `server_properties.cluster_name` and logs.
    pub name: String,
    /// Folder for all node data (created when missing).
    pub data_dir: PathBuf,
}

/// `[amqp]`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AmqpConfig {
    /// Address the AMQP listener binds.
    pub listen: SocketAddr,
    /// Heartbeat interval the server proposes in connection.tune (seconds, 0 = off).
    pub heartbeat_s: u16,
    /// Largest frame the server accepts and proposes (bytes).
    pub frame_max_bytes: u32,
    /// Highest channel number the server proposes.
    pub channel_max: u16,
    /// Time a client has to finish the handshake (milliseconds).
    pub handshake_timeout_ms: u64,
    /// Users that may only connect from a loopback address (RabbitMQ's `loopback_users`).
    pub loopback_users: Vec<String>,
    /// Largest message body accepted (bytes); larger publishes close the channel with 406.
    pub max_message_size_bytes: u64,
    /// `[amqp.tls]`: an AMQPS listener beside the plaintext one (none when absent).
    pub tls: Option<TlsConfig>,
}

/// `[limits]`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LimitsConfig {
    /// Bytes of message data held in memory by all queues above which publishing connections
    /// are blocked (`connection.blocked`). 0 means `memory_high_watermark_fraction` of RAM.
    pub memory_high_watermark_bytes: u64,
    /// Fraction of physical memory used when `memory_high_watermark_bytes` is 0.
    pub memory_high_watermark_fraction: f64,
    /// Fraction of the watermark above which queues page messages to disk (RabbitMQ's
    /// `vm_memory_high_watermark_paging_ratio`).
    pub memory_paging_ratio: f64,
    /// Free bytes on the data folder's file system below which publishers are blocked
    /// (RabbitMQ's `disk_free_limit`, 50 MB by default).
    pub disk_free_limit_bytes: u64,
    /// Messages a publishing channel may send to one queue before the queue grants more
    /// (RabbitMQ's credit_flow initial credit).
    pub queue_credit_initial: u32,
    /// Bytes queued for a consumer connection's socket above which queues stop delivering to
    /// it until the socket drains.
    pub connection_outbound_bytes_max: usize,
    /// Failed logins from one address within `failed_login_window_ms` after which its
    /// logins are refused unchecked until the window ends (0: no limit). Warren only.
    pub max_failed_logins: u32,
    /// The window of `max_failed_logins`, in milliseconds.
    pub failed_login_window_ms: u64,
}

/// `[admin]`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AdminConfig {
    /// Address of the admin endpoint (`warrenctl`); users need the `administrator` tag.
    pub listen: SocketAddr,
    /// `[admin.tls]`: the endpoint on `listen` speaks TLS only (plaintext when absent).
    pub tls: Option<TlsConfig>,
}

impl Default for AdminConfig {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 5679)),
            tls: None,
        }
    }
}

/// `[management]`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ManagementConfig {
    /// Address of the management HTTP API (RabbitMQ's `management.tcp.port`); `""` turns
    /// it off.
    pub listen: String,
    /// `[management.tls]`: an HTTPS listener beside the HTTP one (none when absent).
    pub tls: Option<TlsConfig>,
}

impl Default for ManagementConfig {
    fn default() -> Self {
        Self {
            listen: "127.0.0.1:15672".into(),
            tls: None,
        }
    }
}

impl ManagementConfig {
    /// The address to bind, or none when the listener is off (validated at load).
    pub fn listen_addr(&self) -> Option<SocketAddr> {
        optional_addr(&self.listen)
    }
}

/// `[definitions]`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DefinitionsConfig {
    /// A file in RabbitMQ's definitions format imported at every start, once the node has
    /// its metadata and before it accepts clients (RabbitMQ's `load_definitions`); `""`
    /// imports nothing. An unreadable or invalid file stops the start.
    pub load_file: String,
}

/// `[prometheus]`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PrometheusConfig {
    /// Address of the metrics endpoint (`/metrics`, `/metrics/per-object`; RabbitMQ's
    /// `prometheus.tcp.port`); `""` turns it off.
    pub listen: String,
}

impl Default for PrometheusConfig {
    fn default() -> Self {
        Self {
            listen: "127.0.0.1:15692".into(),
        }
    }
}

impl PrometheusConfig {
    /// The address to bind, or none when the listener is off (validated at load).
    pub fn listen_addr(&self) -> Option<SocketAddr> {
        optional_addr(&self.listen)
    }
}

/// A listener address that `""` turns off.
fn optional_addr(listen: &str) -> Option<SocketAddr> {
    if listen.is_empty() {
        None
    } else {
        listen.parse().ok()
    }
}

/// Refuses a listener address that is neither an address nor `""`.
fn check_optional_addr(key: &'static str, listen: &str) -> Result<(), ConfigError> {
    if listen.is_empty() || listen.parse::<SocketAddr>().is_ok() {
        return Ok(());
    }
    Err(ConfigError::Invalid {
        key,
        reason: format!("`{listen}` is not an address (host:port), nor \"\" (off)"),
    })
}

/// `[storage]`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct StorageConfig {
    /// Write persistent messages of durable queues to disk (false: everything in memory).
    pub enabled: bool,
    /// 0: a confirm waits for the fsync of its batch (group commit). N > 0: confirms follow
    /// the write to the OS and fsync runs every N ms; a crash can lose up to N ms of
    /// confirmed messages (RocketMQ's async flush).
    pub fsync_interval_ms: u64,
    /// Messages (with properties) smaller than this live inside the queue index.
    pub queue_index_embed_msgs_below: usize,
    /// Entries per queue index segment file.
    pub queue_index_segment_entry_count: u64,
    /// Journal records before they are moved into segments.
    pub queue_index_journal_max_entries: usize,
    /// Size at which a message store file is rolled over.
    pub msg_store_file_size_limit_bytes: u64,
    /// Messages a paging queue keeps in RAM at its head (at most 8 MiB, and a quarter of the
    /// paging threshold, of them).
    pub queue_paging_head_messages: usize,
}

impl Default for StorageConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            fsync_interval_ms: 0,
            queue_index_embed_msgs_below: 4096,
            queue_index_segment_entry_count: 16384,
            queue_index_journal_max_entries: 32768,
            msg_store_file_size_limit_bytes: 16 * 1024 * 1024,
            queue_paging_head_messages: 2048,
        }
    }
}

/// `[[vhosts]]`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VhostConfig {
    /// Name, e.g. `/`.
    pub name: String,
}

/// `[[users]]`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UserConfig {
    /// User name.
    pub name: String,
    /// Password (plain text in config; compared in constant time).
    pub password: String,
    /// Tags such as `administrator`.
    #[serde(default)]
    pub tags: Vec<String>,
}

/// `[[permissions]]`: configure/write/read regular expressions, as in RabbitMQ.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PermissionConfig {
    /// The user.
    pub user: String,
    /// The vhost.
    pub vhost: String,
    /// Regex of resources the user may declare or delete.
    pub configure: String,
    /// Regex of resources the user may publish to or bind to.
    pub write: String,
    /// Regex of resources the user may consume from or bind from.
    pub read: String,
}

impl Default for NodeConfig {
    fn default() -> Self {
        Self {
            name: "warren@localhost".into(),
            data_dir: PathBuf::from("warren-data"),
        }
    }
}

impl Default for AmqpConfig {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 5672)),
            heartbeat_s: 60,
            frame_max_bytes: 131_072,
            channel_max: 2047,
            handshake_timeout_ms: 10_000,
            loopback_users: vec!["guest".into()],
            max_message_size_bytes: 128 * 1024 * 1024,
            tls: None,
        }
    }
}

impl Default for LimitsConfig {
    fn default() -> Self {
        Self {
            memory_high_watermark_bytes: 0,
            memory_high_watermark_fraction: 0.4,
            memory_paging_ratio: 0.5,
            disk_free_limit_bytes: 50_000_000,
            queue_credit_initial: 400,
            connection_outbound_bytes_max: 4 * 1024 * 1024,
            max_failed_logins: 10,
            failed_login_window_ms: 60_000,
        }
    }
}

impl Default for Config {
    fn default() -> Self {
        Self {
            node: NodeConfig::default(),
            amqp: AmqpConfig::default(),
            limits: LimitsConfig::default(),
            storage: StorageConfig::default(),
            admin: AdminConfig::default(),
            management: ManagementConfig::default(),
            prometheus: PrometheusConfig::default(),
            definitions: DefinitionsConfig::default(),
            vhosts: vec![VhostConfig { name: "/".into() }],
            users: vec![UserConfig {
                name: "guest".into(),
                password: "guest".into(),
                tags: vec!["administrator".into()],
            }],
            permissions: vec![PermissionConfig {
                user: "guest".into(),
                vhost: "/".into(),
                configure: ".*".into(),
                write: ".*".into(),
                read: ".*".into(),
            }],
            cluster: None,
            source: None,
        }
    }
}

impl Config {
    /// Parses TOML text; `origin` names it in errors.
    pub fn parse(text: &str, origin: &str) -> Result<Config, ConfigError> {
        let config: Config = toml::from_str(text).map_err(|e| ConfigError::Parse {
            origin: origin.to_string(),
            message: e.to_string(),
        })?;
        config.validate()
    }

    /// Loads and validates a file.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        let mut config = Self::parse(&text, &path.display().to_string())?;
        config.source = Some(std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf()));
        Ok(config)
    }

    /// The embedded default configuration.
    pub fn embedded() -> Config {
        Self::parse(EMBEDDED_DEFAULT, "(embedded default)")
            .expect("the embedded default config is valid (tested)")
    }

    /// A configuration for tests: listens on 127.0.0.1 port 0, data under `data_dir`.
    pub fn for_tests(data_dir: &Path) -> Config {
        let mut config = Config::default();
        config.amqp.listen = SocketAddr::from(([127, 0, 0, 1], 0));
        config.admin.listen = SocketAddr::from(([127, 0, 0, 1], 0));
        config.management.listen = "127.0.0.1:0".into();
        config.prometheus.listen = "127.0.0.1:0".into();
        config.node.data_dir = data_dir.to_path_buf();
        config.limits.memory_high_watermark_bytes = 1 << 30;
        config
    }

    /// Checks ranges and cross references.
    pub fn validate(self) -> Result<Config, ConfigError> {
        if self.amqp.frame_max_bytes != 0 && self.amqp.frame_max_bytes < 4096 {
            return Err(ConfigError::Invalid {
                key: "amqp.frame_max_bytes",
                reason: "must be 0 (no limit) or at least 4096".into(),
            });
        }
        check_optional_addr("management.listen", &self.management.listen)?;
        if let Some(t) = &self.amqp.tls {
            t.validate(TlsUse::Amqp)?;
        }
        if let Some(t) = &self.management.tls {
            t.validate(TlsUse::Management)?;
        }
        if let Some(t) = &self.admin.tls {
            t.validate(TlsUse::Admin)?;
        }
        check_optional_addr("prometheus.listen", &self.prometheus.listen)?;
        if !(0.0..=1.0).contains(&self.limits.memory_high_watermark_fraction) {
            return Err(ConfigError::Invalid {
                key: "limits.memory_high_watermark_fraction",
                reason: "must be between 0 and 1".into(),
            });
        }
        if !(0.0..=1.0).contains(&self.limits.memory_paging_ratio) {
            return Err(ConfigError::Invalid {
                key: "limits.memory_paging_ratio",
                reason: "must be between 0 and 1".into(),
            });
        }
        if self.limits.queue_credit_initial == 0 {
            return Err(ConfigError::Invalid {
                key: "limits.queue_credit_initial",
                reason: "must be at least 1".into(),
            });
        }
        if let Some(c) = &self.cluster {
            if c.node_id == 0 {
                return Err(ConfigError::Invalid {
                    key: "cluster.node_id",
                    reason: "must be at least 1".into(),
                });
            }
            if c.cluster_id.is_empty() {
                return Err(ConfigError::Invalid {
                    key: "cluster.cluster_id",
                    reason: "must not be empty".into(),
                });
            }
            let mut ids: Vec<u64> = c.initial_members.iter().map(|m| m.id).collect();
            ids.sort_unstable();
            ids.dedup();
            if ids.len() != c.initial_members.len() || ids.contains(&0) {
                return Err(ConfigError::Invalid {
                    key: "cluster.initial_members",
                    reason: "ids must be distinct and at least 1".into(),
                });
            }
            if !c.initial_members.is_empty() && !ids.contains(&c.node_id) {
                return Err(ConfigError::Invalid {
                    key: "cluster.initial_members",
                    reason: format!("must include this node ({})", c.node_id),
                });
            }
            if let Some(t) = &c.tls {
                t.validate(TlsUse::NodeLink)?;
            }
            if !(60..=60_000).contains(&c.election_timeout_ms) {
                return Err(ConfigError::Invalid {
                    key: "cluster.election_timeout_ms",
                    reason: "must be between 60 and 60000".into(),
                });
            }
            // A routing change's wait for a node behind (2.5 leases and 100 ms:
            // `cluster::routing_lease::lapse_after_ms`) must end before the commit times out.
            if c.routing_lease_ms < 200 || 3 * c.routing_lease_ms > c.commit_timeout_ms {
                return Err(ConfigError::Invalid {
                    key: "cluster.routing_lease_ms",
                    reason: format!(
                        "must be at least 200 and at most a third of cluster.commit_timeout_ms ({})",
                        c.commit_timeout_ms
                    ),
                });
            }
            if c.peer_timeout_ms <= c.heartbeat_ms {
                return Err(ConfigError::Invalid {
                    key: "cluster.peer_timeout_ms",
                    reason: "must be longer than cluster.heartbeat_ms".into(),
                });
            }
        }
        for p in &self.permissions {
            if !self.users.iter().any(|u| u.name == p.user) {
                return Err(ConfigError::Invalid {
                    key: "permissions.user",
                    reason: format!("unknown user `{}`", p.user),
                });
            }
            if !self.vhosts.iter().any(|v| v.name == p.vhost) {
                return Err(ConfigError::Invalid {
                    key: "permissions.vhost",
                    reason: format!("unknown vhost `{}`", p.vhost),
                });
            }
            for re in [&p.configure, &p.write, &p.read] {
                if let Err(e) = regex::Regex::new(re) {
                    return Err(ConfigError::Invalid {
                        key: "permissions",
                        reason: format!("bad regex `{re}`: {e}"),
                    });
                }
            }
        }
        Ok(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn embedded_default_parses_and_matches_defaults() {
        let c = Config::embedded();
        let d = Config::default();
        assert_eq!(c.amqp.listen, d.amqp.listen);
        assert_eq!(c.amqp.heartbeat_s, d.amqp.heartbeat_s);
        assert_eq!(c.amqp.frame_max_bytes, d.amqp.frame_max_bytes);
        assert_eq!(c.amqp.channel_max, d.amqp.channel_max);
        assert_eq!(c.node.data_dir, d.node.data_dir);
        assert_eq!(c.users.len(), 1);
        assert_eq!(c.management.listen, d.management.listen);
    }

    #[test]
    fn management_listen_is_an_address_or_empty() {
        let off = Config::parse("[management]\nlisten = \"\"\n", "t").expect("off");
        assert_eq!(off.management.listen_addr(), None);
        let on = Config::parse("[management]\nlisten = \"127.0.0.1:0\"\n", "t").expect("on");
        assert!(on.management.listen_addr().is_some());
        let err = Config::parse("[management]\nlisten = \"nowhere\"\n", "t").unwrap_err();
        let prom = Config::parse("[prometheus]\nlisten = \"\"\n", "t").expect("off");
        assert_eq!(prom.prometheus.listen_addr(), None);
        assert_eq!(
            Config::default().prometheus.listen_addr(),
            Some(SocketAddr::from(([127, 0, 0, 1], 15692)))
        );
        assert!(Config::parse("[prometheus]\nlisten = \"x\"\n", "t").is_err());
        assert!(err.to_string().contains("management.listen"), "{err}");
    }

    #[test]
    fn unknown_key_is_refused_with_its_name() {
        let err = Config::parse("[amqp]\nlisten_port = 5\n", "t").unwrap_err();
        assert!(err.to_string().contains("listen_port"), "{err}");
    }

    #[test]
    fn small_frame_max_is_refused() {
        let err = Config::parse("[amqp]\nframe_max_bytes = 100\n", "t").unwrap_err();
        assert!(err.to_string().contains("frame_max_bytes"), "{err}");
    }

    #[test]
    fn an_inconsistent_cluster_section_is_refused_with_its_key() {
        let base = "[cluster]\ncluster_id = \"c\"\nlisten = \"127.0.0.1:0\"\n";
        let member = |id: u64| format!("[[cluster.initial_members]]\nid = {id}\nlink = \"x:1\"\n");
        let cases = [
            (format!("{base}node_id = 0\n"), "cluster.node_id"),
            (
                format!("{base}node_id = 1\n{}", member(2)),
                "cluster.initial_members",
            ),
            (
                format!("{base}node_id = 1\n{}{}", member(1), member(1)),
                "cluster.initial_members",
            ),
            (
                format!("{base}node_id = 1\nheartbeat_ms = 500\npeer_timeout_ms = 400\n"),
                "cluster.peer_timeout_ms",
            ),
            (
                format!("{base}node_id = 1\nelection_timeout_ms = 10\n"),
                "cluster.election_timeout_ms",
            ),
            (
                format!("{base}node_id = 1\ncommit_timeout_ms = 4000\n"),
                "cluster.routing_lease_ms",
            ),
            (
                format!("{base}node_id = 1\nrouting_lease_ms = 150\n"),
                "cluster.routing_lease_ms",
            ),
        ];
        for (text, key) in cases {
            let err = Config::parse(&text, "t").unwrap_err();
            assert!(err.to_string().contains(key), "{text}: {err}");
        }
        let ok = Config::parse(
            &format!("{base}node_id = 2\n{}{}", member(1), member(2)),
            "t",
        )
        .expect("a valid cluster section");
        assert_eq!(ok.cluster.expect("cluster").initial_members.len(), 2);
    }
}

//! The TLS sections, all one [`TlsConfig`] with the keys RabbitMQ's `ssl_options` uses
//! (`certfile`, `keyfile`, `cacertfile`, `verify_peer`, `fail_if_no_peer_cert`):
//!
//! - `[amqp.tls]` and `[management.tls]`: a TLS listener beside the plaintext one.
//! - `[admin.tls]`: the admin endpoint (`warrenctl`) speaks TLS only, on `admin.listen`.
//! - `[cluster.tls]`: node links speak mutual TLS only, on `cluster.listen`: `cacertfile`
//!   is required and peer verification cannot be turned off.
//!
//! Only the keys are checked here ([`TlsUse`] says which apply where); the files are read
//! when the node starts (`runtime::tls`), where a missing file or a bad PEM stops the start.

use std::net::SocketAddr;
use std::path::PathBuf;

use serde::Deserialize;

use super::ConfigError;

/// The AMQPS port RabbitMQ listens on (`listeners.ssl.default`).
pub const AMQPS_PORT: u16 = 5671;
/// The management API's HTTPS port in RabbitMQ (`management.ssl.port`).
pub const MANAGEMENT_HTTPS_PORT: u16 = 15671;

/// One TLS listener.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TlsConfig {
    /// Address the TLS listener binds; 127.0.0.1 with the section's RabbitMQ port
    /// ([`AMQPS_PORT`], [`MANAGEMENT_HTTPS_PORT`]) when absent.
    #[serde(default)]
    pub listen: Option<SocketAddr>,
    /// PEM file with the server's certificate, followed by any intermediates.
    pub certfile: PathBuf,
    /// PEM file with the server's private key (PKCS#8, PKCS#1 or SEC1).
    pub keyfile: PathBuf,
    /// PEM file with the CA certificates client certificates are checked against; needed
    /// with `verify_peer`.
    #[serde(default)]
    pub cacertfile: Option<PathBuf>,
    /// Ask clients for a certificate and refuse the handshake when the one given does not
    /// chain to `cacertfile` (Erlang's `verify_peer`; false is `verify_none`: no client
    /// certificate is asked for). Off when absent, except in `[cluster.tls]`, where it is
    /// always on. Read it with [`TlsConfig::verify_peer`].
    #[serde(default)]
    pub verify_peer: Option<bool>,
    /// With `verify_peer`: refuse the handshake of a client that gives no certificate. Off
    /// when absent, except in `[cluster.tls]`. Read it with
    /// [`TlsConfig::fail_if_no_peer_cert`].
    #[serde(default)]
    pub fail_if_no_peer_cert: Option<bool>,
    /// What EXTERNAL authentication takes as the user name (`[amqp.tls]` only; RabbitMQ's
    /// `ssl_cert_login_from`): `common_name` by default.
    #[serde(default)]
    pub ssl_cert_login_from: Option<CertLoginFrom>,
}

/// Where EXTERNAL takes the user name from in a client certificate.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CertLoginFrom {
    /// The subject's CN (several CNs are joined with `,`, as RabbitMQ does).
    #[default]
    CommonName,
    /// The first DNS name among the subject alternative names (RabbitMQ's
    /// `ssl_cert_login_san_type = dns`, `ssl_cert_login_san_index = 0`).
    SubjectAlternativeName,
}

/// Where a [`TlsConfig`] is used: decides which keys apply and what absent keys mean.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TlsUse {
    /// `[amqp.tls]`: a listener of its own; `ssl_cert_login_from` applies.
    Amqp,
    /// `[management.tls]`: a listener of its own.
    Management,
    /// `[admin.tls]`: replaces the plaintext admin endpoint on `admin.listen`.
    Admin,
    /// `[cluster.tls]`: node links on `cluster.listen`, always mutual.
    NodeLink,
}

impl TlsUse {
    /// The section's name in the config file.
    pub fn section(self) -> &'static str {
        match self {
            TlsUse::Amqp => "amqp.tls",
            TlsUse::Management => "management.tls",
            TlsUse::Admin => "admin.tls",
            TlsUse::NodeLink => "cluster.tls",
        }
    }
}

impl TlsConfig {
    /// A section with the given files and every other key absent.
    pub fn new(certfile: PathBuf, keyfile: PathBuf, cacertfile: Option<PathBuf>) -> TlsConfig {
        TlsConfig {
            listen: None,
            certfile,
            keyfile,
            cacertfile,
            verify_peer: None,
            fail_if_no_peer_cert: None,
            ssl_cert_login_from: None,
        }
    }

    /// Whether peers must present a certificate chaining to `cacertfile` (asked for, at
    /// least). Always for node links.
    pub fn verify_peer(&self, usage: TlsUse) -> bool {
        usage == TlsUse::NodeLink || self.verify_peer.unwrap_or(false)
    }

    /// Whether a peer without a certificate is refused. Always for node links.
    pub fn fail_if_no_peer_cert(&self, usage: TlsUse) -> bool {
        usage == TlsUse::NodeLink || self.fail_if_no_peer_cert.unwrap_or(false)
    }

    /// The address to bind: `listen`, or 127.0.0.1 on `default_port`.
    pub fn listen_addr(&self, default_port: u16) -> SocketAddr {
        self.listen
            .unwrap_or_else(|| SocketAddr::from(([127, 0, 0, 1], default_port)))
    }

    /// The certificate login source (`common_name` when not set).
    pub fn cert_login_from(&self) -> CertLoginFrom {
        self.ssl_cert_login_from.unwrap_or_default()
    }

    /// Checks the keys of the section used as `usage`.
    pub(super) fn validate(&self, usage: TlsUse) -> Result<(), ConfigError> {
        let key = usage.section();
        let invalid = |reason: &str| ConfigError::Invalid {
            key,
            reason: reason.to_string(),
        };
        if self.certfile.as_os_str().is_empty() || self.keyfile.as_os_str().is_empty() {
            return Err(invalid("certfile and keyfile must name PEM files"));
        }
        let no_ca = self
            .cacertfile
            .as_ref()
            .is_none_or(|p| p.as_os_str().is_empty());
        if usage == TlsUse::NodeLink {
            // Mutual TLS is the point of the section: a node link with an unchecked peer
            // would let anyone who can reach the port into the cluster.
            if no_ca {
                return Err(invalid(
                    "cacertfile is required: every node checks its peer's certificate against \
                     the cluster's CA",
                ));
            }
            if self.verify_peer == Some(false) || self.fail_if_no_peer_cert == Some(false) {
                return Err(invalid(
                    "node links always verify the peer; verify_peer and fail_if_no_peer_cert \
                     cannot be false here",
                ));
            }
        }
        if matches!(usage, TlsUse::NodeLink | TlsUse::Admin) && self.listen.is_some() {
            return Err(invalid(
                "listen does not apply: TLS replaces the plaintext listener on the section's \
                 own address (cluster.listen, admin.listen)",
            ));
        }
        if self.verify_peer(usage) && no_ca {
            return Err(invalid(
                "verify_peer needs cacertfile (the CAs client certificates must chain to)",
            ));
        }
        if self.fail_if_no_peer_cert(usage) && !self.verify_peer(usage) {
            // Erlang's ssl refuses this pair as incompatible too.
            return Err(invalid(
                "fail_if_no_peer_cert needs verify_peer (without it no certificate is asked for)",
            ));
        }
        if usage != TlsUse::Amqp && self.ssl_cert_login_from.is_some() {
            return Err(invalid(
                "ssl_cert_login_from applies to [amqp.tls] only (EXTERNAL authentication)",
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::TlsUse;
    use crate::config::{Config, ConfigError};

    const BASE: &str = "certfile = \"c.pem\"\nkeyfile = \"k.pem\"\n";

    #[test]
    fn the_sections_parse_with_their_defaults() {
        let c = Config::parse(
            &format!("[amqp.tls]\n{BASE}\n[management.tls]\n{BASE}listen = \"0.0.0.0:8443\"\n"),
            "t",
        )
        .expect("valid");
        let amqp = c.amqp.tls.expect("amqp.tls");
        assert_eq!(amqp.listen_addr(5671).to_string(), "127.0.0.1:5671");
        assert!(!amqp.verify_peer(super::TlsUse::Amqp));
        assert!(!amqp.fail_if_no_peer_cert(super::TlsUse::Amqp));
        assert_eq!(amqp.cert_login_from(), super::CertLoginFrom::CommonName);
        let mgmt = c.management.tls.expect("management.tls");
        assert_eq!(mgmt.listen_addr(15671).to_string(), "0.0.0.0:8443");
        let san = Config::parse(
            &format!("[amqp.tls]\n{BASE}ssl_cert_login_from = \"subject_alternative_name\"\n"),
            "t",
        )
        .expect("valid");
        assert_eq!(
            san.amqp.tls.expect("tls").cert_login_from(),
            super::CertLoginFrom::SubjectAlternativeName
        );
        assert!(Config::default().amqp.tls.is_none());
    }

    #[test]
    fn inconsistent_keys_are_refused_with_their_section() {
        let cases = [
            ("[amqp.tls]\nverify_peer = true\n", "amqp.tls", "cacertfile"),
            (
                "[amqp.tls]\nfail_if_no_peer_cert = true\n",
                "amqp.tls",
                "verify_peer",
            ),
            (
                "[management.tls]\nssl_cert_login_from = \"common_name\"\n",
                "management.tls",
                "ssl_cert_login_from",
            ),
        ];
        for (section, key, why) in cases {
            let (head, rest) = section.split_once('\n').expect("two lines");
            let text = format!("{head}\n{BASE}{rest}");
            let err = Config::parse(&text, "t").unwrap_err().to_string();
            assert!(err.contains(key) && err.contains(why), "{text}: {err}");
        }
        let missing = Config::parse("[amqp.tls]\ncertfile = \"c.pem\"\n", "t").unwrap_err();
        assert!(missing.to_string().contains("keyfile"), "{missing}");
        let unknown = Config::parse(&format!("[amqp.tls]\n{BASE}verify = true\n"), "t");
        assert!(unknown.is_err());
        let bad = Config::parse(
            &format!("[amqp.tls]\n{BASE}ssl_cert_login_from = \"distinguished_name\"\n"),
            "t",
        );
        assert!(bad.is_err(), "only the two supported sources parse");
    }

    const CLUSTER: &str = "[cluster]\nnode_id = 1\ncluster_id = \"c\"\nlisten = \"127.0.0.1:0\"\n";

    #[test]
    fn node_links_always_verify_the_peer_against_the_cluster_ca() {
        let ok = Config::parse(
            &format!("{CLUSTER}[cluster.tls]\n{BASE}cacertfile = \"ca.pem\"\n"),
            "t",
        )
        .expect("valid");
        let tls = ok.cluster.expect("cluster").tls.expect("cluster.tls");
        assert!(tls.verify_peer(TlsUse::NodeLink) && tls.fail_if_no_peer_cert(TlsUse::NodeLink));
        let cases = [
            ("", "cacertfile is required"),
            (
                "cacertfile = \"ca.pem\"\nverify_peer = false\n",
                "always verify",
            ),
            (
                "cacertfile = \"ca.pem\"\nfail_if_no_peer_cert = false\n",
                "always verify",
            ),
            (
                "cacertfile = \"ca.pem\"\nlisten = \"127.0.0.1:1\"\n",
                "listen does not apply",
            ),
            (
                "cacertfile = \"ca.pem\"\nssl_cert_login_from = \"common_name\"\n",
                "[amqp.tls] only",
            ),
        ];
        for (rest, why) in cases {
            let text = format!("{CLUSTER}[cluster.tls]\n{BASE}{rest}");
            let err = Config::parse(&text, "t").unwrap_err();
            assert!(
                matches!(&err, ConfigError::Invalid { key: "cluster.tls", reason } if reason.contains(why)),
                "{text}: {err}"
            );
        }
    }

    #[test]
    fn the_admin_endpoint_takes_tls_on_its_own_address() {
        let ok = Config::parse(&format!("[admin.tls]\n{BASE}"), "t").expect("valid");
        let tls = ok.admin.tls.expect("admin.tls");
        assert!(!tls.verify_peer(TlsUse::Admin), "off unless asked for");
        let err = Config::parse(
            &format!("[admin.tls]\n{BASE}listen = \"127.0.0.1:1\"\n"),
            "t",
        )
        .unwrap_err();
        assert!(
            matches!(&err, ConfigError::Invalid { key: "admin.tls", reason } if reason.contains("listen")),
            "{err}"
        );
        let err =
            Config::parse(&format!("[admin.tls]\n{BASE}verify_peer = true\n"), "t").unwrap_err();
        assert!(err.to_string().contains("cacertfile"), "{err}");
    }
}

//! `[amqp.tls]` and `[management.tls]`: a TLS listener beside the plaintext one, with the
//! keys RabbitMQ's `ssl_options` uses (`certfile`, `keyfile`, `cacertfile`, `verify_peer`,
//! `fail_if_no_peer_cert`). Only the keys are checked here; the files are read when the
//! node starts (`runtime::tls`), where a missing file or a bad PEM stops the start.

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
    /// certificate is asked for).
    #[serde(default)]
    pub verify_peer: bool,
    /// With `verify_peer`: refuse the handshake of a client that gives no certificate.
    #[serde(default)]
    pub fail_if_no_peer_cert: bool,
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

impl TlsConfig {
    /// The address to bind: `listen`, or 127.0.0.1 on `default_port`.
    pub fn listen_addr(&self, default_port: u16) -> SocketAddr {
        self.listen
            .unwrap_or_else(|| SocketAddr::from(([127, 0, 0, 1], default_port)))
    }

    /// The certificate login source (`common_name` when not set).
    pub fn cert_login_from(&self) -> CertLoginFrom {
        self.ssl_cert_login_from.unwrap_or_default()
    }

    /// Checks the keys of the section `key` names (`amqp.tls`, `management.tls`).
    pub(super) fn validate(&self, key: &'static str, cert_login: bool) -> Result<(), ConfigError> {
        let invalid = |reason: &str| ConfigError::Invalid {
            key,
            reason: reason.to_string(),
        };
        if self.certfile.as_os_str().is_empty() || self.keyfile.as_os_str().is_empty() {
            return Err(invalid("certfile and keyfile must name PEM files"));
        }
        if self.verify_peer
            && self
                .cacertfile
                .as_ref()
                .is_none_or(|p| p.as_os_str().is_empty())
        {
            return Err(invalid(
                "verify_peer needs cacertfile (the CAs client certificates must chain to)",
            ));
        }
        if self.fail_if_no_peer_cert && !self.verify_peer {
            // Erlang's ssl refuses this pair as incompatible too.
            return Err(invalid(
                "fail_if_no_peer_cert needs verify_peer (without it no certificate is asked for)",
            ));
        }
        if !cert_login && self.ssl_cert_login_from.is_some() {
            return Err(invalid(
                "ssl_cert_login_from applies to [amqp.tls] only (EXTERNAL authentication)",
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use crate::config::Config;

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
        assert!(!amqp.verify_peer && !amqp.fail_if_no_peer_cert);
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
}

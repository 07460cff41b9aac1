//! TLS for the listeners and node links, with rustls and its ring provider: TLS 1.2 and 1.3
//! only.
//!
//! - [`server_config`]: a rustls `ServerConfig` from any TLS section (`[amqp.tls]`,
//!   `[management.tls]`, `[admin.tls]`, `[cluster.tls]`: certificate chain, key, and the
//!   client-certificate policy of `verify_peer` and `fail_if_no_peer_cert`); unreadable
//!   files and bad PEM are [`TlsError`]s that stop the node's start.
//! - [`client_config`]: the other end, for a node dialling a peer (node links, the admin
//!   call of `join_cluster`): trusts `cacertfile`, presents `certfile`.
//! - [`link`]: node links over mutual TLS.
//! - [`amqps`]: the AMQPS listener; each connection is the same connection task as a
//!   plaintext one, over the TLS stream.
//! - [`https`]: the management API's HTTPS listener, handed to axum.
//! - [`peer`]: what the session learns of a TLS client (protocol, cipher, the certificate's
//!   login name for EXTERNAL).

pub mod amqps;
pub mod https;
pub mod link;
pub mod peer;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use rustls::{ClientConfig, RootCertStore, ServerConfig, SupportedProtocolVersion};

use crate::config::{TlsConfig, TlsUse};

/// The protocol versions the listeners accept: TLS 1.3 and 1.2. Nothing older is offered
/// (rustls implements nothing older either).
pub static PROTOCOL_VERSIONS: &[&SupportedProtocolVersion] =
    &[&rustls::version::TLS13, &rustls::version::TLS12];

/// Why a TLS listener could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// A file could not be read.
    #[error("[{section}] {key} = {path}: cannot read: {source}")]
    Read {
        /// The section: `amqp.tls`, `management.tls`, `admin.tls` or `cluster.tls`.
        section: &'static str,
        /// `certfile`, `keyfile` or `cacertfile`.
        key: &'static str,
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// A file is not what its key says: no PEM item of the right kind, or a broken one.
    #[error("[{section}] {key} = {path}: {reason}")]
    Pem {
        /// The section: `amqp.tls`, `management.tls`, `admin.tls` or `cluster.tls`.
        section: &'static str,
        /// `certfile`, `keyfile` or `cacertfile`.
        key: &'static str,
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// rustls refused the material (a key that does not match the certificate, a CA
    /// certificate it cannot use).
    #[error("[{section}]: {reason}")]
    Rustls {
        /// The section: `amqp.tls`, `management.tls`, `admin.tls` or `cluster.tls`.
        section: &'static str,
        /// rustls' message.
        reason: String,
    },
}

/// The process-independent crypto provider every listener uses.
fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// Reads a file named by `key` in `section`.
fn read(section: &'static str, key: &'static str, path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|source| TlsError::Read {
        section,
        key,
        path: path.to_path_buf(),
        source,
    })
}

/// The certificates of a PEM file: at least one, every one well-formed.
fn certificates(
    section: &'static str,
    key: &'static str,
    path: &Path,
) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let pem = read(section, key, path)?;
    let bad = |reason: String| TlsError::Pem {
        section,
        key,
        path: path.to_path_buf(),
        reason,
    };
    let certs = CertificateDer::pem_slice_iter(&pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| bad(format!("not valid PEM: {e}")))?;
    if certs.is_empty() {
        return Err(bad("no CERTIFICATE in the file".into()));
    }
    Ok(certs)
}

/// The private key of a PEM file (PKCS#8, PKCS#1 or SEC1).
fn private_key(section: &'static str, path: &Path) -> Result<PrivateKeyDer<'static>, TlsError> {
    let pem = read(section, "keyfile", path)?;
    PrivateKeyDer::from_pem_slice(&pem).map_err(|e| TlsError::Pem {
        section,
        key: "keyfile",
        path: path.to_path_buf(),
        reason: match e {
            rustls::pki_types::pem::Error::NoItemsFound => "no PRIVATE KEY in the file".into(),
            e => format!("not valid PEM: {e}"),
        },
    })
}

/// The trust roots of `cacertfile`.
fn roots(section: &'static str, ca: &Path) -> Result<RootCertStore, TlsError> {
    let mut roots = RootCertStore::empty();
    for c in certificates(section, "cacertfile", ca)? {
        roots.add(c).map_err(|e| TlsError::Rustls {
            section,
            reason: e.to_string(),
        })?;
    }
    Ok(roots)
}

/// The rustls configuration of the listener the section used as `usage` describes: TLS 1.2
/// and 1.3, the server's chain and key, and with `verify_peer` client certificates checked
/// against `cacertfile` (required with `fail_if_no_peer_cert`, optional otherwise).
/// Without `verify_peer` no client certificate is asked for; node links always verify.
pub fn server_config(
    cfg: &TlsConfig,
    usage: TlsUse,
    alpn: &[&[u8]],
) -> Result<Arc<ServerConfig>, TlsError> {
    let section = usage.section();
    let rustls_error = |e: rustls::Error| TlsError::Rustls {
        section,
        reason: e.to_string(),
    };
    let chain = certificates(section, "certfile", &cfg.certfile)?;
    let key = private_key(section, &cfg.keyfile)?;
    let provider = provider();
    let verifier = match (&cfg.cacertfile, cfg.verify_peer(usage)) {
        (Some(ca), true) => {
            let roots = roots(section, ca)?;
            let builder =
                WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider.clone());
            let builder = if cfg.fail_if_no_peer_cert(usage) {
                builder
            } else {
                builder.allow_unauthenticated()
            };
            builder.build().map_err(|e| TlsError::Rustls {
                section,
                reason: e.to_string(),
            })?
        }
        // Config validation refuses verify_peer without cacertfile.
        _ => WebPkiClientVerifier::no_client_auth(),
    };
    let mut config = ServerConfig::builder_with_provider(provider)
        .with_protocol_versions(PROTOCOL_VERSIONS)
        .map_err(rustls_error)?
        .with_client_cert_verifier(verifier)
        .with_single_cert(chain, key)
        .map_err(rustls_error)?;
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    Ok(Arc::new(config))
}

/// The rustls configuration of a node dialling a listener the section used as `usage`
/// protects: the server's certificate must chain to `cacertfile` and name the host dialled
/// (webpki's usual check), and `certfile` / `keyfile` are presented as the client's.
pub fn client_config(cfg: &TlsConfig, usage: TlsUse) -> Result<Arc<ClientConfig>, TlsError> {
    let section = usage.section();
    let Some(ca) = &cfg.cacertfile else {
        return Err(TlsError::Pem {
            section,
            key: "cacertfile",
            path: PathBuf::new(),
            reason: "needed to check the certificate of the node dialled".into(),
        });
    };
    client_config_with(section, ca, Some((&cfg.certfile, &cfg.keyfile)))
}

/// A TLS client (TLS 1.2 and 1.3) trusting the CAs of `ca`, presenting the certificate
/// chain and key of `identity` when given (`warrenctl --cacert/--cert/--key`); errors name
/// `section`.
pub fn client_config_with(
    section: &'static str,
    ca: &Path,
    identity: Option<(&Path, &Path)>,
) -> Result<Arc<ClientConfig>, TlsError> {
    let rustls_error = |e: rustls::Error| TlsError::Rustls {
        section,
        reason: e.to_string(),
    };
    let builder = ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(PROTOCOL_VERSIONS)
        .map_err(rustls_error)?
        .with_root_certificates(roots(section, ca)?);
    let config = match identity {
        None => builder.with_no_client_auth(),
        Some((cert, key)) => {
            let chain = certificates(section, "certfile", cert)?;
            let key = private_key(section, key)?;
            builder
                .with_client_auth_cert(chain, key)
                .map_err(rustls_error)?
        }
    };
    Ok(Arc::new(config))
}

/// The name a dialled `host:port` (or `[v6]:port`) must have in its certificate: the host,
/// a DNS name or an IP address.
pub fn server_name(addr: &str) -> Result<rustls::pki_types::ServerName<'static>, String> {
    let host = match addr.rsplit_once(':') {
        Some((host, port)) if port.parse::<u16>().is_ok() => host,
        _ => addr,
    };
    let host = host.trim_start_matches('[').trim_end_matches(']');
    rustls::pki_types::ServerName::try_from(host.to_string())
        .map_err(|e| format!("{host:?} cannot be checked against a certificate: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp(name: &str, text: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("warren-tls-unit-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let p = dir.join(name);
        std::fs::write(&p, text).expect("write");
        p
    }

    fn cfg(cert: PathBuf, key: PathBuf) -> TlsConfig {
        TlsConfig::new(cert, key, None)
    }

    #[test]
    fn only_tls_1_2_and_1_3_are_offered() {
        let versions: Vec<_> = PROTOCOL_VERSIONS.iter().map(|v| v.version).collect();
        assert_eq!(
            versions,
            [
                rustls::ProtocolVersion::TLSv1_3,
                rustls::ProtocolVersion::TLSv1_2
            ]
        );
    }

    #[test]
    fn server_names_come_from_the_host_dialled() {
        let ip = server_name("127.0.0.1:25672").expect("ip");
        assert_eq!(ip.to_str(), "127.0.0.1");
        let v6 = server_name("[::1]:25672").expect("v6");
        assert_eq!(v6.to_str(), "::1");
        let dns = server_name("node2.example:25672").expect("dns");
        assert_eq!(dns.to_str(), "node2.example");
        assert!(server_name("bad name:1").is_err());
    }

    #[test]
    fn a_missing_file_names_its_key_and_path() {
        let missing = PathBuf::from("/nonexistent/warren/cert.pem");
        let err = server_config(&cfg(missing, "/x".into()), TlsUse::Amqp, &[]).unwrap_err();
        let text = err.to_string();
        assert!(
            matches!(
                err,
                TlsError::Read {
                    key: "certfile",
                    ..
                }
            ),
            "{err:?}"
        );
        assert!(
            text.contains("[amqp.tls] certfile = /nonexistent/warren/cert.pem"),
            "{text}"
        );
    }

    #[test]
    fn files_without_the_right_pem_item_are_refused() {
        let junk = temp("junk.pem", "not a certificate\n");
        let err = server_config(&cfg(junk.clone(), junk.clone()), TlsUse::Amqp, &[]).unwrap_err();
        assert!(
            matches!(&err, TlsError::Pem { key: "certfile", reason, .. } if reason.contains("no CERTIFICATE")),
            "{err:?}"
        );
        let broken = temp(
            "broken.pem",
            "-----BEGIN CERTIFICATE-----\n!!!!\n-----END CERTIFICATE-----\n",
        );
        let err = server_config(&cfg(broken, junk.clone()), TlsUse::Management, &[]).unwrap_err();
        assert!(
            matches!(
                &err,
                TlsError::Pem {
                    section: "management.tls",
                    ..
                }
            ),
            "{err:?}"
        );
        if let Some(dir) = junk.parent() {
            std::fs::remove_dir_all(dir).expect("remove the test's folder");
        }
    }
}

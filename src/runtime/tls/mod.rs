//! TLS for the client listeners, with rustls and its ring provider: TLS 1.2 and 1.3 only.
//!
//! - [`server_config`]: a rustls `ServerConfig` from `[amqp.tls]` or `[management.tls]`
//!   (certificate chain, key, and the client-certificate policy of `verify_peer` and
//!   `fail_if_no_peer_cert`); unreadable files and bad PEM are [`TlsError`]s that stop the
//!   node's start.
//! - [`amqps`]: the AMQPS listener; each connection is the same connection task as a
//!   plaintext one, over the TLS stream.
//! - [`https`]: the management API's HTTPS listener, handed to axum.
//! - [`peer`]: what the session learns of a TLS client (protocol, cipher, the certificate's
//!   login name for EXTERNAL).

pub mod amqps;
pub mod https;
pub mod peer;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use rustls::{RootCertStore, ServerConfig, SupportedProtocolVersion};

use crate::config::TlsConfig;

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
        /// `amqp.tls` or `management.tls`.
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
        /// `amqp.tls` or `management.tls`.
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
        /// `amqp.tls` or `management.tls`.
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

/// The rustls configuration of the listener `section` (`amqp.tls`, `management.tls`)
/// describes: TLS 1.2 and 1.3, the server's chain and key, and with `verify_peer` client
/// certificates checked against `cacertfile` (required with `fail_if_no_peer_cert`,
/// optional otherwise). Without `verify_peer` no client certificate is asked for.
pub fn server_config(
    cfg: &TlsConfig,
    section: &'static str,
    alpn: &[&[u8]],
) -> Result<Arc<ServerConfig>, TlsError> {
    let rustls_error = |e: rustls::Error| TlsError::Rustls {
        section,
        reason: e.to_string(),
    };
    let chain = certificates(section, "certfile", &cfg.certfile)?;
    let key = private_key(section, &cfg.keyfile)?;
    let provider = provider();
    let verifier = match (&cfg.cacertfile, cfg.verify_peer) {
        (Some(ca), true) => {
            let mut roots = RootCertStore::empty();
            for c in certificates(section, "cacertfile", ca)? {
                roots.add(c).map_err(rustls_error)?;
            }
            let builder =
                WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider.clone());
            let builder = if cfg.fail_if_no_peer_cert {
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
        TlsConfig {
            listen: None,
            certfile: cert,
            keyfile: key,
            cacertfile: None,
            verify_peer: false,
            fail_if_no_peer_cert: false,
            ssl_cert_login_from: None,
        }
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
    fn a_missing_file_names_its_key_and_path() {
        let missing = PathBuf::from("/nonexistent/warren/cert.pem");
        let err = server_config(&cfg(missing, "/x".into()), "amqp.tls", &[]).unwrap_err();
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
        let err = server_config(&cfg(junk.clone(), junk.clone()), "amqp.tls", &[]).unwrap_err();
        assert!(
            matches!(&err, TlsError::Pem { key: "certfile", reason, .. } if reason.contains("no CERTIFICATE")),
            "{err:?}"
        );
        let broken = temp(
            "broken.pem",
            "-----BEGIN CERTIFICATE-----\n!!!!\n-----END CERTIFICATE-----\n",
        );
        let err = server_config(&cfg(broken, junk), "management.tls", &[]).unwrap_err();
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
    }
}

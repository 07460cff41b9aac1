//! Certificates made at test time with rcgen (nothing secret is committed): a CA, a server
//! certificate for 127.0.0.1 and localhost, and client certificates, as PEM files in a
//! temporary folder that goes with the [`Pki`]. Shared by `tests/tls.rs` and
//! `tests/node_tls.rs`, which each use part of it.
#![allow(dead_code)]

use std::path::PathBuf;
use std::sync::Arc;

use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DistinguishedName, DnType,
    ExtendedKeyUsagePurpose, IsCa, KeyPair, KeyUsagePurpose,
};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use warren::config::TlsConfig;

/// A client's certificate and key, PEM.
pub struct Identity {
    pub cert_pem: String,
    pub key_pem: String,
}

/// A CA and the files of a server certificate it signed.
pub struct Pki {
    pub dir: PathBuf,
    ca: CertifiedIssuer<'static, KeyPair>,
    pub ca_pem: String,
}

fn name(cn: &str) -> DistinguishedName {
    let mut dn = DistinguishedName::new();
    dn.push(DnType::OrganizationName, "Warren tests");
    dn.push(DnType::CommonName, cn);
    dn
}

impl Pki {
    /// A new CA named `ca_name`, with the server certificate written to `dir`.
    pub fn new(ca_name: &str) -> Pki {
        let dir = std::env::temp_dir().join(super::common::unique("warren-pki"));
        std::fs::create_dir_all(&dir).expect("pki dir");
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("CA params");
        params.distinguished_name = name(ca_name);
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let ca = CertifiedIssuer::self_signed(params, KeyPair::generate().expect("CA key"))
            .expect("CA certificate");
        let ca_pem = ca.pem();
        std::fs::write(dir.join("ca.pem"), &ca_pem).expect("write CA");
        let pki = Pki { dir, ca, ca_pem };
        let server = pki.issue(
            "localhost",
            &["localhost", "127.0.0.1"],
            ExtendedKeyUsagePurpose::ServerAuth,
        );
        std::fs::write(pki.dir.join("server.pem"), &server.cert_pem).expect("write cert");
        std::fs::write(pki.dir.join("server.key"), &server.key_pem).expect("write key");
        pki
    }

    fn issue(&self, cn: &str, sans: &[&str], usage: ExtendedKeyUsagePurpose) -> Identity {
        let sans: Vec<String> = sans.iter().map(|s| s.to_string()).collect();
        let mut params = CertificateParams::new(sans).expect("params");
        params.distinguished_name = name(cn);
        params.extended_key_usages = vec![usage];
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        let key = KeyPair::generate().expect("key");
        let cert = params.signed_by(&key, &self.ca).expect("signed");
        Identity {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
        }
    }

    /// A node certificate (`[cluster.tls]`: both server and client usages) with subject CN
    /// `cn` and the names `sans` (DNS names or IP addresses), written to `<cn>.pem` and
    /// `<cn>.key`; returns the section naming them and this CA.
    pub fn node(&self, cn: &str, sans: &[&str]) -> TlsConfig {
        let sans: Vec<String> = sans.iter().map(|s| s.to_string()).collect();
        let mut params = CertificateParams::new(sans).expect("params");
        params.distinguished_name = name(cn);
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        let key = KeyPair::generate().expect("key");
        let cert = params.signed_by(&key, &self.ca).expect("signed");
        let (cert_file, key_file) = (
            self.dir.join(format!("{cn}.pem")),
            self.dir.join(format!("{cn}.key")),
        );
        std::fs::write(&cert_file, cert.pem()).expect("write cert");
        std::fs::write(&key_file, key.serialize_pem()).expect("write key");
        TlsConfig::new(cert_file, key_file, Some(self.ca_file()))
    }

    /// The CA certificate's file.
    pub fn ca_file(&self) -> PathBuf {
        self.dir.join("ca.pem")
    }

    /// A client certificate with subject CN `cn` and the DNS names `sans`.
    pub fn client(&self, cn: &str, sans: &[&str]) -> Identity {
        self.issue(cn, sans, ExtendedKeyUsagePurpose::ClientAuth)
    }

    /// A listener section using the server certificate and this CA.
    pub fn listener(&self, verify_peer: bool, fail_if_no_peer_cert: bool) -> TlsConfig {
        TlsConfig {
            listen: Some("127.0.0.1:0".parse().expect("address")),
            certfile: self.dir.join("server.pem"),
            keyfile: self.dir.join("server.key"),
            cacertfile: Some(self.dir.join("ca.pem")),
            verify_peer: Some(verify_peer),
            fail_if_no_peer_cert: Some(fail_if_no_peer_cert),
            ssl_cert_login_from: None,
        }
    }

    /// A rustls client trusting this CA, offering `versions`, presenting `identity`.
    pub fn client_config(
        &self,
        identity: Option<&Identity>,
        versions: &[&'static rustls::SupportedProtocolVersion],
    ) -> Arc<rustls::ClientConfig> {
        let mut roots = rustls::RootCertStore::empty();
        roots
            .add(CertificateDer::from_pem_slice(self.ca_pem.as_bytes()).expect("CA PEM"))
            .expect("CA accepted");
        let builder = rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_protocol_versions(versions)
        .expect("versions")
        .with_root_certificates(roots);
        let config = match identity {
            None => builder.with_no_client_auth(),
            Some(id) => builder
                .with_client_auth_cert(
                    vec![CertificateDer::from_pem_slice(id.cert_pem.as_bytes()).expect("cert")],
                    PrivateKeyDer::from_pem_slice(id.key_pem.as_bytes()).expect("key"),
                )
                .expect("client identity"),
        };
        Arc::new(config)
    }
}

impl Drop for Pki {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

//! What the session learns of a TLS client: protocol version, cipher suite, and the verified
//! certificate's subject and login name. The session decides what EXTERNAL does with the
//! name ([`crate::session::external`]); this only reads the certificate, with x509-parser.

use rustls::ServerConnection;
use x509_parser::extensions::GeneralName;
use x509_parser::prelude::{FromDer, X509Certificate};

use crate::config::CertLoginFrom;
use crate::session::{PeerCert, TlsPeer};

/// The session's view of a finished handshake.
pub fn tls_peer(conn: &ServerConnection, from: CertLoginFrom) -> TlsPeer {
    let protocol = match conn.protocol_version() {
        Some(rustls::ProtocolVersion::TLSv1_3) => "tlsv1.3".to_string(),
        Some(rustls::ProtocolVersion::TLSv1_2) => "tlsv1.2".to_string(),
        other => format!("{other:?}").to_lowercase(),
    };
    let cipher = conn
        .negotiated_cipher_suite()
        .map_or_else(String::new, |s| format!("{:?}", s.suite()));
    // The first certificate is the client's own; rustls has verified the chain (a client
    // that gave none passed only where `fail_if_no_peer_cert` is off).
    let cert = conn
        .peer_certificates()
        .and_then(|chain| chain.first())
        .map(|der| peer_cert(der.as_ref(), from));
    TlsPeer {
        protocol,
        cipher,
        cert,
    }
}

/// The subject and login name of a DER certificate.
pub fn peer_cert(der: &[u8], from: CertLoginFrom) -> PeerCert {
    let Ok((_, cert)) = X509Certificate::from_der(der) else {
        // webpki accepted it, so this is unlikely; it only means no name to log in with.
        return PeerCert {
            subject: String::new(),
            login: None,
        };
    };
    PeerCert {
        subject: cert.subject().to_string(),
        login: login_name(&cert, from),
    }
}

/// RabbitMQ's `peer_cert_auth_name`: every CN of the subject joined with `,`, or the first
/// DNS subject alternative name.
fn login_name(cert: &X509Certificate<'_>, from: CertLoginFrom) -> Option<String> {
    match from {
        CertLoginFrom::CommonName => {
            let names: Vec<&str> = cert
                .subject()
                .iter_common_name()
                .filter_map(|cn| cn.as_str().ok())
                .collect();
            (!names.is_empty()).then(|| names.join(","))
        }
        CertLoginFrom::SubjectAlternativeName => {
            let san = cert.subject_alternative_name().ok().flatten()?;
            san.value.general_names.iter().find_map(|n| match n {
                GeneralName::DNSName(d) => Some(d.to_string()),
                _ => None,
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cert(cn: Option<&str>, sans: &[&str]) -> Vec<u8> {
        let mut params =
            rcgen::CertificateParams::new(sans.iter().map(|s| s.to_string()).collect::<Vec<_>>())
                .expect("params");
        params.distinguished_name = rcgen::DistinguishedName::new();
        params
            .distinguished_name
            .push(rcgen::DnType::OrganizationName, "Warren tests");
        if let Some(cn) = cn {
            params
                .distinguished_name
                .push(rcgen::DnType::CommonName, cn);
        }
        let key = rcgen::KeyPair::generate().expect("key");
        params
            .self_signed(&key)
            .expect("self-signed")
            .der()
            .to_vec()
    }

    #[test]
    fn the_common_name_is_the_default_login() {
        let der = cert(Some("alice"), &["alice.example"]);
        let c = peer_cert(&der, CertLoginFrom::CommonName);
        assert_eq!(c.login.as_deref(), Some("alice"));
        assert!(c.subject.contains("CN=alice"), "{}", c.subject);
        let san = peer_cert(&der, CertLoginFrom::SubjectAlternativeName);
        assert_eq!(san.login.as_deref(), Some("alice.example"));
    }

    #[test]
    fn a_certificate_without_the_field_has_no_login() {
        let der = cert(None, &[]);
        assert_eq!(peer_cert(&der, CertLoginFrom::CommonName).login, None);
        assert_eq!(
            peer_cert(&der, CertLoginFrom::SubjectAlternativeName).login,
            None
        );
        assert_eq!(peer_cert(b"junk", CertLoginFrom::CommonName).login, None);
    }
}

//! What the session learns of a TLS client: protocol version, the cipher suite's parts in
//! RabbitMQ's names, and the verified certificate's subject, issuer, validity and login
//! name. The session decides what EXTERNAL does with the
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
    let suite = conn
        .negotiated_cipher_suite()
        .map_or_else(String::new, |s| format!("{:?}", s.suite()));
    let (key_exchange, cipher, hash) = suite_parts(&suite);
    // The first certificate is the client's own; rustls has verified the chain (a client
    // that gave none passed only where `fail_if_no_peer_cert` is off).
    let cert = conn
        .peer_certificates()
        .and_then(|chain| chain.first())
        .map(|der| peer_cert(der.as_ref(), from));
    TlsPeer {
        protocol,
        cipher,
        key_exchange,
        hash,
        cert,
    }
}

/// A rustls suite name (`TLS13_AES_256_GCM_SHA384`, `TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256`)
/// split into the key exchange, bulk cipher and MAC that RabbitMQ lists, in Erlang's
/// lower-case names: TLS 1.3's key exchange is `any`, an AEAD cipher's MAC is `aead`.
fn suite_parts(suite: &str) -> (String, String, String) {
    let (key_exchange, rest) = match suite.strip_prefix("TLS13_") {
        Some(rest) => ("any".to_string(), rest),
        None => match suite.trim_start_matches("TLS_").split_once("_WITH_") {
            Some((kx, rest)) => (kx.to_lowercase(), rest),
            None => return (String::new(), suite.to_lowercase(), String::new()),
        },
    };
    // The last part names the hash (`SHA384`); the cipher is what comes before it.
    let (cipher, digest) = rest.rsplit_once('_').unwrap_or((rest, ""));
    let aead = ["GCM", "CCM", "POLY1305"]
        .iter()
        .any(|a| cipher.contains(a));
    let hash = if aead {
        "aead".to_string()
    } else {
        digest.to_lowercase()
    };
    (key_exchange, cipher.to_lowercase(), hash)
}

/// A certificate time as RabbitMQ shows it: `2026-12-04T20:00:00Z` (UTC).
fn rfc3339(unix: i64) -> String {
    let (days, secs) = (unix.div_euclid(86_400), unix.rem_euclid(86_400));
    // Howard Hinnant's days-to-civil (proleptic Gregorian).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        secs / 3600,
        secs % 3600 / 60,
        secs % 60
    )
}

/// The subject and login name of a DER certificate.
pub fn peer_cert(der: &[u8], from: CertLoginFrom) -> PeerCert {
    let Ok((_, cert)) = X509Certificate::from_der(der) else {
        // webpki accepted it, so this is unlikely; it only means no name to log in with.
        return PeerCert {
            subject: String::new(),
            issuer: String::new(),
            validity: String::new(),
            login: None,
        };
    };
    let validity = cert.validity();
    PeerCert {
        subject: cert.subject().to_string(),
        issuer: cert.issuer().to_string(),
        validity: format!(
            "{} - {}",
            rfc3339(validity.not_before.timestamp()),
            rfc3339(validity.not_after.timestamp())
        ),
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
    fn issuer_and_validity_are_read_as_rabbitmq_shows_them() {
        let mut params = rcgen::CertificateParams::new(vec![]).expect("params");
        params.distinguished_name = rcgen::DistinguishedName::new();
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, "issuer-and-subject");
        params.not_before = rcgen::date_time_ymd(2024, 2, 29);
        params.not_after = rcgen::date_time_ymd(2031, 12, 31);
        let key = rcgen::KeyPair::generate().expect("key");
        let der = params
            .self_signed(&key)
            .expect("self-signed")
            .der()
            .to_vec();
        let c = peer_cert(&der, CertLoginFrom::CommonName);
        assert_eq!(c.issuer, "CN=issuer-and-subject");
        assert_eq!(c.validity, "2024-02-29T00:00:00Z - 2031-12-31T00:00:00Z");
    }

    #[test]
    fn times_are_utc_calendar_dates() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00Z");
        assert_eq!(rfc3339(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(rfc3339(1_796_418_021), "2026-12-04T21:00:21Z");
        assert_eq!(rfc3339(-1), "1969-12-31T23:59:59Z");
    }

    #[test]
    fn suites_split_into_rabbitmqs_key_exchange_cipher_and_hash() {
        let parts = suite_parts;
        let own = |a: &str, b: &str, c: &str| (a.to_string(), b.to_string(), c.to_string());
        assert_eq!(
            parts("TLS13_AES_256_GCM_SHA384"),
            own("any", "aes_256_gcm", "aead")
        );
        assert_eq!(
            parts("TLS13_CHACHA20_POLY1305_SHA256"),
            own("any", "chacha20_poly1305", "aead")
        );
        assert_eq!(
            parts("TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256"),
            own("ecdhe_rsa", "aes_128_gcm", "aead")
        );
        assert_eq!(
            parts("TLS_RSA_WITH_AES_128_CBC_SHA256"),
            own("rsa", "aes_128_cbc", "sha256")
        );
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

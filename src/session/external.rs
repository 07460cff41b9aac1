//! TLS clients in the session: what the runtime learnt from the TLS handshake
//! ([`TlsPeer`]), and SASL EXTERNAL as RabbitMQ's `rabbitmq_auth_mechanism_ssl` does it.
//!
//! - EXTERNAL is offered on every TLS connection, with or without a client certificate
//!   (RabbitMQ offers it without one too, so that the refusal says why rather than the
//!   client failing to agree on a mechanism); a plaintext connection does not offer it, and
//!   asking for it there is `503 COMMAND_INVALID`, "invalid authentication mechanism".
//! - The user name is the one the runtime took from the verified client certificate
//!   (`[amqp.tls] ssl_cert_login_from`: the subject's CN, or the first DNS subject
//!   alternative name). The user must exist; no password is checked, and the client's SASL
//!   response is ignored.
//! - No certificate, a certificate without the name, or an unknown user: `403
//!   ACCESS_REFUSED` with RabbitMQ's "Login was refused" text; the reason goes to the log.
//!
//! The session never sees a certificate: only the text the runtime extracted from it.

use std::fmt;

/// The mechanism's name in connection.start and start-ok.
pub const EXTERNAL: &str = "EXTERNAL";

/// What the session knows of a connection that came in over TLS.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsPeer {
    /// The protocol version as RabbitMQ lists it (`tlsv1.3`, `tlsv1.2`).
    pub protocol: String,
    /// The suite's bulk cipher, as RabbitMQ (Erlang) names it: `aes_256_gcm`.
    pub cipher: String,
    /// The suite's key exchange as RabbitMQ names it: `ecdhe_rsa`, or `any` for TLS 1.3
    /// (whose suites do not fix it).
    pub key_exchange: String,
    /// The suite's MAC as RabbitMQ names it: `aead` for every AEAD cipher.
    pub hash: String,
    /// The client's certificate, verified against `cacertfile`; `None` when the client gave
    /// none (or none was asked for: `verify_peer = false`).
    pub cert: Option<PeerCert>,
}

/// A verified client certificate, as far as the session needs it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerCert {
    /// The subject's distinguished name, for listings.
    pub subject: String,
    /// The issuer's distinguished name, for listings.
    pub issuer: String,
    /// Its validity as RabbitMQ shows it: `2026-01-01T00:00:00Z - 2027-01-01T00:00:00Z`.
    pub validity: String,
    /// The user name EXTERNAL logs in as; `None` when the certificate does not carry the
    /// field `ssl_cert_login_from` names.
    pub login: Option<String>,
}

/// Why EXTERNAL found no user name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// A plaintext connection: the mechanism is not offered.
    NotTls,
    /// The client gave no certificate.
    NoCertificate,
    /// The certificate has no name where `ssl_cert_login_from` looks.
    NoName,
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // RabbitMQ's texts for the same cases.
        f.write_str(match self {
            Refusal::NotTls => "not a TLS-enabled connection",
            Refusal::NoCertificate => "connection peer presented no TLS (x.509) certificate",
            Refusal::NoName => "no name found",
        })
    }
}

/// The mechanisms connection.start offers, space separated.
pub fn mechanisms(tls: Option<&TlsPeer>) -> &'static str {
    // EXTERNAL last: a client that takes the first mechanism offered keeps using a password.
    if tls.is_some() {
        "PLAIN AMQPLAIN EXTERNAL"
    } else {
        "PLAIN AMQPLAIN"
    }
}

/// The user name EXTERNAL logs in as, or why there is none.
pub fn login(tls: Option<&TlsPeer>) -> Result<&str, Refusal> {
    let tls = tls.ok_or(Refusal::NotTls)?;
    let cert = tls.cert.as_ref().ok_or(Refusal::NoCertificate)?;
    cert.login.as_deref().ok_or(Refusal::NoName)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tls(cert: Option<PeerCert>) -> TlsPeer {
        TlsPeer {
            protocol: "tlsv1.3".into(),
            cipher: "aes_128_gcm".into(),
            key_exchange: "any".into(),
            hash: "aead".into(),
            cert,
        }
    }

    #[test]
    fn external_is_offered_on_tls_connections_only() {
        assert_eq!(mechanisms(None), "PLAIN AMQPLAIN");
        assert_eq!(mechanisms(Some(&tls(None))), "PLAIN AMQPLAIN EXTERNAL");
    }

    #[test]
    fn the_login_is_the_certificate_name_or_the_reason_there_is_none() {
        assert_eq!(login(None), Err(Refusal::NotTls));
        assert_eq!(login(Some(&tls(None))), Err(Refusal::NoCertificate));
        let nameless = tls(Some(PeerCert {
            subject: "O=x".into(),
            issuer: "O=x".into(),
            validity: String::new(),
            login: None,
        }));
        assert_eq!(login(Some(&nameless)), Err(Refusal::NoName));
        let named = tls(Some(PeerCert {
            subject: "CN=alice".into(),
            issuer: "CN=ca".into(),
            validity: String::new(),
            login: Some("alice".into()),
        }));
        assert_eq!(login(Some(&named)), Ok("alice"));
        assert!(Refusal::NoCertificate
            .to_string()
            .contains("no TLS (x.509)"));
    }
}

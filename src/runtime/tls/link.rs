//! Node links over mutual TLS (`[cluster.tls]`): both ends present a certificate from the
//! cluster's CA and check the other's.
//!
//! - The acceptor requires a client certificate that chains to `cacertfile`; a peer with
//!   none, with one from another CA, or speaking plaintext fails the handshake and the link
//!   is refused before a single frame is read.
//! - The dialler checks that the acceptor's certificate chains to `cacertfile` and names the
//!   host it dialled (the host of the peer's link address, a DNS name or an IP address), so
//!   node certificates carry their link host as a subject alternative name.
//! - The node id a dialler claims in its `Hello` is bound to its certificate the same way:
//!   the acceptor takes the claim only if the certificate names the host of that node's
//!   registered link address ([`LinkTls::check_names`]). A certificate therefore speaks for
//!   the nodes of one host, not for the whole cluster. The `cluster_id` check still runs
//!   inside the TLS session.
//!
//! The streams are handed to the same framing as plaintext links
//! ([`crate::runtime::node_link::wire`]).

use std::sync::Arc;

use rustls::pki_types::CertificateDer;
use tokio::net::TcpStream;
use tokio_rustls::{client, server, TlsAcceptor, TlsConnector};

use super::{client_config, server_config, server_name, TlsError};
use crate::config::{TlsConfig, TlsUse};

/// The ALPN name of node links: a client of another protocol (AMQPS, HTTPS) offering its
/// own is refused at the handshake instead of being read as frames.
const ALPN: &[u8] = b"warren-link";

/// The TLS ends of one node's links, built once from `[cluster.tls]`.
#[derive(Clone)]
pub struct LinkTls {
    acceptor: TlsAcceptor,
    connector: TlsConnector,
}

impl std::fmt::Debug for LinkTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LinkTls").finish_non_exhaustive()
    }
}

impl LinkTls {
    /// Reads the files `cfg` names; an unusable one is an error that stops the start.
    pub fn new(cfg: &TlsConfig) -> Result<LinkTls, TlsError> {
        let server = server_config(cfg, TlsUse::NodeLink, &[ALPN])?;
        let mut client = Arc::unwrap_or_clone(client_config(cfg, TlsUse::NodeLink)?);
        client.alpn_protocols = vec![ALPN.to_vec()];
        Ok(LinkTls {
            acceptor: TlsAcceptor::from(server),
            connector: TlsConnector::from(Arc::new(client)),
        })
    }

    /// The server side of the handshake on an accepted connection.
    pub async fn accept(&self, tcp: TcpStream) -> std::io::Result<server::TlsStream<TcpStream>> {
        self.acceptor.accept(tcp).await
    }

    /// The client side of the handshake with the peer dialled at `addr` (`host:port`).
    pub async fn connect(
        &self,
        addr: &str,
        tcp: TcpStream,
    ) -> std::io::Result<client::TlsStream<TcpStream>> {
        let name = server_name(addr)
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
        self.connector.connect(name, tcp).await
    }

    /// The certificate a peer presented in an accepted session (its end-entity one), kept to
    /// check against the node id it claims once its `Hello` arrives.
    pub fn peer_certificate(
        session: &server::TlsStream<TcpStream>,
    ) -> Option<CertificateDer<'static>> {
        let (_, conn) = session.get_ref();
        conn.peer_certificates()
            .and_then(|chain| chain.first())
            .map(|cert| cert.clone().into_owned())
    }

    /// Whether `cert` names the host of `addr` (`host:port`), the link address registered
    /// for the node a dialler claims to be: the check a dialler makes of the acceptor's
    /// certificate, made the other way. The chain was already verified by the handshake.
    pub fn check_names(cert: &CertificateDer<'_>, addr: &str) -> Result<(), String> {
        let name = server_name(addr)?;
        let cert = webpki::EndEntityCert::try_from(cert)
            .map_err(|e| format!("unreadable peer certificate: {e}"))?;
        cert.verify_is_valid_for_subject_name(&name)
            .map_err(|e| format!("its certificate does not name {}: {e}", name.to_str()))
    }
}

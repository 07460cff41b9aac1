//! The AMQPS listener: accepts TCP connections, runs the TLS handshake (bounded by the
//! AMQP handshake timeout), and hands the TLS stream to the same connection task a
//! plaintext connection gets, with the session's view of the TLS peer.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_rustls::TlsAcceptor;
use tokio_util::task::TaskTracker;

use super::peer::tls_peer;
use crate::config::CertLoginFrom;
use crate::runtime::conn_task::{self, ConnContext};

/// An AMQPS listener, bound, with what its connections need.
pub struct Amqps {
    /// The bound socket.
    pub listener: TcpListener,
    /// Its address.
    pub addr: SocketAddr,
    /// The rustls server configuration ([`super::server_config`]).
    pub config: Arc<rustls::ServerConfig>,
    /// Where EXTERNAL's user name comes from.
    pub login_from: CertLoginFrom,
    /// Time a client has for the TLS handshake.
    pub handshake_timeout: Duration,
}

impl Amqps {
    /// Accepts until `shutdown` flips; every connection is a task on `tracker`.
    pub fn spawn(
        self,
        ctx: ConnContext,
        tracker: TaskTracker,
        mut shutdown: watch::Receiver<bool>,
    ) -> JoinHandle<()> {
        let acceptor = TlsAcceptor::from(self.config);
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    biased;
                    _ = shutdown.changed() => break,
                    r = self.listener.accept() => match r {
                        Ok((tcp, peer)) => {
                            // As the plaintext listener: deliveries are batched per write.
                            let _ = tcp.set_nodelay(true);
                            let local = tcp.local_addr().unwrap_or(self.addr);
                            tracker.spawn(connection(
                                acceptor.clone(),
                                tcp,
                                peer,
                                local,
                                self.login_from,
                                self.handshake_timeout,
                                ctx.clone(),
                            ));
                        }
                        Err(e) => {
                            tracing::warn!(error = %e, "AMQPS accept failed");
                            tokio::time::sleep(Duration::from_millis(50)).await;
                        }
                    }
                }
            }
        })
    }
}

/// One client: the TLS handshake, then the connection task over the TLS stream.
async fn connection(
    acceptor: TlsAcceptor,
    tcp: tokio::net::TcpStream,
    peer: SocketAddr,
    local: SocketAddr,
    login_from: CertLoginFrom,
    timeout: Duration,
    ctx: ConnContext,
) {
    let mut shutdown = ctx.shutdown.clone();
    let handshake = tokio::time::timeout(timeout, acceptor.accept(tcp));
    let tls = tokio::select! {
        biased;
        _ = shutdown.changed() => return,
        r = handshake => match r {
            Ok(Ok(tls)) => tls,
            Ok(Err(e)) => {
                // A client without an acceptable certificate, or that offered only old
                // protocol versions, ends here: the alert has been sent.
                tracing::info!(%peer, error = %e, "TLS handshake failed");
                return;
            }
            Err(_) => {
                tracing::info!(%peer, "TLS handshake timed out");
                return;
            }
        }
    };
    let session = tls_peer(tls.get_ref().1, login_from);
    tracing::debug!(%peer, protocol = %session.protocol, cipher = %session.cipher, "TLS handshake done");
    conn_task::run(tls, peer, local, Some(session), ctx).await;
}

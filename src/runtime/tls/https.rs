//! An HTTPS listener for axum: a task accepts TCP connections and runs each TLS handshake
//! in its own task (a slow client holds up only itself), and [`TlsListener::accept`] hands
//! the finished streams to `axum::serve`, which serves them as it serves plaintext ones.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};
use tokio_rustls::server::TlsStream;
use tokio_rustls::TlsAcceptor;

/// Time a client has for the TLS handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Finished handshakes waiting for axum.
const BACKLOG: usize = 64;

/// TLS streams whose handshake finished, for `axum::serve`.
pub struct TlsListener {
    ready: mpsc::Receiver<(TlsStream<TcpStream>, SocketAddr)>,
    addr: SocketAddr,
}

impl TlsListener {
    /// Starts accepting on `listener` (bound at `addr`) until `shutdown` flips.
    pub fn start(
        listener: TcpListener,
        addr: SocketAddr,
        config: Arc<rustls::ServerConfig>,
        mut shutdown: watch::Receiver<bool>,
    ) -> TlsListener {
        let (tx, ready) = mpsc::channel(BACKLOG);
        let acceptor = TlsAcceptor::from(config);
        tokio::spawn(async move {
            loop {
                let (tcp, peer) = tokio::select! {
                    biased;
                    _ = shutdown.changed() => break,
                    r = listener.accept() => match r {
                        Ok(accepted) => accepted,
                        Err(e) => {
                            tracing::warn!(error = %e, "HTTPS accept failed");
                            tokio::time::sleep(Duration::from_millis(50)).await;
                            continue;
                        }
                    },
                };
                let (acceptor, tx) = (acceptor.clone(), tx.clone());
                tokio::spawn(async move {
                    match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
                        Ok(Ok(tls)) => {
                            // axum has stopped when this fails: the stream is dropped.
                            let _ = tx.send((tls, peer)).await;
                        }
                        Ok(Err(e)) => tracing::info!(%peer, error = %e, "HTTPS handshake failed"),
                        Err(_) => tracing::info!(%peer, "HTTPS handshake timed out"),
                    }
                });
            }
        });
        TlsListener { ready, addr }
    }
}

impl axum::serve::Listener for TlsListener {
    type Io = TlsStream<TcpStream>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        match self.ready.recv().await {
            Some(ready) => ready,
            // The accepting task has stopped (shutdown): nothing more comes; axum's
            // graceful shutdown ends the serve.
            None => std::future::pending().await,
        }
    }

    fn local_addr(&self) -> std::io::Result<SocketAddr> {
        Ok(self.addr)
    }
}

//! The `Transport` trait: how the node gets client sockets. Tokio here; turmoil in `sim/`.

use std::future::Future;
use std::io;
use std::net::SocketAddr;

use tokio::io::{AsyncRead, AsyncWrite};

/// A bound listener.
pub trait Listener: Send + 'static {
    /// The stream type it accepts.
    type Stream: AsyncRead + AsyncWrite + Unpin + Send + 'static;
    /// Accepts the next connection.
    fn accept(&mut self) -> impl Future<Output = io::Result<(Self::Stream, SocketAddr)>> + Send;
    /// The address it is bound to.
    fn local_addr(&self) -> io::Result<SocketAddr>;
    /// The node's end of an accepted stream (the bound address unless the stream knows
    /// better, e.g. which interface a wildcard listener accepted on).
    fn stream_local_addr(&self, _stream: &Self::Stream) -> io::Result<SocketAddr> {
        self.local_addr()
    }
}

/// A network: binds listeners.
pub trait Transport: Send + Sync + 'static {
    /// Its listener type.
    type Listener: Listener;
    /// Binds `addr`.
    fn bind(&self, addr: SocketAddr) -> impl Future<Output = io::Result<Self::Listener>> + Send;
}

/// The real network through tokio.
#[derive(Debug, Clone, Copy, Default)]
pub struct TokioTransport;

/// A tokio TCP listener.
#[derive(Debug)]
pub struct TokioListener(tokio::net::TcpListener);

impl Listener for TokioListener {
    type Stream = tokio::net::TcpStream;

    async fn accept(&mut self) -> io::Result<(Self::Stream, SocketAddr)> {
        let (s, a) = self.0.accept().await?;
        // Deliveries and confirms are latency-sensitive and already batched per write.
        let _ = s.set_nodelay(true);
        Ok((s, a))
    }

    fn local_addr(&self) -> io::Result<SocketAddr> {
        self.0.local_addr()
    }

    fn stream_local_addr(&self, stream: &Self::Stream) -> io::Result<SocketAddr> {
        stream.local_addr()
    }
}

impl Transport for TokioTransport {
    type Listener = TokioListener;

    async fn bind(&self, addr: SocketAddr) -> io::Result<TokioListener> {
        Ok(TokioListener(tokio::net::TcpListener::bind(addr).await?))
    }
}

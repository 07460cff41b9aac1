//! The client's socket halves: plaintext TCP for `amqp://`, TLS over TCP (tokio-rustls,
//! TLS 1.2 and 1.3) for `amqps://`. Plaintext keeps tokio's owned halves, so an `amqp://`
//! run costs what it cost before TLS existed; TLS goes through `tokio::io::split`.

use std::io;
use std::path::Path;
use std::pin::Pin;
use std::sync::{Arc, OnceLock};
use std::task::{Context, Poll};

use amq_protocol::uri::{AMQPScheme, AMQPUri};
use anyhow::{anyhow, bail, Context as _, Result};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf, ReadHalf, WriteHalf};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;
use tokio_rustls::TlsConnector;

/// The TLS client every `amqps://` connection uses, set once from `--cacert`.
static TLS: OnceLock<TlsConnector> = OnceLock::new();

/// Trusts the CA certificates of the PEM file `cacert` for `amqps://` connections.
pub fn trust(cacert: &Path) -> Result<()> {
    let pem = std::fs::read(cacert).with_context(|| format!("--cacert {}", cacert.display()))?;
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(&pem) {
        let cert = cert.map_err(|e| anyhow!("--cacert {}: {e}", cacert.display()))?;
        roots.add(cert)?;
    }
    if roots.is_empty() {
        bail!("--cacert {}: no CERTIFICATE in the file", cacert.display());
    }
    let config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_protocol_versions(&[&rustls::version::TLS13, &rustls::version::TLS12])?
    .with_root_certificates(roots)
    .with_no_client_auth();
    TLS.set(TlsConnector::from(Arc::new(config)))
        .map_err(|_| anyhow!("the TLS client is set up once"))
}

/// The reading half of a connection.
pub enum Rd {
    Tcp(OwnedReadHalf),
    Tls(ReadHalf<TlsStream<TcpStream>>),
}

/// The writing half of a connection.
pub enum Wr {
    Tcp(OwnedWriteHalf),
    Tls(WriteHalf<TlsStream<TcpStream>>),
}

/// Connects to `uri`'s host and port, over TLS for `amqps://`.
pub async fn connect(uri: &AMQPUri, label: &str) -> Result<(Rd, Wr)> {
    let host = uri.authority.host.as_str();
    let port = uri.authority.port;
    let tcp = TcpStream::connect((host, port))
        .await
        .with_context(|| format!("{label}: cannot connect to {host}:{port}"))?;
    tcp.set_nodelay(true)?;
    if uri.scheme != AMQPScheme::AMQPS {
        let (rd, wr) = tcp.into_split();
        return Ok((Rd::Tcp(rd), Wr::Tcp(wr)));
    }
    let tls = TLS.get().ok_or_else(|| {
        anyhow!("amqps:// needs --cacert (the CA the broker's certificate chains to)")
    })?;
    let name = ServerName::try_from(host.to_string())
        .map_err(|e| anyhow!("{label}: '{host}' is not a TLS server name: {e}"))?;
    let stream = tls
        .connect(name, tcp)
        .await
        .with_context(|| format!("{label}: TLS handshake with {host}:{port} failed"))?;
    let (rd, wr) = tokio::io::split(stream);
    Ok((Rd::Tls(rd), Wr::Tls(wr)))
}

impl AsyncRead for Rd {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Rd::Tcp(r) => Pin::new(r).poll_read(cx, buf),
            Rd::Tls(r) => Pin::new(r).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Wr {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Wr::Tcp(w) => Pin::new(w).poll_write(cx, buf),
            Wr::Tls(w) => Pin::new(w).poll_write(cx, buf),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Wr::Tcp(w) => Pin::new(w).poll_flush(cx),
            Wr::Tls(w) => Pin::new(w).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Wr::Tcp(w) => Pin::new(w).poll_shutdown(cx),
            Wr::Tls(w) => Pin::new(w).poll_shutdown(cx),
        }
    }
}

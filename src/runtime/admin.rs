//! The admin listener `warrenctl` talks to: accepts TCP connections, reads length-prefixed
//! frames with deadlines, and hands each request to the sans-IO [`crate::admin`] handler.
//!
//! A connection authenticates with its first frame; a refusal, a malformed or oversized
//! frame, or a silent peer ends the connection. Nothing a peer sends can panic the node.
//!
//! With `[admin.tls]` the listener speaks TLS only: the handshake (and, with `verify_peer`,
//! the client certificate) comes before the first frame, and a connection that fails it is
//! refused and logged. The password check still follows: a certificate gets a client to
//! the login, not past it.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio_rustls::{TlsAcceptor, TlsConnector};
use tokio_util::task::TaskTracker;

use super::clock::Clock;
use super::cluster::ClusterControl;
use super::conn_task::MetaCommit;
use crate::admin::{self, Auth, FrameError, Handled, NodeInfo, Request, Response};
use crate::broker::remote::{QueueCall, QueueReply};
use crate::broker::Broker;
use crate::meta::Command;

/// How long the first frame (authentication) may take to arrive.
const AUTH_DEADLINE: Duration = Duration::from_secs(10);
/// How long a connection may sit idle between requests.
const IDLE_DEADLINE: Duration = Duration::from_secs(60);
/// How long one frame may take once its first byte arrived, and a reply to be written.
const IO_DEADLINE: Duration = Duration::from_secs(10);

/// Why an admin connection ended.
#[derive(Debug, thiserror::Error)]
pub enum AdminConnError {
    /// Socket error.
    #[error("i/o: {0}")]
    Io(#[from] std::io::Error),
    /// Bad frame.
    #[error("{0}")]
    Frame(#[from] FrameError),
    /// A deadline passed.
    #[error("timed out")]
    Timeout,
    /// The peer closed the connection.
    #[error("closed by peer")]
    Closed,
    /// The TLS handshake failed.
    #[error("TLS handshake: {0}")]
    Tls(std::io::Error),
}

/// What every admin connection shares.
#[derive(Clone)]
pub struct AdminContext {
    /// The broker.
    pub broker: Arc<Broker>,
    /// This node.
    pub node: NodeInfo,
    /// The node's clock.
    pub clock: Clock,
    /// Where metadata changes are committed.
    pub meta: Arc<dyn MetaCommit>,
    /// Cluster status and `join_cluster`, on a clustered node.
    pub cluster: Option<ClusterControl>,
}

/// Binds the admin listener.
pub async fn bind(addr: SocketAddr) -> std::io::Result<TcpListener> {
    TcpListener::bind(addr).await
}

/// Accepts connections until `shutdown` flips; connections run on `tracker`. With `tls`
/// every connection must complete a TLS handshake first.
pub async fn serve(
    listener: TcpListener,
    ctx: AdminContext,
    tracker: TaskTracker,
    mut shutdown: watch::Receiver<bool>,
    tls: Option<TlsAcceptor>,
) {
    loop {
        tokio::select! {
            biased;
            _ = shutdown.changed() => break,
            r = listener.accept() => match r {
                Ok((stream, peer)) => {
                    let ctx = ctx.clone();
                    let shutdown = shutdown.clone();
                    let tls = tls.clone();
                    tracker.spawn(async move {
                        let ended = match tls {
                            None => connection(stream, ctx, shutdown).await,
                            Some(tls) => tls_connection(stream, tls, ctx, shutdown).await,
                        };
                        match ended {
                            Ok(()) | Err(AdminConnError::Closed) => {}
                            Err(AdminConnError::Tls(e)) => {
                                tracing::warn!(%peer, error = %e, "admin connection refused: TLS handshake failed");
                            }
                            Err(e) => tracing::debug!(%peer, error = %e, "admin connection ended"),
                        }
                    });
                }
                Err(e) => {
                    tracing::warn!(error = %e, "admin accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        }
    }
}

/// Runs the TLS handshake (bounded like the first frame), then the connection.
async fn tls_connection(
    stream: TcpStream,
    tls: TlsAcceptor,
    ctx: AdminContext,
    shutdown: watch::Receiver<bool>,
) -> Result<(), AdminConnError> {
    let stream = tokio::time::timeout(AUTH_DEADLINE, tls.accept(stream))
        .await
        .map_err(|_| AdminConnError::Timeout)?
        .map_err(AdminConnError::Tls)?;
    connection(stream, ctx, shutdown).await
}

/// Reads one frame body. `first_byte` bounds the wait for the frame to start.
async fn read_frame<S: AsyncRead + Unpin>(
    stream: &mut S,
    first_byte: Duration,
) -> Result<Vec<u8>, AdminConnError> {
    let mut prefix = [0u8; 4];
    let n = tokio::time::timeout(first_byte, stream.read(&mut prefix[..1]))
        .await
        .map_err(|_| AdminConnError::Timeout)??;
    if n == 0 {
        return Err(AdminConnError::Closed);
    }
    let body = tokio::time::timeout(IO_DEADLINE, async {
        stream.read_exact(&mut prefix[1..]).await?;
        let len = admin::frame_len(prefix)?;
        let mut body = vec![0u8; len];
        stream.read_exact(&mut body).await?;
        Ok::<_, AdminConnError>(body)
    })
    .await
    .map_err(|_| AdminConnError::Timeout)??;
    Ok(body)
}

async fn write_response<S: AsyncWrite + Unpin>(
    stream: &mut S,
    r: &Response,
) -> Result<(), AdminConnError> {
    let bytes = admin::encode_frame(r)?;
    tokio::time::timeout(IO_DEADLINE, async {
        stream.write_all(&bytes).await?;
        // TLS may hold the end of the record until flushed.
        stream.flush().await
    })
    .await
    .map_err(|_| AdminConnError::Timeout)??;
    Ok(())
}

/// Answers one request: cluster requests here, the rest planned by the sans-IO handler
/// and, for a change, committed through the node's `MetaCommit`.
async fn answer(ctx: &AdminContext, auth: &Auth, request: &Request) -> Response {
    match (request, &ctx.cluster) {
        (Request::ClusterStatus, Some(c)) => return c.status(),
        (Request::JoinCluster { seed }, Some(c)) => return c.join(seed, auth).await,
        (Request::ExportDefinitions, _) => {
            return Response::done(
                crate::mgmt::definitions::export(&ctx.broker.snapshot()).to_string(),
            )
        }
        (Request::ImportDefinitions { json }, _) => {
            return import_definitions(ctx, json.as_bytes()).await
        }
        _ => {}
    }
    let counts = match request {
        Request::ListQueues { vhost, .. } => remote_counts(&ctx.broker, vhost).await,
        _ => admin::RemoteCounts::new(),
    };
    match admin::plan_with_counts(&ctx.broker, &ctx.node, request, &counts) {
        Handled::Reply(r) => r,
        Handled::Commit { command, ok } => match ctx.meta.commit(command, ctx.clock.now()).await {
            Ok(_) => Response::done(ok),
            Err(e) => Response::refused(e.to_string()),
        },
    }
}

/// Plans a definitions file and commits its commands in order, in batches
/// ([`Command::batched`]); a refusal stops it (the batch it is in applies none of its
/// commands, the batches before it stay, as RabbitMQ's import keeps what it did before an
/// error).
pub(crate) async fn import_definitions(ctx: &AdminContext, json: &[u8]) -> Response {
    let commands = match crate::mgmt::definitions::plan_json(&ctx.broker, &ctx.node, json) {
        Ok(c) => c,
        Err(e) => return Response::refused(e),
    };
    let n = commands.len();
    for command in Command::batched(commands) {
        if let Err(e) = ctx.meta.commit(command, ctx.clock.now()).await {
            return Response::refused(e.to_string());
        }
    }
    Response::done(format!("Imported {n} definitions"))
}

/// The figures ([`crate::broker::QueueFigures`]) of `vhost`'s queues that other nodes run,
/// asked of those nodes at once (a node that does not answer leaves its queues out: they
/// list as 0).
pub(crate) async fn remote_counts(broker: &Broker, vhost: &str) -> admin::RemoteCounts {
    remote_counts_of(broker, vhost, None).await
}

/// As [`remote_counts`], of the queue named `only` alone when given (a single-queue page).
pub(crate) async fn remote_counts_of(
    broker: &Broker,
    vhost: &str,
    only: Option<&str>,
) -> admin::RemoteCounts {
    let snapshot = broker.snapshot();
    let Some(v) = snapshot.vhost(vhost) else {
        return admin::RemoteCounts::new();
    };
    let calls: Vec<_> = v
        .queues
        .keys()
        .filter(|name| only.is_none_or(|o| o == name.as_str()))
        .filter(|name| broker.queue(vhost, name).is_none())
        .filter_map(|name| broker.remote_queue(vhost, name))
        .map(|q| {
            let name = q.name.clone();
            let link = q.link.clone();
            let call = link.call(QueueCall::Figures { queue: q });
            (name, call)
        })
        .collect();
    let mut counts = admin::RemoteCounts::new();
    for (name, call) in calls {
        if let Ok(QueueReply::Figures(f)) = tokio::time::timeout(IO_DEADLINE, call).await {
            counts.insert(name, f);
        }
    }
    counts
}

/// Runs `requests` against the admin endpoint at `addr` as `auth` (one node asking
/// another, as `join_cluster` does); the replies in order. With `tls` the endpoint must
/// present a certificate that chains to its roots and names the host of `addr`.
pub async fn call(
    addr: &str,
    auth: &Auth,
    requests: &[Request],
    tls: Option<&TlsConnector>,
) -> Result<Vec<Response>, AdminConnError> {
    let stream = tokio::time::timeout(IO_DEADLINE, TcpStream::connect(addr))
        .await
        .map_err(|_| AdminConnError::Timeout)??;
    match tls {
        None => call_on(stream, auth, requests).await,
        Some(tls) => {
            let name = super::tls::server_name(addr).map_err(|e| {
                AdminConnError::Tls(std::io::Error::new(std::io::ErrorKind::InvalidInput, e))
            })?;
            let stream = tokio::time::timeout(IO_DEADLINE, tls.connect(name, stream))
                .await
                .map_err(|_| AdminConnError::Timeout)?
                .map_err(AdminConnError::Tls)?;
            call_on(stream, auth, requests).await
        }
    }
}

/// [`call`] on a connected stream.
async fn call_on<S: AsyncRead + AsyncWrite + Unpin>(
    mut stream: S,
    auth: &Auth,
    requests: &[Request],
) -> Result<Vec<Response>, AdminConnError> {
    let hello = exchange(&mut stream, admin::encode_frame(auth)?).await?;
    if !hello.ok {
        return Ok(vec![hello]);
    }
    let mut replies = Vec::with_capacity(requests.len());
    for r in requests {
        replies.push(exchange(&mut stream, admin::encode_frame(r)?).await?);
    }
    Ok(replies)
}

/// Writes one frame and reads the reply.
async fn exchange<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    frame: Vec<u8>,
) -> Result<Response, AdminConnError> {
    tokio::time::timeout(IO_DEADLINE, async {
        stream.write_all(&frame).await?;
        stream.flush().await
    })
    .await
    .map_err(|_| AdminConnError::Timeout)??;
    let body = read_frame(stream, IO_DEADLINE).await?;
    Ok(admin::decode_body(&body)?)
}

async fn connection<S: AsyncRead + AsyncWrite + Unpin>(
    mut stream: S,
    ctx: AdminContext,
    mut shutdown: watch::Receiver<bool>,
) -> Result<(), AdminConnError> {
    let body = read_frame(&mut stream, AUTH_DEADLINE).await?;
    let auth: Auth = admin::decode_body(&body)?;
    let reply = admin::authenticate(&ctx.broker, &auth);
    write_response(&mut stream, &reply).await?;
    if !reply.ok {
        tracing::warn!(user = %auth.user, "admin authentication refused");
        let _ = stream.shutdown().await;
        return Ok(());
    }
    loop {
        let body = tokio::select! {
            biased;
            _ = shutdown.changed() => return Ok(()),
            r = read_frame(&mut stream, IDLE_DEADLINE) => r?,
        };
        let request: Request = admin::decode_body(&body)?;
        let response = answer(&ctx, &auth, &request).await;
        if !response.ok {
            tracing::info!(user = %auth.user, error = %response.message, "admin command refused");
        }
        write_response(&mut stream, &response).await?;
    }
}

//! The node's listeners: the TLS server configurations loaded, every socket bound (AMQP,
//! AMQPS, admin, management HTTP and HTTPS, Prometheus), and the AMQP accept loops.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_util::task::TaskTracker;

use super::NodeError;
use crate::config::Config;
use crate::runtime::conn_task::{self, ConnContext};
use crate::runtime::transport::{Listener, Transport};

/// The TLS material of the listeners that have a `tls` section.
pub(super) struct Tls {
    /// `[amqp.tls]`.
    pub amqps: Option<Arc<rustls::ServerConfig>>,
    /// `[management.tls]`.
    pub mgmt: Option<Arc<rustls::ServerConfig>>,
    /// `[admin.tls]`.
    pub admin: AdminTls,
}

/// `[admin.tls]`: the endpoint's own TLS, and the client side `join_cluster` uses to reach
/// a seed's endpoint (only with a CA to check the seed against).
#[derive(Default)]
pub(super) struct AdminTls {
    pub acceptor: Option<tokio_rustls::TlsAcceptor>,
    pub connector: Option<tokio_rustls::TlsConnector>,
}

/// Loads every listener's TLS material (certificates, keys, CAs).
pub(super) fn load_tls(config: &Config) -> Result<Tls, NodeError> {
    use crate::runtime::tls::{client_config, server_config};
    let amqps = match &config.amqp.tls {
        Some(t) => Some(server_config(t, crate::config::TlsUse::Amqp, &[])?),
        None => None,
    };
    let mgmt = match &config.management.tls {
        Some(t) => Some(server_config(
            t,
            crate::config::TlsUse::Management,
            &[b"http/1.1"],
        )?),
        None => None,
    };
    let admin = match &config.admin.tls {
        Some(t) => {
            let server = server_config(t, crate::config::TlsUse::Admin, &[])?;
            let connector = match &t.cacertfile {
                Some(_) => Some(tokio_rustls::TlsConnector::from(client_config(
                    t,
                    crate::config::TlsUse::Admin,
                )?)),
                None => None,
            };
            AdminTls {
                acceptor: Some(tokio_rustls::TlsAcceptor::from(server)),
                connector,
            }
        }
        None => AdminTls::default(),
    };
    Ok(Tls { amqps, mgmt, admin })
}

/// Where the node listens (the bound addresses: a configured port 0 is resolved).
#[derive(Debug, Clone, Copy)]
pub(super) struct Addrs {
    pub amqp: SocketAddr,
    pub amqps: Option<SocketAddr>,
    pub admin: SocketAddr,
    pub mgmt: Option<SocketAddr>,
    pub mgmt_tls: Option<SocketAddr>,
    pub prometheus: Option<SocketAddr>,
}

/// The bound listeners; the optional ones only when configured.
pub(super) struct Listeners<L> {
    pub amqp: L,
    pub amqps: Option<TcpListener>,
    pub admin: TcpListener,
    pub mgmt: Option<TcpListener>,
    pub mgmt_tls: Option<TcpListener>,
    pub prometheus: Option<TcpListener>,
    pub addrs: Addrs,
}

/// Binds every configured listener: AMQP over `transport`, the others over real TCP.
pub(super) async fn bind<T: Transport>(
    config: &Config,
    transport: &T,
) -> Result<Listeners<T::Listener>, NodeError> {
    let amqp = transport
        .bind(config.amqp.listen)
        .await
        .map_err(|source| NodeError::Bind {
            addr: config.amqp.listen,
            source,
        })?;
    let addr = amqp.local_addr().map_err(|source| NodeError::Bind {
        addr: config.amqp.listen,
        source,
    })?;
    let admin = crate::runtime::admin::bind(config.admin.listen)
        .await
        .map_err(|source| NodeError::Bind {
            addr: config.admin.listen,
            source,
        })?;
    let admin_addr = admin.local_addr().map_err(|source| NodeError::Bind {
        addr: config.admin.listen,
        source,
    })?;
    let (mgmt, mgmt_addr) = bind_optional(config.management.listen_addr()).await?;
    let (prometheus, prometheus_addr) = bind_optional(config.prometheus.listen_addr()).await?;
    let (amqps, amqps_addr) = bind_optional(
        config
            .amqp
            .tls
            .as_ref()
            .map(|t| t.listen_addr(crate::config::AMQPS_PORT)),
    )
    .await?;
    let (mgmt_tls, mgmt_tls_addr) = bind_optional(
        config
            .management
            .tls
            .as_ref()
            .map(|t| t.listen_addr(crate::config::MANAGEMENT_HTTPS_PORT)),
    )
    .await?;
    Ok(Listeners {
        amqp,
        amqps,
        admin,
        mgmt,
        mgmt_tls,
        prometheus,
        addrs: Addrs {
            amqp: addr,
            amqps: amqps_addr,
            admin: admin_addr,
            mgmt: mgmt_addr,
            mgmt_tls: mgmt_tls_addr,
            prometheus: prometheus_addr,
        },
    })
}

/// Binds `addr` when a listener is configured there: (listener, its bound address).
async fn bind_optional(
    addr: Option<SocketAddr>,
) -> Result<(Option<TcpListener>, Option<SocketAddr>), NodeError> {
    let Some(a) = addr else {
        return Ok((None, None));
    };
    let bind = |source| NodeError::Bind { addr: a, source };
    let listener = TcpListener::bind(a).await.map_err(bind)?;
    let local = listener.local_addr().map_err(bind)?;
    Ok((Some(listener), Some(local)))
}

/// Starts accepting clients: AMQPS (when configured), then plaintext AMQP. Every
/// connection is a task on `tracker`; the accept loops stop when `shutdown` flips.
pub(super) fn accept<L: Listener>(
    config: &Config,
    mut amqp: L,
    amqps: Option<(TcpListener, Arc<rustls::ServerConfig>)>,
    addrs: Addrs,
    ctx: ConnContext,
    tracker: &TaskTracker,
    shutdown: &watch::Receiver<bool>,
) -> Vec<JoinHandle<()>> {
    let mut tasks = Vec::new();
    if let (Some((listener, tls)), Some(amqps)) = (amqps, addrs.amqps) {
        let login_from = config
            .amqp
            .tls
            .as_ref()
            .map(|t| t.cert_login_from())
            .unwrap_or_default();
        tracing::info!(addr = %amqps, "AMQPS listening");
        let amqps = crate::runtime::tls::amqps::Amqps {
            listener,
            addr: amqps,
            config: tls,
            login_from,
            handshake_timeout: Duration::from_millis(config.amqp.handshake_timeout_ms),
        };
        tasks.push(amqps.spawn(ctx.clone(), tracker.clone(), shutdown.clone()));
    }

    let addr = addrs.amqp;
    let accept_tracker = tracker.clone();
    let mut accept_shutdown = shutdown.clone();
    tasks.push(tokio::spawn(async move {
        loop {
            tokio::select! {
                biased;
                _ = accept_shutdown.changed() => break,
                r = amqp.accept() => match r {
                    Ok((stream, peer)) => {
                        let ctx = ctx.clone();
                        let local = amqp.stream_local_addr(&stream).unwrap_or(addr);
                        accept_tracker.spawn(conn_task::run(stream, peer, local, None, ctx));
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                }
            }
        }
    }));
    tasks
}

//! Serving an axum router on a listener until shutdown: the management API's and the
//! Prometheus endpoint's listeners share it; the management API's HTTPS listener
//! ([`super::tls::https`]) too.

use std::net::SocketAddr;

use axum::serve::ListenerExt;
use tokio::net::TcpListener;
use tokio::sync::watch;

use super::tls::https::TlsListener;

/// Serves `app` on `listener` until `shutdown` flips; `what` names the listener in the log.
pub async fn serve(
    listener: TcpListener,
    app: axum::Router,
    mut shutdown: watch::Receiver<bool>,
    what: &'static str,
) {
    let stop = async move {
        let _ = shutdown.changed().await;
    };
    let app = app.into_make_service_with_connect_info::<SocketAddr>();
    if let Err(e) = axum::serve(listener, app)
        .with_graceful_shutdown(stop)
        .await
    {
        tracing::warn!(error = %e, listener = what, "HTTP listener stopped");
    }
}

/// Serves `app` over TLS on `listener` until `shutdown` flips.
pub async fn serve_tls(
    listener: TlsListener,
    app: axum::Router,
    mut shutdown: watch::Receiver<bool>,
    what: &'static str,
) {
    let stop = async move {
        let _ = shutdown.changed().await;
    };
    let app = app.into_make_service_with_connect_info::<SocketAddr>();
    // axum gives handlers the peer's `SocketAddr` for a TCP listener and for any listener
    // wrapped with `tap_io`; the tap itself does nothing.
    let listener = listener.tap_io(|_| {});
    if let Err(e) = axum::serve(listener, app)
        .with_graceful_shutdown(stop)
        .await
    {
        tracing::warn!(error = %e, listener = what, "HTTPS listener stopped");
    }
}

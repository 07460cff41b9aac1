//! Serving an axum router on a listener until shutdown: the management API's and the
//! Prometheus endpoint's listeners share it.

use std::net::SocketAddr;

use tokio::net::TcpListener;
use tokio::sync::watch;

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

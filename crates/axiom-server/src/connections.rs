//! The sockets: accepting connections up to a cap, closing those that are slow to send their
//! headers or idle between requests, and a graceful shutdown with a deadline.
//!
//! axum's own `serve` has none of these bounds (a client that never finishes its headers holds
//! its socket forever), so connections are driven here by hyper directly.

use crate::api::ApiError;
use crate::metrics::ServerMetrics;
use axum::body::Body;
use axum::http::StatusCode;
use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, Semaphore};
use tokio::task::JoinSet;
use tokio::time::Instant;
use tower::ServiceExt;

/// How long connections may take and how many may be open.
#[derive(Clone, Copy, Debug)]
pub struct ConnectionLimits {
    /// Most connections open at once; past it a connection gets 503 and is closed.
    pub max_connections: usize,
    /// From the moment a connection waits for a request until that request's headers are in.
    pub header_timeout: Duration,
    /// A connection with no request in flight for this long is closed.
    pub keep_alive_timeout: Duration,
    /// After the shutdown signal, open requests may finish for this long; then every
    /// connection is closed.
    pub shutdown_timeout: Duration,
}

/// Serves `app` on `listener` until `shutdown` resolves, then stops accepting, lets open
/// requests finish within the shutdown timeout, and closes what is left.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    limits: ConnectionLimits,
    metrics: Arc<ServerMetrics>,
    shutdown: impl std::future::Future<Output = ()>,
) {
    let slots = Arc::new(Semaphore::new(limits.max_connections));
    // Refusals are written by short tasks of their own, themselves bounded.
    let refusals = Arc::new(Semaphore::new(64));
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut connections = JoinSet::new();
    tokio::pin!(shutdown);
    loop {
        let (stream, _) = tokio::select! {
            _ = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    // Out of file descriptors, most likely: wait for some to close.
                    tracing::warn!("accepting a connection: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        // Finished connections are reaped here so the set does not grow with the server's age.
        while connections.try_join_next().is_some() {}
        match slots.clone().try_acquire_owned() {
            Ok(slot) => {
                let app = app.clone();
                let stop = stop_rx.clone();
                connections.spawn(async move {
                    serve_connection(stream, app, limits, stop).await;
                    drop(slot);
                });
            }
            Err(_) => {
                metrics.count_request("rejected_503");
                if let Ok(permit) = refusals.clone().try_acquire_owned() {
                    tokio::spawn(async move {
                        refuse(stream, limits.max_connections).await;
                        drop(permit);
                    });
                }
            }
        }
    }
    drop(listener);
    let _ = stop_tx.send(true);
    let drained = tokio::time::timeout(limits.shutdown_timeout, async {
        while connections.join_next().await.is_some() {}
    })
    .await;
    if drained.is_err() {
        tracing::warn!(
            "closing {} connections still open after {} s",
            connections.len(),
            limits.shutdown_timeout.as_secs_f64()
        );
        connections.shutdown().await;
    }
}

/// One connection, until the client closes it, it idles past the keep-alive timeout, or the
/// server stops.
async fn serve_connection(stream: TcpStream, app: Router, limits: ConnectionLimits, mut stop: watch::Receiver<bool>) {
    let activity = Activity::new();
    let service = {
        let activity = activity.clone();
        hyper::service::service_fn(move |request: hyper::Request<hyper::body::Incoming>| {
            let busy = activity.begin();
            let app = app.clone();
            async move {
                let response = app.oneshot(request.map(Body::new)).await?;
                // The request stays in flight until its body (a stream, maybe) is done or dropped.
                Ok::<_, Infallible>(crate::hold_until_body_ends(response, busy))
            }
        })
    };
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new()).header_read_timeout(limits.header_timeout);
    let connection = http.serve_connection(TokioIo::new(stream), service);
    tokio::pin!(connection);
    let mut closing = false;
    loop {
        tokio::select! {
            result = connection.as_mut() => {
                if let Err(e) = result {
                    tracing::debug!("connection ended: {e}");
                }
                return;
            }
            _ = stop.wait_for(|&s| s), if !closing => {
                connection.as_mut().graceful_shutdown();
                closing = true;
            }
            _ = activity.idle_for(limits.keep_alive_timeout), if !closing => {
                connection.as_mut().graceful_shutdown();
                closing = true;
            }
        }
    }
}

/// Requests in flight on one connection, and since when it has had none.
#[derive(Clone)]
struct Activity(Arc<watch::Sender<(usize, Instant)>>);

/// A request in flight; dropping it ends the request.
struct Busy(Arc<watch::Sender<(usize, Instant)>>);

impl Activity {
    fn new() -> Activity {
        Activity(Arc::new(watch::Sender::new((0, Instant::now()))))
    }

    fn begin(&self) -> Busy {
        self.0.send_modify(|(n, _)| *n += 1);
        Busy(self.0.clone())
    }

    /// Resolves once no request has been in flight for `limit`.
    async fn idle_for(&self, limit: Duration) {
        let mut state = self.0.subscribe();
        loop {
            let (in_flight, since) = *state.borrow_and_update();
            if in_flight == 0 {
                tokio::select! {
                    _ = tokio::time::sleep_until(since + limit) => return,
                    _ = state.changed() => {}
                }
            } else if state.changed().await.is_err() {
                return;
            }
        }
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        self.0.send_modify(|(n, since)| {
            *n -= 1;
            *since = Instant::now();
        });
    }
}

/// Answers a connection over the cap with 503 and closes it, reading what the client sent
/// meanwhile so that the close does not reset the connection before the answer arrives.
async fn refuse(mut stream: TcpStream, max_connections: usize) {
    let error = ApiError::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "server_error",
        format!("the server is at its limit of {max_connections} open connections; try again"),
    );
    let body = error.body().to_string();
    let response = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\
         retry-after: 1\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    let _ = tokio::time::timeout(Duration::from_secs(1), async {
        stream.write_all(response.as_bytes()).await?;
        stream.shutdown().await?;
        let mut sink = [0u8; 4096];
        while stream.read(&mut sink).await? > 0 {}
        std::io::Result::Ok(())
    })
    .await;
}

//! `/healthz`, `/readyz` and `/metrics`, bounded.
//!
//! No request runs a query. A background task ([`refresh_status`]) checks the
//! schema and reads `leader_status` every [`REFRESH_EVERY`] on its own
//! one-connection pool, each step under [`CHECK_TIMEOUT`], and keeps a
//! [`StatusSnapshot`]; `/readyz` and `/metrics` read that. When the leases
//! have a path of their own (`HARDCOUNT_LEASE_DATABASE_URL`), the same task
//! checks it answers too, on a one-connection pool of its own and beside
//! the other checks: no role can lead without it. A flood of probes or
//! scrapes therefore costs the database nothing and the app pool no connection
//! (issue 12, point 7). Every request is also bounded by tower layers:
//! [`REQUEST_TIMEOUT`] and at most [`MAX_CONCURRENT_REQUESTS`] served at once
//! (the rest wait, within the timeout).
//!
//! `/readyz` answers `ready` or `not ready`, nothing more: why goes to the log
//! (a driver error can name hosts and roles).
//!
//! Connections are bounded too ([`serve_bounded`], issue 26, point 6): a
//! client has [`HEADER_READ_TIMEOUT`] to send each request's head, the first
//! or the next one on a kept-alive connection, so an idle connection is closed
//! after it; a head is at most [`MAX_REQUEST_HEAD_BYTES`]; at most
//! [`MAX_CONNECTIONS`] are open. At the cap a new connection is still
//! accepted, and the connection that has waited longest for a request (none
//! in a handler) is closed to make room, as nginx reuses idle connections:
//! a flood of idle connections then costs at most the cap in descriptors and
//! buffers. With no idle connection, a request whose handler has waited
//! [`BODY_STALL`] for body bytes that have not come makes room, so heads
//! whose bodies never come cannot hold every place (docs/adr/0131), and a probe, which sends its request as soon as it connects, is
//! answered at once instead of waiting in the kernel's backlog behind the
//! flood (where it would wait a whole [`HEADER_READ_TIMEOUT`] per cap's worth
//! of idle connections ahead of it) or being refused with them.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use axum::extract::State;
use axum::http::{Request, StatusCode};
use axum::routing::get;
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use metrics_exporter_prometheus::PrometheusHandle;
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tower::ServiceExt as _;
use tower::limit::GlobalConcurrencyLimitLayer;
use tower_http::timeout::TimeoutLayer;
use tracing::{debug, warn};

mod status;

pub use status::{CHECK_TIMEOUT, REFRESH_EVERY, STALE_AFTER, StatusSnapshot, refresh_status};

/// The longest any request is served; past it, 503.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);
/// Requests served at once across every route.
pub const MAX_CONCURRENT_REQUESTS: usize = 16;
/// The longest a client may take to send a request's head: counted from the
/// accept for the first request and from the end of the last response for
/// each next one, so it is also the idle keep-alive timeout. (hyper 1.12 arms
/// its header-read timer whenever the connection waits for a head,
/// `proto/h1/conn.rs` `poll_read_head`; `bounded_connections` pins both.)
/// Probes and scrapers send their request with the connection, so a few
/// seconds is generous; Prometheus scrapes every 15 s or more and reconnects.
pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(5);
/// Connections open at once. A replica is probed by its kubelet and scraped by
/// one or two Prometheus servers, a handful of connections; the cap bounds the
/// descriptors (well under a default soft `RLIMIT_NOFILE` of 1024, beside the
/// database pools and the webhook and SMTP clients) and the buffers
/// (`MAX_CONNECTIONS × MAX_REQUEST_HEAD_BYTES` = 4 MiB) a flood can take.
pub const MAX_CONNECTIONS: usize = 256;
/// The largest request head (start line and headers) read, and so the most a
/// connection's read buffer grows to (hyper's default is about 400 KiB); past
/// it, 431. Our requests are a few hundred bytes.
pub const MAX_REQUEST_HEAD_BYTES: usize = 16 * 1024;
/// After an accept error other than a reset (`EMFILE`, `ENFILE`, `ENOMEM`), how
/// long the accept loop waits before trying again, so it does not spin.
pub const ACCEPT_BACKOFF: Duration = Duration::from_millis(50);
/// How long a request's handler must have waited for body bytes before its
/// connection may make room at the cap (when no connection is idle): far
/// longer than the pause between two chunks of a body that is coming, far
/// shorter than the request timeout a withheld body would hold its place for.
pub const BODY_STALL: Duration = Duration::from_secs(1);

#[derive(Clone)]
pub struct AppState {
    pub status: Arc<StatusSnapshot>,
    pub metrics: PrometheusHandle,
}

pub fn router(state: AppState) -> Router {
    bounded(
        Router::new()
            .route("/healthz", get(|| async { "ok\n" }))
            .route("/readyz", get(readyz))
            .route("/metrics", get(metrics))
            .with_state(state),
        REQUEST_TIMEOUT,
        MAX_CONCURRENT_REQUESTS,
    )
}

/// `routes` with a request timeout (503 past it) around a concurrency limit
/// shared by every route.
fn bounded(routes: Router, timeout: Duration, concurrent: usize) -> Router {
    routes
        .layer(GlobalConcurrencyLimitLayer::new(concurrent))
        .layer(TimeoutLayer::with_status_code(
            StatusCode::SERVICE_UNAVAILABLE,
            timeout,
        ))
}

/// Serve `app` on `listener` until `stop` is cancelled, bounded per
/// connection and in connections (the module doc): HTTP/1.1, TCP_NODELAY.
///
/// Once `stop` is cancelled it accepts nothing more, closes idle connections,
/// lets requests in flight finish within [`REQUEST_TIMEOUT`], and returns.
pub async fn serve_bounded(listener: TcpListener, app: Router, stop: CancellationToken) {
    let open = Arc::new(OpenConnections::new(MAX_CONNECTIONS));
    let connections = TaskTracker::new();
    loop {
        let accepted = tokio::select! {
            () = stop.cancelled() => break,
            accepted = listener.accept() => accepted,
        };
        let stream = match accepted {
            Ok((stream, _)) => stream,
            Err(e) if is_connection_error(&e) => continue,
            Err(e) => {
                warn!(error = %e, "HTTP accept failed; retrying");
                let _ = stop
                    .run_until_cancelled(tokio::time::sleep(ACCEPT_BACKOFF))
                    .await;
                continue;
            }
        };
        // At the cap with every connection in a handler, the new one is
        // closed: it is the only one that has not been served yet.
        let Some(slot) = open.admit() else {
            continue;
        };
        let _ = stream.set_nodelay(true);
        connections.spawn(serve_connection(stream, app.clone(), slot, stop.clone()));
    }
    drop(listener);
    connections.close();
    if tokio::time::timeout(REQUEST_TIMEOUT, connections.wait())
        .await
        .is_err()
    {
        warn!("HTTP connections still open {REQUEST_TIMEOUT:?} after shutdown; dropping them");
    }
}

fn is_connection_error(e: &std::io::Error) -> bool {
    use std::io::ErrorKind::{ConnectionAborted, ConnectionRefused, ConnectionReset};
    matches!(
        e.kind(),
        ConnectionRefused | ConnectionAborted | ConnectionReset
    )
}

/// One connection until it closes, is evicted (dropped: the socket closes), or
/// `stop` asks it to finish its request in flight and close.
async fn serve_connection(
    stream: TcpStream,
    app: Router,
    slot: ConnectionSlot,
    stop: CancellationToken,
) {
    let service = hyper::service::service_fn(|req: Request<Incoming>| {
        // The request holds its connection against eviction from its head
        // on, unless its handler has waited `BODY_STALL` for body bytes that
        // have not come and no connection is idle: a client that sends a
        // head and then withholds the body leaves a place the cap can take
        // back, instead of holding every place for the request timeout with
        // forged keys that are checked only once the body is read
        // (docs/adr/0131).
        let in_handler = slot.request_started();
        let (parts, body) = req.into_parts();
        let req = Request::from_parts(
            parts,
            BodyWatch {
                inner: body,
                conn: slot.conn(),
                waiting: false,
            },
        );
        let app = app.clone();
        async move {
            let response = app.oneshot(req).await;
            drop(in_handler);
            response
        }
    });
    let conn = http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(HEADER_READ_TIMEOUT)
        .max_buf_size(MAX_REQUEST_HEAD_BYTES)
        .max_header_size(MAX_REQUEST_HEAD_BYTES)
        .serve_connection(TokioIo::new(stream), service);
    tokio::pin!(conn);
    tokio::select! {
        done = conn.as_mut() => {
            if let Err(e) = done {
                debug!(error = %e, "HTTP connection closed");
            }
            return;
        }
        () = slot.evict.cancelled() => return,
        () = stop.cancelled() => {}
    }
    conn.as_mut().graceful_shutdown();
    tokio::select! {
        _ = conn => {}
        () = slot.evict.cancelled() => {}
    }
}

/// The open connections, for the cap: which one is in a handler, and which
/// has waited longest for a request.
struct OpenConnections {
    cap: usize,
    state: Mutex<Open>,
}

#[derive(Default)]
struct Open {
    /// Hands out connection ids and activity marks, both increasing.
    clock: u64,
    slots: HashMap<u64, SlotState>,
    /// When the cap was last reported, so a flood logs once a minute.
    reported_at: Option<Instant>,
}

struct SlotState {
    /// `clock` when the connection was accepted or last finished a request.
    last_active: u64,
    in_handler: usize,
    /// Since when its request's handler has waited for body bytes that have
    /// not come (reset by every frame).
    awaiting_body: Option<Instant>,
    evict: CancellationToken,
}

/// A connection's place under the cap; dropping it (the connection's task
/// ending, a panic included) frees the place.
struct ConnectionSlot {
    open: Arc<OpenConnections>,
    id: u64,
    evict: CancellationToken,
}

/// One connection's place, as its requests see it.
#[derive(Clone)]
struct Conn {
    open: Arc<OpenConnections>,
    id: u64,
}

/// A request's body, which marks its connection evictable while the handler
/// waits for bytes of it that have not come (see [`serve_connection`]).
struct BodyWatch {
    inner: Incoming,
    conn: Conn,
    /// What the connection was last told, so that the cap's lock is taken
    /// only when the wait starts or ends, not at every poll.
    waiting: bool,
}

impl BodyWatch {
    fn waiting(&mut self, waiting: bool) {
        if self.waiting != waiting {
            self.waiting = waiting;
            self.conn.awaiting_body(waiting);
        }
    }
}

impl hyper::body::Body for BodyWatch {
    type Data = hyper::body::Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<Self::Data>, Self::Error>>> {
        let polled = std::pin::Pin::new(&mut self.inner).poll_frame(cx);
        self.waiting(polled.is_pending());
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.inner.size_hint()
    }
}

impl Drop for BodyWatch {
    fn drop(&mut self) {
        self.waiting(false);
    }
}

/// A request in a handler: its connection is not evicted until it is dropped.
struct InHandler {
    open: Arc<OpenConnections>,
    id: u64,
}

impl OpenConnections {
    fn new(cap: usize) -> Self {
        Self {
            cap,
            state: Mutex::new(Open::default()),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Open> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A place for a new connection: a free one, else the one of the
    /// connection with no request in a handler that was active least
    /// recently, else the one whose request has waited longest for body bytes
    /// that have not come, if it has waited [`BODY_STALL`] (a body read
    /// chunk by chunk waits a moment between chunks; a withheld one waits
    /// until the timeout). That one is closed. `None` when neither exists.
    fn admit(self: &Arc<Self>) -> Option<ConnectionSlot> {
        let mut open = self.lock();
        if open.slots.len() >= self.cap {
            let now = Instant::now();
            let idle = open
                .slots
                .iter()
                .filter(|(_, s)| s.in_handler == 0)
                .min_by_key(|(_, s)| s.last_active)
                .map(|(id, _)| *id);
            let stalled = || {
                open.slots
                    .iter()
                    .filter_map(|(id, s)| s.awaiting_body.map(|since| (*id, since)))
                    .filter(|(_, since)| now.duration_since(*since) >= BODY_STALL)
                    .min_by_key(|(_, since)| *since)
                    .map(|(id, _)| id)
            };
            let oldest_idle = idle.or_else(stalled);
            if open
                .reported_at
                .is_none_or(|at| now.duration_since(at) > Duration::from_secs(60))
            {
                open.reported_at = Some(now);
                warn!(
                    cap = self.cap,
                    "HTTP connection cap reached; closing the idle connections that waited longest"
                );
            }
            let evicted = open.slots.remove(&oldest_idle?)?;
            evicted.evict.cancel();
        }
        open.clock += 1;
        let id = open.clock;
        let evict = CancellationToken::new();
        open.slots.insert(
            id,
            SlotState {
                last_active: id,
                in_handler: 0,
                awaiting_body: None,
                evict: evict.clone(),
            },
        );
        Some(ConnectionSlot {
            open: self.clone(),
            id,
            evict,
        })
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.lock().slots.len()
    }
}

impl ConnectionSlot {
    fn conn(&self) -> Conn {
        Conn {
            open: self.open.clone(),
            id: self.id,
        }
    }

    fn request_started(&self) -> InHandler {
        if let Some(s) = self.open.lock().slots.get_mut(&self.id) {
            s.in_handler += 1;
        }
        InHandler {
            open: self.open.clone(),
            id: self.id,
        }
    }
}

impl Conn {
    /// The request's handler starts (stamped now) or stops waiting for body
    /// bytes that have not come; while it waits its connection may make room
    /// at the cap. [`BodyWatch`] calls it only when that changes.
    fn awaiting_body(&self, waiting: bool) {
        if let Some(s) = self.open.lock().slots.get_mut(&self.id) {
            s.awaiting_body = waiting.then(Instant::now);
        }
    }
}

impl Drop for ConnectionSlot {
    fn drop(&mut self) {
        self.open.lock().slots.remove(&self.id);
    }
}

impl Drop for InHandler {
    fn drop(&mut self) {
        let mut open = self.open.lock();
        open.clock += 1;
        let now = open.clock;
        if let Some(s) = open.slots.get_mut(&self.id) {
            s.in_handler -= 1;
            s.last_active = now;
        }
    }
}

/// Ready when the last background check found the database answering and the
/// schema current (and the lease path answering, when it is its own), recently.
async fn readyz(State(s): State<AppState>) -> (StatusCode, &'static str) {
    if s.status.is_ready() {
        (StatusCode::OK, "ready\n")
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "not ready\n")
    }
}

/// The metrics as last refreshed; no query.
async fn metrics(State(s): State<AppState>) -> String {
    s.metrics.render()
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::body::Body;

    #[test]
    fn requests_are_bounded() {
        assert!(REQUEST_TIMEOUT > Duration::ZERO && MAX_CONCURRENT_REQUESTS > 0);
    }

    fn slow() -> Router {
        Router::new().route(
            "/slow",
            get(|| async {
                tokio::time::sleep(Duration::from_millis(300)).await;
                "done"
            }),
        )
    }

    async fn status(app: &Router) -> StatusCode {
        let req = Request::get("/slow").body(Body::empty()).unwrap();
        app.clone().oneshot(req).await.unwrap().status()
    }

    /// Fails without the timeout layer (the slow request is answered 200).
    #[tokio::test]
    async fn a_request_past_the_timeout_is_answered_503() {
        let app = bounded(slow(), Duration::from_millis(100), 4);
        assert_eq!(status(&app).await, StatusCode::SERVICE_UNAVAILABLE);
        let app = bounded(slow(), Duration::from_secs(2), 4);
        assert_eq!(status(&app).await, StatusCode::OK);
    }

    /// With one slot, three slow requests run one after another: the last waits
    /// past the timeout. Fails without the concurrency limit (all three at once).
    #[tokio::test]
    async fn requests_past_the_concurrency_limit_wait_within_the_timeout() {
        let app = bounded(slow(), Duration::from_millis(700), 1);
        let answers = futures_join3(status(&app), status(&app), status(&app)).await;
        let late = answers
            .iter()
            .filter(|s| **s == StatusCode::SERVICE_UNAVAILABLE)
            .count();
        assert_eq!(late, 1, "{answers:?}");
    }

    /// At the cap the idle connection that was active least recently makes
    /// room; one in a handler never does, and with every one in a handler the
    /// newcomer is refused. Fails if the cap admits past itself, evicts by
    /// accept order instead of activity, or evicts a connection in a handler.
    #[test]
    fn at_the_cap_the_longest_idle_connection_makes_room() {
        let open = Arc::new(OpenConnections::new(3));
        let a = open.admit().unwrap();
        let b = open.admit().unwrap();
        let c = open.admit().unwrap();
        drop(a.request_started()); // a is now the most recently active
        let busy = b.request_started();
        let d = open.admit().unwrap();
        assert_eq!(open.len(), 3);
        assert!(c.evict.is_cancelled(), "c waited longest");
        assert!(!a.evict.is_cancelled() && !b.evict.is_cancelled());
        let _e = open.admit().unwrap();
        assert!(a.evict.is_cancelled(), "then a; never b, in a handler");
        let _d_busy = d.request_started();
        let _e_busy = _e.request_started();
        assert!(open.admit().is_none(), "every connection is in a handler");
        assert!(!b.evict.is_cancelled());
        drop(busy);
        let _f = open.admit().unwrap();
        assert!(b.evict.is_cancelled());
        drop((a, c));
        assert_eq!(open.len(), 3, "an evicted slot is not counted twice");
    }

    /// Every place under the cap but two taken by a request whose head came
    /// and whose body does not (a forged key is checked only once the body
    /// is read) does not shut a new client out, and does not cost the two
    /// requests at work their places. The withheld ones have waited for body
    /// bytes past [`BODY_STALL`], so the cap takes them back; the two older
    /// ones, one whose handler read its body and one whose handler ignores
    /// the `{}` it was sent, are never evicted, though they are the least
    /// recently active. Before, every request counted as in a handler from
    /// its head, and the newcomers were closed unanswered (seen). Mutation
    /// `body_stall_never_evicted` (the newcomers are closed).
    #[tokio::test]
    async fn requests_whose_bodies_do_not_come_hold_no_place_a_new_client_needs() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        use tokio::net::TcpStream;
        const WORK: Duration = Duration::from_millis(3000);
        let app = Router::new()
            .route("/ok", get(|| async { "ok" }))
            .route(
                "/read",
                axum::routing::post(|body: String| async move {
                    tokio::time::sleep(WORK).await;
                    body
                }),
            )
            .route(
                "/ignore",
                axum::routing::post(|| async {
                    tokio::time::sleep(WORK).await;
                    "ignored"
                }),
            );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let stop = CancellationToken::new();
        let server = tokio::spawn(serve_bounded(listener, app, stop.clone()));
        async fn send(addr: std::net::SocketAddr, request: &[u8]) -> TcpStream {
            let mut c = TcpStream::connect(addr).await.unwrap();
            c.write_all(request).await.unwrap();
            c
        }
        async fn answer(mut c: TcpStream) -> String {
            let mut answer = Vec::new();
            let read =
                tokio::time::timeout(Duration::from_secs(5), c.read_to_end(&mut answer)).await;
            format!("{read:?} {}", String::from_utf8_lossy(&answer))
        }
        let at_work = [
            send(
                addr,
                b"POST /read HTTP/1.1\r\nHost: t\r\nConnection: close\r\nContent-Length: 5\r\n\r\nhello",
            )
            .await,
            send(
                addr,
                b"POST /ignore HTTP/1.1\r\nHost: t\r\nConnection: close\r\nContent-Length: 2\r\n\r\n{}",
            )
            .await,
        ];
        tokio::time::sleep(Duration::from_millis(100)).await;
        let mut withheld = Vec::with_capacity(MAX_CONNECTIONS);
        for _ in 2..MAX_CONNECTIONS {
            withheld.push(
                send(
                    addr,
                    b"POST /read HTTP/1.1\r\nHost: t\r\nContent-Length: 1000\r\n\r\n",
                )
                .await,
            );
        }
        // Every head read and its handler waiting for the body, past the stall.
        tokio::time::sleep(BODY_STALL + Duration::from_millis(300)).await;
        for _ in 0..2 {
            let got = answer(
                send(
                    addr,
                    b"GET /ok HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n",
                )
                .await,
            )
            .await;
            assert!(
                got.starts_with("Ok(Ok(") && got.ends_with("\r\n\r\nok"),
                "{got}"
            );
        }
        let [read, ignored] = at_work;
        let read = answer(read).await;
        assert!(read.ends_with("\r\n\r\nhello"), "{read}");
        let ignored = answer(ignored).await;
        assert!(ignored.ends_with("\r\n\r\nignored"), "{ignored}");
        stop.cancel();
        drop(withheld);
        server.await.unwrap();
    }

    /// With no idle connection at the cap, a request waiting for body bytes
    /// only a moment (hyper hands a body over chunk by chunk, and its handler
    /// waits between two) keeps its place and the newcomer is refused; one
    /// that has waited [`BODY_STALL`] makes room, the longest waiting first.
    /// Mutation `body_stall_ignored` (any wait makes room: an upload on its way
    /// closed).
    #[test]
    fn a_request_waiting_for_its_body_makes_room_only_once_stalled() {
        let open = Arc::new(OpenConnections::new(3));
        let (a, b, c) = (
            open.admit().unwrap(),
            open.admit().unwrap(),
            open.admit().unwrap(),
        );
        let _busy = [
            a.request_started(),
            b.request_started(),
            c.request_started(),
        ];
        a.conn().awaiting_body(true);
        assert!(open.admit().is_none(), "a body on its way keeps its place");
        let stalled_since = |by: Duration| Instant::now().checked_sub(by).unwrap();
        for (slot, by) in [(&a, BODY_STALL), (&b, BODY_STALL * 2)] {
            open.lock().slots.get_mut(&slot.id).unwrap().awaiting_body = Some(stalled_since(by));
        }
        let _d = open.admit().unwrap();
        assert!(b.evict.is_cancelled(), "b has waited longest");
        assert!(!a.evict.is_cancelled() && !c.evict.is_cancelled());
    }

    async fn futures_join3<F: Future<Output = StatusCode>>(a: F, b: F, c: F) -> [StatusCode; 3] {
        let (a, b, c) = tokio::join!(a, b, c);
        [a, b, c]
    }
}

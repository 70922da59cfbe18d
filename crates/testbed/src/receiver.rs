//! A webhook receiver on loopback: axum on 127.0.0.1:0 that records every
//! request (path, headers, body, when it arrived) and answers as told, per
//! request, by a script that sees the request's place in arrival order and its
//! path.
//!
//! One receiver serves the delivery crate's tests (scripted failures, hangs,
//! `Retry-After`, a huge answer, a connection count), the system tests and the
//! webhook benchmark (thousands of requests, arrival instants).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode, Uri, header};
use axum::response::Response;
use axum::serve::ListenerExt as _;
use tokio::sync::watch;

/// How the receiver answers one request. Every answer but `Huge` has an empty body.
#[derive(Debug, Clone)]
pub enum Reply {
    Status(u16),
    /// A status with extra headers (e.g. `Retry-After`).
    WithHeaders(u16, Vec<(&'static str, String)>),
    /// A status with a body.
    WithBody(u16, String),
    /// Never answer; the connection stays open.
    Hang,
    /// Answer with a status after a pause.
    Delayed(Duration, u16),
    /// A 200 announcing `len` bytes of body, handed to the connection in
    /// 64 KiB pieces until done or the client goes away.
    Huge {
        len: usize,
    },
}

/// What the script sees of a request when choosing its answer.
#[derive(Debug, Clone, Copy)]
pub struct Incoming<'a> {
    /// Place in arrival order, from 0.
    pub n: usize,
    /// The URI's path, e.g. `/hooks/in`.
    pub path: &'a str,
}

/// One request as it arrived.
#[derive(Debug, Clone)]
pub struct Received {
    pub path: String,
    pub headers: HeaderMap,
    pub body: Bytes,
    /// When the whole request had been read, on this process's monotonic clock.
    pub at: Instant,
    /// The same moment on the wall clock, for checking a signed timestamp's age.
    pub received_at: SystemTime,
}

impl Received {
    /// The header's value, or `None` when it is absent or not visible ASCII.
    pub fn try_header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }

    /// The header's value.
    ///
    /// # Panics
    /// When the request has no such header (or it is not visible ASCII).
    pub fn header(&self, name: &str) -> &str {
        self.try_header(name)
            .unwrap_or_else(|| panic!("no {name} header in {:?}", self.headers))
    }
}

type Script = dyn Fn(Incoming<'_>) -> Reply + Send + Sync;

struct Inbox {
    script: Box<Script>,
    /// Requests in arrival order; drained by [`Receiver::take`].
    requests: Mutex<Vec<Received>>,
    /// Requests ever received, including taken ones: the script's `n`.
    seen: AtomicUsize,
    connections: AtomicUsize,
    /// Body bytes handed out by `Reply::Huge` answers, summed.
    huge_written: AtomicUsize,
    /// `Reply::Huge` answers dropped before their last byte (the client went away).
    huge_cut: AtomicUsize,
    /// Bumped on every change a test may wait for (a request held, a huge
    /// answer cut), after the change.
    changed: watch::Sender<u64>,
}

impl Inbox {
    fn announce(&self) {
        self.changed.send_modify(|n| *n += 1);
    }
}

/// A running receiver; it serves until the runtime that started it stops.
pub struct Receiver {
    addr: SocketAddr,
    inbox: Arc<Inbox>,
}

impl Receiver {
    /// Start a receiver on 127.0.0.1:0; `script` chooses each request's answer.
    ///
    /// # Panics
    /// When no loopback port can be bound.
    pub async fn start(script: impl Fn(Incoming<'_>) -> Reply + Send + Sync + 'static) -> Receiver {
        let inbox = Arc::new(Inbox {
            script: Box::new(script),
            requests: Mutex::new(Vec::new()),
            seen: AtomicUsize::new(0),
            connections: AtomicUsize::new(0),
            huge_written: AtomicUsize::new(0),
            huge_cut: AtomicUsize::new(0),
            changed: watch::Sender::new(0),
        });
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind a loopback port for the receiver");
        let addr = listener.local_addr().expect("the receiver's address");
        let counted = inbox.clone();
        let listener = listener.tap_io(move |_| {
            counted.connections.fetch_add(1, Ordering::SeqCst);
        });
        let app = Router::new().fallback(receive).with_state(inbox.clone());
        tokio::spawn(async move {
            if let Err(e) = axum::serve(listener, app).await {
                eprintln!("test receiver stopped: {e}");
            }
        });
        Receiver { addr, inbox }
    }

    /// Always answer `code`, at once.
    pub async fn answering(code: u16) -> Receiver {
        Receiver::start(move |_| Reply::Status(code)).await
    }

    /// `http://127.0.0.1:<port>`, to append a path to.
    pub fn base_url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The URL of `/hooks/in`.
    pub fn url(&self) -> String {
        self.url_at("/hooks/in")
    }

    /// The URL of `path` (which starts with `/`).
    pub fn url_at(&self, path: &str) -> String {
        format!("{}{path}", self.base_url())
    }

    pub fn port(&self) -> u16 {
        self.addr.port()
    }

    /// The requests received and not yet taken, in arrival order.
    pub fn requests(&self) -> Vec<Received> {
        self.inbox.requests.lock().unwrap().clone()
    }

    /// Look at the requests not yet taken without copying them.
    pub fn inspect<T>(&self, f: impl FnOnce(&[Received]) -> T) -> T {
        f(&self.inbox.requests.lock().unwrap())
    }

    /// Wait until `done` holds for this receiver (checked now and after each
    /// request held or huge answer cut), and return how long that took.
    /// `limit` is a safety bound, never the pace.
    ///
    /// # Panics
    /// After `limit`, naming `what`.
    pub async fn until(
        &self,
        limit: Duration,
        what: &str,
        done: impl Fn(&Receiver) -> bool,
    ) -> Duration {
        let started = Instant::now();
        let mut changed = self.inbox.changed.subscribe();
        let waited = tokio::time::timeout(limit, async {
            while !done(self) {
                changed
                    .changed()
                    .await
                    .expect("the inbox outlives its receiver");
            }
        })
        .await;
        assert!(
            waited.is_ok(),
            "timed out after {limit:?} waiting for {what}"
        );
        started.elapsed()
    }

    /// Wait until at least `n` requests are held; see [`Receiver::until`].
    pub async fn until_count(&self, n: usize, limit: Duration) -> Duration {
        self.until(limit, &format!("{n} requests"), |r| r.count() >= n)
            .await
    }

    /// How many requests are held (received and not yet taken).
    pub fn count(&self) -> usize {
        self.inbox.requests.lock().unwrap().len()
    }

    /// Hand over the requests held and start afresh, e.g. between benchmark phases.
    pub fn take(&self) -> Vec<Received> {
        std::mem::take(&mut *self.inbox.requests.lock().unwrap())
    }

    /// TCP connections accepted so far.
    pub fn connections(&self) -> usize {
        self.inbox.connections.load(Ordering::SeqCst)
    }

    pub fn huge_written(&self) -> usize {
        self.inbox.huge_written.load(Ordering::SeqCst)
    }

    pub fn huge_cut(&self) -> usize {
        self.inbox.huge_cut.load(Ordering::SeqCst)
    }
}

async fn receive(
    State(inbox): State<Arc<Inbox>>,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let (at, received_at) = (Instant::now(), SystemTime::now());
    let path = uri.path().to_owned();
    let n = inbox.seen.fetch_add(1, Ordering::SeqCst);
    let reply = (inbox.script)(Incoming { n, path: &path });
    inbox.requests.lock().unwrap().push(Received {
        path,
        headers,
        body,
        at,
        received_at,
    });
    inbox.announce();
    match reply {
        Reply::Status(code) => empty(code, &[]),
        Reply::WithHeaders(code, extra) => empty(code, &extra),
        Reply::WithBody(code, body) => {
            let mut response = Response::new(Body::from(body));
            *response.status_mut() = StatusCode::from_u16(code).expect("a valid status code");
            response
        }
        Reply::Hang => std::future::pending().await,
        Reply::Delayed(pause, code) => {
            tokio::time::sleep(pause).await;
            empty(code, &[])
        }
        Reply::Huge { len } => huge(inbox, len),
    }
}

fn empty(code: u16, extra: &[(&'static str, String)]) -> Response {
    let mut response = Response::new(Body::empty());
    *response.status_mut() = StatusCode::from_u16(code).expect("a valid status code");
    for (name, value) in extra {
        response.headers_mut().insert(
            HeaderName::from_static(name),
            HeaderValue::from_str(value).expect("a valid header value"),
        );
    }
    response
}

/// A 200 with `len` bytes announced; counts what it handed out and whether it was
/// dropped before the end.
fn huge(inbox: Arc<Inbox>, len: usize) -> Response {
    const PIECE: usize = 64 * 1024;
    /// Counts a cut when the body is dropped unfinished.
    struct Progress {
        inbox: Arc<Inbox>,
        left: usize,
    }
    impl Drop for Progress {
        fn drop(&mut self) {
            if self.left > 0 {
                self.inbox.huge_cut.fetch_add(1, Ordering::SeqCst);
                self.inbox.announce();
            }
        }
    }
    let piece = Bytes::from(vec![b'x'; PIECE]);
    let pieces = futures::stream::unfold(Progress { inbox, left: len }, move |mut p| {
        let piece = piece.clone();
        async move {
            if p.left == 0 {
                return None;
            }
            let n = p.left.min(PIECE);
            p.left -= n;
            p.inbox.huge_written.fetch_add(n, Ordering::SeqCst);
            Some((Ok::<_, std::io::Error>(piece.slice(..n)), p))
        }
    });
    let mut response = Response::new(Body::from_stream(pieces));
    let headers = response.headers_mut();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain"));
    headers.insert(header::CONTENT_LENGTH, HeaderValue::from(len));
    response
}

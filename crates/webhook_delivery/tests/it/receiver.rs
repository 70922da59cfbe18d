//! A webhook receiver on loopback: a small HTTP/1.1 server over a tokio
//! `TcpListener`, scripted per request, that records what it received, how
//! many connections it accepted, and how much of a large answer it got to write.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpListener, TcpStream};

/// How the receiver answers one request.
#[derive(Debug, Clone)]
pub enum Reply {
    Status(u16),
    /// A status with extra headers (e.g. `Retry-After`).
    WithHeaders(u16, Vec<(&'static str, String)>),
    /// Read the request, then never answer (the socket stays open).
    Hang,
    /// Answer with a status after a pause.
    Delayed(Duration, u16),
    /// A 200 announcing `len` bytes of body, written in 64 KiB pieces until
    /// done or the client goes away.
    Huge {
        len: usize,
    },
}

#[derive(Debug, Clone)]
pub struct Received {
    /// Header names in lower case.
    pub headers: HashMap<String, String>,
    pub body: Vec<u8>,
}

impl Received {
    pub fn header(&self, name: &str) -> &str {
        self.headers
            .get(name)
            .map(String::as_str)
            .unwrap_or_else(|| panic!("no {name} header in {:?}", self.headers))
    }
}

type Script = dyn Fn(usize) -> Reply + Send + Sync;

struct State {
    script: Box<Script>,
    requests: Mutex<Vec<Received>>,
    connections: AtomicUsize,
    /// Body bytes written by `Reply::Huge` answers, summed.
    huge_written: AtomicUsize,
    /// How many `Reply::Huge` answers stopped because the client went away.
    huge_cut: AtomicUsize,
}

pub struct Receiver {
    addr: SocketAddr,
    state: Arc<State>,
}

impl Receiver {
    /// Start a receiver on 127.0.0.1; `script(n)` answers the n-th request (from 0).
    pub async fn start(script: impl Fn(usize) -> Reply + Send + Sync + 'static) -> Receiver {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let state = Arc::new(State {
            script: Box::new(script),
            requests: Mutex::new(Vec::new()),
            connections: AtomicUsize::new(0),
            huge_written: AtomicUsize::new(0),
            huge_cut: AtomicUsize::new(0),
        });
        let shared = state.clone();
        tokio::spawn(async move {
            while let Ok((socket, _)) = listener.accept().await {
                shared.connections.fetch_add(1, Ordering::SeqCst);
                tokio::spawn(serve(socket, shared.clone()));
            }
        });
        Receiver { addr, state }
    }

    /// Always answer `code`.
    pub async fn answering(code: u16) -> Receiver {
        Receiver::start(move |_| Reply::Status(code)).await
    }

    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}/hooks/in", self.addr.port())
    }

    pub fn port(&self) -> u16 {
        self.addr.port()
    }

    pub fn requests(&self) -> Vec<Received> {
        self.state.requests.lock().unwrap().clone()
    }

    pub fn connections(&self) -> usize {
        self.state.connections.load(Ordering::SeqCst)
    }

    pub fn huge_written(&self) -> usize {
        self.state.huge_written.load(Ordering::SeqCst)
    }

    pub fn huge_cut(&self) -> usize {
        self.state.huge_cut.load(Ordering::SeqCst)
    }
}

async fn serve(mut socket: TcpStream, state: Arc<State>) {
    loop {
        let Some(request) = read_request(&mut socket).await else {
            return;
        };
        let n = {
            let mut requests = state.requests.lock().unwrap();
            requests.push(request);
            requests.len() - 1
        };
        match (state.script)(n) {
            Reply::Status(code) => {
                if respond(&mut socket, code, &[], b"").await.is_err() {
                    return;
                }
            }
            Reply::WithHeaders(code, headers) => {
                if respond(&mut socket, code, &headers, b"").await.is_err() {
                    return;
                }
            }
            Reply::Hang => {
                tokio::time::sleep(Duration::from_secs(3600)).await;
                return;
            }
            Reply::Delayed(pause, code) => {
                tokio::time::sleep(pause).await;
                if respond(&mut socket, code, &[], b"").await.is_err() {
                    return;
                }
            }
            Reply::Huge { len } => {
                let head = format!(
                    "HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: {len}\r\n\r\n"
                );
                if socket.write_all(head.as_bytes()).await.is_err() {
                    return;
                }
                let piece = vec![b'x'; 64 * 1024];
                let mut left = len;
                while left > 0 {
                    let n = left.min(piece.len());
                    if socket.write_all(&piece[..n]).await.is_err() {
                        state.huge_cut.fetch_add(1, Ordering::SeqCst);
                        return;
                    }
                    state.huge_written.fetch_add(n, Ordering::SeqCst);
                    left -= n;
                }
            }
        }
    }
}

async fn respond(
    socket: &mut TcpStream,
    code: u16,
    headers: &[(&'static str, String)],
    body: &[u8],
) -> std::io::Result<()> {
    let mut head = format!(
        "HTTP/1.1 {code} Scripted\r\ncontent-length: {}\r\n",
        body.len()
    );
    for (name, value) in headers {
        head.push_str(&format!("{name}: {value}\r\n"));
    }
    head.push_str("\r\n");
    socket.write_all(head.as_bytes()).await?;
    socket.write_all(body).await
}

/// One request: headers up to the blank line, then `content-length` bytes.
async fn read_request(socket: &mut TcpStream) -> Option<Received> {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 8192];
    let header_end = loop {
        if let Some(at) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break at + 4;
        }
        let n = socket.read(&mut chunk).await.ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&chunk[..n]);
    };
    let head = String::from_utf8_lossy(&buf[..header_end]).into_owned();
    let headers: HashMap<String, String> = head
        .lines()
        .skip(1)
        .filter_map(|line| line.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_owned()))
        .collect();
    let len: usize = headers
        .get("content-length")
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let mut body = buf[header_end..].to_vec();
    while body.len() < len {
        let n = socket.read(&mut chunk).await.ok()?;
        if n == 0 {
            return None;
        }
        body.extend_from_slice(&chunk[..n]);
    }
    body.truncate(len);
    Some(Received { headers, body })
}

//! Issue 26, point 6: the HTTP server bounds its connections. 10,000 idle TCP
//! connections to [`hardcount::run`] in this process neither exhaust its file
//! descriptors nor stop `/healthz` answering, and the idle ones are closed
//! after `HEADER_READ_TIMEOUT`.
//!
//! Fails (each tried) with plain `axum::serve` ("1000 server descriptors with
//! 1000 idle connections": it keeps every idle connection open, none ever
//! closed), with the cap refusing newcomers instead of closing the connection
//! idle longest (the first probe during the flood is closed unanswered), and
//! without the header-read timeout (the kept-alive connection is still open
//! after twice the timeout). Takes about 10 s: the flood, then one timeout.

use std::time::{Duration, Instant};

use clap::Parser;
use hardcount::http::{HEADER_READ_TIMEOUT, MAX_CONNECTIONS};
use hardcount::{Cli, Command};
use testbed::{Leg, TestDb};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;

const IDLE: usize = 10_000;
/// Connections opened at once. Bursts of a few hundred overflow the accept
/// queue of a debug build on a busy machine, and each overflowed connect then
/// waits a whole second for its SYN to be sent again.
const BURST: usize = 50;
/// Connections opened between two checks.
const BATCH: usize = 1_000;
/// Descriptors the process may open besides the idle clients and the server's
/// capped sockets: the tests running beside this one (their pools, clients).
const OTHER_DESCRIPTORS: usize = 128;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_thousand_idle_connections_neither_exhaust_descriptors_nor_stop_healthz() {
    raise_open_file_limit((IDLE + MAX_CONNECTIONS + 2 * OTHER_DESCRIPTORS) as u64);
    let t = TestDb::new().await;
    let cli = Cli::try_parse_from(["hardcount", "serve", "--roles", "webhook_outbox"]).unwrap();
    let Command::Serve(settings) = cli.command else {
        panic!("not serve: {:?}", cli.command)
    };
    let config = settings.config(t.app_url(Leg::current()), None).unwrap();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let shutdown = CancellationToken::new();
    let server = tokio::spawn(hardcount::run(config, listener, shutdown.clone()));
    let deadline = Instant::now() + Duration::from_secs(10);
    while healthz(addr).await.is_err() {
        assert!(Instant::now() < deadline, "never served /healthz");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // The flood: each batch's connections send nothing. After each, the
    // server's sockets (the process's descriptors less the clients') stay
    // within the cap, and a fresh /healthz is answered at once.
    let fds_before = open_descriptors();
    let mut idle: Vec<TcpStream> = Vec::with_capacity(IDLE);
    let (mut most_server_sockets, mut slowest_probe) = (0, Duration::ZERO);
    let flood = Instant::now();
    while idle.len() < IDLE {
        for _ in 0..BATCH / BURST {
            idle.extend(futures_connect(addr, BURST).await);
        }
        // Evicted connections' tasks close their sockets just after.
        tokio::time::sleep(Duration::from_millis(20)).await;
        let server_sockets = open_descriptors().saturating_sub(fds_before + idle.len());
        most_server_sockets = most_server_sockets.max(server_sockets);
        assert!(
            server_sockets <= MAX_CONNECTIONS + OTHER_DESCRIPTORS,
            "{server_sockets} server descriptors with {} idle connections; cap {MAX_CONNECTIONS}",
            idle.len()
        );
        let asked = Instant::now();
        let answer = tokio::time::timeout(Duration::from_secs(2), healthz(addr))
            .await
            .unwrap_or_else(|_| panic!("/healthz unanswered for 2 s with {} idle", idle.len()));
        answer.unwrap_or_else(|e| panic!("/healthz failed with {} idle: {e}", idle.len()));
        slowest_probe = slowest_probe.max(asked.elapsed());
    }
    let flooded = Instant::now();
    let still_open = server_side(addr.port());
    assert!(
        still_open <= MAX_CONNECTIONS,
        "{still_open} connections open"
    );
    eprintln!(
        "{IDLE} idle connections in {:?}: at most {most_server_sockets} server descriptors, \
         slowest /healthz {slowest_probe:?}, {still_open} still open",
        flooded - flood
    );

    // A connection served once and then idle is closed HEADER_READ_TIMEOUT
    // after its response; by then the flood's last ones (opened earlier, never
    // sending) are closed too.
    let mut kept = TcpStream::connect(addr).await.unwrap();
    kept.write_all(b"GET /healthz HTTP/1.1\r\nHost: t\r\n\r\n")
        .await
        .unwrap();
    let mut response = Vec::new();
    let mut buf = [0u8; 1024];
    while !response.ends_with(b"\r\n\r\nok\n") {
        let n = kept.read(&mut buf).await.unwrap();
        assert!(n > 0, "closed before answering");
        response.extend_from_slice(&buf[..n]);
    }
    let served = Instant::now();
    let closed = tokio::time::timeout(HEADER_READ_TIMEOUT * 2, kept.read(&mut buf))
        .await
        .expect("a kept-alive connection idle for twice the timeout is still open");
    let idle_for = served.elapsed();
    assert!(matches!(closed, Ok(0)), "{closed:?}");
    assert!(
        idle_for >= HEADER_READ_TIMEOUT - Duration::from_millis(200),
        "closed after {idle_for:?} idle, before the timeout"
    );
    let open = server_side(addr.port());
    assert_eq!(
        open,
        0,
        "{open} connections still open {:?} after the flood",
        flooded.elapsed()
    );
    let server_sockets = open_descriptors().saturating_sub(fds_before + idle.len());
    assert!(server_sockets <= OTHER_DESCRIPTORS, "{server_sockets}");
    drop(idle);

    shutdown.cancel();
    tokio::time::timeout(Duration::from_secs(15), server)
        .await
        .expect("run returns after cancel")
        .unwrap()
        .unwrap();
}

/// `n` connections to `addr` opened at once, each within 5 s.
async fn futures_connect(addr: std::net::SocketAddr, n: usize) -> Vec<TcpStream> {
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..n {
        tasks.spawn(tokio::time::timeout(
            Duration::from_secs(5),
            TcpStream::connect(addr),
        ));
    }
    let mut out = Vec::with_capacity(n);
    while let Some(done) = tasks.join_next().await {
        let stream = done
            .unwrap()
            .expect("connect took over 5 s: the server stopped accepting")
            .expect("connect failed");
        out.push(stream);
    }
    out
}

/// `GET /healthz` on a new connection; `Err` unless the answer is 200 `ok`.
async fn healthz(addr: std::net::SocketAddr) -> std::io::Result<()> {
    let mut s = TcpStream::connect(addr).await?;
    s.write_all(b"GET /healthz HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
        .await?;
    let mut answer = Vec::new();
    s.read_to_end(&mut answer).await?;
    let text = String::from_utf8_lossy(&answer);
    if text.starts_with("HTTP/1.1 200") && text.ends_with("\r\n\r\nok\n") {
        Ok(())
    } else {
        Err(std::io::Error::other(format!("answered {text:?}")))
    }
}

/// Established sockets on the server's side of `port` (`/proc/net/tcp`): those
/// the server accepted and those in its accept queue. (Not the clients' side:
/// a connect whose handshake overflowed the accept queue can stay established
/// there with nothing behind it.)
fn server_side(port: u16) -> usize {
    let text = std::fs::read_to_string("/proc/net/tcp").unwrap_or_default();
    let want = format!(":{port:04X}");
    text.lines()
        .skip(1)
        .filter(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            f.len() > 3 && f[1].ends_with(&want) && f[3] == "01"
        })
        .count()
}

fn open_descriptors() -> usize {
    std::fs::read_dir("/proc/self/fd").map_or(0, Iterator::count)
}

/// Make room for `want` descriptors: the soft limit up to the hard one, and the
/// hard one too when allowed (root).
fn raise_open_file_limit(want: u64) {
    use rlimit::Resource;
    let (soft, hard) = Resource::NOFILE.get().unwrap();
    if soft >= want {
        return;
    }
    Resource::NOFILE
        .set(want, hard.max(want))
        .or_else(|_| Resource::NOFILE.set(hard.min(want), hard))
        .unwrap();
    let (soft, _) = Resource::NOFILE.get().unwrap();
    assert!(
        soft >= want,
        "RLIMIT_NOFILE is {soft}; this test needs {want}"
    );
}

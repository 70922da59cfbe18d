//! A fault-injecting TCP proxy (issue 27, docs/adr/0038): one per replica,
//! between the replica and PgBouncer, switched at run time between
//!
//! - [`Mode::Pass`]: bytes forwarded as they come;
//! - [`Mode::Delay`]: each chunk held that long before it is forwarded, both ways;
//! - [`Mode::Blackhole`]: connections accepted and held, nothing forwarded
//!   either way (a severed link: the peers see silence, not an error); what
//!   was read is kept, and forwarded in order once the mode changes back;
//! - [`Mode::Reset`]: every open connection closed with a TCP reset, new
//!   ones accepted and reset at once (a refused or restarted path).
//!
//! The proxy connects upstream per accepted connection (in Blackhole, only once
//! the mode lets it through).

use std::net::SocketAddr;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

/// What the proxy does with the bytes of its connections.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Pass,
    Delay(Duration),
    Blackhole,
    Reset,
}

impl std::fmt::Display for Mode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Mode::Pass => f.write_str("pass"),
            Mode::Delay(d) => write!(f, "delay {} ms", d.as_millis()),
            Mode::Blackhole => f.write_str("blackhole"),
            Mode::Reset => f.write_str("reset"),
        }
    }
}

/// A running proxy; stopped (every connection closed) on drop.
pub struct FaultProxy {
    addr: SocketAddr,
    upstream: SocketAddr,
    mode: watch::Sender<Mode>,
    stop: CancellationToken,
}

impl FaultProxy {
    /// Listen on a free loopback port and forward to `upstream`, in [`Mode::Pass`].
    ///
    /// # Panics
    /// If no loopback port can be bound.
    pub async fn start(upstream: SocketAddr) -> FaultProxy {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the proxy's port");
        let addr = listener.local_addr().unwrap();
        let (mode, modes) = watch::channel(Mode::Pass);
        let stop = CancellationToken::new();
        tokio::spawn(accept_loop(listener, upstream, modes, stop.clone()));
        FaultProxy {
            addr,
            upstream,
            mode,
            stop,
        }
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// A proxy in front of the test leg's server, and `t`'s app URL through
    /// it: the database as a replica behind a link the test can break.
    ///
    /// # Panics
    /// If the leg's address does not parse or no loopback port can be bound.
    pub async fn in_front_of(t: &crate::TestDb) -> (FaultProxy, String) {
        let proxy = FaultProxy::start(crate::Leg::current().addr().parse().unwrap()).await;
        let url = format!(
            "postgres://hardcount_app@{}/{}",
            proxy.host_port(),
            t.name()
        );
        (proxy, url)
    }

    /// `host:port` of the proxy, for a database URL.
    pub fn host_port(&self) -> String {
        self.addr.to_string()
    }

    pub fn upstream(&self) -> SocketAddr {
        self.upstream
    }

    /// Switch every connection, open and new, to `mode`.
    pub fn set(&self, mode: Mode) {
        self.mode.send_replace(mode);
    }

    pub fn mode(&self) -> Mode {
        *self.mode.borrow()
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

async fn accept_loop(
    listener: TcpListener,
    upstream: SocketAddr,
    modes: watch::Receiver<Mode>,
    stop: CancellationToken,
) {
    loop {
        let accepted = tokio::select! {
            () = stop.cancelled() => return,
            a = listener.accept() => a,
        };
        let Ok((client, _)) = accepted else {
            tokio::time::sleep(Duration::from_millis(10)).await;
            continue;
        };
        let _ = client.set_nodelay(true);
        tokio::spawn(connection(
            client,
            upstream,
            modes.clone(),
            stop.child_token(),
        ));
    }
}

/// Close `s` with a reset rather than a FIN.
fn reset(s: TcpStream) {
    let _ = s.set_zero_linger();
    drop(s);
}

/// Wait until the mode lets bytes through: `Some(delay)` to forward after
/// that delay, `None` when the connection must be reset (or the proxy stops).
async fn passable(modes: &mut watch::Receiver<Mode>, stop: &CancellationToken) -> Option<Duration> {
    loop {
        let now = *modes.borrow_and_update();
        match now {
            Mode::Pass => return Some(Duration::ZERO),
            Mode::Delay(d) => return Some(d),
            Mode::Reset => return None,
            Mode::Blackhole => {}
        }
        tokio::select! {
            () = stop.cancelled() => return None,
            changed = modes.changed() => if changed.is_err() { return None },
        }
    }
}

async fn connection(
    client: TcpStream,
    upstream: SocketAddr,
    mut modes: watch::Receiver<Mode>,
    stop: CancellationToken,
) {
    // Held until the mode lets it through; reset at once in Reset.
    if passable(&mut modes, &stop).await.is_none() {
        reset(client);
        return;
    }
    let Ok(server) = TcpStream::connect(upstream).await else {
        reset(client);
        return;
    };
    let _ = server.set_nodelay(true);
    let (cr, cw) = client.into_split();
    let (sr, sw) = server.into_split();
    let done = stop.child_token();
    let up = tokio::spawn(pump(cr, sw, modes.clone(), done.clone()));
    let down = tokio::spawn(pump(sr, cw, modes.clone(), done));
    let (Ok((cr, sw)), Ok((sr, cw))) = (up.await, down.await) else {
        return;
    };
    // Ended by a reset: both peers see one. Otherwise (an EOF, an error, the
    // proxy stopped) both sides are closed.
    if *modes.borrow() == Mode::Reset {
        if let Ok(s) = cr.reunite(cw) {
            reset(s);
        }
        if let Ok(s) = sr.reunite(sw) {
            reset(s);
        }
    }
}

/// Forward `from` to `to` as the mode says until EOF, an error, a reset, or
/// the other direction ends (told through `done`, which this one cancels as
/// it ends). Hands the halves back.
async fn pump(
    mut from: OwnedReadHalf,
    mut to: OwnedWriteHalf,
    mut modes: watch::Receiver<Mode>,
    done: CancellationToken,
) -> (OwnedReadHalf, OwnedWriteHalf) {
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        if passable(&mut modes, &done).await.is_none() {
            break;
        }
        // Read while the mode may change: a change to Reset or Blackhole
        // takes effect even on an idle connection.
        let n = tokio::select! {
            () = done.cancelled() => break,
            changed = modes.changed() => {
                if changed.is_err() {
                    break;
                }
                continue;
            }
            r = from.read(&mut buf) => match r {
                Ok(0) | Err(_) => {
                    let _ = to.shutdown().await;
                    break;
                }
                Ok(n) => n,
            },
        };
        // Hold what was read through a blackhole; drop it on a reset.
        let Some(delay) = passable(&mut modes, &done).await else {
            break;
        };
        if !delay.is_zero() {
            tokio::select! {
                () = done.cancelled() => break,
                () = tokio::time::sleep(delay) => {}
            }
        }
        let wrote = tokio::select! {
            () = done.cancelled() => break,
            w = to.write_all(&buf[..n]) => w,
        };
        if wrote.is_err() {
            break;
        }
    }
    done.cancel();
    (from, to)
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use super::*;

    /// An echo server on loopback.
    async fn echo() -> SocketAddr {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        tokio::spawn(async move {
            while let Ok((mut s, _)) = l.accept().await {
                tokio::spawn(async move {
                    let mut buf = [0u8; 1024];
                    while let Ok(n) = s.read(&mut buf).await {
                        if n == 0 || s.write_all(&buf[..n]).await.is_err() {
                            break;
                        }
                    }
                });
            }
        });
        addr
    }

    async fn round_trip(s: &mut TcpStream, msg: &[u8]) -> std::io::Result<Vec<u8>> {
        s.write_all(msg).await?;
        let mut got = vec![0u8; msg.len()];
        s.read_exact(&mut got).await?;
        Ok(got)
    }

    #[tokio::test]
    async fn pass_forwards_both_ways() {
        let p = FaultProxy::start(echo().await).await;
        let mut s = TcpStream::connect(p.addr()).await.unwrap();
        assert_eq!(round_trip(&mut s, b"hello").await.unwrap(), b"hello");
        assert_eq!(round_trip(&mut s, b"again").await.unwrap(), b"again");
    }

    #[tokio::test]
    async fn delay_holds_each_chunk_both_ways() {
        let p = FaultProxy::start(echo().await).await;
        let mut s = TcpStream::connect(p.addr()).await.unwrap();
        round_trip(&mut s, b"warm").await.unwrap();
        p.set(Mode::Delay(Duration::from_millis(150)));
        let t = Instant::now();
        assert_eq!(round_trip(&mut s, b"slow").await.unwrap(), b"slow");
        // Held once each way.
        assert!(
            t.elapsed() >= Duration::from_millis(300),
            "{:?}",
            t.elapsed()
        );
        p.set(Mode::Pass);
        let t = Instant::now();
        round_trip(&mut s, b"fast").await.unwrap();
        assert!(
            t.elapsed() < Duration::from_millis(150),
            "{:?}",
            t.elapsed()
        );
    }

    #[tokio::test]
    async fn blackhole_holds_open_and_new_connections_silently_then_delivers_in_order() {
        let p = FaultProxy::start(echo().await).await;
        let mut open = TcpStream::connect(p.addr()).await.unwrap();
        round_trip(&mut open, b"before").await.unwrap();
        p.set(Mode::Blackhole);
        // Give the pumps a moment to see the mode.
        tokio::time::sleep(Duration::from_millis(20)).await;
        open.write_all(b"held").await.unwrap();
        let mut fresh = TcpStream::connect(p.addr()).await.unwrap();
        fresh.write_all(b"new").await.unwrap();
        let mut buf = [0u8; 8];
        // Silence, neither an answer nor a close.
        assert!(
            tokio::time::timeout(Duration::from_millis(300), open.read(&mut buf))
                .await
                .is_err(),
            "the blackhole answered"
        );
        assert!(
            tokio::time::timeout(Duration::from_millis(100), fresh.read(&mut buf))
                .await
                .is_err(),
            "the blackhole answered a new connection"
        );
        p.set(Mode::Pass);
        let mut got = [0u8; 4];
        open.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"held");
        let mut got = [0u8; 3];
        fresh.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"new");
    }

    #[tokio::test]
    async fn reset_closes_open_connections_and_refuses_new_ones_until_pass() {
        let p = FaultProxy::start(echo().await).await;
        let mut open = TcpStream::connect(p.addr()).await.unwrap();
        round_trip(&mut open, b"before").await.unwrap();
        p.set(Mode::Reset);
        // The open connection is closed without a write of ours.
        let mut buf = [0u8; 8];
        let r = tokio::time::timeout(Duration::from_secs(2), open.read(&mut buf))
            .await
            .expect("the open connection was not closed");
        assert!(matches!(r, Ok(0) | Err(_)), "{r:?}");
        // A new one is accepted and reset before anything is forwarded.
        let mut fresh = TcpStream::connect(p.addr()).await.unwrap();
        let r = tokio::time::timeout(Duration::from_secs(2), round_trip(&mut fresh, b"x"))
            .await
            .expect("the new connection was not closed");
        assert!(r.is_err(), "{r:?}");
        p.set(Mode::Pass);
        let mut again = TcpStream::connect(p.addr()).await.unwrap();
        assert_eq!(round_trip(&mut again, b"after").await.unwrap(), b"after");
    }
}

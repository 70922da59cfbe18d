//! The socket under lettre, with its writes held until the next read.
//!
//! lettre 0.11.23 writes and flushes every piece on its own: a command, a
//! message's body, and the body's final `.` line in a second write after the
//! body. With `TCP_NODELAY` each flush is a segment of its own, so every
//! message costs the server one more read than the message needs
//! (docs/adr/0058). SMTP without pipelining is request and answer: lettre
//! always reads the server's reply after the last thing it wrote. So writes
//! are buffered here and a flush only notes that they may go. The buffer goes
//! out, in as few writes as the socket takes, before the next read, at
//! shutdown, or once it holds [`HOLD_AT_MOST`] bytes. Nothing waits on a
//! reply to bytes still held, because every wait for a reply is a read.

use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use lettre::transport::smtp::client::AsyncTokioStream;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;

/// Past this many bytes held, a write sends them first: a large message goes
/// out as it is written instead of being copied whole.
pub(crate) const HOLD_AT_MOST: usize = 64 * 1024;

/// A TCP stream whose writes go out before the next read (see the module).
#[derive(Debug)]
pub(crate) struct Coalesced {
    tcp: TcpStream,
    held: Vec<u8>,
    /// How much of `held` the socket has taken.
    sent: usize,
}

impl Coalesced {
    pub(crate) fn new(tcp: TcpStream) -> Coalesced {
        Coalesced {
            tcp,
            held: Vec::new(),
            sent: 0,
        }
    }

    /// Write out everything held, then flush the socket.
    fn poll_send_held(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while self.sent < self.held.len() {
            let n = ready!(Pin::new(&mut self.tcp).poll_write(cx, &self.held[self.sent..]))?;
            if n == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            self.sent += n;
        }
        self.held.clear();
        self.sent = 0;
        Pin::new(&mut self.tcp).poll_flush(cx)
    }
}

impl AsyncRead for Coalesced {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        ready!(this.poll_send_held(cx))?;
        Pin::new(&mut this.tcp).poll_read(cx, buf)
    }
}

impl AsyncWrite for Coalesced {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if this.held.len() >= HOLD_AT_MOST {
            ready!(this.poll_send_held(cx))?;
        }
        this.held.extend_from_slice(buf);
        Poll::Ready(Ok(buf.len()))
    }

    /// Held bytes stay held: the next read sends them (see the module).
    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        ready!(this.poll_send_held(cx))?;
        Pin::new(&mut this.tcp).poll_shutdown(cx)
    }
}

impl AsyncTokioStream for Coalesced {
    fn peer_addr(&self) -> io::Result<SocketAddr> {
        self.tcp.peer_addr()
    }
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;

    use super::*;

    /// A body and its final line, each written and flushed as lettre does,
    /// reach the other end in one read once the writer waits for a reply;
    /// nothing is sent before that. Seen failing with `poll_flush` sending
    /// what is held: the server's first read got the body alone.
    #[tokio::test]
    async fn writes_go_out_together_at_the_next_read() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let server = tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            let mut buf = vec![0u8; 1024];
            // Nothing arrives while the client only writes and flushes.
            let early =
                tokio::time::timeout(std::time::Duration::from_millis(200), s.read(&mut buf)).await;
            assert!(early.is_err(), "bytes arrived before the client read");
            let n = s.read(&mut buf).await.unwrap();
            s.write_all(b"250 ok\r\n").await.unwrap();
            buf.truncate(n);
            buf
        });
        let tcp = TcpStream::connect(addr).await.unwrap();
        tcp.set_nodelay(true).unwrap();
        let mut c = Coalesced::new(tcp);
        c.write_all(b"Subject: hi\r\n\r\nbody").await.unwrap();
        c.flush().await.unwrap();
        tokio::time::sleep(std::time::Duration::from_millis(300)).await;
        c.write_all(b"\r\n.\r\n").await.unwrap();
        c.flush().await.unwrap();
        let mut reply = [0u8; 8];
        c.read_exact(&mut reply).await.unwrap();
        assert_eq!(&reply, b"250 ok\r\n");
        let got = server.await.unwrap();
        assert_eq!(got, b"Subject: hi\r\n\r\nbody\r\n.\r\n");
    }

    /// A message larger than [`HOLD_AT_MOST`] is sent as it is written, and
    /// arrives whole.
    #[tokio::test]
    async fn a_large_message_is_not_held_whole() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let size = 3 * HOLD_AT_MOST + 17;
        let server = tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            let mut got = vec![0u8; size];
            s.read_exact(&mut got).await.unwrap();
            s.write_all(b"250 ok\r\n").await.unwrap();
            got
        });
        let tcp = TcpStream::connect(addr).await.unwrap();
        let mut c = Coalesced::new(tcp);
        let body: Vec<u8> = (0..size).map(|i| u8::try_from(i % 251).unwrap()).collect();
        for chunk in body.chunks(1000) {
            c.write_all(chunk).await.unwrap();
        }
        assert!(c.held.len() <= HOLD_AT_MOST + 1000, "{}", c.held.len());
        c.flush().await.unwrap();
        let mut reply = [0u8; 8];
        c.read_exact(&mut reply).await.unwrap();
        assert_eq!(server.await.unwrap(), body);
    }
}

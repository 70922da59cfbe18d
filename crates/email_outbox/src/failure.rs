//! Why a send got no SMTP answer: what opening a connection (`smtp.rs`) and
//! the pool's send (`pool.rs`) fail with, and what `send.rs` turns into a
//! reply. No I/O.

/// Why a send got no SMTP answer to its message.
#[derive(Debug)]
pub(crate) enum Failure {
    /// No usable connection: refused, unreachable, a TLS handshake failed,
    /// the server refused the session (greeting, EHLO, STARTTLS, AUTH;
    /// docs/adr/0079), or nothing answered in time.
    Connect(String),
    /// The server answered with an error, or the connection broke mid-send.
    Smtp(lettre::transport::smtp::Error),
}

//! Counting a process's client connections to a local port.

use std::collections::HashSet;

/// Established IPv4 sockets whose remote end is `port` on this machine: the
/// client side of connections to a local server (`/proc/net/tcp`, state 01).
/// Returns how many, each counted once by its local address, and how many
/// lines listed a socket already seen: the file is not one snapshot, and read
/// over several pages while sockets come and go it can list one twice (it
/// once made the email benchmark report 17 connections against a bound of 16).
pub fn established_to(port: u16) -> (usize, usize) {
    let text = std::fs::read_to_string("/proc/net/tcp").unwrap_or_default();
    let want = format!(":{port:04X}");
    let mut seen = HashSet::new();
    let mut repeated = 0;
    for l in text.lines().skip(1) {
        let f: Vec<&str> = l.split_whitespace().collect();
        if f.len() > 3 && f[2].ends_with(&want) && f[3] == "01" && !seen.insert(f[1].to_owned()) {
            repeated += 1;
        }
    }
    (seen.len(), repeated)
}

/// Sockets a process holds open: its `/proc/PID/fd` entries that are
/// sockets (listening ones included). Reading it costs a directory listing
/// and a `readlink` per descriptor, whatever else the machine has open,
/// where `/proc/net/tcp` walks the kernel's whole table of sockets.
pub fn sockets_of(pid: u32) -> usize {
    let Ok(dir) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
        return 0;
    };
    dir.filter_map(Result::ok)
        .filter(|e| {
            std::fs::read_link(e.path()).is_ok_and(|l| l.to_string_lossy().starts_with("socket:"))
        })
        .count()
}

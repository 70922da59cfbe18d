//! The lease history (`leader_terms`, migration 0027) as the harness reads
//! it: terms, takeovers after a fault, and the proof that an old leader
//! committed nothing after the new ACQUIRE.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use sqlx::Row;
use sqlx::postgres::PgConnection;

pub const ROLES: [&str; 5] = [
    "billing",
    "dunning",
    "webhook_outbox",
    "email_outbox",
    "webhook_delivery",
];

/// One term; times in seconds since the epoch (the harness, Postgres and the
/// unskewed replicas share this machine's clock).
#[derive(Debug, Clone)]
pub struct Term {
    pub role: String,
    pub token: i64,
    pub holder: String,
    pub acquired: f64,
    pub expires: f64,
    pub renewed: Option<f64>,
    pub released: Option<f64>,
    pub end: Option<String>,
}

impl Term {
    /// Where the term ended (or will): its release, else its last expiry.
    pub fn ended(&self) -> f64 {
        self.released.map_or(self.expires, |r| r.min(self.expires))
    }

    pub fn held_by(&self, pid: u32) -> bool {
        self.holder.contains(&format!(":{pid}:"))
    }

    /// The term ended by no clean release: expired unreleased, or released
    /// as lost, interrupted, failed or panicked. A duplicate delivery is
    /// explained only by such a term of its role.
    pub fn unclean(&self) -> bool {
        !matches!(
            self.end.as_deref(),
            Some("completed" | "completed_due_now" | "more_work" | "paused")
        )
    }
}

pub fn now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs_f64()
}

pub async fn terms(su: &mut PgConnection) -> Vec<Term> {
    sqlx::query(
        "SELECT role, token, holder_id, \
                extract(epoch FROM acquired_at)::float8 AS acquired, \
                extract(epoch FROM expires_at)::float8 AS expires, \
                extract(epoch FROM last_renewed_at)::float8 AS renewed, \
                extract(epoch FROM released_at)::float8 AS released, tick_end \
         FROM leader_terms ORDER BY role, token",
    )
    .fetch_all(su)
    .await
    .unwrap()
    .iter()
    .map(|r| Term {
        role: r.get("role"),
        token: r.get("token"),
        holder: r.get("holder_id"),
        acquired: r.get("acquired"),
        expires: r.get("expires"),
        renewed: r.get("renewed"),
        released: r.get("released"),
        end: r.get("tick_end"),
    })
    .collect()
}

/// The term of `role` open now (acquired, not released, not expired), if any.
pub async fn open_term(su: &mut PgConnection, role: &str) -> Option<Term> {
    let t = now();
    terms(su)
        .await
        .into_iter()
        .filter(|x| x.role == role && x.released.is_none() && x.expires > t)
        .max_by_key(|x| x.token)
}

/// What one fault did to one role the victim held.
#[derive(Debug, Clone)]
pub struct Takeover {
    pub role: String,
    /// From the fault to another replica's ACQUIRE of the role (its tick start).
    pub after_fault: Duration,
    /// From the old term's expiry to the new ACQUIRE (negative: the old term
    /// was released, not left to expire).
    pub slack_ms: f64,
    /// The old term's last statement (RENEW or RELEASE) committed before the
    /// new ACQUIRE.
    pub fenced: bool,
    pub old_end: Option<String>,
}

/// For each role whose term `victim` held at `fault_at`: the first later term
/// of another holder, once there is one for every such role (or `limit`).
pub async fn takeovers(
    su: &mut PgConnection,
    victim: u32,
    fault_at: f64,
    limit: Duration,
) -> Vec<Takeover> {
    let deadline = std::time::Instant::now() + limit;
    loop {
        let all = terms(su).await;
        let held: Vec<&Term> = all
            .iter()
            .filter(|t| t.held_by(victim) && t.acquired <= fault_at && t.ended() > fault_at)
            .collect();
        let mut out = Vec::new();
        for old in &held {
            if let Some(new) = all
                .iter()
                .filter(|t| t.role == old.role && t.token > old.token && !t.held_by(victim))
                .min_by_key(|t| t.token)
            {
                let last_write = old
                    .renewed
                    .unwrap_or(old.acquired)
                    .max(old.released.unwrap_or(0.0));
                out.push(Takeover {
                    role: old.role.clone(),
                    after_fault: Duration::from_secs_f64((new.acquired - fault_at).max(0.0)),
                    slack_ms: (new.acquired - old.expires) * 1000.0,
                    fenced: last_write <= new.acquired && old.ended() <= new.acquired,
                    old_end: old.end.clone(),
                });
            }
        }
        if out.len() == held.len() || std::time::Instant::now() > deadline {
            return out;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Terms of one role that overlap an earlier one: (role, earlier token,
/// later token). `all` in (role, token) order, as [`terms`] returns it; each
/// term is held against the latest end of the role's earlier terms.
pub fn overlaps(all: &[Term]) -> Vec<(String, i64, i64)> {
    let mut out = Vec::new();
    let mut latest: Option<(&str, i64, f64)> = None;
    for b in all {
        if let Some((role, token, end)) = latest
            && role == b.role
        {
            if b.acquired < end {
                out.push((b.role.clone(), token, b.token));
            }
            if b.ended() > end {
                latest = Some((&b.role, b.token, b.ended()));
            }
            continue;
        }
        latest = Some((&b.role, b.token, b.ended()));
    }
    out
}

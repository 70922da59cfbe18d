//! The `webhook_delivery` role: POSTs each due webhook delivery to its endpoint,
//! signed per Standard Webhooks, retries failures on a schedule with jitter, and
//! dead-letters a delivery after its last attempt. Targets on private, loopback and
//! link-local networks are refused unless configuration allows them.
//!
//! This crate's pure building blocks, with no database:
//!
//! - [`signature`]: endpoint secrets (`whsec_...`) and the `webhook-*` headers.
//! - [`ssrf`]: which addresses a delivery may connect to, enforced inside the
//!   HTTP client's DNS resolution.
//! - [`backoff`]: the retry schedule and `Retry-After` handling.
//!
//! The store (claims and outcome writes) and the tick that drives a delivery pass
//! live in their own modules.

pub mod backoff;
pub mod signature;
pub mod ssrf;

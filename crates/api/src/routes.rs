//! The `/v1` routes, one module per resource.

pub mod deliveries;
pub mod emails;
pub mod endpoints;
pub mod events;

//! The `/v1` routes, one module per resource.

pub mod events;

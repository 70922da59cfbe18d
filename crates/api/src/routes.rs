//! The `/v1` routes, one module per resource.

pub mod customers;
pub mod deliveries;
pub mod dunning;
pub mod emails;
pub mod endpoints;
pub mod events;
pub mod invoices;
pub mod plans;
pub mod subscriptions;

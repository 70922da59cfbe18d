//! The `webhook_delivery` role (being built).

//! Shared helpers for the benchmark binaries in src/bin/.

// `sqlx::migrate!` embeds migrations/ at build time; rebuild when it changes.
fn main() {
    println!("cargo:rerun-if-changed=../../migrations");
}

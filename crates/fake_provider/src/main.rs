//! `fake_provider`: the fake payment provider as a process, for the local run
//! and benchmarks. Listens on `FAKE_PROVIDER_ADDR` (default 127.0.0.1:12111),
//! accepts `FAKE_PROVIDER_SECRET_KEY` (default the crate's test key), and
//! declines the customers listed in `FAKE_PROVIDER_DECLINE`
//! (`cus_a:insufficient_funds,cus_b:expired_card`). Every other behaviour,
//! settling a processing intent, pruning keys and rolling the secret key are
//! asked for over HTTP (`POST /_test/…`, see the library's docs).

use fake_provider::{Behaviour, FakeProvider, TEST_SECRET_KEY};

#[tokio::main]
async fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .init();
    let addr = std::env::var("FAKE_PROVIDER_ADDR").unwrap_or_else(|_| "127.0.0.1:12111".into());
    let Ok(addr) = addr.parse() else {
        eprintln!("fake_provider: FAKE_PROVIDER_ADDR is not HOST:PORT: {addr:?}");
        std::process::exit(2);
    };
    let key = std::env::var("FAKE_PROVIDER_SECRET_KEY").unwrap_or_else(|_| TEST_SECRET_KEY.into());
    let provider = match FakeProvider::start_on(addr, &key).await {
        Ok(p) => p,
        Err(e) => {
            eprintln!("fake_provider: cannot listen on {addr}: {e}");
            std::process::exit(1);
        }
    };
    for entry in std::env::var("FAKE_PROVIDER_DECLINE")
        .unwrap_or_default()
        .split(',')
    {
        if let Some((customer, code)) = entry.trim().split_once(':') {
            provider.set_behaviour(customer, Behaviour::Decline(code.to_owned()));
        }
    }
    println!("fake_provider listening on {}", provider.base_url());
    let _ = tokio::signal::ctrl_c().await;
}

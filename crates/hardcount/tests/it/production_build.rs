//! The production build (deploy/Dockerfile's `cargo build`) links no test double:
//! `fake_provider` comes only with the `dev-provider` feature (docs/adr/0028).

use std::path::{Path, PathBuf};
use std::process::Command;

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The feature flags of the Dockerfile's `cargo build … -p hardcount` command.
fn dockerfile_feature_flags(dockerfile: &str) -> Vec<String> {
    let line = dockerfile
        .lines()
        .find(|l| l.contains("cargo build") && l.contains("-p hardcount"))
        .expect("deploy/Dockerfile builds hardcount with `cargo build ... -p hardcount`");
    let mut words = line.split_whitespace();
    let mut flags = Vec::new();
    while let Some(w) = words.next() {
        match w {
            "--no-default-features" | "--all-features" => flags.push(w.to_owned()),
            "--features" | "-F" => {
                flags.push(w.to_owned());
                flags.extend(words.next().map(str::to_owned));
            }
            w if w.starts_with("--features=") => flags.push(w.to_owned()),
            _ => {}
        }
    }
    flags
}

/// The packages `hardcount` links (normal dependencies) under `flags`.
fn linked(flags: &[String]) -> String {
    let out = Command::new(env!("CARGO"))
        .args([
            "tree",
            "-p",
            "hardcount",
            "-e",
            "normal",
            "--prefix",
            "none",
        ])
        .args(["--offline", "--locked"])
        .args(flags)
        .current_dir(repo_root())
        .output()
        .expect("run cargo tree");
    assert!(
        out.status.success(),
        "cargo tree {flags:?}: {}",
        crate::text(&out)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Fails if the Dockerfile's build links `fake_provider`. Mutations: drop
/// `--no-default-features` from deploy/Dockerfile (tried), or make the
/// dependency non-optional in crates/hardcount/Cargo.toml (tried). The default
/// build is checked to link it, so the search cannot pass by finding nothing.
#[test]
fn the_production_build_does_not_link_the_fake_provider() {
    let dockerfile = std::fs::read_to_string(repo_root().join("deploy/Dockerfile")).unwrap();
    let flags = dockerfile_feature_flags(&dockerfile);
    let is_fake = |tree: &str| tree.lines().any(|l| l.starts_with("fake_provider "));
    assert!(
        is_fake(&linked(&[])),
        "the default build (`cargo run -p hardcount -- dev`) no longer links fake_provider, \
         or this search no longer finds it"
    );
    let production = linked(&flags);
    assert!(
        !is_fake(&production),
        "deploy/Dockerfile's build (flags {flags:?}) links fake_provider:\n{production}"
    );
}

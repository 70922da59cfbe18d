//! Issue 25, point 9: docker-compose.yml and the kustomize base in
//! deploy/kubernetes, checked as far as a machine without Docker or a cluster
//! can: they parse, every hardcount container's command is the binary's
//! command line and its environment is accepted by the binary's own settings,
//! and the hosts, ports, users and keys they name agree with one another
//! (PgBouncer's ini and userlist, the fake provider, Mailpit, the receiver,
//! Prometheus, Grafana) and with the webhook port policy. No database needed.
//! Seen failing: with a variable `serve` does not read added to a replica,
//! with BILLING_PROVIDER_URL not a URL (the binary's own refusal), and with
//! the NetworkPolicy's port range ending below 65535.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use clap::{CommandFactory as _, Parser as _};
use reqwest::Url;
use yaml_rust2::{Yaml, YamlLoader};

use crate::deploy::{read, repo_root};

/// Every document of a YAML file, with `<<` merge keys applied.
fn load(path: &str) -> Vec<Yaml> {
    let text = read(&repo_root().join(path));
    YamlLoader::load_from_str(&text)
        .unwrap_or_else(|e| panic!("{path} does not parse: {e}"))
        .iter()
        .map(merged)
        .collect()
}

/// `<<: *anchor` (YAML 1.1's merge key, which compose uses) applied: the
/// anchor's entries, then the map's own over them.
fn merged(y: &Yaml) -> Yaml {
    match y {
        Yaml::Hash(h) => {
            let mut out = yaml_rust2::yaml::Hash::new();
            if let Some(Yaml::Hash(base)) = h.get(&Yaml::String("<<".into())).map(merged) {
                out.extend(base);
            }
            for (k, v) in h {
                if k.as_str() != Some("<<") {
                    out.insert(k.clone(), merged(v));
                }
            }
            Yaml::Hash(out)
        }
        Yaml::Array(a) => Yaml::Array(a.iter().map(merged).collect()),
        other => other.clone(),
    }
}

fn s(y: &Yaml) -> String {
    match y {
        Yaml::String(s) => s.clone(),
        Yaml::Integer(i) => i.to_string(),
        Yaml::Boolean(b) => b.to_string(),
        other => panic!("expected a scalar, got {other:?}"),
    }
}

fn strings(y: &Yaml) -> Vec<String> {
    y.as_vec()
        .map(|v| v.iter().map(s).collect())
        .unwrap_or_default()
}

fn keys(y: &Yaml) -> Vec<String> {
    y.as_hash()
        .map(|h| h.keys().map(s).collect())
        .unwrap_or_default()
}

/// The port of `HOST:PORT`.
fn port_of(addr: &str) -> u16 {
    addr.rsplit_once(':')
        .and_then(|(_, p)| p.parse().ok())
        .unwrap_or_else(|| panic!("{addr:?} is not HOST:PORT"))
}

/// What the binary's command line is: for `subcommand`, the long flag of the
/// argument each environment variable sets (globals included).
fn flags_by_env(subcommand: &str) -> BTreeMap<String, String> {
    let cli = hardcount::Cli::command();
    let sub = cli
        .find_subcommand(subcommand)
        .unwrap_or_else(|| panic!("`hardcount {subcommand}` is not a command"));
    cli.get_arguments()
        .chain(sub.get_arguments())
        .filter_map(|a| {
            let env = a.get_env()?.to_str()?.to_owned();
            Some((env, a.get_long()?.to_owned()))
        })
        .collect()
}

/// A container's `args`/`command` and environment as the binary takes them:
/// each variable must be one the command reads (as its flag, so the test's
/// own environment plays no part), the line must parse, and the settings must
/// pass the binary's own validation (`serve`'s config, `migrate`'s URL).
fn check_command(what: &str, command: &[String], env: &BTreeMap<String, String>) {
    let subcommand = command
        .first()
        .unwrap_or_else(|| panic!("{what}: no command"));
    let flags = flags_by_env(subcommand);
    let mut argv = vec!["hardcount".to_owned()];
    argv.extend(command.iter().cloned());
    for (name, value) in env {
        let flag = flags.get(name).unwrap_or_else(|| {
            panic!(
                "{what} sets {name}, which `hardcount {subcommand}` does not read; it reads {:?}",
                flags.keys()
            )
        });
        argv.push(format!("--{flag}={value}"));
    }
    let cli = hardcount::Cli::try_parse_from(&argv)
        .unwrap_or_else(|e| panic!("{what}: `{}` does not parse: {e}", argv.join(" ")));
    match &cli.command {
        hardcount::Command::Serve(settings) => {
            let url = cli.common.database_url().unwrap();
            let keyring = cli.common.keyring().unwrap();
            if let Err(e) = settings.config(url, keyring) {
                panic!("{what}: `hardcount serve` refuses its settings: {e:#}");
            }
        }
        hardcount::Command::Migrate => {
            cli.common
                .migration_database_url()
                .unwrap_or_else(|e| panic!("{what}: {e:#}"));
        }
        _ => panic!("{what} runs `hardcount {subcommand}`; expected serve or migrate"),
    }
}

/// deploy/pgbouncer/pgbouncer.ini: its listen port, and each database entry's
/// pool mode.
fn pgbouncer() -> (u16, BTreeMap<String, String>) {
    let ini = read(&repo_root().join("deploy/pgbouncer/pgbouncer.ini"));
    let mut section = "";
    let mut port = None;
    let mut default_mode = "session".to_owned();
    let mut entries = BTreeMap::new();
    for line in ini.lines().map(str::trim) {
        if line.starts_with(';') || line.is_empty() {
            continue;
        }
        if line.starts_with('[') {
            section = line;
            continue;
        }
        let Some((k, v)) = line.split_once('=') else {
            continue;
        };
        let (k, v) = (k.trim(), v.trim());
        match section {
            "[databases]" => {
                let mode = v
                    .split_whitespace()
                    .find_map(|w| w.strip_prefix("pool_mode="))
                    .unwrap_or("")
                    .to_owned();
                entries.insert(k.to_owned(), mode);
            }
            "[pgbouncer]" if k == "listen_port" => port = v.parse().ok(),
            "[pgbouncer]" if k == "pool_mode" => default_mode = v.to_owned(),
            _ => {}
        }
    }
    for mode in entries.values_mut() {
        if mode.is_empty() {
            mode.clone_from(&default_mode);
        }
    }
    (port.expect("pgbouncer.ini has a listen_port"), entries)
}

/// deploy/pgbouncer/userlist.txt.example: user to password.
fn userlist() -> BTreeMap<String, String> {
    read(&repo_root().join("deploy/pgbouncer/userlist.txt.example"))
        .lines()
        .filter(|l| l.starts_with('"'))
        .map(|l| {
            let parts: Vec<&str> = l.split('"').collect();
            (parts[1].to_owned(), parts[3].to_owned())
        })
        .collect()
}

fn env_map(y: &Yaml) -> BTreeMap<String, String> {
    y.as_hash()
        .map(|h| h.iter().map(|(k, v)| (s(k), s(v))).collect())
        .unwrap_or_default()
}

/// The container side of each `HOST:CONTAINER` port mapping.
fn container_ports(service: &Yaml) -> BTreeSet<u16> {
    strings(&service["ports"])
        .iter()
        .map(|p| port_of(p))
        .collect()
}

/// The hardcount services are the ones built from deploy/Dockerfile's default target.
fn is_hardcount(service: &Yaml) -> bool {
    service["build"]["dockerfile"].as_str() == Some("deploy/Dockerfile")
        && service["build"]["target"].is_badvalue()
}

#[test]
fn compose_runs_the_whole_stack_with_settings_the_binary_accepts() {
    let doc = &load("docker-compose.yml")[0];
    let services = &doc["services"];
    let names: BTreeSet<String> = keys(services).into_iter().collect();
    for needed in [
        "postgres",
        "pgbouncer",
        "migrate",
        "hardcount-a",
        "hardcount-b",
        "fake-provider",
        "mailpit",
        "webhook-receiver",
        "prometheus",
        "grafana",
    ] {
        assert!(names.contains(needed), "docker-compose.yml has no {needed}");
    }
    let (bouncer_port, bouncer_dbs) = pgbouncer();
    let users = userlist();
    let fake = &services["fake-provider"];
    let fake_env = env_map(&fake["environment"]);
    let receiver = &services["webhook-receiver"];
    let receiver_ip: std::net::IpAddr = receiver["networks"]["default"]["ipv4_address"]
        .as_str()
        .expect("the receiver has a fixed address")
        .parse()
        .unwrap();
    let receiver_port: u16 = s(&receiver["environment"]["HTTP_PORT"]).parse().unwrap();

    let mut replicas = Vec::new();
    for name in &names {
        let service = &services[name.as_str()];
        // Pinned images: a tag, never `latest`; the images built here are named `:dev`.
        let image = service["image"]
            .as_str()
            .unwrap_or_else(|| panic!("{name} has no image"));
        let tag = image.rsplit_once(':').map(|(_, t)| t);
        if service["build"].is_badvalue() {
            assert!(
                tag.is_some_and(|t| t != "latest" && !t.contains('/')),
                "{name}'s image {image} is not pinned to a version"
            );
        } else {
            assert_eq!(tag, Some("dev"), "{name} builds {image}");
        }
        for dep in keys(&service["depends_on"])
            .into_iter()
            .chain(strings(&service["depends_on"]))
        {
            assert!(names.contains(&dep), "{name} depends on {dep}, no service");
        }
        for volume in strings(&service["volumes"]) {
            if let Some(source) = volume.strip_prefix("./") {
                let source = source.split(':').next().unwrap();
                assert!(
                    repo_root().join(source).exists(),
                    "{name} mounts {source}, which does not exist"
                );
            }
        }
        if !is_hardcount(service) {
            continue;
        }
        let command = strings(&service["command"]);
        let env = env_map(&service["environment"]);
        check_command(&format!("docker-compose.yml's {name}"), &command, &env);
        for (var, value) in &env {
            if !var.ends_with("DATABASE_URL") {
                continue;
            }
            let url = Url::parse(value).unwrap();
            let db = url.path().trim_start_matches('/');
            match url.host_str() {
                Some("pgbouncer") => {
                    assert_eq!(url.port(), Some(bouncer_port), "{name} {var}");
                    let mode = bouncer_dbs
                        .get(db)
                        .unwrap_or_else(|| panic!("{name} {var}: PgBouncer has no entry {db}"));
                    assert_eq!(mode, "transaction", "{name} {var} through {db}");
                    assert_eq!(
                        users.get(url.username()).map(String::as_str),
                        url.password(),
                        "{name} {var}: PgBouncer's userlist has another password for {}",
                        url.username()
                    );
                }
                // Migrations: directly to Postgres, never through transaction mode.
                Some("postgres") => {
                    assert_eq!(
                        var, "MIGRATION_DATABASE_URL",
                        "{name}: {var} bypasses PgBouncer"
                    );
                    assert_eq!(url.port(), Some(5432));
                    assert_eq!(
                        url.username(),
                        s(&services["postgres"]["environment"]["POSTGRES_USER"])
                    );
                }
                other => panic!("{name} {var} points at {other:?}"),
            }
        }
        if command == ["serve"] {
            replicas.push((name.clone(), service, env));
        }
    }
    assert_eq!(replicas.len(), 2, "two replicas of `hardcount serve`");

    let prometheus = load("deploy/prometheus/prometheus.yml");
    let targets: BTreeSet<String> =
        strings(&prometheus[0]["scrape_configs"][0]["static_configs"][0]["targets"])
            .into_iter()
            .collect();
    let ports = webhook_delivery::ssrf::Ports::default();
    for (name, service, env) in &replicas {
        let http = port_of(&env["HARDCOUNT_HTTP_ADDR"]);
        let api = port_of(&env["HARDCOUNT_API_ADDR"]);
        let published = container_ports(service);
        assert!(published.contains(&http), "{name} does not publish {http}");
        assert!(
            published.contains(&api),
            "{name} does not publish its API's {api}"
        );
        let hostname = service["hostname"].as_str().unwrap();
        assert!(
            targets.contains(&format!("{hostname}:{http}")),
            "prometheus.yml does not scrape {hostname}:{http}: {targets:?}"
        );
        // Mail to Mailpit's SMTP port.
        let smtp = Url::parse(&env["SMTP_URL"]).unwrap();
        assert_eq!(smtp.host_str(), Some("mailpit"));
        assert_eq!(smtp.port(), Some(1025), "Mailpit's SMTP port");
        // Charges to the fake provider, with its key.
        let provider = Url::parse(&env["BILLING_PROVIDER_URL"]).unwrap();
        assert_eq!(provider.host_str(), Some("fake-provider"));
        assert_eq!(
            provider.port(),
            Some(port_of(&fake_env["FAKE_PROVIDER_ADDR"]))
        );
        assert_eq!(
            env["BILLING_PROVIDER_SECRET_KEY"],
            fake_env["FAKE_PROVIDER_SECRET_KEY"]
        );
        assert_eq!(
            fake_env["FAKE_PROVIDER_SECRET_KEY"],
            fake_provider::TEST_SECRET_KEY
        );
        // Webhooks may reach the receiver: its address opened, its port allowed.
        assert_eq!(
            env["HARDCOUNT_WEBHOOK_ALLOWLIST"],
            format!("{receiver_ip}/32"),
            "{name}: the allowlist opens only the receiver"
        );
        assert!(
            ports.permits(receiver_port),
            "the receiver's port {receiver_port}"
        );
    }
    assert_eq!(
        targets.len(),
        replicas.len(),
        "prometheus.yml scrapes {targets:?}"
    );
    assert_eq!(strings(&prometheus[0]["rule_files"]), ["rules.yml"]);

    // Grafana: the datasource the dashboard names, pointing at Prometheus.
    let datasources = load("deploy/grafana/provisioning/datasources/prometheus.yml");
    let ds = &datasources[0]["datasources"][0];
    let dashboard = read(&repo_root().join("deploy/grafana/dashboards/hardcount.json"));
    let uid = ds["uid"].as_str().unwrap();
    assert!(
        dashboard.contains(&format!("\"uid\": \"{uid}\"")),
        "the dashboard's datasource uid"
    );
    assert_eq!(ds["url"].as_str(), Some("http://prometheus:9090"));
    assert!(container_ports(&services["prometheus"]).contains(&9090));
    let providers = load("deploy/grafana/provisioning/dashboards/hardcount.yml");
    let path = providers[0]["providers"][0]["options"]["path"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(
        strings(&services["grafana"]["volumes"])
            .iter()
            .any(|v| v == &format!("./deploy/grafana/dashboards:{path}:ro")),
        "Grafana does not mount the dashboards where its provider reads them ({path})"
    );
}

/// The manifests of the kustomize base, by kind and name.
fn manifests() -> BTreeMap<(String, String), Yaml> {
    let mut out = BTreeMap::new();
    let kustomization = &load("deploy/kubernetes/kustomization.yaml")[0];
    for file in strings(&kustomization["resources"]) {
        for doc in load(&format!("deploy/kubernetes/{file}")) {
            let kind = s(&doc["kind"]);
            let name = s(&doc["metadata"]["name"]);
            out.insert((kind, name), doc);
        }
    }
    out
}

/// The example Secrets: name to key to value.
fn example_secrets() -> BTreeMap<String, BTreeMap<String, String>> {
    load("deploy/kubernetes/secret.example.yaml")
        .iter()
        .map(|d| (s(&d["metadata"]["name"]), env_map(&d["stringData"])))
        .collect()
}

/// A container's environment: literal values, and Secret references (which
/// must exist in secret.example.yaml) filled from it.
fn container_env(what: &str, container: &Yaml) -> BTreeMap<String, String> {
    let secrets = example_secrets();
    let mut env = BTreeMap::new();
    for var in container["env"].as_vec().unwrap() {
        let name = s(&var["name"]);
        let value = if let Some(v) = var["value"].as_str() {
            v.to_owned()
        } else {
            let r = &var["valueFrom"]["secretKeyRef"];
            let (secret, key) = (s(&r["name"]), s(&r["key"]));
            secrets
                .get(&secret)
                .and_then(|keys| keys.get(&key))
                .unwrap_or_else(|| {
                    panic!(
                        "{what}: {name} from Secret {secret}/{key}, which secret.example.yaml lacks"
                    )
                })
                .clone()
        };
        env.insert(name, value);
    }
    // The example's key is a placeholder; the check is that the variable is read.
    if env.contains_key("HARDCOUNT_SECRETS_KEY") {
        env.insert("HARDCOUNT_SECRETS_KEY".into(), testbed::SECRETS_KEY.into());
    }
    env
}

#[test]
fn the_kustomize_base_runs_commands_the_binary_accepts_and_its_egress_matches_the_webhook_port_policy()
 {
    // The base lists every manifest but the example Secrets (applying those would
    // overwrite real credentials).
    let kustomization = &load("deploy/kubernetes/kustomization.yaml")[0];
    let listed: BTreeSet<String> = strings(&kustomization["resources"]).into_iter().collect();
    let on_disk: BTreeSet<String> = std::fs::read_dir(repo_root().join("deploy/kubernetes"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|f| f.ends_with(".yaml"))
        .filter(|f| f != "kustomization.yaml" && f != "secret.example.yaml")
        .collect();
    assert_eq!(listed, on_disk, "kustomization.yaml's resources");
    assert!(Path::new(&repo_root().join("deploy/kubernetes/secret.example.yaml")).exists());

    let m = manifests();
    let get = |kind: &str, name: &str| {
        m.get(&(kind.to_owned(), name.to_owned()))
            .unwrap_or_else(|| panic!("no {kind} {name} in the base"))
    };
    let deployment = get("Deployment", "hardcount");
    let pod = &deployment["spec"]["template"];
    let container = &pod["spec"]["containers"][0];
    let env = container_env("the Deployment", container);
    check_command("the Deployment", &strings(&container["args"]), &env);
    let http = port_of(&env["HARDCOUNT_HTTP_ADDR"]);
    let port = &container["ports"][0];
    assert_eq!(port["containerPort"].as_i64(), Some(i64::from(http)));
    assert_eq!(port["name"].as_str(), Some("http"));
    assert_eq!(
        pod["metadata"]["annotations"]["prometheus.io/port"].as_str(),
        Some(http.to_string().as_str())
    );
    let service = get("Service", "hardcount");
    assert_eq!(
        service["spec"]["ports"][0]["targetPort"].as_str(),
        Some("http")
    );

    let job = get("Job", "hardcount-migrate");
    let migrate = &job["spec"]["template"]["spec"]["containers"][0];
    let migrate_env = container_env("the migration Job", migrate);
    check_command(
        "the migration Job",
        &strings(&migrate["args"]),
        &migrate_env,
    );

    // Egress to PgBouncer on the port DATABASE_URL and pgbouncer.ini use.
    let (bouncer_port, _) = pgbouncer();
    let db = Url::parse(&env["DATABASE_URL"]).unwrap();
    assert_eq!(db.port(), Some(bouncer_port));
    let policy = get("NetworkPolicy", "hardcount");
    let egress = policy["spec"]["egress"].as_vec().unwrap();
    let to_bouncer = egress
        .iter()
        .find(|r| {
            r["to"][0]["podSelector"]["matchLabels"]["app.kubernetes.io/name"].as_str()
                == Some("pgbouncer")
        })
        .expect("an egress rule to PgBouncer");
    assert_eq!(
        to_bouncer["ports"][0]["port"].as_i64(),
        Some(i64::from(bouncer_port))
    );

    // The internet rule opens exactly the ports the webhook port policy allows.
    let internet = egress
        .iter()
        .find(|r| r["to"][0]["ipBlock"]["cidr"].as_str() == Some("0.0.0.0/0"))
        .expect("an egress rule to the internet");
    let mut open = vec![false; 65536];
    for p in internet["ports"].as_vec().unwrap() {
        assert_eq!(p["protocol"].as_str(), Some("TCP"));
        let from = p["port"].as_i64().unwrap() as usize;
        let to = p["endPort"].as_i64().map_or(from, |e| e as usize);
        for o in &mut open[from..=to] {
            *o = true;
        }
    }
    let policy_ports = webhook_delivery::ssrf::Ports::default();
    for port in 1..=u16::MAX {
        assert_eq!(
            open[usize::from(port)],
            policy_ports.permits(port),
            "port {port}: the NetworkPolicy and the webhook port policy (HARDCOUNT_WEBHOOK_MIN_PORT's default) disagree"
        );
    }
}

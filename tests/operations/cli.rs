//! The `leasehold` binary.
#![allow(clippy::expect_used, clippy::unwrap_used)] // tests fail by panicking

use std::process::Command;

fn leasehold(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_leasehold"))
        .args(args)
        .output()
        .expect("run leasehold");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// `check-config` on a file named `name` holding `text` (in a temporary folder).
fn check_config_of(name: &str, text: &str) -> (bool, String, String) {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join(name);
    std::fs::write(&path, text).expect("write");
    leasehold(&["check-config", path.to_str().expect("utf-8 path")])
}

/// The example files: the rules file, and the envoyproxy/ratelimit file the README's and
/// docs/serve.md's serve commands name.
#[test]
fn check_config_accepts_the_example_files() {
    for (file, wants) in [
        (
            "limits.toml",
            &[
                "api.write",
                "override \"tenant-42\"",
                "4 rule(s), 2 override(s) ok",
                "local share 50%: 8 seats of 50 tokens at 250.000/s",
            ][..],
        ),
        (
            "ratelimit.yaml",
            &[
                "gw.api_key ",
                "gw.tenant_tenant-42",
                "fail_open",
                "3 rule(s), 0 override(s), 1 descriptor(s) without a bucket ok",
            ][..],
        ),
    ] {
        let example = format!("{}/examples/{file}", env!("CARGO_MANIFEST_DIR"));
        let (ok, stdout, stderr) = leasehold(&["check-config", &example]);
        assert!(ok, "{file}: {stderr}");
        for want in wants {
            assert!(stdout.contains(want), "{file}: {want:?} not in {stdout}");
        }
    }
}

#[test]
fn check_config_names_what_is_wrong() {
    let cases = [
        ("[rules.a]\ncapacity = 10\nrate = \"0/s\"\n", "rule a: rate"),
        (
            "[rules.a]\ncapacity = 10\nrate = \"1/s\"\nlease_max = 11\n",
            "lease_max = 11",
        ),
        (
            "[rules.\"a b\"]\ncapacity = 10\nrate = \"1/s\"\n",
            "\"a b\"",
        ),
        ("[rules.a]\ncapacity = 10\n", "rate"),
        ("not toml at all [", "rules file"),
    ];
    for (text, want) in cases {
        let (ok, _, stderr) = check_config_of("bad.toml", text);
        assert!(!ok, "accepted {text:?}");
        assert!(stderr.contains(want), "for {text:?}: {stderr}");
    }
    let (ok, _, stderr) = leasehold(&["check-config", "/nonexistent.toml"]);
    assert!(!ok && stderr.contains("/nonexistent.toml"), "{stderr}");
}

/// A rule leased by rate: check-config says how many gateways its capacity suits (each
/// share needs a burst out of B), and what serves a small B shared by many.
#[test]
fn check_config_says_how_many_gateways_a_rate_leased_capacity_suits() {
    let (ok, stdout, stderr) = check_config_of(
        "rate.toml",
        "[rules.big]\ncapacity = 20000\nrate = \"20000/s\"\nleasing = \"rate\"\n\
         [rules.small]\ncapacity = 100\nrate = \"20000/s\"\nleasing = \"rate\"\n",
    );
    assert!(ok, "{stderr}");
    assert!(
        stdout.contains("the smallest here, 100, suits about 20 gateways"),
        "{stdout}"
    );
    assert!(stdout.contains("leasing = \"exact\""), "{stdout}");
}

#[test]
fn coordinator_names_what_is_wrong() {
    let example = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/limits.toml");
    for (extra, want) in [
        (
            &["--config", example, "--split-above", "0"][..],
            "--split-above 0",
        ),
        (&["--config", "/nonexistent.toml"][..], "/nonexistent.toml"),
        (
            &["--config", example, "--admin-token", ""][..],
            "--admin-token is empty",
        ),
    ] {
        let mut args = vec!["coordinator", "--redis", "redis://127.0.0.1:1"];
        args.extend_from_slice(extra);
        let (ok, _, stderr) = leasehold(&args);
        assert!(!ok && stderr.contains(want), "{extra:?}: {stderr}");
    }
    // Nothing listening on the store's port is not an error: the coordinator starts and
    // retries (tests/operations/ops_binaries.rs).

    // serve's envoyproxy/ratelimit YAML is read as serve reads it: its errors are the
    // YAML's (not a TOML parser's).
    let dir = tempfile::tempdir().expect("tempdir");
    let yaml = dir.path().join("limits.yaml");
    std::fs::write(
        &yaml,
        "domain: d\ndescriptors:\n  - key: a\n    rate_limit: {requests_per_unit: 1}\n",
    )
    .expect("write");
    let (ok, _, stderr) = leasehold(&[
        "coordinator",
        "--redis",
        "redis://127.0.0.1:1",
        "--config",
        yaml.to_str().expect("utf-8"),
    ]);
    assert!(
        !ok && stderr.contains("rate_limit needs a unit"),
        "{stderr}"
    );
}

/// The store's address from a file or the environment, never echoed: a malformed address
/// read from `--redis-url-file` or `LEASEHOLD_REDIS_URL` is refused, its password `***`.
#[test]
fn coordinator_reads_the_address_from_a_file_or_the_environment_and_hides_it() {
    let example = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/limits.toml");
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("redis-url");
    std::fs::write(&file, "redis://:file-secret-pw@127.0.0.1:notaport\n").expect("write");
    let (ok, _, stderr) = leasehold(&[
        "coordinator",
        "--redis-url-file",
        file.to_str().expect("utf-8"),
        "--config",
        example,
    ]);
    assert!(!ok, "{stderr}");
    assert!(stderr.contains("redis://***@***"), "{stderr}");
    assert!(!stderr.contains("file-secret-pw"), "{stderr}");

    let out = Command::new(env!("CARGO_BIN_EXE_leasehold"))
        .args(["coordinator", "--config", example])
        .env(
            "LEASEHOLD_REDIS_URL",
            "redis://:env-secret-pw@127.0.0.1:notaport",
        )
        .output()
        .expect("run leasehold");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("redis://***@***") && !stderr.contains("env-secret-pw"),
        "{stderr}"
    );

    let help = Command::new(env!("CARGO_BIN_EXE_leasehold"))
        .args(["coordinator", "--help"])
        .env("LEASEHOLD_REDIS_URL", "redis://:env-secret-pw@127.0.0.1:1")
        .output()
        .expect("run leasehold");
    let text = String::from_utf8_lossy(&help.stdout);
    assert!(
        text.contains("--redis-url-file") && !text.contains("env-secret-pw"),
        "{text}"
    );

    let (ok, _, stderr) = leasehold(&["coordinator", "--config", example]);
    assert!(!ok && stderr.contains("no store given"), "{stderr}");
}

/// The protocol page's table of a bucket's hash lists every field `leasehold_core::schema`
/// has.
#[test]
fn the_protocol_page_describes_every_hash_field() {
    let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/protocol.md"))
        .expect("docs/protocol.md");
    for (name, _) in leasehold_core::schema::FIELDS {
        let cell = if name.starts_with(':') {
            format!("| `ID{name}` |")
        } else {
            format!("| `{name}` |")
        };
        assert!(readme.contains(&cell), "docs/protocol.md lacks {cell}");
    }
}

/// serve's listener flags out of range are refused at start, naming the flag.
#[test]
fn serve_names_a_listener_flag_out_of_range() {
    let example = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/limits.toml");
    for (flag, value, says) in [
        ("--max-connections", "0", "--max-connections 0: at least 1"),
        (
            "--max-connections",
            "100000000",
            "--max-connections 100000000: this process may open only",
        ),
        ("--header-timeout", "0", "--header-timeout 0"),
        ("--idle-timeout", "0", "--idle-timeout 0"),
    ] {
        let (ok, _, stderr) = leasehold(&[
            "serve",
            "--config",
            example,
            "--http",
            "127.0.0.1:0",
            flag,
            value,
        ]);
        assert!(!ok && stderr.contains(says), "{flag} {value}: {stderr}");
    }
}

/// A malformed address is explained in words (not redis-rs's "InvalidClientConfig").
#[test]
fn a_malformed_address_is_explained() {
    let example = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/limits.toml");
    for (address, says) in [
        ("redis://:Zq9secret@127.0.0.1:notaport", "is not HOST:PORT"),
        ("redis://127.0.0.1:6379/x", "not /DB, a database number"),
    ] {
        let (ok, _, stderr) = leasehold(&[
            "serve",
            "--config",
            example,
            "--http",
            "127.0.0.1:0",
            "--redis",
            address,
        ]);
        assert!(!ok && stderr.contains(says), "{address}: {stderr}");
        assert!(!stderr.contains("InvalidClientConfig"), "{stderr}");
        assert!(!stderr.contains("Zq9secret"), "{stderr}");
    }
}

/// check-config reads envoyproxy/ratelimit's YAML as serve does (a migrating user can
/// check a file without starting serve), and names what is wrong in a bad one.
#[test]
fn check_config_reads_ratelimit_yaml() {
    let (ok, stdout, stderr) = check_config_of(
        "rls.yaml",
        "domain: messaging\ndescriptors:\n  - key: message_type\n    value: marketing\n    \
         descriptors:\n      - key: to_number\n        rate_limit: {unit: day, requests_per_unit: 5}\n  \
         - key: to_number\n    rate_limit: {unit: day, requests_per_unit: 100}\n",
    );
    assert!(ok, "{stderr}");
    assert!(
        stdout.contains("domain(s) messaging")
            && stdout.contains("messaging.message_type_marketing.to_number")
            && stdout.contains("2 rule(s)"),
        "{stdout}"
    );
    // The note on failure policies names the rules as the list does: a value with a `/`
    // becomes a rule name with a digest, and the note said the value instead.
    let example = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/ratelimit.yaml");
    let (ok, stdout, stderr) = leasehold(&["check-config", example]);
    assert!(ok, "{stderr}");
    let listed = (stdout.lines())
        .find_map(|l| {
            l.split_whitespace()
                .next()
                .filter(|r| r.starts_with("gw.api_key.path_"))
        })
        .unwrap_or_else(|| panic!("no path rule listed: {stdout}"));
    let note = (stdout.lines())
        .find(|l| l.starts_with("on failure:"))
        .unwrap_or_else(|| panic!("no failure note: {stdout}"));
    assert!(note.contains(listed), "{listed} not named so in: {note}");
    // Its row says the same: Envoy decides (it said fail_closed, the rule's own default).
    let row = (stdout.lines())
        .find(|l| l.starts_with(listed))
        .unwrap_or_default();
    assert!(row.ends_with("Envoy's (gRPC), 503 (HTTP)"), "{row}");
    let (ok, _, stderr) = check_config_of(
        "bad.yml",
        "domain: x\ndescriptors:\n  - key: a\n    rate_limit: {unit: fortnight, requests_per_unit: 5}\n",
    );
    assert!(!ok && stderr.contains("\"fortnight\""), "{stderr}");
}

/// Two files for one domain: refused, unless merged (`--merge-domain-config` or
/// ratelimit's `MERGE_DOMAIN_CONFIG=true`); a descriptor defined twice is refused even then.
#[test]
fn files_of_one_domain_merge_only_when_asked() {
    let dir = tempfile::tempdir().expect("tempdir");
    let write = |name: &str, key: &str| {
        std::fs::write(
            dir.path().join(name),
            format!(
                "domain: d\ndescriptors:\n  - key: {key}\n    rate_limit: {{unit: second, requests_per_unit: 5}}\n"
            ),
        )
        .expect("write");
    };
    write("1.yaml", "a");
    write("2.yaml", "b");
    let path = dir.path().to_str().expect("utf-8");
    let (ok, _, stderr) = leasehold(&["check-config", path]);
    assert!(
        !ok && stderr.contains("domain \"d\" is already defined"),
        "{stderr}"
    );
    let (ok, stdout, stderr) = leasehold(&["check-config", "--merge-domain-config", path]);
    assert!(
        ok && stdout.contains("d.a") && stdout.contains("d.b"),
        "{stdout}{stderr}"
    );
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_leasehold"))
        .args(["check-config", path])
        .env("MERGE_DOMAIN_CONFIG", "true")
        .output()
        .expect("run");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    write("3.yaml", "a");
    let (ok, _, stderr) = leasehold(&["check-config", "--merge-domain-config", path]);
    assert!(
        !ok && stderr.contains("d.a: duplicate descriptor"),
        "{stderr}"
    );
}

/// A port already taken is said at once, before the store (down here) is dialled.
#[test]
fn serve_names_a_taken_port_before_dialling_the_store() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = taken.local_addr().expect("addr").port();
    let example = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/limits.toml");
    let at = format!("127.0.0.1:{port}");
    let (ok, _, stderr) = leasehold(&[
        "serve",
        "--config",
        example,
        "--redis",
        "redis://127.0.0.1:1",
        "--http",
        &at,
    ]);
    assert!(!ok, "{stderr}");
    assert!(stderr.contains(&format!("--http {at}")), "{stderr}");
    assert!(!stderr.contains("store unreachable"), "{stderr}");
}

//! Production start-up: what it refuses, in one message, and the compose
//! file's environment passing it as written.

use std::process::Command;

/// `seckill token` under `SECKILL_ENV=production` with `vars`: every
/// command loads and validates the settings first.
fn start_in_production(vars: &[(String, String)]) -> std::process::Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_seckill"));
    cmd.arg("token").env("SECKILL_ENV", "production");
    for (key, _) in std::env::vars().filter(|(k, _)| k.starts_with("SECKILL__")) {
        cmd.env_remove(key);
    }
    for (key, value) in vars {
        cmd.env(key, value);
    }
    cmd.output().expect("the seckill binary runs")
}

/// The `SECKILL__*` variables compose.yaml gives the service, with each
/// `${VAR:?…}` a user must supply filled in with a strong value.
fn compose_environment() -> Vec<(String, String)> {
    let compose = std::fs::read_to_string("compose.yaml").expect("compose.yaml");
    compose
        .lines()
        .filter_map(|l| l.trim().split_once(": "))
        .filter(|(k, _)| k.starts_with("SECKILL__"))
        .map(|(k, v)| {
            let v = if v.starts_with("${") {
                format!("{k}-{}", "s".repeat(40))
            } else {
                v.to_owned()
            };
            (k.to_owned(), v)
        })
        .collect()
}

#[test]
fn production_without_its_variables_names_each_missing_one_in_one_message() {
    let out = start_in_production(&[]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    for name in [
        "SECKILL__AUTH__JWT_SECRET",
        "SECKILL__AUTH__SERVER_SECRET",
        "SECKILL__PAYMENT__NOTIFY_SECRET",
    ] {
        assert!(err.contains(name), "{err}");
    }
    assert_eq!(
        err.matches("production (SECKILL_ENV=production) needs")
            .count(),
        1
    );
}

#[test]
fn production_refuses_the_mock_payment_provider() {
    let mut vars = compose_environment();
    vars.push(("SECKILL__PAYMENT__MOCK".into(), "true".into()));
    let out = start_in_production(&vars);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("SECKILL__PAYMENT__MOCK=false"), "{err}");
}

#[test]
fn the_compose_files_environment_starts_in_production_as_written() {
    let vars = compose_environment();
    assert!(
        vars.iter()
            .any(|(k, _)| k == "SECKILL__PAYMENT__NOTIFY_SECRET")
    );
    let out = start_in_production(&vars);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `SECKILL_ENV=NAME seckill serve` with the development defaults and
/// nothing else: refused before anything starts.
fn serve_in(env: &str) -> std::process::Output {
    serve_with(Some(env), &[])
}

/// `seckill serve` with `SECKILL_ENV` set to `env` (unset: `None`), the
/// development defaults and `vars`.
fn serve_with(env: Option<&str>, vars: &[(&str, &str)]) -> std::process::Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_seckill"));
    cmd.arg("serve").env_remove("SECKILL_ENV");
    if let Some(env) = env {
        cmd.env("SECKILL_ENV", env);
    }
    for (key, _) in std::env::vars().filter(|(k, _)| k.starts_with("SECKILL__")) {
        cmd.env_remove(key);
    }
    // Were it to start, it would not take a port of the other tests.
    cmd.env("SECKILL__APP__PORT", "0");
    cmd.envs(vars.iter().copied());
    let mut child = cmd
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("the seckill binary runs");
    // A server that started would serve until stopped: give it a while,
    // then stop it, so the assertion below fails instead of hanging.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while child.try_wait().expect("try_wait").is_none() {
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    child.wait_with_output().expect("output")
}

#[test]
fn any_environment_but_development_and_test_refuses_the_development_defaults() {
    for env in ["staging", "prod", "producton"] {
        let out = serve_in(env);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{env} started: {err}");
        for name in [
            "SECKILL__AUTH__JWT_SECRET",
            "SECKILL__AUTH__SERVER_SECRET",
            "SECKILL__PAYMENT__NOTIFY_SECRET",
            "SECKILL__PAYMENT__MOCK=false",
        ] {
            assert!(err.contains(name), "{env}: {err}");
        }
        assert!(err.contains(&format!("SECKILL_ENV={env}")), "{env}: {err}");
    }
}

#[test]
fn a_server_without_a_named_environment_refuses_to_face_a_network() {
    // No SECKILL_ENV: development is assumed, with its published secret
    // and the admin-minting dev token route. Bound beyond loopback, it
    // must not start.
    for host in ["0.0.0.0", "::"] {
        let out = serve_with(None, &[("SECKILL__APP__HOST", host)]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{host}: started: {err}");
        assert!(
            err.contains("SECKILL_ENV is not set") && err.contains("beyond loopback"),
            "{host}: {err}"
        );
    }
}

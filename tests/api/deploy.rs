//! The Kubernetes manifests (`deploy/kubernetes`), built and validated by
//! `scripts/k8s-validate.sh` (kustomize, then the API schemas, strictly),
//! then checked against the service itself: every probe names a route
//! this server answers on the port it listens on, every container runs a
//! command the binary takes, the grace period covers the preStop sleep
//! and the drain, and the workers' autoscaler stops at the order topic's
//! partition count.

use std::collections::HashMap;

use yaml_rust2::{Yaml, YamlLoader};

use crate::helpers::{TestApp, spawn_app};

/// Each build's YAML (`base`, `production`, …), from the script.
fn builds() -> Vec<(String, String)> {
    let out = tempfile_dir();
    let status = std::process::Command::new(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/scripts/k8s-validate.sh"
    ))
    .arg(&out)
    .status()
    .expect("scripts/k8s-validate.sh runs");
    assert!(status.success(), "the manifests build and validate");
    let mut builds: Vec<(String, String)> = std::fs::read_dir(&out)
        .expect("the builds")
        .map(|e| {
            let path = e.expect("an entry").path();
            let name = path.file_stem().unwrap().to_string_lossy().into_owned();
            (name, std::fs::read_to_string(&path).expect("a build"))
        })
        .collect();
    builds.sort();
    let _ = std::fs::remove_dir_all(&out);
    assert!(builds.iter().any(|(n, _)| n == "production"), "{builds:?}");
    builds
}

fn tempfile_dir() -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("seckill-k8s-{}", uuid::Uuid::new_v4()));
    std::fs::create_dir_all(&dir).expect("a temporary folder");
    dir
}

/// What is wrong with one build, in words; empty when nothing is.
async fn problems(app: &TestApp, build: &str) -> Vec<String> {
    let docs = YamlLoader::load_from_str(build).expect("a build is YAML");
    let mut problems = Vec::new();
    let of_kind = |kind: &str| -> Vec<&Yaml> {
        docs.iter()
            .filter(|d| d["kind"].as_str() == Some(kind))
            .collect()
    };
    let config: HashMap<String, String> = of_kind("ConfigMap")
        .iter()
        .flat_map(|c| c["data"].as_hash().into_iter().flatten())
        .filter_map(|(k, v)| Some((k.as_str()?.to_owned(), v.as_str()?.to_owned())))
        .collect();
    let setting = |key: &str| -> i64 {
        config
            .get(key)
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("the ConfigMap sets {key}"))
    };
    let port = setting("SECKILL__APP__PORT");
    let drain = setting("SECKILL__APP__SHUTDOWN_TIMEOUT_SECS");
    let partitions = setting("SECKILL__KAFKA__PARTITIONS");

    let mut workloads = of_kind("Deployment");
    workloads.extend(of_kind("Job"));
    let mut consume_deployments = Vec::new();
    for w in workloads {
        let name = w["metadata"]["name"].as_str().unwrap_or("?").to_owned();
        let pod = &w["spec"]["template"]["spec"];
        // A rolling upgrade across a migration: no new pod starts before
        // the migration Job has applied what its image carries.
        if w["kind"].as_str() == Some("Deployment") {
            let waits = pod["initContainers"]
                .as_vec()
                .into_iter()
                .flatten()
                .any(|c| {
                    let args: Vec<&str> = c["args"]
                        .as_vec()
                        .into_iter()
                        .flatten()
                        .filter_map(Yaml::as_str)
                        .collect();
                    args == ["migrate", "wait"]
                        && app.seckill(&["migrate", "wait", "--help"]).status.success()
                });
            if !waits {
                problems.push(format!(
                    "{name}: no init container waits for the schema (`seckill migrate wait`)"
                ));
            }
        }
        for c in pod["containers"].as_vec().into_iter().flatten() {
            let args: Vec<&str> = c["args"]
                .as_vec()
                .into_iter()
                .flatten()
                .filter_map(Yaml::as_str)
                .collect();
            // The binary takes the command and its flags.
            let help = app.seckill(&[args.as_slice(), &["--help"]].concat());
            if !help.status.success() {
                problems.push(format!(
                    "{name}: `seckill {}` is no command",
                    args.join(" ")
                ));
            }
            if args.first() == Some(&"consume") && w["kind"].as_str() == Some("Deployment") {
                consume_deployments.push(name.clone());
            }
            let ports: HashMap<&str, i64> = c["ports"]
                .as_vec()
                .into_iter()
                .flatten()
                .filter_map(|p| Some((p["name"].as_str()?, p["containerPort"].as_i64()?)))
                .collect();
            for probe in ["startupProbe", "readinessProbe", "livenessProbe"] {
                let get = &c[probe]["httpGet"];
                let Some(path) = get["path"].as_str() else {
                    continue;
                };
                let probe_port = match &get["port"] {
                    Yaml::Integer(n) => Some(*n),
                    Yaml::String(s) => ports.get(s.as_str()).copied(),
                    _ => None,
                };
                if probe_port != Some(port) {
                    problems.push(format!(
                        "{name}: {probe} on port {probe_port:?}, the server listens on {port}"
                    ));
                }
                let status = app.get(path, None).await.status().as_u16();
                if status == 404 {
                    problems.push(format!("{name}: {probe} path {path} is no route (404)"));
                }
            }
            let pre_stop: i64 = match c["lifecycle"]["preStop"]["exec"]["command"].as_vec() {
                Some(cmd) => cmd
                    .last()
                    .and_then(Yaml::as_str)
                    .map_or(0, |s| s.parse().unwrap_or(0)),
                None => 0,
            };
            let grace = pod["terminationGracePeriodSeconds"].as_i64().unwrap_or(30);
            if w["kind"].as_str() == Some("Deployment") && grace < pre_stop + drain {
                problems.push(format!(
                    "{name}: a grace period of {grace}s is shorter than the preStop sleep \
                     ({pre_stop}s) and the drain ({drain}s)"
                ));
            }
        }
    }
    for so in of_kind("ScaledObject") {
        let target = so["spec"]["scaleTargetRef"]["name"].as_str().unwrap_or("?");
        if !consume_deployments.iter().any(|d| d == target) {
            problems.push(format!(
                "ScaledObject scales {target}, no `consume` Deployment"
            ));
        }
        let max = so["spec"]["maxReplicaCount"].as_i64().unwrap_or(i64::MAX);
        if max > partitions {
            problems.push(format!(
                "ScaledObject: up to {max} workers for {partitions} partitions"
            ));
        }
        for t in so["spec"]["triggers"].as_vec().into_iter().flatten() {
            let m = &t["metadata"];
            if m["consumerGroup"].as_str() != Some("order-creator")
                || m["topic"].as_str() != Some("order.requested")
            {
                problems.push(format!("ScaledObject: not the order consumers' lag: {m:?}"));
            }
        }
    }
    for hpa in of_kind("HorizontalPodAutoscaler") {
        let target = hpa["spec"]["scaleTargetRef"]["name"].as_str();
        if !of_kind("Deployment")
            .iter()
            .any(|d| d["metadata"]["name"].as_str() == target)
        {
            problems.push(format!(
                "HorizontalPodAutoscaler scales {target:?}, no Deployment"
            ));
        }
    }
    problems
}

#[tokio::test]
async fn the_manifests_validate_and_name_real_routes_commands_and_limits() {
    let app = spawn_app().await;
    for (name, build) in builds() {
        let found = problems(&app, &build).await;
        assert!(found.is_empty(), "{name}: {found:#?}");

        // The check can fail: a readiness probe on a path that is no route,
        // a command the binary does not take, more workers than partitions.
        let broken = build
            .replace("path: /health/ready", "path: /health/readyz")
            .replace("- --no-consumer", "- --no-consumers")
            .replace("maxReplicaCount: ", "maxReplicaCount: 9");
        let found = problems(&app, &broken).await;
        for expected in [
            "/health/readyz is no route",
            "--no-consumers` is no command",
            "partitions",
        ] {
            assert!(
                found.iter().any(|p| p.contains(expected)),
                "{name}: a broken build not caught ({expected}): {found:#?}"
            );
        }
    }
}

//! The dashboard (`ops/grafana/seckill.json`) and the alert rules
//! (`ops/prometheus/alerts.yml`) name only metrics `/metrics` exports, and
//! only label values it exports: a renamed metric or a misspelt label
//! fails here, not silently on a dashboard during a sale.

use std::collections::{BTreeMap, BTreeSet};

use crate::helpers::spawn_app;

/// `name{k="v",...}` selectors of a PromQL text: the metric name and its
/// equality matchers (`=~`, `!=` and `!~` are not checked).
fn selectors(text: &str) -> Vec<(String, Vec<(String, String)>)> {
    let mut found = Vec::new();
    let bytes = text.as_bytes();
    let mut i = 0;
    while let Some(at) = text[i..].find("seckill_") {
        let start = i + at;
        // Part of a longer word (e.g. `my_seckill_x`): not a metric.
        if start > 0 && (bytes[start - 1].is_ascii_alphanumeric() || bytes[start - 1] == b'_') {
            i = start + 1;
            continue;
        }
        let mut end = start;
        while end < bytes.len() && (bytes[end].is_ascii_alphanumeric() || bytes[end] == b'_') {
            end += 1;
        }
        let name = text[start..end].to_owned();
        let mut matchers = Vec::new();
        if bytes.get(end) == Some(&b'{') {
            let close = end + closing_brace(&text[end..]);
            for part in text[end + 1..close].split(',') {
                let part = part.trim();
                let Some((k, v)) = part.split_once('=') else {
                    continue;
                };
                if k.ends_with('!') || v.starts_with('~') {
                    continue;
                }
                matchers.push((k.trim().to_owned(), v.trim().trim_matches('"').to_owned()));
            }
            end = close;
        }
        found.push((name, matchers));
        i = end;
    }
    found
}

#[test]
fn selectors_are_read_with_their_equality_matchers() {
    let found = selectors(
        r#"sum(rate(seckill_a_total{x="1", y=~"2|3", z!="4", r="/a/{id}"}[1m])) / seckill_b and my_seckill_c"#,
    );
    assert_eq!(
        found,
        vec![
            (
                "seckill_a_total".into(),
                vec![("x".into(), "1".into()), ("r".into(), "/a/{id}".into())]
            ),
            ("seckill_b".into(), vec![]),
        ]
    );
}

/// Where the label set that `text` opens closes: the first `}` outside a
/// quoted label value (a route label holds `{id}`).
fn closing_brace(text: &str) -> usize {
    let mut quoted = false;
    text.char_indices()
        .find(|&(_, c)| {
            quoted ^= c == '"';
            c == '}' && !quoted
        })
        .expect("a closed label set")
        .0
}

/// Exported series: family name → the label sets of its samples.
fn exported(metrics: &str) -> BTreeMap<String, Vec<String>> {
    let mut series: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for line in metrics.lines().filter(|l| !l.starts_with('#')) {
        let name_end = line.find(['{', ' ']).unwrap_or(line.len());
        let labels = match line[name_end..].strip_prefix('{') {
            Some(_) => line[name_end + 1..name_end + closing_brace(&line[name_end..])].to_owned(),
            None => String::new(),
        };
        series
            .entry(line[..name_end].to_owned())
            .or_default()
            .push(labels);
    }
    series
}

/// The rules of a Prometheus rules file, `(alert, expr)`, checked for the
/// shape Prometheus loads: `groups[].rules[]`, each with an alert name, an
/// expression, a severity and a summary.
fn alert_rules(text: &str) -> Vec<(String, String)> {
    use yaml_rust2::{Yaml, YamlLoader};
    let docs = YamlLoader::load_from_str(text).expect("the rules file is YAML");
    let groups = docs[0]["groups"].as_vec().expect("groups: a list");
    let mut rules = Vec::new();
    for group in groups {
        assert!(group["name"].as_str().is_some(), "a group has a name");
        for rule in group["rules"].as_vec().expect("rules: a list") {
            let name = rule["alert"].as_str().expect("each rule is an alert");
            let expr = rule["expr"]
                .as_str()
                .unwrap_or_else(|| panic!("{name}: expr"));
            assert!(
                rule["labels"]["severity"].as_str().is_some(),
                "{name}: labels.severity"
            );
            assert!(
                rule["annotations"]["summary"].as_str().is_some(),
                "{name}: annotations.summary"
            );
            if let Yaml::String(f) = &rule["for"] {
                assert!(f.ends_with('m') || f.ends_with('s'), "{name}: for: {f}");
            }
            rules.push((name.to_owned(), expr.to_owned()));
        }
    }
    rules
}

#[test]
fn the_rules_file_is_read_as_prometheus_reads_it() {
    let rules = alert_rules(
        "groups:\n  - name: g\n    rules:\n      - alert: A\n        expr: |\n          up\n          == 0\n        for: 1m\n        labels: {severity: page}\n        annotations: {summary: s}\n",
    );
    assert_eq!(rules, vec![("A".to_owned(), "up\n== 0\n".to_owned())]);
}

#[tokio::test]
async fn every_metric_the_dashboard_and_the_alerts_name_is_exported() {
    let app = spawn_app().await;
    // What a running sale has: an activity reconciled (the stock gauges),
    // a purchase (the HTTP and admission series).
    let id = app.live_activity(3, 1, 1).await;
    let (status, _) = app.buy(1, id).await;
    assert_eq!(status, 202);
    crate::reconcile::reconcile(&app).await;
    // And a waiting room with a ticket admitted (its per-room gauges).
    let (room, _) = app
        .room_activity(3, -60, crate::waiting_room::room(0, 10))
        .await;
    assert_eq!(app.join(1, room).await.0, 201);
    let gauge = format!("seckill_waiting_room_passes_outstanding{{activity_id=\"{room}\"}}");
    crate::helpers::eventually(
        "the room's gauges",
        std::time::Duration::from_secs(30),
        || {
            let (app, gauge) = (&app, &gauge);
            async move { (app.metric(gauge).await? == 1).then_some(()) }
        },
    )
    .await;
    let metrics = app.get("/metrics", None).await.text().await.unwrap();
    let series = exported(&metrics);

    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("ops");
    let dashboard = std::fs::read_to_string(root.join("grafana/seckill.json")).unwrap();
    let alerts = std::fs::read_to_string(root.join("prometheus/alerts.yml")).unwrap();
    // The dashboard's queries, from the JSON (not its titles or text).
    let board: serde_json::Value = serde_json::from_str(&dashboard).unwrap();
    let mut queries = Vec::new();
    for panel in board["panels"].as_array().unwrap() {
        for target in panel["targets"].as_array().unwrap() {
            queries.push(target["expr"].as_str().unwrap().to_owned());
        }
    }
    assert!(queries.len() >= 20, "the dashboard has its queries");
    let rules = alert_rules(&alerts);
    assert!(
        rules.len() >= 8,
        "the rules file has its rules ({})",
        rules.len()
    );

    let mut named = BTreeSet::new();
    let mut missing = Vec::new();
    for (file, text) in queries
        .iter()
        .map(|q| ("dashboard", q.as_str()))
        .chain(rules.iter().map(|(_, expr)| ("alerts", expr.as_str())))
    {
        for (name, matchers) in selectors(text) {
            named.insert(name.clone());
            let Some(samples) = series.get(&name) else {
                missing.push(format!("{file}: {name} is not exported"));
                continue;
            };
            for (k, v) in matchers {
                let pair = format!("{k}=\"{v}\"");
                if !samples
                    .iter()
                    .any(|labels| labels.split(',').any(|l| l == pair))
                {
                    missing.push(format!("{file}: no {name} sample has {pair}"));
                }
            }
        }
    }
    assert!(missing.is_empty(), "{missing:#?}");
    // The issue's list, by name: each is on the dashboard or in a rule.
    for needed in [
        "seckill_admission_total",
        "seckill_http_request_duration_seconds_bucket",
        "seckill_stock_units",
        "seckill_order_consumer_lag",
        "seckill_outbox_rows",
        "seckill_dead_letters_total",
        "seckill_orders_closed_total",
        "seckill_reconcile_total",
        "seckill_order_consumer_stalled_seconds",
        "seckill_event_conflicts_total",
        "seckill_waiting_room_queue_length",
        "seckill_waiting_room_admitted_total",
        "seckill_waiting_room_passes_outstanding",
        "seckill_waiting_room_offers_open",
        "seckill_waiting_room_pass_checks_total",
        "seckill_waiting_room_pow_total",
        "seckill_waiting_room_offers_total",
    ] {
        assert!(
            named.contains(needed),
            "{needed} is on no panel and in no rule"
        );
    }
}

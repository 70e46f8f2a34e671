//! The layer rule, checked on the source tree (CI runs it with the suite):
//!
//! - only the HTTP edge (`src/http/`) and the assembly (`app.rs`, and the
//!   binary) know HTTP: no other module names `crate::http`, `crate::app`,
//!   `crate::state` or `actix_web`;
//! - `state.rs` (the clients every handler shares) knows the domain but not
//!   the HTTP edge;
//! - `store/` (database and Redis connections, the schema) imports nothing
//!   above it but the settings.
//!
//! - the routes (`src/http/routes/`) make no Redis, Kafka or Diesel call
//!   of their own: they name none of those crates, open no transaction and
//!   send no query or script, and reach the stores only through the
//!   domain's functions (`store::run` over a repo function, a gate's
//!   method);
//!
//! - order states are named by `OrderStatus` (and payment states by
//!   `PaymentStatus`): no quoted state name in SQL or code outside the
//!   `status.rs` that defines them.
//!
//! The scan reads `crate::x` paths, grouped imports (`crate::{x, y}`)
//! included, and ignores comments.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

/// Every `.rs` file under `dir`, as paths relative to `src/`.
fn sources(root: &Path, dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("readable src/") {
        let path = entry.expect("dir entry").path();
        if path.is_dir() {
            sources(root, &path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path.strip_prefix(root).expect("under src/").to_owned());
        }
    }
}

/// The code of a line, without a trailing `//` comment (a `//` inside a
/// string literal is rare enough in `use` lines to be ignored).
fn code(line: &str) -> &str {
    let trimmed = line.trim_start();
    if trimmed.starts_with("//") {
        return "";
    }
    match line.find("//") {
        Some(at) if !line[..at].contains('"') => &line[..at],
        _ => line,
    }
}

/// The top-level modules of this crate a file's code names, and whether it
/// names `actix_web`.
fn dependencies(text: &str) -> (BTreeSet<String>, bool) {
    let code: String = text.lines().map(code).collect::<Vec<_>>().join("\n");
    let mut modules = BTreeSet::new();
    let mut rest = code.as_str();
    while let Some(at) = rest.find("crate::") {
        let after = &rest[at + "crate::".len()..];
        let preceded_by_ident = rest[..at]
            .chars()
            .next_back()
            .is_some_and(|c| c.is_alphanumeric() || c == '_');
        if !preceded_by_ident {
            if let Some(group) = after.strip_prefix('{') {
                let end = group.find('}').unwrap_or(group.len());
                // Top-level names of the group: before any `::` or `{`.
                let mut depth = 0;
                let mut name = String::new();
                for c in group[..end].chars() {
                    match c {
                        '{' => depth += 1,
                        '}' => depth -= 1,
                        ',' if depth == 0 => {
                            push_module(&mut modules, &name);
                            name.clear();
                        }
                        _ if depth == 0 => name.push(c),
                        _ => {}
                    }
                }
                push_module(&mut modules, &name);
            } else {
                push_module(&mut modules, after);
            }
        }
        rest = after;
    }
    (modules, code.contains("actix_web"))
}

fn push_module(modules: &mut BTreeSet<String>, path: &str) {
    let name: String = path
        .trim()
        .chars()
        .take_while(|c| c.is_alphanumeric() || *c == '_')
        .collect();
    if !name.is_empty() && name != "self" {
        modules.insert(name);
    }
}

/// What a route may not do itself: name a store's or the broker's crate,
/// or call them directly (a transaction, a query, a script, a send).
const STORE_CALLS: [&str; 10] = [
    "diesel",
    "redis::",
    "rdkafka",
    "deadpool",
    "redis_conn",
    "sql_query",
    ".transaction(",
    "query_async",
    "invoke_async",
    "send_result",
];

/// The direct store or broker calls a route file's code makes.
fn store_calls(file: &Path, text: &str) -> Vec<String> {
    if !file.starts_with("http/routes") {
        return Vec::new();
    }
    let code: String = text.lines().map(code).collect::<Vec<_>>().join("\n");
    STORE_CALLS
        .iter()
        .filter(|call| code.contains(*call))
        .map(|call| format!("a route calls `{call}` itself"))
        .collect()
}

/// Where a file sits: the top-level module it belongs to.
fn top_module(file: &Path) -> String {
    let first = file.components().next().expect("a path");
    first
        .as_os_str()
        .to_string_lossy()
        .trim_end_matches(".rs")
        .to_owned()
}

/// What the rule says `file` may not name, given what it names.
fn violations(file: &Path, modules: &BTreeSet<String>, actix: bool) -> Vec<String> {
    let top = top_module(file);
    let mut found = Vec::new();
    let edge = ["http", "app", "main"].contains(&top.as_str());
    if !edge {
        for above in ["http", "app"] {
            if modules.contains(above) {
                found.push(format!("names crate::{above}"));
            }
        }
        if top != "state" && modules.contains("state") {
            found.push("names crate::state".to_owned());
        }
        if actix {
            found.push("names actix_web".to_owned());
        }
    }
    if top == "store" {
        for m in modules {
            if m != "store" && m != "config" {
                found.push(format!("store/ names crate::{m}"));
            }
        }
    }
    found
}

/// The tree the rules read: this crate's `src/`, or `LAYERS_SRC` (to
/// check them against another checkout).
fn src_root() -> PathBuf {
    std::env::var_os("LAYERS_SRC")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("src"))
}

#[test]
fn only_the_http_edge_knows_http_and_the_store_knows_nothing_above_it() {
    let root = src_root();
    let mut files = Vec::new();
    sources(&root, &root, &mut files);
    assert!(files.len() > 20, "found only {} source files", files.len());
    let mut broken = Vec::new();
    for file in &files {
        let text = std::fs::read_to_string(root.join(file)).expect("readable source");
        let (modules, actix) = dependencies(&text);
        for v in violations(file, &modules, actix)
            .into_iter()
            .chain(store_calls(file, &text))
        {
            broken.push(format!("src/{}: {v}", file.display()));
        }
    }
    assert!(
        broken.is_empty(),
        "layer rule broken:\n{}",
        broken.join("\n")
    );
}

/// The rule's own checks: each kind of breach is caught, and what is
/// allowed passes.
#[test]
fn the_scan_catches_each_kind_of_breach() {
    let check = |file: &str, text: &str| {
        let (modules, actix) = dependencies(text);
        violations(Path::new(file), &modules, actix)
    };
    assert_eq!(
        check("orders/repo.rs", "use crate::http::error::ApiError;"),
        ["names crate::http"]
    );
    assert_eq!(
        check("orders/repo.rs", "use crate::{ids::OrderNo, app::{X, Y}};"),
        ["names crate::app"]
    );
    assert_eq!(
        check("reconcile/mod.rs", "fn f(s: crate::state::AppState) {}"),
        ["names crate::state"]
    );
    assert_eq!(
        check("payments/repo.rs", "use actix_web::web;"),
        ["names actix_web"]
    );
    assert_eq!(
        check(
            "store/mod.rs",
            "use crate::config::X;\nuse crate::orders::Y;"
        ),
        ["store/ names crate::orders"]
    );
    let route = |text: &str| store_calls(Path::new("http/routes/orders.rs"), text);
    assert_eq!(
        route("use diesel::Connection;\nconn.transaction(|c| f(c))"),
        [
            "a route calls `diesel` itself",
            "a route calls `.transaction(` itself"
        ]
    );
    assert_eq!(
        route("let n: i64 = redis::cmd(\"GET\").query_async(&mut c).await?;"),
        [
            "a route calls `redis::` itself",
            "a route calls `query_async` itself"
        ]
    );
    assert_eq!(
        route("producer.send_result(record)"),
        ["a route calls `send_result` itself"]
    );
    assert!(route("store::run(&state.pg.db, move |c| Ok(repo::mine(c, u)?))").is_empty());
    assert!(route("state.redis.gate.ping().await").is_empty());
    assert!(route("// no diesel:: here, a comment").is_empty());
    assert!(store_calls(Path::new("orders/repo.rs"), "use diesel::prelude::*;").is_empty());
    // Comments and the edge itself are fine.
    assert!(check("orders/repo.rs", "// see crate::http::routes").is_empty());
    assert!(check("http/routes/orders.rs", "use crate::state::AppState;").is_empty());
    assert!(check("app.rs", "use crate::http; use actix_web::App;").is_empty());
    assert!(check("state.rs", "use crate::orders::consumer::ConsumerDeps;").is_empty());
    assert!(check("store/mod.rs", "use crate::config::PostgresSettings;").is_empty());
}

/// The order states' names, as they would appear quoted in code or SQL.
const STATES: [&str; 6] = [
    "PROCESSING",
    "WAITING_PAY",
    "PAID",
    "CANCELLED",
    "CLOSED",
    "FAILED",
];

/// The quoted state names a file's code spells out.
fn state_literals(text: &str) -> Vec<String> {
    let code: String = text.lines().map(code).collect::<Vec<_>>().join("\n");
    let mut found = Vec::new();
    for state in STATES {
        for quote in ['"', '\''] {
            let literal = format!("{quote}{state}{quote}");
            if code.contains(&literal) {
                found.push(literal);
            }
        }
    }
    found
}

#[test]
fn order_states_are_named_only_by_their_enum() {
    let root = src_root();
    let mut files = Vec::new();
    sources(&root, &root, &mut files);
    let mut broken = Vec::new();
    for file in files.iter().filter(|f| !f.ends_with("status.rs")) {
        let text = std::fs::read_to_string(root.join(file)).expect("readable source");
        for literal in state_literals(&text) {
            broken.push(format!("src/{}: {literal}", file.display()));
        }
    }
    assert!(broken.is_empty(), "state literals:\n{}", broken.join("\n"));
    // The scan itself: SQL and Rust literals are caught, prose is not.
    assert_eq!(
        state_literals("sql(\"... WHERE status = 'WAITING_PAY'\")"),
        ["'WAITING_PAY'"]
    );
    assert_eq!(state_literals("if s == \"PAID\" {}"), ["\"PAID\""]);
    assert!(state_literals("bad_request(\"only a WAITING_PAY order\")").is_empty());
    assert!(state_literals("// \"CLOSED\" in a comment").is_empty());
}

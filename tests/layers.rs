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
//! - imports run one way between files: no file reaches itself through
//!   the files it imports from. A `mod.rs` and the files it declares are
//!   one unit and may name each other; a re-export (`pub use`) is followed
//!   to the file that defines the item.
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

/// A module's path below the crate root: `admission/gate/reserve.rs` is
/// `["admission", "gate", "reserve"]`, a `mod.rs` is its directory's.
fn module_of(file: &Path) -> Vec<String> {
    let mut path: Vec<String> = file
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    let last = path.pop().expect("a file name");
    match last.trim_end_matches(".rs") {
        "mod" | "lib" => {}
        name => path.push(name.to_owned()),
    }
    path
}

/// A file's code for the import scan: comments dropped, and its test
/// module cut off (tests may reach anywhere).
fn scanned(text: &str) -> String {
    let code: String = text.lines().map(code).collect::<Vec<_>>().join("\n");
    match code.find("#[cfg(test)]\nmod ") {
        Some(at) => code[..at].to_owned(),
        None => code,
    }
}

/// Expands one `use` tree (`a::{b, c::{d, e as f}}`) into its paths.
fn expand(tree: &str, prefix: &[String], out: &mut Vec<Vec<String>>) {
    let tree = tree.trim();
    let Some(open) = tree.find('{') else {
        let name = tree.split(" as ").next().unwrap_or(tree);
        let mut path = prefix.to_vec();
        path.extend(
            name.split("::")
                .map(str::trim)
                .filter(|s| !s.is_empty())
                .map(str::to_owned),
        );
        out.push(path);
        return;
    };
    let mut path = prefix.to_vec();
    path.extend(
        tree[..open]
            .split("::")
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(str::to_owned),
    );
    let inner = &tree[open + 1..tree.rfind('}').unwrap_or(tree.len())];
    let (mut depth, mut start) = (0, 0);
    for (i, c) in inner.char_indices() {
        match c {
            '{' => depth += 1,
            '}' => depth -= 1,
            ',' if depth == 0 => {
                expand(&inner[start..i], &path, out);
                start = i + 1;
            }
            _ => {}
        }
    }
    if !inner[start..].trim().is_empty() {
        expand(&inner[start..], &path, out);
    }
}

/// What a file imports: its `use` paths, each marked whether it is a
/// re-export (`pub use`), and its inline `crate::…`/`super::…` paths.
fn imports(code: &str) -> Vec<(Vec<String>, bool)> {
    let mut found = Vec::new();
    let mut in_use = vec![false; code.len()];
    let mut rest = 0;
    while let Some(at) = code[rest..].find("use ").map(|i| i + rest) {
        rest = at + 4;
        let before = code[..at].trim_end_matches([' ', '\t']);
        let (head, public) = match before.rsplit_once(['\n', ';', '{', '}']) {
            Some((_, head)) => (
                head.trim(),
                before.trim_end().ends_with(')') || head.contains("pub"),
            ),
            None => (before.trim(), before.contains("pub")),
        };
        let statement_start = head.is_empty() || head.starts_with("pub");
        let preceded = code[..at].chars().next_back();
        if !statement_start || preceded.is_some_and(|c| c.is_alphanumeric() || c == '_') {
            continue;
        }
        let Some(end) = code[at..].find(';').map(|i| i + at) else {
            break;
        };
        in_use[at..end].iter_mut().for_each(|b| *b = true);
        let mut paths = Vec::new();
        expand(&code[at + 4..end], &[], &mut paths);
        found.extend(paths.into_iter().map(|p| (p, public)));
        rest = end;
    }
    for root in ["crate::", "super::"] {
        inline_paths(code, root, &in_use, &mut found);
    }
    found
}

/// The inline paths of `code` that start with `root` (`crate::`,
/// `super::`, or a child module's `name::`), outside `use` statements.
fn inline_paths(code: &str, root: &str, in_use: &[bool], found: &mut Vec<(Vec<String>, bool)>) {
    {
        let mut rest = 0;
        while let Some(at) = code[rest..].find(root).map(|i| i + rest) {
            rest = at + root.len();
            let preceded = code[..at].chars().next_back();
            // `pub(in crate::x)` names where an item is seen, not an import.
            let visibility = code[..at].trim_end().ends_with("(in");
            if in_use[at]
                || visibility
                || preceded.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == ':')
            {
                continue;
            }
            let chain: String = code[at..]
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_' || *c == ':')
                .collect();
            let path: Vec<String> = chain
                .split("::")
                .filter(|s| !s.is_empty())
                .map(str::to_owned)
                .collect();
            found.push((path, false));
        }
    }
}

/// An import path made absolute (below the crate root) from the module
/// that names it, or `None` for another crate's path.
fn absolute(
    path: &[String],
    here: &[String],
    modules: &BTreeSet<Vec<String>>,
) -> Option<Vec<String>> {
    let first = path.first()?;
    let mut base: Vec<String>;
    let mut rest = path;
    match first.as_str() {
        "crate" => {
            base = Vec::new();
            rest = &path[1..];
        }
        "self" => {
            base = here.to_vec();
            rest = &path[1..];
        }
        "super" => {
            base = here.to_vec();
            while rest.first().is_some_and(|s| s == "super") {
                base.pop()?;
                rest = &rest[1..];
            }
        }
        child => {
            // A path relative to this module: only if it names a child.
            let mut probe = here.to_vec();
            probe.push(child.to_owned());
            if !modules.contains(&probe) {
                return None;
            }
            base = here.to_vec();
        }
    }
    base.extend(rest.iter().cloned());
    Some(base)
}

/// The file an absolute path lands in: the deepest module it names,
/// followed through that module's re-exports (`pub use child::Item`) to
/// the module that defines the item.
fn landing(
    path: &[String],
    files: &std::collections::BTreeMap<Vec<String>, PathBuf>,
    reexports: &std::collections::BTreeMap<Vec<String>, Vec<Vec<String>>>,
) -> Option<PathBuf> {
    let mut path = path.to_vec();
    for _ in 0..8 {
        let depth = (0..=path.len())
            .rev()
            .find(|&k| files.contains_key(&path[..k]))?;
        let module = path[..depth].to_vec();
        let Some(item) = path.get(depth) else {
            return files.get(&module).cloned();
        };
        let onward = reexports.get(&module).and_then(|targets| {
            targets
                .iter()
                .find(|t| t.last() == Some(item))
                .or_else(|| targets.iter().find(|t| t.last().is_some_and(|l| l == "*")))
        });
        match onward {
            Some(target) if target.last().is_some_and(|l| l == "*") => {
                let mut next = target[..target.len() - 1].to_vec();
                next.extend(path[depth..].iter().cloned());
                path = next;
            }
            Some(target) => {
                let mut next = target.clone();
                next.extend(path[depth + 1..].iter().cloned());
                path = next;
            }
            None => return files.get(&module).cloned(),
        }
    }
    None
}

/// A `mod.rs` and a file it declares (`mod child;`) are one unit: they
/// may name each other. Any other pair of files imports one way.
fn parent_and_child(a: &[String], b: &[String]) -> bool {
    let below = |x: &[String], y: &[String]| x.len() == y.len() + 1 && x.starts_with(y);
    below(a, b) || below(b, a)
}

/// The import graph between the files of `src/` (the library's: the
/// binary names the crate by name), as file → files it imports from.
fn import_graph(root: &Path) -> std::collections::BTreeMap<PathBuf, BTreeSet<PathBuf>> {
    use std::collections::BTreeMap;
    let mut list = Vec::new();
    sources(root, root, &mut list);
    list.retain(|f| f != Path::new("main.rs"));
    let files: BTreeMap<Vec<String>, PathBuf> =
        list.iter().map(|f| (module_of(f), f.clone())).collect();
    let modules: BTreeSet<Vec<String>> = files.keys().cloned().collect();
    let mut code_of = BTreeMap::new();
    let mut reexports: BTreeMap<Vec<String>, Vec<Vec<String>>> = BTreeMap::new();
    for file in &list {
        let here = module_of(file);
        let code = scanned(&std::fs::read_to_string(root.join(file)).expect("readable source"));
        for (path, public) in imports(&code) {
            if let (true, Some(target)) = (public, absolute(&path, &here, &modules)) {
                reexports.entry(here.clone()).or_default().push(target);
            }
        }
        code_of.insert(file.clone(), code);
    }
    let mut graph: BTreeMap<PathBuf, BTreeSet<PathBuf>> = BTreeMap::new();
    for file in &list {
        let here = module_of(file);
        let edges = graph.entry(file.clone()).or_default();
        let code = &code_of[file];
        let mut paths = imports(code);
        // A parent's calls into its children (`child::f()`) name no root.
        let outside_use = vec![false; code.len()];
        for child in modules
            .iter()
            .filter(|m| m.len() == here.len() + 1 && m.starts_with(&here))
        {
            let root = format!("{}::", child.last().expect("a child"));
            let mut inline = Vec::new();
            inline_paths(code, &root, &outside_use, &mut inline);
            paths.extend(inline.into_iter().map(|(mut p, public)| {
                p.insert(0, "self".to_owned());
                (p, public)
            }));
        }
        for (path, public) in paths {
            if public {
                continue; // a re-export passes through; its users are followed
            }
            let Some(target) = absolute(&path, &here, &modules) else {
                continue;
            };
            if let Some(to) = landing(&target, &files, &reexports)
                && &to != file
                && !parent_and_child(&here, &module_of(&to))
            {
                edges.insert(to);
            }
        }
    }
    graph
}

/// The circles of a graph: its strongly connected parts of more than one
/// file (Tarjan's algorithm).
fn circles(graph: &std::collections::BTreeMap<PathBuf, BTreeSet<PathBuf>>) -> Vec<Vec<PathBuf>> {
    use std::collections::BTreeMap;
    struct Walk<'a> {
        graph: &'a BTreeMap<PathBuf, BTreeSet<PathBuf>>,
        index: BTreeMap<&'a PathBuf, usize>,
        low: BTreeMap<&'a PathBuf, usize>,
        stack: Vec<&'a PathBuf>,
        on_stack: BTreeSet<&'a PathBuf>,
        found: Vec<Vec<PathBuf>>,
    }
    fn visit<'a>(w: &mut Walk<'a>, node: &'a PathBuf) {
        let n = w.index.len();
        w.index.insert(node, n);
        w.low.insert(node, n);
        w.stack.push(node);
        w.on_stack.insert(node);
        for next in w.graph.get(node).into_iter().flatten() {
            let Some((next, _)) = w.graph.get_key_value(next) else {
                continue;
            };
            if !w.index.contains_key(next) {
                visit(w, next);
                let low = w.low[node].min(w.low[next]);
                w.low.insert(node, low);
            } else if w.on_stack.contains(next) {
                let low = w.low[node].min(w.index[next]);
                w.low.insert(node, low);
            }
        }
        if w.low[node] == w.index[node] {
            let mut part = Vec::new();
            while let Some(top) = w.stack.pop() {
                w.on_stack.remove(top);
                part.push(top.clone());
                if top == node {
                    break;
                }
            }
            if part.len() > 1 {
                part.sort();
                w.found.push(part);
            }
        }
    }
    let mut walk = Walk {
        graph,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on_stack: BTreeSet::new(),
        found: Vec::new(),
    };
    for node in graph.keys() {
        if !walk.index.contains_key(node) {
            visit(&mut walk, node);
        }
    }
    walk.found
}

/// Imports run one way between the files of `src/`: no file reaches
/// itself through the files it imports from. A circle means neither side
/// can be read, tested or moved without the other.
#[test]
fn no_import_circle_between_files() {
    let graph = import_graph(&src_root());
    assert!(graph.len() > 20, "found only {} source files", graph.len());
    let found: Vec<String> = circles(&graph)
        .iter()
        .map(|part| {
            part.iter()
                .map(|f| {
                    let to: Vec<String> = graph[f]
                        .iter()
                        .filter(|t| part.contains(t))
                        .map(|t| t.display().to_string())
                        .collect();
                    format!("  {} -> {}", f.display(), to.join(", "))
                })
                .collect::<Vec<_>>()
                .join("\n")
        })
        .collect();
    assert!(
        found.is_empty(),
        "{} import circles:\n{}",
        found.len(),
        found.join("\n\n")
    );
}

/// The circle scan's own checks, on a made-up tree: a circle through a
/// re-export and an inline path is found; a parent and its child naming
/// each other, and a one-way chain, are not.
#[test]
fn the_circle_scan_catches_a_circle_through_re_exports() {
    let root = std::env::temp_dir().join(format!("layers-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let write = |path: &str, text: &str| {
        let path = root.join(path);
        std::fs::create_dir_all(path.parent().expect("a parent")).expect("a dir");
        std::fs::write(path, text).expect("written");
    };
    write("lib.rs", "pub mod a;\npub mod b;\npub mod c;\n");
    // a/mod.rs re-exports its child's item; b reaches it through a.
    write(
        "a/mod.rs",
        "mod inner;\npub use inner::Thing;\nuse super::c::Low;\n",
    );
    write(
        "a/inner.rs",
        "use super::Other;\nfn f() { crate::b::g(); }\n",
    );
    write("b.rs", "use crate::a::Thing;\npub fn g() {}\n");
    write("c.rs", "pub(in crate::b) struct Low;\n");
    let graph = import_graph(&root);
    let found = circles(&graph);
    assert_eq!(
        found,
        [vec![PathBuf::from("a/inner.rs"), PathBuf::from("b.rs")]],
        "{graph:?}"
    );
    // Cut the inline call: no circle is left.
    write("a/inner.rs", "use super::Other;\n");
    assert!(circles(&import_graph(&root)).is_empty());
    std::fs::remove_dir_all(&root).expect("removed");
}

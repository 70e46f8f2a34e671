//! Sizes a newcomer can read, checked on the tree (CI runs it with the
//! suite):
//!
//! - the README is one screen (8 KB) and BENCHMARKS.md one current table
//!   with its findings (20 KB);
//! - the pages a newcomer reads first stay readable in one sitting: the
//!   architecture (20 KB), the testing guide (12 KB) and the benchmarks'
//!   history (15 KB);
//! - all the prose under `docs/` stays under 150 KB;
//! - no source file in `src/` passes 700 lines.
//!
//! A page that needs more room is a sign that it holds two subjects, or a
//! diary the git log should keep.

use std::path::{Path, PathBuf};

const KB: u64 = 1024;

const PAGES: [(&str, u64); 5] = [
    ("README.md", 8 * KB),
    ("BENCHMARKS.md", 20 * KB),
    ("docs/ARCHITECTURE.md", 20 * KB),
    ("docs/TESTING.md", 12 * KB),
    ("docs/BENCHMARKS-HISTORY.md", 15 * KB),
];

const DOCS_TOTAL: u64 = 150 * KB;

const MAX_SOURCE_LINES: usize = 700;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Every file under `dir` whose name ends in `.ext`.
fn files(dir: &Path, ext: &str, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("readable directory") {
        let path = entry.expect("dir entry").path();
        if path.is_dir() {
            files(&path, ext, out);
        } else if path.extension().is_some_and(|e| e == ext) {
            out.push(path);
        }
    }
}

fn size(path: &Path) -> u64 {
    std::fs::metadata(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .len()
}

/// The pages over their limit, as "page: size > limit".
fn oversized(root: &Path, pages: &[(&str, u64)]) -> Vec<String> {
    pages
        .iter()
        .filter_map(|&(page, limit)| {
            let bytes = size(&root.join(page));
            (bytes > limit).then(|| format!("{page}: {bytes} bytes > {limit}"))
        })
        .collect()
}

/// The files over `max` lines, as "file: lines".
fn long_files(paths: &[PathBuf], max: usize) -> Vec<String> {
    paths
        .iter()
        .filter_map(|p| {
            let text = std::fs::read_to_string(p).expect("readable source");
            let lines = text.lines().count();
            (lines > max).then(|| format!("{}: {lines} lines", p.display()))
        })
        .collect()
}

#[test]
fn each_named_page_is_within_its_size() {
    let over = oversized(&root(), &PAGES);
    assert!(over.is_empty(), "pages over their size: {over:#?}");
}

#[test]
fn the_prose_under_docs_is_within_its_total() {
    let mut pages = Vec::new();
    files(&root().join("docs"), "md", &mut pages);
    assert!(pages.len() > 5, "docs/ holds {} pages", pages.len());
    let total: u64 = pages.iter().map(|p| size(p)).sum();
    assert!(
        total <= DOCS_TOTAL,
        "docs/*.md hold {total} bytes > {DOCS_TOTAL}"
    );
}

#[test]
fn no_source_file_passes_the_line_limit() {
    let mut sources = Vec::new();
    files(&root().join("src"), "rs", &mut sources);
    assert!(sources.len() > 50, "src/ holds {} files", sources.len());
    let long = long_files(&sources, MAX_SOURCE_LINES);
    assert!(
        long.is_empty(),
        "files over {MAX_SOURCE_LINES} lines: {long:#?}"
    );
}

/// The checks see what they are meant to: a page one byte over its limit
/// and a file one line over fail, and ones at the limit pass.
#[test]
fn the_checks_fail_one_over_the_limit() {
    let dir = std::env::temp_dir().join(format!("seckill-sizes-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("at.md"), "x".repeat(100)).unwrap();
    std::fs::write(dir.join("over.md"), "x".repeat(101)).unwrap();
    assert_eq!(
        oversized(&dir, &[("at.md", 100), ("over.md", 100)]),
        vec!["over.md: 101 bytes > 100".to_string()]
    );
    let at = dir.join("at.rs");
    let over = dir.join("over.rs");
    std::fs::write(&at, "fn f() {}\n".repeat(3)).unwrap();
    std::fs::write(&over, "fn f() {}\n".repeat(4)).unwrap();
    assert_eq!(long_files(&[at, over.clone()], 3).len(), 1);
    assert!(long_files(&[over], 3)[0].ends_with("4 lines"));
    std::fs::remove_dir_all(&dir).unwrap();
}

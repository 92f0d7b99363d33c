//! The shape of the source tree, checked: no module of a crate depends on a module that
//! depends back on it (directly or through others), and no source file (tests' too) grows past the size
//! a reader can hold, and every file is named in `docs/architecture.md`'s map. A cycle means
//! two rooms that cannot be understood, tested or moved apart; the fix is to move what both
//! need into a third. The size limit is a signal, not a rule for where to split: a file
//! splits where a concern ends. Beside them: the crates outside the workspace lock the workspace's versions.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Crate source folders, relative to the workspace root.
const CRATES: &[&str] = &[
    "agent/src",
    "agent/decide/src",
    "consensus/src",
    "daemon/src",
    "daemon/lab/src",
    "trainer/src",
    "snapshot/src",
    "deploy/src",
];

/// Lines a source file may have.
const MAX_LINES: usize = 800;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

/// Every module of a crate (`a::b`, the root is ``) and its file.
fn modules(src: &Path) -> BTreeMap<String, PathBuf> {
    let mut out = BTreeMap::new();
    let mut stack = vec![src.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for e in std::fs::read_dir(&dir).unwrap().flatten() {
            let p = e.path();
            if p.is_dir() {
                if p.file_name().is_some_and(|n| n != "bin") {
                    stack.push(p);
                }
                continue;
            }
            if p.extension().is_none_or(|x| x != "rs") {
                continue;
            }
            let rel = p.strip_prefix(src).unwrap().with_extension("");
            let mut parts: Vec<String> = rel.iter().map(|s| s.to_string_lossy().into_owned()).collect();
            if matches!(parts.last().map(String::as_str), Some("mod" | "lib" | "main")) {
                parts.pop();
            }
            out.insert(parts.join("::"), p);
        }
    }
    out
}

/// The code of a file without its unit tests (they may reach anywhere in the crate).
fn code(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap();
    match text.find("#[cfg(test)]\nmod tests") {
        Some(at) => text[..at].to_string(),
        None => text,
    }
}

/// The `a::b::c` paths following each occurrence of `prefix` in `text`.
fn paths_after<'a>(text: &'a str, prefix: &'a str) -> impl Iterator<Item = Vec<&'a str>> + 'a {
    text.match_indices(prefix).filter_map(move |(at, _)| {
        let before = text[..at].chars().next_back();
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_') {
            return None;
        }
        let rest = &text[at + prefix.len()..];
        let end =
            rest.find(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == ':')).unwrap_or(rest.len());
        let path: Vec<&str> = rest[..end].split("::").filter(|s| !s.is_empty()).collect();
        (!path.is_empty()).then_some(path)
    })
}

/// The longest module of `names` that `path` (from `base`) names.
fn resolve(names: &BTreeSet<String>, base: &[&str], path: &[&str]) -> Option<String> {
    (1..=path.len()).rev().find_map(|i| {
        let full: Vec<&str> = base.iter().chain(&path[..i]).copied().collect();
        let name = full.join("::");
        names.contains(&name).then_some(name)
    })
}

/// The module dependency graph of one crate (edges between a module and its own ancestors
/// or descendants do not count: a parent declares its children).
fn graph(src: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let mods = modules(src);
    let names: BTreeSet<String> = mods.keys().cloned().collect();
    let mut edges = BTreeMap::new();
    for (m, file) in &mods {
        let text = code(file);
        let me: Vec<&str> = m.split("::").filter(|s| !s.is_empty()).collect();
        let mut deps = BTreeSet::new();
        for path in paths_after(&text, "crate::") {
            deps.extend(resolve(&names, &[], &path));
        }
        // `super` is the parent module whichever file holds the module (`a/b.rs` or
        // `a/b/mod.rs` are both `a::b`, whose `super` is `a`).
        let up = &me[..me.len().saturating_sub(1)];
        for path in paths_after(&text, "super::") {
            deps.extend(resolve(&names, up, &path));
        }
        deps.retain(|d| {
            d != m
                && !m.starts_with(&format!("{d}::"))
                && !d.starts_with(&format!("{m}::"))
                && !d.is_empty()
                && !m.is_empty()
        });
        edges.insert(m.clone(), deps);
    }
    edges
}

/// Strongly connected components with more than one module (Tarjan).
fn cycles(g: &BTreeMap<String, BTreeSet<String>>) -> Vec<Vec<String>> {
    struct T<'a> {
        g: &'a BTreeMap<String, BTreeSet<String>>,
        index: BTreeMap<&'a str, usize>,
        low: BTreeMap<&'a str, usize>,
        stack: Vec<&'a str>,
        on: BTreeSet<&'a str>,
        out: Vec<Vec<String>>,
    }
    fn visit<'a>(t: &mut T<'a>, v: &'a str) {
        let i = t.index.len();
        t.index.insert(v, i);
        t.low.insert(v, i);
        t.stack.push(v);
        t.on.insert(v);
        for w in &t.g[v] {
            if !t.index.contains_key(w.as_str()) {
                visit(t, w);
                let lw = t.low[w.as_str()];
                let lv = t.low.get_mut(v).unwrap();
                *lv = (*lv).min(lw);
            } else if t.on.contains(w.as_str()) {
                let iw = t.index[w.as_str()];
                let lv = t.low.get_mut(v).unwrap();
                *lv = (*lv).min(iw);
            }
        }
        if t.low[v] == t.index[v] {
            let mut comp = Vec::new();
            loop {
                let w = t.stack.pop().unwrap();
                t.on.remove(w);
                comp.push(w.to_string());
                if w == v {
                    break;
                }
            }
            if comp.len() > 1 {
                comp.sort();
                t.out.push(comp);
            }
        }
    }
    let mut t = T {
        g,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on: BTreeSet::new(),
        out: Vec::new(),
    };
    for v in g.keys() {
        if !t.index.contains_key(v.as_str()) {
            visit(&mut t, v);
        }
    }
    t.out
}

#[test]
fn no_crate_has_a_module_cycle() {
    let mut found = Vec::new();
    for c in CRATES {
        for cycle in cycles(&graph(&root().join(c))) {
            found.push(format!("{c}: {}", cycle.join(" <-> ")));
        }
    }
    assert!(found.is_empty(), "module cycles:\n{}", found.join("\n"));
}

#[test]
fn the_checker_finds_a_cycle() {
    let g: BTreeMap<String, BTreeSet<String>> = [
        ("a".to_string(), BTreeSet::from(["b".to_string()])),
        ("b".to_string(), BTreeSet::from(["c".to_string()])),
        ("c".to_string(), BTreeSet::from(["a".to_string()])),
        ("d".to_string(), BTreeSet::from(["a".to_string()])),
    ]
    .into_iter()
    .collect();
    assert_eq!(cycles(&g), vec![vec!["a".to_string(), "b".to_string(), "c".to_string()]]);
}

/// Test folders, relative to the workspace root: their files are held to the same limit.
const TEST_DIRS: &[&str] = &[
    "tests",
    "agent/tests",
    "agent/decide/tests",
    "consensus/tests",
    "trainer/tests",
    "daemon/lab/tests",
    "snapshot/tests",
    "deploy/tests",
    "fuzz/fuzz_targets",
    "bench/synthetic/src",
];

#[test]
fn no_source_file_is_over_the_limit() {
    let mut long = Vec::new();
    let tests = TEST_DIRS.iter().filter(|d| root().join(d).is_dir());
    for c in CRATES.iter().chain(tests) {
        for (_, file) in modules(&root().join(c)) {
            let n = std::fs::read_to_string(&file).unwrap().lines().count();
            if n > MAX_LINES {
                long.push(format!("{} ({n} lines)", file.display()));
            }
        }
    }
    assert!(long.is_empty(), "files over {MAX_LINES} lines:\n{}", long.join("\n"));
}

/// A user's clone has nothing beside it: no tracked file names a folder outside the
/// repository (the traces limpet uses ship in `daemon/traces/`).
#[test]
fn no_tracked_file_reaches_outside_the_clone() {
    let outside = ["..", "/shared"].concat();
    let out = std::process::Command::new("git")
        .args(["ls-files", "-z"])
        .current_dir(root())
        .output()
        .expect("git, to list the tracked files");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let offenders: Vec<String> = String::from_utf8_lossy(&out.stdout)
        .split('\0')
        .filter(|f| !f.is_empty())
        .filter(|f| {
            std::fs::read(root().join(f)).is_ok_and(|b| String::from_utf8_lossy(&b).contains(&outside))
        })
        .map(String::from)
        .collect();
    assert!(offenders.is_empty(), "tracked files name {outside}: {offenders:?}");
}

/// The map of the source tree stays true: every source file (tests' and fuzz targets' too)
/// is named, by its path from the repository's root, in `docs/architecture.md`, which says
/// what each room owns. A new file without a line there fails here.
#[test]
fn every_source_file_is_named_in_the_architecture_map() {
    let map = std::fs::read_to_string(root().join("docs/architecture.md")).unwrap();
    let mut unnamed = Vec::new();
    let tests = TEST_DIRS.iter().filter(|d| root().join(d).is_dir());
    for c in CRATES.iter().chain(tests) {
        let mut stack = vec![root().join(c)];
        while let Some(dir) = stack.pop() {
            for e in std::fs::read_dir(&dir).unwrap().flatten() {
                let p = e.path();
                if p.is_dir() {
                    stack.push(p);
                } else if p.extension().is_some_and(|x| x == "rs") {
                    let rel = p.strip_prefix(root()).unwrap().to_string_lossy().into_owned();
                    if !map.contains(&format!("`{rel}`")) {
                        unnamed.push(rel);
                    }
                }
            }
        }
    }
    unnamed.sort();
    assert!(
        unnamed.is_empty(),
        "source files docs/architecture.md does not name (add a line to its map):\n{}",
        unnamed.join("\n")
    );
}

/// Each package's versions in a Cargo.lock.
fn locked(path: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let text = std::fs::read_to_string(path).unwrap();
    let mut out: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for pkg in text.split("[[package]]").skip(1) {
        let field = |k: &str| {
            pkg.lines().find_map(|l| l.strip_prefix(k)).map(|v| v.trim().trim_matches('"').to_string())
        };
        if let (Some(name), Some(version)) = (field("name = "), field("version = ")) {
            out.entry(name).or_default().insert(version);
        }
    }
    out
}

/// The crates outside the workspace (the fuzz crate, the synthetic agent) lock only versions
/// the workspace's lock holds of every package they share with it (they use fewer), so their
/// builds in the workspace's target directory reuse its build scripts' runs (libtorch's and
/// aws-lc's C++ among them) rather than building other versions. After `cargo update`: copy
/// Cargo.lock over theirs and let cargo prune it and add what is theirs
/// (`cargo metadata --manifest-path fuzz/Cargo.toml`, likewise bench/synthetic).
#[test]
fn the_outside_crates_locks_pin_the_workspaces_versions() {
    let ws = locked(&root().join("Cargo.lock"));
    for (lock, own) in
        [("fuzz/Cargo.lock", "libfuzzer-sys"), ("bench/synthetic/Cargo.lock", "limpet-synthetic")]
    {
        let theirs = locked(&root().join(lock));
        let differ: Vec<String> = theirs
            .iter()
            .filter_map(|(name, v)| {
                ws.get(name).filter(|w| !v.is_subset(w)).map(|w| format!("{name}: {v:?}, workspace {w:?}"))
            })
            .collect();
        assert!(differ.is_empty(), "{lock} has versions Cargo.lock has not:\n{}", differ.join("\n"));
        assert!(theirs.contains_key(own) && theirs.contains_key("tokio"), "{lock}: {:?}", theirs.keys());
    }
}

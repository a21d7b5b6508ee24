//! No module of the crate imports one that imports it back: the `crate::`
//! and `super::` paths of every source file (tests left out), as edges
//! between modules, hold no cycle. A module using its own ancestors or
//! descendants does not count (a parent declares its children), but a
//! child that imports a module importing its parent closes a cycle.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// Module path (`communicator::world`) of every source file under `dir`.
fn modules(dir: &Path, prefix: &[String], out: &mut BTreeMap<String, String>) {
    for entry in std::fs::read_dir(dir).expect("the source folder reads") {
        let path = entry.expect("an entry").path();
        let name = path.file_stem().and_then(|s| s.to_str()).expect("a file name").to_string();
        if path.is_dir() {
            modules(&path, &[prefix, &[name]].concat(), out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            let module = if name == "mod" || name == "lib" { prefix.to_vec() } else { [prefix, &[name]].concat() };
            let text = std::fs::read_to_string(&path).expect("a source file reads");
            out.insert(module.join("::"), text);
        }
    }
}

/// The longest known module a path names, from module `here`.
fn resolve(known: &BTreeMap<String, String>, here: &str, path: &[&str]) -> Option<String> {
    let mut base: Vec<&str> = if here.is_empty() { Vec::new() } else { here.split("::").collect() };
    let rest = match path[0] {
        "crate" => {
            base.clear();
            &path[1..]
        }
        "super" => {
            let supers = path.iter().take_while(|p| **p == "super").count();
            base.truncate(base.len().saturating_sub(supers));
            &path[supers..]
        }
        _ => return None,
    };
    (0..=rest.len()).rev().map(|i| [&base[..], &rest[..i]].concat().join("::")).find(|m| known.contains_key(m))
}

fn related(a: &str, b: &str) -> bool {
    a.is_empty() || b.is_empty() || a == b || a.starts_with(&format!("{b}::")) || b.starts_with(&format!("{a}::"))
}

#[test]
fn no_module_imports_one_that_imports_it_back() {
    let mut known = BTreeMap::new();
    modules(&Path::new(env!("CARGO_MANIFEST_DIR")).join("src"), &[], &mut known);
    let mut edges: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (module, text) in &known {
        // Test modules may use anything.
        let code = text.split("#[cfg(test)]").next().unwrap_or_default();
        for word in code.split(|c: char| !(c.is_alphanumeric() || c == '_' || c == ':')) {
            let path: Vec<&str> = word.split("::").filter(|p| !p.is_empty()).collect();
            if path.len() < 2 || !matches!(path[0], "crate" | "super") {
                continue;
            }
            if let Some(target) = resolve(&known, module, &path).filter(|t| !related(module, t)) {
                edges.entry(module.clone()).or_default().insert(target);
            }
        }
    }
    // Depth-first search for a path back to where it started (or to one of
    // its ancestors or descendants): a module goes on with its own edges
    // and its descendants'.
    fn back(edges: &BTreeMap<String, BTreeSet<String>>, from: &str, to: &str, seen: &mut BTreeSet<String>) -> bool {
        let below = format!("{from}::");
        let onward = edges.iter().filter(|(m, _)| *m == from || m.starts_with(&below)).flat_map(|(_, e)| e);
        // Edges inside `from`'s own subtree lead nowhere new.
        let onward: Vec<&String> = onward.filter(|next| !related(next, from)).collect();
        onward.into_iter().any(|next| related(next, to) || (seen.insert(next.clone()) && back(edges, next, to, seen)))
    }
    let cycles: Vec<&String> = edges.keys().filter(|m| back(&edges, m, m, &mut BTreeSet::new())).collect();
    assert!(cycles.is_empty(), "these modules sit on import cycles: {cycles:?}\nedges: {edges:#?}");
    assert!(edges.get("communicator::world").is_some_and(|e| e.contains("communicator::keys")), "{edges:#?}");
}

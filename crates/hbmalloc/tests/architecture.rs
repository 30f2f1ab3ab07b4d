//! The engine's modules form a DAG (`ARCHITECTURE.md`): read from the
//! sources, outside unit tests and comments, no module reaches a module that
//! reaches back to it, and nothing imports through `lib.rs`'s re-exports.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// Top-level module name -> the top-level modules its non-test code names.
fn module_imports() -> BTreeMap<String, BTreeSet<String>> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut imports: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let mut pending = vec![src.clone()];
    while let Some(dir) = pending.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                pending.push(path);
                continue;
            }
            let relative = path.strip_prefix(&src).unwrap();
            let top = relative
                .components()
                .next()
                .unwrap()
                .as_os_str()
                .to_string_lossy()
                .trim_end_matches(".rs")
                .to_string();
            if top == "lib" || relative.ends_with("tests.rs") {
                continue;
            }
            let text = std::fs::read_to_string(&path).unwrap();
            let code = text.split("#[cfg(test)]\nmod tests").next().unwrap();
            let names = imports.entry(top.clone()).or_default();
            for line in code.lines().filter(|l| !l.trim_start().starts_with("//")) {
                assert!(
                    !line.contains("use crate::{") && !line.contains("use crate::*"),
                    "{}: imports through lib.rs: {line}",
                    relative.display()
                );
                for (i, _) in line.match_indices("crate::") {
                    let name: String = line[i + 7..]
                        .chars()
                        .take_while(|c| c.is_ascii_lowercase() || *c == '_')
                        .collect();
                    if !name.is_empty() && name != top {
                        names.insert(name);
                    }
                }
            }
        }
    }
    imports
}

#[test]
fn engine_modules_import_without_a_cycle() {
    let imports = module_imports();
    assert!(imports.contains_key("allocator") && imports.contains_key("device"));
    for start in imports.keys() {
        let mut seen = BTreeSet::new();
        let mut stack: Vec<&String> = imports[start].iter().collect();
        while let Some(module) = stack.pop() {
            assert_ne!(module, start, "{start} reaches itself through its imports");
            if seen.insert(module.clone()) {
                stack.extend(imports.get(module).into_iter().flatten());
            }
        }
    }
}

#[test]
fn the_leaves_import_nothing_above_them() {
    let imports = module_imports();
    for leaf in ["device", "format", "fastmap", "sync", "stats"] {
        assert!(
            imports[leaf].is_empty(),
            "{leaf} imports {:?}",
            imports[leaf]
        );
    }
    assert_eq!(
        imports["error"],
        BTreeSet::from(["device".to_string(), "format".to_string()])
    );
}

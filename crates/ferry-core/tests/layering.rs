//! ferry-core's dependency rule, checked on its sources. The crate reads bottom-up: error -> loader, kv, moe (pure
//! logic) -> backend -> model -> engine; a file names modules of its own tier or lower only, whether through
//! `crate::` paths (grouped or not) or `super::` chains that climb to the crate root. And nothing under moe/
//! mentions CUDA, not even in a comment: the expert cache's logic is the same whatever backend applies it.

use std::path::{Path, PathBuf};

/// ferry-core's top-level modules and their tiers, lowest first. Names not listed (the root's re-exports of
/// `Error` and `Result`) count as the lowest tier.
const TIERS: [(&str, u32); 7] = [
    ("error", 0),
    ("loader", 1),
    ("kv", 1),
    ("moe", 1),
    ("backend", 2),
    ("model", 3),
    ("engine", 4),
];

fn tier(module: &str) -> u32 {
    TIERS
        .iter()
        .find(|(name, _)| *name == module)
        .map_or(0, |&(_, tier)| tier)
}

/// Every .rs file under `dir`, with its module path (`backend/cuda/mod.rs` -> `["backend", "cuda"]`).
fn sources(dir: &Path, module: &[String], out: &mut Vec<(PathBuf, Vec<String>)>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_stem().unwrap().to_string_lossy().into_owned();
        let mut inner = module.to_vec();
        if path.is_dir() {
            inner.push(name);
            sources(&path, &inner, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            if name != "mod" && name != "lib" {
                inner.push(name);
            }
            out.push((path, inner));
        }
    }
}

fn is_ident(c: char) -> bool {
    c.is_alphanumeric() || c == '_'
}

/// The identifier at the start of `text`.
fn ident(text: &str) -> &str {
    &text[..text.find(|c: char| !is_ident(c)).unwrap_or(text.len())]
}

/// The top-level modules that the code of the file at `module` names (comments aside): the segment after each
/// `crate::`, each item's first segment in a `crate::{...}` group, and the segment a `super::` chain long enough to
/// leave the file's module tree reaches.
fn named_modules(source: &str, module: &[String]) -> Vec<String> {
    let code: String = source
        .lines()
        .map(|line| line.split("//").next().unwrap_or(""))
        .collect::<Vec<_>>()
        .join("\n");
    let mut named = Vec::new();
    let mut after_root = Vec::new();
    let starts = |pattern: &'static str| {
        code.match_indices(pattern)
            .filter(|&(at, _)| !code[..at].ends_with(is_ident))
            .map(move |(at, _)| at + pattern.len())
    };
    after_root.extend(starts("crate::"));
    for mut at in starts("super::") {
        let mut climbs = 1;
        while code[at..].starts_with("super::") {
            at += "super::".len();
            climbs += 1;
        }
        // `super` from a file's module leaves its parent; climbing past every ancestor reaches the crate root.
        if climbs >= module.len() && !code[..at - climbs * "super::".len()].ends_with("super::") {
            after_root.push(at);
        }
    }
    for at in after_root {
        let rest = &code[at..];
        if let Some(group) = rest.strip_prefix('{') {
            let mut depth = 0;
            let mut item_start = true;
            for (i, c) in group.char_indices() {
                match c {
                    '{' => depth += 1,
                    '}' if depth == 0 => break,
                    '}' => depth -= 1,
                    ',' if depth == 0 => item_start = true,
                    c if item_start && is_ident(c) => {
                        named.push(ident(&group[i..]).to_string());
                        item_start = false;
                    }
                    _ => {}
                }
            }
        } else {
            named.push(ident(rest).to_string());
        }
    }
    named
}

/// What the file at `module` names above its own tier.
fn violations(source: &str, module: &[String]) -> Vec<String> {
    let own = module.first().map_or(0, |m| tier(m));
    named_modules(source, module)
        .into_iter()
        .filter(|named| tier(named) > own)
        .collect()
}

fn module(path: &str) -> Vec<String> {
    path.split('/').map(String::from).collect()
}

#[test]
fn every_module_names_only_modules_of_its_tier_or_below() {
    let mut files = Vec::new();
    sources(&Path::new(env!("CARGO_MANIFEST_DIR")).join("src"), &[], &mut files);
    assert!(files.len() > 20, "found only {} sources", files.len());
    let mut broken = Vec::new();
    for (path, module) in &files {
        let source = std::fs::read_to_string(path).unwrap();
        for named in violations(&source, module) {
            broken.push(format!("{} names {named}", path.display()));
        }
        if module.first().is_some_and(|m| m == "moe") && source.to_lowercase().contains("cuda") {
            broken.push(format!("{} mentions CUDA", path.display()));
        }
    }
    assert!(broken.is_empty(), "the layering rule is broken:\n{}", broken.join("\n"));
}

#[test]
fn the_check_sees_plain_grouped_and_climbing_paths() {
    let cache = module("moe/cache");
    assert_eq!(violations("use crate::engine::MAX_BATCH_TOKENS;", &cache), ["engine"]);
    assert_eq!(
        violations("use crate::{kv::KvSpec, model::{ModelSpec, MoeSpec}, Error};", &cache),
        ["model"]
    );
    assert_eq!(
        violations("let b = super::super::backend::cpu::CpuBackend;", &cache),
        ["backend"]
    );
    // Within the module's own tree, and in comments, nothing counts.
    assert!(violations("use super::policy::Lru; // not crate::engine", &cache).is_empty());
    assert!(violations("use super::ExpertTensors;", &module("backend/cuda/offload")).is_empty());
    assert!(violations("use crate::{moe::Plan, Error, Result};", &module("backend/cuda")).is_empty());
    assert_eq!(
        violations("use crate::model::ModelSpec;", &module("backend/cuda")),
        ["model"]
    );
}

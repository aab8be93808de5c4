//! The kernel table against the sources, without a GPU: the kernels ferry-kernels compiles (every
//! `extern "C" __global__` of `cuda/*.cu`), the ones `load_kernels` loads ([`KERNELS`]) and the ones the backend
//! launches by name (`kernel!`'s `struct X = "name"`, a name given to `launch_kernel`, `copy_rows`, `function` or
//! `allow_shared_bytes`) must be the same set. A loaded name with no kernel fails `CudaBackend::new`, so every GPU
//! test; a compiled kernel nothing launches is dead code.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use super::{attention, flash_attention, linear, KERNELS};

fn crate_dir() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn kernel_source(module: &str) -> PathBuf {
    crate_dir().join(format!("../ferry-kernels/cuda/{module}.cu"))
}

/// C/C++ `source` without its comments (kernel sources hold no string with a comment marker in it).
fn strip_c_comments(source: &str) -> String {
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while let Some(start) = rest.find('/') {
        out.push_str(&rest[..start]);
        let tail = &rest[start..];
        if tail.starts_with("//") {
            rest = &tail[tail.find('\n').unwrap_or(tail.len())..];
        } else if tail.starts_with("/*") {
            rest = &tail[tail.find("*/").map_or(tail.len(), |end| end + 2)..];
        } else {
            out.push('/');
            rest = &tail[1..];
        }
    }
    out.push_str(rest);
    out
}

fn identifier_prefix(text: &str) -> &str {
    let end = text
        .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == '#'))
        .unwrap_or(text.len());
    &text[..end]
}

/// The names of the `__global__` functions `code` defines, as written (a macro's may hold `##`); an error for one
/// that is not `extern "C"`, whose name the driver could not find.
fn defined_kernels(code: &str) -> Result<Vec<String>, String> {
    let mut names = Vec::new();
    for (at, _) in code.match_indices("__global__") {
        let mut rest = code[at + "__global__".len()..].trim_start();
        rest = rest.strip_prefix("void").unwrap_or(rest).trim_start();
        if let Some(bounds) = rest.strip_prefix("__launch_bounds__") {
            let close = bounds.find(')').ok_or("unclosed __launch_bounds__")?;
            rest = bounds[close + 1..].trim_start();
        }
        let name = identifier_prefix(rest).to_string();
        if !code[..at].trim_end().ends_with("extern \"C\"") {
            return Err(format!("kernel {name} is not extern \"C\""));
        }
        names.push(name);
    }
    Ok(names)
}

/// Every kernel a `.cu` source defines, those that a function-like macro defines (`#define M(P, Q) ... __global__
/// ... name_##P##_##Q(`) named once per line `M(a, b)` that instantiates it.
fn compiled_kernels(source: &str) -> Result<BTreeSet<String>, String> {
    let code = strip_c_comments(source).replace("\\\n", " ");
    let (defines, lines): (Vec<&str>, Vec<&str>) = code.lines().partition(|l| l.trim_start().starts_with("#define"));
    let body = lines.join("\n");
    let mut kernels: BTreeSet<String> = defined_kernels(&body)?.into_iter().collect();
    let split = |list: &str| list.split(',').map(|p| p.trim().to_string()).collect::<Vec<_>>();
    for define in defines {
        let head = define.trim_start()["#define".len()..].trim_start();
        let macro_name = identifier_prefix(head);
        let Some(params) = head[macro_name.len()..].strip_prefix('(') else {
            continue;
        };
        let params = split(&params[..params.find(')').ok_or("unclosed macro parameters")?]);
        for template in defined_kernels(define)? {
            for line in &lines {
                let Some(args) = line.trim().strip_prefix(macro_name).and_then(|a| a.strip_prefix('(')) else {
                    continue;
                };
                let args = split(args.strip_suffix(')').ok_or_else(|| format!("cannot read {line:?}"))?);
                if args.len() != params.len() {
                    return Err(format!("{line:?} gives {macro_name} {} arguments", args.len()));
                }
                let mut name = template.clone();
                for (param, arg) in params.iter().zip(&args) {
                    name = name
                        .replace(&format!("##{param}"), arg)
                        .replace(&format!("{param}##"), arg);
                }
                kernels.insert(name.replace("##", ""));
            }
        }
    }
    Ok(kernels)
}

/// The string literals `text` starts with, up to its first `)`: the arguments of a call.
fn literal_arguments(text: &str) -> Vec<String> {
    let args = &text[..text.find(')').unwrap_or(text.len())];
    args.split('"').skip(1).step_by(2).map(str::to_string).collect()
}

/// The `.rs` files under `dir`, in its subdirectories too, test modules (`tests.rs`, this file) left out.
fn rust_sources(dir: &Path) -> Vec<PathBuf> {
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            files.extend(rust_sources(&path));
        } else if path.extension().is_some_and(|e| e == "rs") && !path.ends_with("tests.rs") {
            files.push(path);
        }
    }
    files
}

/// The kernel names the backend's sources give a launch, comments skipped.
fn launched_kernels() -> BTreeSet<String> {
    // Kernels picked by a name the launch site formats: each module lists them.
    let listed = linear::GEMV_KERNELS
        .iter()
        .chain(&flash_attention::FLASH_KERNELS)
        .chain(&attention::ATTENTION_KERNELS);
    let mut names: BTreeSet<String> = listed.map(|s| s.to_string()).collect();
    for path in rust_sources(&crate_dir().join("src/backend/cuda")) {
        let source = std::fs::read_to_string(&path).unwrap();
        let code: String = source
            .lines()
            .filter(|l| !l.trim_start().starts_with("//"))
            .collect::<Vec<_>>()
            .join("\n");
        for (at, _) in code.match_indices("struct ") {
            let rest = &code[at + "struct ".len()..];
            let rest = rest[identifier_prefix(rest).len()..].trim_start();
            if let Some(literal) = rest.strip_prefix("= \"") {
                names.insert(literal[..literal.find('"').unwrap()].to_string());
            }
        }
        for call in ["launch_kernel(", "copy_rows(", ".function(", "allow_shared_bytes("] {
            for (at, _) in code.match_indices(call) {
                names.extend(literal_arguments(&code[at + call.len()..]));
            }
        }
    }
    names
}

fn loaded_kernels() -> BTreeSet<String> {
    let mut loaded = BTreeSet::new();
    for (_, names) in KERNELS {
        for name in *names {
            assert!(loaded.insert(name.to_string()), "kernel {name} is loaded twice");
        }
    }
    loaded
}

#[test]
fn every_loaded_kernel_is_compiled_in_its_module_and_every_compiled_one_loaded() {
    let mut modules: Vec<String> = std::fs::read_dir(crate_dir().join("../ferry-kernels/cuda"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "cu"))
        .map(|p| p.file_stem().unwrap().to_string_lossy().into_owned())
        .collect();
    modules.sort();
    let mut loaded_modules: Vec<String> = KERNELS.iter().map(|(m, _)| m.to_string()).collect();
    loaded_modules.sort();
    assert_eq!(loaded_modules, modules, "KERNELS must name each cuda/*.cu module once");
    for (module, names) in KERNELS {
        let source = std::fs::read_to_string(kernel_source(module)).unwrap();
        let compiled = compiled_kernels(&source).unwrap_or_else(|e| panic!("{module}.cu: {e}"));
        let loaded: BTreeSet<String> = names.iter().map(|s| s.to_string()).collect();
        let missing: Vec<_> = loaded.difference(&compiled).collect();
        let unloaded: Vec<_> = compiled.difference(&loaded).collect();
        assert!(
            missing.is_empty(),
            "loaded from {module} but not in {module}.cu: {missing:?}"
        );
        assert!(unloaded.is_empty(), "in {module}.cu but never loaded: {unloaded:?}");
    }
}

#[test]
fn every_launched_kernel_is_loaded_and_every_loaded_one_launched() {
    let loaded = loaded_kernels();
    let launched = launched_kernels();
    let not_loaded: Vec<_> = launched.difference(&loaded).collect();
    let never_launched: Vec<_> = loaded.difference(&launched).collect();
    assert!(not_loaded.is_empty(), "launched but not in KERNELS: {not_loaded:?}");
    assert!(
        never_launched.is_empty(),
        "in KERNELS but never launched: {never_launched:?}"
    );
}

#[test]
fn kernel_names_are_read_from_macros_and_launch_bounds() {
    let source = r#"
        // extern "C" __global__ void commented_out(int x) {}
        extern "C" __global__ void __launch_bounds__(WARPS * 32)
            bounded(int x) {}
        extern "C" __global__ void plain(int x) {}
        #define MAKE(N) \
            extern "C" __global__ void made_##N(int x) { body<N>(x); }
        MAKE(1)
        MAKE(2)
    "#;
    let names: Vec<String> = compiled_kernels(source).unwrap().into_iter().collect();
    assert_eq!(names, ["bounded", "made_1", "made_2", "plain"]);
    let mangled = "__global__ void lost(int x) {}";
    assert_eq!(
        compiled_kernels(mangled).unwrap_err(),
        "kernel lost is not extern \"C\""
    );
}

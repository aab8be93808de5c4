//! Compiles every `cuda/*.cu` into a fatbin (sm_80, sm_86, sm_89, sm_90a, sm_120 machine code plus compute_80 PTX
//! for newer GPUs) and embeds it. nvcc is found at `$NVCC`, `$CUDA_HOME/bin`, on PATH, or in the repository's
//! `.cuda-toolchain/` (scripts/install-cuda-toolchain.sh). Without nvcc the crate still builds, with no kernels
//! and a warning; the binary then says at run time how to get them.

use std::path::{Path, PathBuf};
use std::process::Command;

const GENCODES: &[&str] = &[
    "arch=compute_80,code=sm_80",
    "arch=compute_86,code=sm_86",
    "arch=compute_89,code=sm_89",
    "arch=compute_90a,code=sm_90a",
    "arch=compute_120,code=sm_120",
    "arch=compute_80,code=compute_80",
];

fn find_nvcc(repo: &Path) -> Option<PathBuf> {
    let works = |p: &Path| {
        Command::new(p)
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success())
    };
    let mut candidates: Vec<PathBuf> = Vec::new();
    if let Some(p) = std::env::var_os("NVCC") {
        candidates.push(p.into());
    }
    if let Some(home) = std::env::var_os("CUDA_HOME") {
        candidates.push(Path::new(&home).join("bin/nvcc"));
    }
    candidates.push("nvcc".into());
    candidates.push(repo.join(".cuda-toolchain/nvidia/cu13/bin/nvcc"));
    candidates.into_iter().find(|p| works(p))
}

fn main() {
    let crate_dir = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").unwrap());
    let repo = crate_dir.join("../..");
    let out_dir = PathBuf::from(std::env::var("OUT_DIR").unwrap());
    let cuda_dir = crate_dir.join("cuda");
    println!("cargo:rerun-if-env-changed=NVCC");
    println!("cargo:rerun-if-env-changed=CUDA_HOME");
    println!("cargo:rerun-if-changed=cuda");
    println!("cargo:rerun-if-changed=../../.cuda-toolchain/nvidia/cu13/bin/nvcc");

    let mut sources: Vec<PathBuf> = std::fs::read_dir(&cuda_dir)
        .expect("crates/ferry-kernels/cuda")
        .map(|e| e.expect("readable cuda dir").path())
        .filter(|p| p.extension().is_some_and(|x| x == "cu"))
        .collect();
    sources.sort();

    let mut table =
        String::from("/// (module name, fatbin) for every kernel module.\npub const MODULES: &[(&str, &[u8])] = &[\n");
    match find_nvcc(&repo) {
        Some(nvcc) => {
            for source in &sources {
                let name = source.file_stem().unwrap().to_str().unwrap();
                let fatbin = out_dir.join(format!("{name}.fatbin"));
                let mut cmd = Command::new(&nvcc);
                cmd.arg("-fatbin")
                    .arg("-O3")
                    .arg("-std=c++17")
                    .arg("-o")
                    .arg(&fatbin)
                    .arg(source);
                for gencode in GENCODES {
                    cmd.arg("-gencode").arg(gencode);
                }
                let status = cmd
                    .status()
                    .unwrap_or_else(|e| panic!("running {}: {e}", nvcc.display()));
                assert!(status.success(), "nvcc failed on {}", source.display());
                table.push_str(&format!("    (\"{name}\", include_bytes!({:?})),\n", fatbin));
            }
        }
        None => {
            println!(
                "cargo:warning=nvcc not found ($NVCC, $CUDA_HOME/bin, PATH, .cuda-toolchain): building ferry without \
                 CUDA kernels; run scripts/install-cuda-toolchain.sh and rebuild for GPU support"
            );
        }
    }
    table.push_str("];\n");
    std::fs::write(out_dir.join("modules.rs"), table).unwrap();
}

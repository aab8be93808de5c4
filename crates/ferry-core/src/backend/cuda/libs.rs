//! Finding the CUDA driver and cuBLAS at run time. The binary links none of them, so it builds and runs on
//! machines without CUDA; when a GPU is asked for, the libraries are looked up here (CUDA_HOME, the usual
//! /usr/local/cuda*, the system linker's path, Python's nvidia-* wheels) and loaded before cudarc touches them,
//! so a missing library is an error that lists where we looked, not cudarc's panic.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use crate::{Error, Result};

/// The libraries loaded, by path, for the log.
#[derive(Clone, Debug)]
pub struct CudaLibraries {
    pub driver: String,
    pub cublas: String,
    pub cublas_lt: String,
}

fn search_dirs() -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = Vec::new();
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Some(home) = std::env::var_os(var) {
            dirs.push(Path::new(&home).join("lib64"));
            dirs.push(Path::new(&home).join("lib"));
        }
    }
    if let Some(paths) = std::env::var_os("LD_LIBRARY_PATH") {
        dirs.extend(std::env::split_paths(&paths));
    }
    let mut cuda_installs: Vec<PathBuf> = std::fs::read_dir("/usr/local")
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("cuda"))
        })
        .collect();
    cuda_installs.sort();
    cuda_installs.reverse();
    dirs.extend(cuda_installs.into_iter().map(|p| p.join("lib64")));
    dirs.extend(
        [
            "/usr/lib/x86_64-linux-gnu",
            "/usr/lib64",
            "/usr/lib",
            "/usr/local/nvidia/lib64",
        ]
        .map(PathBuf::from),
    );
    dirs.extend(python_nvidia_lib_dirs());
    dirs
}

/// `site-packages/nvidia/*/lib` of the Python environments on the machine (PyTorch's CUDA wheels live there).
fn python_nvidia_lib_dirs() -> Vec<PathBuf> {
    let mut roots: Vec<PathBuf> = Vec::new();
    if let Some(venv) = std::env::var_os("VIRTUAL_ENV") {
        roots.push(venv.into());
    }
    roots.extend(["/usr", "/usr/local"].map(PathBuf::from));
    roots.extend(std::fs::read_dir("/opt").into_iter().flatten().flatten().flat_map(|e| {
        let p = e.path();
        [p.join(".venv"), p.join("venv"), p]
    }));
    let mut out = Vec::new();
    for root in roots {
        for lib in ["lib", "lib64"] {
            let Ok(pythons) = std::fs::read_dir(root.join(lib)) else {
                continue;
            };
            for python in pythons.flatten() {
                for packages in ["site-packages", "dist-packages"] {
                    let nvidia = python.path().join(packages).join("nvidia");
                    let Ok(parts) = std::fs::read_dir(&nvidia) else {
                        continue;
                    };
                    out.extend(parts.flatten().map(|p| p.path().join("lib")));
                }
            }
        }
    }
    out
}

/// Loads `name` (a soname) globally: first as the system linker finds it, then from each search directory.
fn load(name: &str, dirs: &[PathBuf]) -> Result<String, String> {
    let open = |path: &str| {
        // SAFETY: loading a shared library runs its initialisers; these are NVIDIA's own libraries, loaded once.
        unsafe {
            libloading::os::unix::Library::open(
                Some(path),
                libloading::os::unix::RTLD_NOW | libloading::os::unix::RTLD_GLOBAL,
            )
        }
    };
    let mut tried = vec![format!("{name} (system linker path)")];
    let found = match open(name) {
        Ok(lib) => Some((lib, name.to_string())),
        Err(_) => dirs.iter().map(|d| d.join(name)).filter(|p| p.exists()).find_map(|p| {
            let shown = p.display().to_string();
            tried.push(shown.clone());
            open(&shown).ok().map(|lib| (lib, shown))
        }),
    };
    match found {
        Some((lib, path)) => {
            // Kept loaded for the life of the process: cudarc resolves its symbols from it by soname.
            std::mem::forget(lib);
            Ok(path)
        }
        None => Err(format!(
            "{name} not found; searched: {}, and {}",
            tried.join(", "),
            dirs.iter()
                .map(|d| d.display().to_string())
                .collect::<Vec<_>>()
                .join(", ")
        )),
    }
}

/// Loads NCCL (libnccl.so.2: the system's, CUDA_HOME's or the nvidia-nccl wheel's) once per process, for the
/// all-reduce of an expert-parallel group of several GPUs; its path.
pub fn load_nccl() -> Result<String> {
    static LOADED: OnceLock<Result<String, String>> = OnceLock::new();
    LOADED
        .get_or_init(|| load("libnccl.so.2", &search_dirs()))
        .clone()
        .map_err(Error::Cuda)
}

/// Loads the driver and cuBLAS once per process.
pub fn load_cuda_libraries() -> Result<CudaLibraries> {
    static LOADED: OnceLock<Result<CudaLibraries, String>> = OnceLock::new();
    LOADED
        .get_or_init(|| {
            let dirs = search_dirs();
            Ok(CudaLibraries {
                driver: load("libcuda.so.1", &dirs)?,
                cublas_lt: load("libcublasLt.so.13", &dirs)?,
                cublas: load("libcublas.so.13", &dirs)?,
            })
        })
        .clone()
        .map_err(Error::Cuda)
}

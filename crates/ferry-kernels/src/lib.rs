//! ferry's CUDA kernels, compiled ahead of time by nvcc (see build.rs) and embedded as fatbins.
//!
//! This crate holds the kernel sources (`cuda/*.cu`) and their compiled images, nothing else: loading them,
//! launching them and owning device memory is the CUDA backend's job (ferry-core's `backend::cuda`).

/// Declares each kernel constant as a `pub const` (build.rs reads the same list into the kernels' header).
macro_rules! kernel_constants {
    ($($(#[doc = $doc:literal])* $name:ident: $ty:ty = $value:expr;)*) => {
        $($(#[doc = $doc])* pub const $name: $ty = $value;)*
    };
}

pub mod constants;

include!(concat!(env!("OUT_DIR"), "/modules.rs"));

/// The fatbin of kernel module `name` (a `cuda/NAME.cu`), or None when this build has no kernels.
pub fn module(name: &str) -> Option<&'static [u8]> {
    MODULES.iter().find(|(n, _)| *n == name).map(|(_, image)| *image)
}

/// Whether this build carries kernels (nvcc was found when it was compiled).
pub fn available() -> bool {
    !MODULES.is_empty()
}

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

#[cfg(test)]
mod tests {
    use std::path::Path;

    /// Kernels that copy what no kernel of the step writes before they wait (weights, in common.cuh's
    /// warp_rows_dot; the keys of earlier steps, in attention.cu's attend_split), passing
    /// `WaitForPreviousKernel()` as their inputs_ready in their own body.
    const COPY_BEFORE_WAITING: [&str; 7] = [
        "gemv_bf16_",
        "gemv_fp8_",
        "gemv_route_",
        "moe_down##SUFFIX(",
        "moe_down_fp8##SUFFIX(",
        "moe_down_mxfp4##SUFFIX(",
        " attention_d",
    ];

    /// The CUDA backend launches every kernel as a programmatic dependent of the one before it (sm_90 on), which
    /// keeps the stream's order only if each kernel waits for its predecessor before anything else
    /// (common.cuh's `wait_for_previous_kernel`): a kernel without it could read what the one before has not yet
    /// written. The kernels of COPY_BEFORE_WAITING wait once their first copies are in flight.
    #[test]
    fn every_kernel_first_waits_for_the_one_before_it() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("cuda");
        let mut kernels = 0;
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.extension().is_none_or(|e| e != "cu") {
                continue;
            }
            let source = std::fs::read_to_string(&path).unwrap();
            for (at, _) in source.match_indices("extern \"C\" __global__") {
                // The body opens at the first brace outside the signature's parentheses.
                let mut depth = 0;
                let body = source[at..]
                    .char_indices()
                    .find_map(|(i, c)| {
                        match c {
                            '(' => depth += 1,
                            ')' => depth -= 1,
                            '{' if depth == 0 => return Some(at + i + 1),
                            _ => {}
                        }
                        None
                    })
                    .unwrap();
                let first = source[body..].trim_start_matches(|c: char| c.is_whitespace() || c == '\\');
                let signature = &source[at..body];
                let name = signature.split('(').next().unwrap_or_default();
                if COPY_BEFORE_WAITING.iter().any(|k| signature.contains(k)) {
                    // The body runs to the next kernel's declaration (or the end of the file).
                    let end = source[body..].find("extern \"C\"").map_or(source.len(), |e| body + e);
                    assert!(
                        source[body..end].contains("WaitForPreviousKernel()"),
                        "{}: `{}` does not pass WaitForPreviousKernel()",
                        path.display(),
                        name.trim()
                    );
                } else {
                    assert!(
                        first.starts_with("wait_for_previous_kernel();"),
                        "{}: `{}` does not start with wait_for_previous_kernel()",
                        path.display(),
                        name.trim()
                    );
                }
                kernels += 1;
            }
        }
        assert!(kernels >= 40, "found {kernels} kernels");
    }
}

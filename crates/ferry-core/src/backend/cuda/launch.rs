//! How the CUDA backend launches a kernel: [`Ptr`], a kernel's typed pointer parameter; [`kernel!`], which declares
//! one launch helper per kernel (a struct of its parameters, named and typed as in its C signature, pushed in that
//! order); and the grid shapes most launches use. The helpers themselves sit next to the code that launches them.

use std::ffi::c_void;
use std::marker::PhantomData;
use std::ptr::null_mut;

use cudarc::driver::{sys, CudaSlice, DevicePtr, DeviceRepr, LaunchConfig};

use super::{cuda_err, CudaBackend};
use crate::Result;

/// A kernel's `T*` parameter: the device address of `T`s (0 for a null pointer). Typed by what it points to, so
/// that a launch helper's `Ptr<f32>` cannot be handed bf16 weights.
#[repr(transparent)]
pub(super) struct Ptr<T> {
    address: u64,
    points_to: PhantomData<*const T>,
}

impl<T> Clone for Ptr<T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T> Copy for Ptr<T> {}

// SAFETY: a Ptr is one u64 (repr(transparent)), which is what a kernel's pointer parameter takes.
unsafe impl<T> DeviceRepr for Ptr<T> {}

impl<T> Ptr<T> {
    /// The pointer to device address `address`.
    pub(super) fn at(address: u64) -> Self {
        Ptr {
            address,
            points_to: PhantomData,
        }
    }

    pub(super) fn null() -> Self {
        Ptr::at(0)
    }

    pub(super) fn address(self) -> u64 {
        self.address
    }

    /// The pointer `elements` `T`s further on.
    pub(super) fn offset(self, elements: usize) -> Self {
        Ptr::at(self.address + (elements * std::mem::size_of::<T>()) as u64)
    }

    /// The same address, read as `U`s (bf16 weights are uploaded as bytes).
    pub(super) fn cast<U>(self) -> Ptr<U> {
        Ptr::at(self.address)
    }
}

/// The start of `slice`.
pub(super) fn ptr<T>(slice: &CudaSlice<T>) -> Ptr<T> {
    // With event tracking off (CudaBackend::new), asking for the address records and waits for nothing.
    Ptr::at(slice.device_ptr(slice.stream()).0)
}

/// Declares a kernel's launch helper: `struct Name = "kernel" { param: Type, ... }` with the kernel's parameters
/// in the order and of the types of its C signature (`Ptr<T>` for `T*`, `i32` for `int`, `usize` for `size_t`),
/// so that a launch names every argument. `launch` runs kernel "kernel"; a helper declared without a kernel name
/// serves several kernels of one signature (the GEMVs, the two delta rules, the row copies) and is run by
/// `launch_kernel`, which takes the kernel's name.
macro_rules! kernel {
    ($(#[doc = $doc:literal])* struct $name:ident = $kernel:literal { $($param:ident: $ty:ty),* $(,)? }) => {
        kernel!($(#[doc = $doc])* struct $name { $($param: $ty),* });

        impl $name {
            pub(super) fn launch(
                &self,
                backend: &$crate::backend::cuda::CudaBackend,
                cfg: ::cudarc::driver::LaunchConfig,
            ) -> $crate::Result<()> {
                self.launch_kernel(backend, $kernel, cfg)
            }
        }
    };
    ($(#[doc = $doc:literal])* struct $name:ident { $($param:ident: $ty:ty),* $(,)? }) => {
        $(#[doc = $doc])*
        pub(super) struct $name {
            $(pub(super) $param: $ty),*
        }

        impl $name {
            pub(super) fn launch_kernel(
                &self,
                backend: &$crate::backend::cuda::CudaBackend,
                kernel: &str,
                cfg: ::cudarc::driver::LaunchConfig,
            ) -> $crate::Result<()> {
                let mut params = [$(&self.$param as *const $ty as *mut ::std::ffi::c_void),*];
                // SAFETY: the fields are the kernel's parameters, in order and of the types its signature names,
                // and outlive the launch (the driver copies them before it returns).
                unsafe { backend.launch(kernel, cfg, &mut params) }
            }
        }
    };
}
pub(super) use kernel;

impl CudaBackend {
    /// Launches kernel `name` with `cfg` on the compute stream, `params` pointing at its parameters. From sm_90
    /// on, as a programmatic dependent of the kernel before it (common.cuh's `wait_for_previous_kernel`, which
    /// every kernel starts with): it may launch while that kernel finishes, and waits for it before it reads.
    ///
    /// # Safety
    /// `params` points at the kernel's parameters in order, each of the type the kernel's signature names: only
    /// [`kernel!`]'s helpers call this.
    pub(super) unsafe fn launch(&self, name: &str, cfg: LaunchConfig, params: &mut [*mut c_void]) -> Result<()> {
        let function = self.function(name)?;
        self.ctx.bind_to_thread().map_err(cuda_err(name))?;
        self.copy_guesses()?;
        let mut dependent = sys::CUlaunchAttribute {
            id: sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
            pad: [0; 4],
            value: sys::CUlaunchAttributeValue {
                programmaticStreamSerializationAllowed: 1,
            },
        };
        let config = sys::CUlaunchConfig {
            gridDimX: cfg.grid_dim.0,
            gridDimY: cfg.grid_dim.1,
            gridDimZ: cfg.grid_dim.2,
            blockDimX: cfg.block_dim.0,
            blockDimY: cfg.block_dim.1,
            blockDimZ: cfg.block_dim.2,
            sharedMemBytes: cfg.shared_mem_bytes,
            hStream: self.stream.cu_stream(),
            attrs: &mut dependent,
            numAttrs: u32::from(self.dependent_launch),
        };
        // SAFETY: the caller's contract for `params`; `config` and its attribute outlive the call.
        unsafe { sys::cuLaunchKernelEx(&config, function.cu_function(), params.as_mut_ptr(), null_mut()) }
            .result()
            .map_err(cuda_err(name))
    }

    /// Under offload, queues the next guessed expert's copy if the last one has landed (offload.rs), so that the
    /// link keeps copying while the host launches a layer's kernels. Skipped while the offload is busy on this
    /// thread (its CPU lane's launches).
    fn copy_guesses(&self) -> Result<()> {
        if let Some(Ok(mut offload)) = self.offload.as_ref().map(|o| o.try_lock()) {
            offload.copy_guesses()?;
        }
        Ok(())
    }
}

/// Threads per block of the kernels whose threads stride over a row or over all elements by `blockDim.x`: any
/// multiple of 32 computes the same; 256 keeps several blocks resident per multiprocessor.
pub(super) const BLOCK_THREADS: u32 = 256;

/// Blocks of `threads` threads for a grid-stride loop over `n` elements.
pub(super) fn grid_1d(n: usize, threads: u32) -> LaunchConfig {
    let blocks = n.div_ceil(threads as usize).clamp(1, 65_535 * 16) as u32;
    LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// One block of `threads` threads per row.
pub(super) fn per_row(rows: usize, threads: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (rows as u32, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pointer_moves_by_whole_elements_of_its_type() {
        let floats = Ptr::<f32>::at(4096);
        assert_eq!(floats.offset(3).address(), 4096 + 12);
        let words: Ptr<u16> = floats.cast();
        assert_eq!(words.offset(3).address(), 4096 + 6);
        assert_eq!(Ptr::<u64>::null().address(), 0);
    }
}

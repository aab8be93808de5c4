//! Device memory of the CUDA backend: allocations from the stream-ordered pool (and the pool's setup), copies to
//! and from the device, and the tensors and weights made of them. Where the KV cache and the experts live is
//! kv.rs's and moe.rs's business; this file is the plain buffers.

use cudarc::driver::{sys, CudaContext, CudaSlice, DeviceRepr};

use super::{cuda_err, CudaBackend, CudaRope, CudaTensor, CudaWeight};
use crate::backend::{check_upload, Rope};
use crate::loader::{DType, TensorRef};
use crate::{Error, Result};

impl CudaBackend {
    /// `len` uninitialised elements (at least one, so that every buffer has an address).
    pub(super) fn alloc<T: DeviceRepr>(&self, len: usize) -> Result<CudaSlice<T>> {
        // SAFETY: every caller hands the buffer to a kernel or copy that writes all of it before it is read.
        unsafe { self.stream.alloc::<T>(len.max(1)) }.map_err(cuda_err("allocating device memory"))
    }

    pub(super) fn copy_to_device<T: DeviceRepr>(&self, host: &[T]) -> Result<CudaSlice<T>> {
        if host.is_empty() {
            return self.alloc(1);
        }
        self.stream.clone_htod(host).map_err(cuda_err("copy to device"))
    }

    /// An uninitialised `[rows, cols]` tensor.
    pub(super) fn tensor(&self, rows: usize, cols: usize) -> Result<CudaTensor> {
        Ok(CudaTensor {
            data: self.alloc(rows * cols)?,
            rows,
            cols,
        })
    }

    /// A `[rows, cols]` tensor of zeros.
    pub(super) fn zeros(&self, rows: usize, cols: usize) -> Result<CudaTensor> {
        Ok(CudaTensor {
            data: self
                .stream
                .alloc_zeros((rows * cols).max(1))
                .map_err(cuda_err("allocating device memory"))?,
            rows,
            cols,
        })
    }

    /// [`crate::backend::Backend::upload`].
    pub(super) fn upload_tensor(&self, data: &[f32], rows: usize, cols: usize) -> Result<CudaTensor> {
        check_upload(data.len(), rows, cols)?;
        Ok(CudaTensor {
            data: self.copy_to_device(data)?,
            rows,
            cols,
        })
    }

    pub(super) fn tensor_to_host(&self, x: &CudaTensor) -> Result<Vec<f32>> {
        self.stream.clone_dtoh(&x.data).map_err(cuda_err("copy to host"))
    }

    /// [`crate::backend::Backend::weight`]: a matrix stays bf16, or FP8 with its f32 scales (read exactly by
    /// linear.rs: an E4M3 value times its scale is not a bf16 number), a vector is widened to f32.
    pub(super) fn upload_weight(&self, tensor: TensorRef) -> Result<CudaWeight> {
        if tensor.dtype == DType::F8E4M3 && tensor.shape.len() == 2 {
            let scales = tensor
                .scales()
                .ok_or_else(|| Error::tensor(&tensor.name, "an FP8 matrix without scales"))?;
            return Ok(CudaWeight::Fp8Matrix {
                data: self.copy_to_device(tensor.bytes())?,
                scales: self.copy_to_device(&scales.values.to_f32_vec())?,
                rows: tensor.shape[0],
                cols: tensor.shape[1],
                block: scales.block,
            });
        }
        match tensor.shape.len() {
            1 => Ok(CudaWeight::Vector(self.copy_to_device(&tensor.to_f32_vec())?)),
            2 => Ok(CudaWeight::Matrix {
                data: self.copy_to_device(bf16_bytes(&tensor)?)?,
                rows: tensor.shape[0],
                cols: tensor.shape[1],
            }),
            _ => Err(Error::tensor(
                &tensor.name,
                format!("expected a matrix or vector, found {:?}", tensor.shape),
            )),
        }
    }

    pub(super) fn upload_rope(&self, rope: &Rope) -> Result<CudaRope> {
        Ok(CudaRope {
            inv_freq: self.copy_to_device(&rope.inv_freq)?,
            rotary_dim: rope.rotary_dim,
            attention_factor: rope.attention_factor,
        })
    }
}

/// Freed device memory stays in the stream-ordered pool instead of going back to the driver at every
/// synchronisation, so the per-step allocations of a forward pass cost no driver calls. What earlier backends of
/// this process left in the pool is released first, so that cuMemGetInfo shows what this one allocates.
pub(super) fn keep_freed_memory_pooled(ctx: &CudaContext) -> Result<()> {
    let mut pool = std::ptr::null_mut();
    let mut threshold = u64::MAX;
    unsafe {
        sys::cuDeviceGetDefaultMemPool(&mut pool, ctx.cu_device())
            .result()
            .map_err(cuda_err("default memory pool"))?;
        ctx.synchronize().map_err(cuda_err("synchronize"))?;
        sys::cuMemPoolTrimTo(pool, 0)
            .result()
            .map_err(cuda_err("trimming the memory pool"))?;
        sys::cuMemPoolSetAttribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            &mut threshold as *mut u64 as *mut _,
        )
        .result()
        .map_err(cuda_err("memory pool release threshold"))?;
    }
    Ok(())
}

/// The bytes of a bf16 matrix, as stored.
pub(super) fn bf16_bytes(t: &TensorRef) -> Result<&[u8]> {
    if t.dtype != DType::BF16 {
        return Err(Error::tensor(
            &t.name,
            format!("the CUDA backend runs bf16 weights; this one is {}", t.dtype.name()),
        ));
    }
    Ok(t.bytes())
}

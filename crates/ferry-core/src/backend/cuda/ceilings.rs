//! The machine's data-movement and compute ceilings, measured on the GPU (`ferry doctor`; `ferry bench` uses
//! them for its bounds): pinned host-to-device and device-to-host copy bandwidth, device-to-device copy
//! bandwidth (bytes read plus written: what HBM moves), cuBLAS bf16 GEMM throughput (the backend's own GEMM, as
//! the prefill's products run it), and a kernel's rate reading pinned host memory in place (zero-copy). The expert offload's two lanes are measured in lane_ceilings.rs.

use cudarc::driver::{sys, CudaSlice, LaunchConfig, PinnedHostSlice};
use serde::Serialize;

use super::launch::{kernel, ptr, Ptr};
use super::memory::keep_freed_memory_pooled;
use super::{cuda_err, Bf16Matrix, CudaBackend};
use crate::{Error, Result};

#[derive(Clone, Debug, Serialize)]
pub struct GpuCeilings {
    pub h2d_pinned_gb_s: f64,
    pub d2h_pinned_gb_s: f64,
    /// Bytes read plus bytes written per second.
    pub d2d_copy_gb_s: f64,
    pub bf16_gemm_tflop_s: f64,
    /// A kernel reading pinned host memory in place over the link (no copy): what expert kernels that read missed
    /// experts straight from the host bank would get.
    pub zero_copy_read_gb_s: f64,
}

kernel! {
    /// elementwise.cu's `read_mapped`: adds the 32-bit lanes of `n` 16-byte words of mapped host memory into
    /// `sink`.
    struct ReadMapped = "read_mapped" {
        src: Ptr<u8>,
        n: usize,
        sink: Ptr<u32>,
    }
}

/// Blocks of the zero-copy read: enough requests in flight to fill the link.
const ZERO_COPY_BLOCKS: u32 = 1024;

const COPY_BYTES: usize = 1 << 30;
const REPEATS: usize = 5;

impl CudaBackend {
    /// Median milliseconds of `REPEATS` runs of `work` on the backend's stream, timed with device events.
    fn time_ms(&self, mut work: impl FnMut() -> Result<()>) -> Result<f64> {
        work()?; // warm-up
        let mut times = Vec::with_capacity(REPEATS);
        for _ in 0..REPEATS {
            let flags = Some(sys::CUevent_flags::CU_EVENT_DEFAULT);
            let start = self.ctx.new_event(flags).map_err(cuda_err("event"))?;
            let end = self.ctx.new_event(flags).map_err(cuda_err("event"))?;
            start.record(&self.stream).map_err(cuda_err("event record"))?;
            work()?;
            end.record(&self.stream).map_err(cuda_err("event record"))?;
            end.synchronize().map_err(cuda_err("event sync"))?;
            times.push(start.elapsed_ms(&end).map_err(cuda_err("event time"))? as f64);
        }
        times.sort_by(f64::total_cmp);
        Ok(times[REPEATS / 2])
    }

    pub fn measure_ceilings(&self) -> Result<GpuCeilings> {
        // Plain pinned memory (not write-combined): what an expert bank read by the CPU too would use.
        let mut host = unsafe { self.ctx.alloc_pinned_with_flags::<u8>(COPY_BYTES, 0) }.map_err(cuda_err("pinning"))?;
        host.as_mut_slice().map_err(cuda_err("pinned memory"))?.fill(1);
        let mut device: CudaSlice<u8> = self.alloc(COPY_BYTES)?;
        let mut other: CudaSlice<u8> = self.alloc(COPY_BYTES)?;
        let gb_s = |bytes: usize, ms: f64| bytes as f64 / (ms * 1e-3) / 1e9;

        let h2d = self.time_ms(|| self.stream.memcpy_htod(&host, &mut device).map_err(cuda_err("H2D")))?;
        let d2h = self.time_ms(|| self.stream.memcpy_dtoh(&device, &mut host).map_err(cuda_err("D2H")))?;
        let d2d = self.time_ms(|| self.stream.memcpy_dtod(&device, &mut other).map_err(cuda_err("D2D")))?;
        let zero_copy = self.time_zero_copy_read(&host)?;

        let n = 8192usize;
        let a: CudaSlice<u16> =
            self.copy_to_device(&(0..n * n).map(|i| 0x3c00 + (i % 61) as u16).collect::<Vec<_>>())?;
        let c: CudaSlice<f32> = self.alloc(n * n)?;
        let a_matrix = Bf16Matrix {
            data: ptr(&a),
            rows: n,
            cols: n,
        };
        let gemm = self.time_ms(|| self.gemm_bf16(ptr(&a), n, a_matrix, ptr(&c), n, false))?;
        drop((host, device, other, a, c));
        // Give the measurement's buffers back to the driver: they are no part of what a model needs.
        keep_freed_memory_pooled(&self.ctx)?;
        Ok(GpuCeilings {
            h2d_pinned_gb_s: gb_s(COPY_BYTES, h2d),
            d2h_pinned_gb_s: gb_s(COPY_BYTES, d2h),
            d2d_copy_gb_s: gb_s(2 * COPY_BYTES, d2d),
            bf16_gemm_tflop_s: 2.0 * (n as f64).powi(3) / (gemm * 1e-3) / 1e12,
            zero_copy_read_gb_s: gb_s(COPY_BYTES, zero_copy),
        })
    }

    /// Milliseconds of `read_mapped` over all of `host` (pinned, every byte 1), its sum checked: a kernel that read
    /// anything else (or nothing) is an error, not a rate.
    fn time_zero_copy_read(&self, host: &PinnedHostSlice<u8>) -> Result<f64> {
        let words = host.len() / 16;
        let sink: CudaSlice<u32> = self.stream.alloc_zeros(1).map_err(cuda_err("zero-copy sum"))?;
        let read = ReadMapped {
            src: Ptr::at(host.as_ptr().map_err(cuda_err("pinned memory"))? as u64),
            n: words,
            sink: ptr(&sink),
        };
        let threads = 256;
        let config = LaunchConfig {
            grid_dim: (ZERO_COPY_BLOCKS, 1, 1),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut launches = 0u64;
        let ms = self.time_ms(|| {
            launches += 1;
            read.launch(self, config)
        })?;
        let sum = self.stream.clone_dtoh(&sink).map_err(cuda_err("zero-copy sum"))?[0];
        // Each word adds four lanes of 0x01010101 in every launch (wrapping, as the kernel's sum does).
        let expected = (launches
            .wrapping_mul(words as u64)
            .wrapping_mul(4)
            .wrapping_mul(0x0101_0101)) as u32;
        if sum != expected {
            return Err(Error::Cuda(format!(
                "a kernel reading pinned host memory in place summed {sum:#x}, not {expected:#x}"
            )));
        }
        Ok(ms)
    }
}

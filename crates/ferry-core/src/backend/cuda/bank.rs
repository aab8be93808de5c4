//! The host expert bank: every routed expert of every MoE layer in host RAM, each expert (gate, up, down) one
//! contiguous block so a cache miss is one copy. Pinned in chunks of about 1 GiB (one giant pinned allocation
//! fails on real machines); when the system refuses to pin, the bank falls back to pageable memory and misses
//! go through a small pinned staging ring instead. Plain (not write-combined) memory: a CPU lane will read it.

use std::sync::Arc;

use cudarc::driver::{sys, CudaContext, CudaEvent, CudaStream, PinnedHostSlice};

use super::cuda_err;
use crate::{Error, Result};

const CHUNK_BYTES: usize = 1 << 30;
/// Blocks start at multiples of this (DMA-friendly, and 16-byte loads for a CPU lane).
const ALIGN: usize = 4096;

enum Chunk {
    Pinned(PinnedHostSlice<u8>),
    Pageable(Vec<u8>),
}

impl Chunk {
    fn bytes_mut(&mut self) -> Result<&mut [u8]> {
        match self {
            Chunk::Pinned(p) => p.as_mut_slice().map_err(cuda_err("pinned bank memory")),
            Chunk::Pageable(v) => Ok(v),
        }
    }
}

/// Two pinned buffers that misses from a pageable bank pass through, each reused once its last copy is done.
struct StagingRing {
    buffers: Vec<(PinnedHostSlice<u8>, Option<CudaEvent>)>,
    next: usize,
}

pub struct HostBank {
    ctx: Arc<CudaContext>,
    block_bytes: usize,
    stride: usize,
    blocks_per_chunk: usize,
    chunks: Vec<Chunk>,
    blocks: usize,
    pinned: bool,
    staging: Option<StagingRing>,
}

impl HostBank {
    pub fn new(ctx: Arc<CudaContext>, block_bytes: usize) -> Self {
        let stride = block_bytes.div_ceil(ALIGN) * ALIGN;
        HostBank {
            ctx,
            block_bytes,
            stride,
            blocks_per_chunk: (CHUNK_BYTES / stride).max(1),
            chunks: Vec::new(),
            blocks: 0,
            pinned: true,
            staging: None,
        }
    }

    pub fn block_bytes(&self) -> usize {
        self.block_bytes
    }

    pub fn is_pinned(&self) -> bool {
        self.pinned
    }

    /// Host bytes the bank holds.
    pub fn bytes(&self) -> usize {
        self.chunks.len() * self.blocks_per_chunk * self.stride
    }

    fn new_chunk(&mut self) -> Result<Chunk> {
        let len = self.blocks_per_chunk * self.stride;
        if self.pinned {
            match unsafe {
                self.ctx
                    .alloc_pinned_with_flags::<u8>(len, sys::CU_MEMHOSTALLOC_PORTABLE)
            } {
                Ok(chunk) => return Ok(Chunk::Pinned(chunk)),
                Err(e) => {
                    tracing::warn!(
                        "pinning {} MiB of host memory for the expert bank failed ({e}); the bank stays pageable and \
                         misses go through a pinned staging ring (slower copies)",
                        len >> 20
                    );
                    self.pinned = false;
                    // Chunks already pinned stay pinned; every copy takes the staging path from now on.
                }
            }
        }
        let mut v = Vec::new();
        v.try_reserve_exact(len).map_err(|e| {
            Error::Cuda(format!(
                "cannot allocate {} MiB of host memory for the expert bank: {e}",
                len >> 20
            ))
        })?;
        v.resize(len, 0);
        Ok(Chunk::Pageable(v))
    }

    /// Appends an expert: its gate, up and down bytes, in that order. Returns its block index.
    pub fn push(&mut self, parts: [&[u8]; 3]) -> Result<usize> {
        if parts.iter().map(|p| p.len()).sum::<usize>() != self.block_bytes {
            return Err(Error::Cuda(
                "an expert of a different size than the bank's blocks".into(),
            ));
        }
        let index = self.blocks;
        let (chunk, slot) = (index / self.blocks_per_chunk, index % self.blocks_per_chunk);
        if chunk == self.chunks.len() {
            let fresh = self.new_chunk()?;
            self.chunks.push(fresh);
        }
        let start = slot * self.stride;
        let bytes = self.chunks[chunk].bytes_mut()?;
        let mut at = start;
        for part in parts {
            bytes[at..at + part.len()].copy_from_slice(part);
            at += part.len();
        }
        self.blocks += 1;
        Ok(index)
    }

    /// Block `index`'s bytes in place, for the CPU lane to read.
    pub fn block(&self, index: usize) -> Result<&[u8]> {
        let (chunk, slot) = (index / self.blocks_per_chunk, index % self.blocks_per_chunk);
        let range = slot * self.stride..slot * self.stride + self.block_bytes;
        let bytes = match self.chunks.get(chunk) {
            Some(Chunk::Pinned(p)) => p.as_slice().map_err(cuda_err("pinned bank memory"))?,
            Some(Chunk::Pageable(v)) => v,
            None => return Err(Error::Cuda(format!("no bank block {index}"))),
        };
        Ok(&bytes[range])
    }

    /// Queues the copy of block `index` to device address `dst` on `stream`.
    pub fn copy_to_device(&mut self, index: usize, dst: u64, stream: &Arc<CudaStream>) -> Result<()> {
        let (chunk, slot) = (index / self.blocks_per_chunk, index % self.blocks_per_chunk);
        let range = slot * self.stride..slot * self.stride + self.block_bytes;
        let HostBank {
            ctx,
            chunks,
            staging,
            block_bytes,
            ..
        } = self;
        match chunks.get(chunk) {
            Some(Chunk::Pinned(p)) => {
                let src = &p.as_slice().map_err(cuda_err("pinned bank memory"))?[range];
                unsafe { cudarc::driver::result::memcpy_htod_async(dst, src, stream.cu_stream()) }
                    .map_err(cuda_err("copying an expert to the GPU"))
            }
            Some(Chunk::Pageable(bytes)) => {
                if staging.is_none() {
                    let buffers = (0..2)
                        .map(|_| {
                            let b = unsafe { ctx.alloc_pinned_with_flags::<u8>(*block_bytes, 0) }
                                .map_err(cuda_err("pinning the expert staging ring"))?;
                            Ok((b, None))
                        })
                        .collect::<Result<_>>()?;
                    *staging = Some(StagingRing { buffers, next: 0 });
                }
                let Some(ring) = staging.as_mut() else {
                    return Err(Error::Cuda("no staging ring".into()));
                };
                let (buffer, done) = &mut ring.buffers[ring.next];
                ring.next = (ring.next + 1) % 2;
                if let Some(event) = done.take() {
                    event.synchronize().map_err(cuda_err("waiting for the staging ring"))?;
                }
                buffer
                    .as_mut_slice()
                    .map_err(cuda_err("staging buffer"))?
                    .copy_from_slice(&bytes[range]);
                let staged = buffer.as_slice().map_err(cuda_err("staging buffer"))?;
                unsafe { cudarc::driver::result::memcpy_htod_async(dst, staged, stream.cu_stream()) }
                    .map_err(cuda_err("copying an expert to the GPU"))?;
                *done = Some(stream.record_event(None).map_err(cuda_err("staging event"))?);
                Ok(())
            }
            None => Err(Error::Cuda(format!("no bank block {index}"))),
        }
    }
}

//! Expert offload: the routed experts live in the host [`HostBank`]; one device slab of equal slots, shared by all
//! MoE layers, caches the hot ones. Per layer and step the routed ids of the whole batch come to the host, the
//! [`ExpertCache`] plans hits and misses, misses are copied bank -> slot on a dedicated copy stream, the layer's
//! device slot table is rewritten for the routed experts, and the compute stream waits on an event for all of it
//! before the same expert kernels as the all-resident path run: only where the weights live differs. A step that
//! routes to nearly all of a layer's experts (prefill) also queues the next layer's experts behind its own, so the
//! bank streams while the layers compute.
//!
//! The offload is part of the backend from its construction ([`CudaBackend::builder`]), with the eviction policy
//! its caller chose.

use std::sync::{Arc, Mutex};

use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr, PinnedHostSlice};

use super::bank::HostBank;
use super::{cuda_err, CudaBackend, CudaRouting};
use crate::backend::ExpertTensors;
use crate::moe::{EvictionPolicy, ExpertCache, OffloadStats, Plan};
use crate::{Error, Result};

/// How experts are offloaded: the GPU cache's slots (each holds one expert of any MoE layer) and the policy that
/// picks which expert leaves a slot.
pub struct OffloadConfig {
    pub slots: usize,
    pub policy: Box<dyn EvictionPolicy>,
}

/// A GPU opened (context, kernels, cuBLAS) but not yet a backend: its memory can be measured to plan a budget, and
/// expert offload chosen, before any model is loaded.
pub struct CudaBackendBuilder {
    backend: CudaBackend,
    offload: Option<OffloadConfig>,
}

impl CudaBackend {
    /// Opens GPU `ordinal`; [`CudaBackendBuilder::build`] makes it a backend, all resident unless offload was asked.
    pub fn builder(ordinal: usize) -> Result<CudaBackendBuilder> {
        Ok(CudaBackendBuilder {
            backend: CudaBackend::new(ordinal)?,
            offload: None,
        })
    }
}

impl CudaBackendBuilder {
    /// Bytes free and total on the device (cuMemGetInfo).
    pub fn memory_info(&self) -> Result<(usize, usize)> {
        self.backend.memory_info()
    }

    /// Keeps the routed experts of the models the backend loads in a host bank, cached on the GPU as `config` says.
    pub fn offload(self, config: OffloadConfig) -> Self {
        CudaBackendBuilder {
            offload: Some(config),
            ..self
        }
    }

    pub fn build(self) -> Result<CudaBackend> {
        let mut backend = self.backend;
        if let Some(config) = self.offload {
            backend.offload = Some(Mutex::new(Offload::new(backend.ctx.clone(), config)?));
        }
        Ok(backend)
    }
}

/// Prefetch the next layer's experts when a step routes to at least this share (numerator, denominator) of a
/// layer's experts: a batch that wide is a prefill chunk, and the next layer will want nearly all of its experts.
const PREFETCH_SHARE: (usize, usize) = (7, 8);

/// One MoE layer under offload: where its experts sit in the bank, and its slot table (device and a pinned host
/// mirror the table is uploaded from).
struct OffloadLayer {
    bank_blocks: Vec<usize>,
    table_host: PinnedHostSlice<u64>,
}

pub struct Offload {
    ctx: Arc<CudaContext>,
    copy_stream: Arc<CudaStream>,
    slots: usize,
    bank: Option<HostBank>,
    slab: Option<CudaSlice<u8>>,
    cache: ExpertCache,
    layers: Vec<OffloadLayer>,
    routed_host: Option<PinnedHostSlice<i32>>,
    copies: u64,
    prefetched: u64,
}

impl Offload {
    fn new(ctx: Arc<CudaContext>, config: OffloadConfig) -> Result<Self> {
        let slots = u32::try_from(config.slots)
            .map_err(|_| Error::Cuda(format!("{} expert cache slots are too many", config.slots)))?;
        Ok(Offload {
            copy_stream: ctx.new_stream().map_err(cuda_err("creating the copy stream"))?,
            ctx,
            slots: config.slots,
            bank: None,
            slab: None,
            cache: ExpertCache::new(slots, config.policy),
            layers: Vec::new(),
            routed_host: None,
            copies: 0,
            prefetched: 0,
        })
    }

    /// Puts a layer's experts in the bank (the slab is made with the first layer, when the block size is known);
    /// returns the layer's index.
    pub fn add_layer(&mut self, stream: &Arc<CudaStream>, experts: &[ExpertTensors]) -> Result<usize> {
        let block_bytes = experts
            .first()
            .map_or(0, |e| e.gate.byte_len() + e.up.byte_len() + e.down.byte_len());
        if self.slab.is_none() {
            if self.slots < experts.len() {
                return Err(Error::Cuda(format!(
                    "{} expert cache slots cannot hold one layer's {} experts; give the cache more memory",
                    self.slots,
                    experts.len()
                )));
            }
            let slab = unsafe { stream.alloc::<u8>(self.slots * block_bytes) }
                .map_err(cuda_err(&format!("allocating {} expert cache slots", self.slots)))?;
            self.slab = Some(slab);
            self.bank = Some(HostBank::new(self.ctx.clone(), block_bytes));
        }
        let Some(bank) = self.bank.as_mut() else {
            return Err(Error::Cuda("no expert bank".into()));
        };
        if block_bytes != bank.block_bytes() {
            return Err(Error::Cuda("MoE layers with experts of different sizes".into()));
        }
        let bank_blocks = experts
            .iter()
            .map(|e| {
                for t in [&e.gate, &e.up, &e.down] {
                    super::bf16_bytes(t)?;
                }
                bank.push([e.gate.bytes(), e.up.bytes(), e.down.bytes()])
            })
            .collect::<Result<_>>()?;
        let mut table_host = unsafe { self.ctx.alloc_pinned_with_flags::<u64>(experts.len(), 0) }
            .map_err(cuda_err("pinning a slot table"))?;
        table_host.as_mut_slice().map_err(cuda_err("slot table"))?.fill(0);
        self.layers.push(OffloadLayer {
            bank_blocks,
            table_host,
        });
        Ok(self.layers.len() - 1)
    }

    /// The device address of `slot`, given the slab's base.
    fn slot_address(slab_base: u64, block_bytes: usize, slot: u32) -> u64 {
        slab_base + slot as u64 * block_bytes as u64
    }

    /// Queues on `stream` the copies of `plan`'s fetches from the layer's bank `blocks` into the slab at
    /// `slab_base`, then commits the plan to `cache`; returns how many copies. If a copy fails to queue, the plan is
    /// given up instead, so that the cache never believes an expert resident whose copy was not queued.
    fn apply(
        cache: &mut ExpertCache,
        bank: &mut HostBank,
        blocks: &[usize],
        plan: &Plan,
        slab_base: u64,
        stream: &Arc<CudaStream>,
    ) -> Result<u64> {
        for (queued, &(expert, slot)) in plan.fetch.iter().enumerate() {
            let dst = Self::slot_address(slab_base, bank.block_bytes(), slot);
            let copied = match blocks.get(expert as usize) {
                Some(&block) => bank.copy_to_device(block, dst, stream),
                None => Err(Error::Cuda(format!(
                    "routed to expert {expert} of a layer of {} experts",
                    blocks.len()
                ))),
            };
            if let Err(error) = copied {
                cache.abort(plan, queued)?;
                return Err(error);
            }
        }
        cache.commit(plan)?;
        Ok(plan.fetch.len() as u64)
    }

    /// Makes the routed experts of `layer` resident for this step: returns the layer's slot addresses by expert
    /// (0 for experts not routed now) after queueing the copies and the table upload, which `compute` waits for.
    pub fn prepare_layer(
        &mut self,
        compute: &Arc<CudaStream>,
        layer: usize,
        routing: &CudaRouting,
        table: &CudaSlice<u64>,
    ) -> Result<Vec<u64>> {
        let routed = routing.rows * routing.top_k;
        if self.routed_host.as_ref().is_none_or(|h| h.len() < routed) {
            self.routed_host = Some(
                unsafe { self.ctx.alloc_pinned_with_flags::<i32>(routed.next_power_of_two(), 0) }
                    .map_err(cuda_err("pinning the routing buffer"))?,
            );
        }
        let Some(host) = self.routed_host.as_mut() else {
            return Err(Error::Cuda("no routing buffer".into()));
        };
        let ids_address = routing.ids.device_ptr(compute).0;
        let dst = &mut host.as_mut_slice().map_err(cuda_err("routing buffer"))?[..routed];
        unsafe { cudarc::driver::result::memcpy_dtoh_async(dst, ids_address, compute.cu_stream()) }
            .map_err(cuda_err("routing to the host"))?;
        // The host needs the ids to plan; every earlier kernel has finished too, so no slot is still being read.
        compute.synchronize().map_err(cuda_err("waiting for the router"))?;
        let ids: Vec<u32> = host.as_slice().map_err(cuda_err("routing buffer"))?[..routed]
            .iter()
            .map(|&e| e as u32)
            .collect();
        let plan = self.cache.plan(layer as u32, &ids)?;
        let (Some(bank), Some(slab)) = (self.bank.as_mut(), self.slab.as_ref()) else {
            return Err(Error::Cuda(
                "expert offload used before any MoE layer was loaded".into(),
            ));
        };
        let (base, block_bytes) = (slab.device_ptr(compute).0, bank.block_bytes());
        let layer_state = self
            .layers
            .get_mut(layer)
            .ok_or_else(|| Error::Cuda(format!("no MoE layer {layer}")))?;
        let layer_experts = layer_state.bank_blocks.len();
        self.copies += Self::apply(
            &mut self.cache,
            bank,
            &layer_state.bank_blocks,
            &plan,
            base,
            &self.copy_stream,
        )?;
        let mirror = layer_state.table_host.as_mut_slice().map_err(cuda_err("slot table"))?;
        mirror.fill(0);
        for &(expert, slot) in plan.resident.iter().chain(&plan.fetch) {
            mirror[expert as usize] = Self::slot_address(base, block_bytes, slot);
        }
        let table_address = table.device_ptr(&self.copy_stream).0;
        let mirror = layer_state.table_host.as_slice().map_err(cuda_err("slot table"))?;
        unsafe { cudarc::driver::result::memcpy_htod_async(table_address, mirror, self.copy_stream.cu_stream()) }
            .map_err(cuda_err("uploading a slot table"))?;
        let addresses = mirror.to_vec();
        let ready = self.copy_stream.record_event(None).map_err(cuda_err("copy event"))?;
        compute.wait(&ready).map_err(cuda_err("waiting for expert copies"))?;
        // A batch that routes to nearly all of this layer's experts (a prefill chunk) will route to nearly all of
        // the next layer's: copy those now, behind this layer's copies and while this layer computes, instead of
        // after the next router. The next layer's event covers them (one copy stream, in order). Only this
        // layer's experts are still read by a kernel (the compute stream was synchronized above), and the
        // prefetch spares them.
        let routed_experts = plan.resident.len() + plan.fetch.len();
        if let Some(next) = self.layers.get(layer + 1) {
            let next_experts = next.bank_blocks.len();
            if routed_experts * PREFETCH_SHARE.1 >= layer_experts * PREFETCH_SHARE.0
                && routed_experts + next_experts <= self.slots
            {
                let all: Vec<u32> = (0..next_experts as u32).collect();
                let prefetch = self.cache.plan_prefetch(layer as u32 + 1, &all)?;
                let copied = Self::apply(
                    &mut self.cache,
                    bank,
                    &next.bank_blocks,
                    &prefetch,
                    base,
                    &self.copy_stream,
                )?;
                self.copies += copied;
                self.prefetched += copied;
            }
        }
        Ok(addresses)
    }

    pub fn stats(&self) -> OffloadStats {
        let counts = self.cache.layer_counts();
        let bank = self.bank.as_ref();
        OffloadStats {
            slots: self.slots,
            bytes_per_expert: bank.map_or(0, |b| b.block_bytes()),
            bank_bytes: bank.map_or(0, |b| b.bytes()),
            bank_pinned: bank.is_some_and(|b| b.is_pinned()),
            layer_hits: counts.iter().map(|c| c.hits).collect(),
            layer_misses: counts.iter().map(|c| c.misses).collect(),
            bytes_copied: self.copies * bank.map_or(0, |b| b.block_bytes()) as u64,
            copies: self.copies,
            prefetched: self.prefetched,
        }
    }
}

//! Expert offload: the routed experts live in the host [`HostBank`]; one device slab of equal slots, shared by all
//! MoE layers, caches the hot ones. Per layer and step the routed ids of the whole batch come to the host (the
//! layer's one wait for the device, whose time [`OffloadStats`] counts), the [`ExpertCache`] plans hits and misses,
//! misses are copied bank -> slot on a dedicated copy stream with an event after each, and the layer's device slot
//! table is rewritten for the routed experts. moe.rs then runs the same expert kernels as the all-resident path:
//! in decode over the resident experts at once and over each copied expert as soon as its event fires, so compute
//! runs under the copies; only where the weights live, and when each expert's work starts, differ.
//!
//! Prefetch, of two kinds. A step that routes to nearly all of a layer's experts (prefill) queues the next layer's
//! experts behind its own, so the bank streams while the layers compute. In decode, the model hands over a guess of
//! the next MoE layer's routing (that layer's router applied to this layer's input, [`Offload::guess_next`]); its
//! ids come to the host with this layer's, and the guessed misses are copied one at a time behind this layer's own
//! copies: the first as soon as they are queued, each next one once the last has landed, noticed while the host
//! waits for the next router and at every kernel launch in between ([`Offload::copy_guesses`]), so the link does
//! not idle while the host launches. A guess never goes ahead of a needed copy, at most one guessed copy is still
//! in flight when the next layer's own copies are queued, and the guesses not yet copied when that layer routes
//! are dropped.
//!
//! The CPU lane. With a [`SplitRule`] other than `Link`, the misses of each step are split ([`plan_split`]): the
//! link's share is copied as above, the host's is computed by the CPU lane (offload_lane.rs) straight from the
//! bank, bf16 or FP8, while the GPU runs the rest. The layer's input rows come to the host with the routed ids
//! (the same wait); the compute stream waits for the lane only before the products' upload and moe_combine, which
//! sums them in router order with the GPU's. A step whose split gives the lane nothing runs as offload's does.
//! Under [`SplitRule::Calibrated`] the split's rates are refined as it runs ([`LaneCalibration`]): each lane job's
//! cost to the pipeline (from its start to the stream's release past its wait, offload_lane.rs) and each layer's
//! link time (the timed events around its copies, read one layer later) are fed back before the next split.
//!
//! The offload is part of the backend from its construction ([`CudaBackend::builder`]), with the eviction policy
//! and the split rule its caller chose.

use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::{sys, CudaContext, CudaEvent, CudaSlice, CudaStream, DevicePtr, PinnedHostSlice};

use super::bank::HostBank;
use super::expert_format::{ExpertFormat, ExpertGlu};
use super::offload_lane::{host_pairs, OffloadLane};
use super::{cuda_err, CudaBackend, CudaRouting, CudaTensor};
use crate::backend::{ExpertTensors, SeqSlice};
use crate::moe::{
    plan_split, rows_per_expert, EvictionPolicy, ExpertCache, LaneCalibration, LaneGuard, OffloadStats, Plan, Regime,
    SplitRule,
};
use crate::{Error, Result};

mod guess;

/// How experts are offloaded: the GPU cache's slots (each holds one expert of any MoE layer) and the policy that
/// picks which expert leaves a slot.
pub struct OffloadConfig {
    pub slots: usize,
    pub policy: Box<dyn EvictionPolicy>,
    /// Whether decode steps copy the guessed experts of the next MoE layer ahead of its router.
    pub decode_prefetch: bool,
}

impl CudaBackend {
    /// Starts the expert offload over as a fresh backend would start it, the loaded bank kept: an empty cache under
    /// `policy`, the misses split by `split`, no guesses and no calibration. `ferry bench` measures several
    /// strategies and routings on one load with it (a large model's load costs minutes). Waits for the device
    /// first, so that nothing in flight reads a slot the new cache may give away.
    pub fn restart_offload(&self, policy: Box<dyn EvictionPolicy>, split: SplitRule) -> Result<()> {
        let Some(offload) = &self.offload else {
            return Err(Error::Config(
                "restarting the expert offload of a backend without one".into(),
            ));
        };
        self.stream.synchronize().map_err(cuda_err("waiting for the device"))?;
        let mut offload = offload.lock().unwrap_or_else(|e| e.into_inner());
        offload
            .copy_stream
            .synchronize()
            .map_err(cuda_err("waiting for the expert copies"))?;
        offload.restart(policy, split)
    }
}

/// Prefetch the next layer's experts when a step routes to at least this share (numerator, denominator) of a
/// layer's experts: a batch that wide is a prefill chunk, and the next layer will want nearly all of its experts.
const PREFETCH_SHARE: (usize, usize) = (7, 8);

/// One MoE layer under offload: where its experts sit in the bank (by expert id; None for another rank's expert
/// under expert parallelism, which this offload never plans, copies nor computes), and its slot table (device and
/// a pinned host mirror the table is uploaded from).
struct OffloadLayer {
    bank_blocks: Vec<Option<usize>>,
    format: ExpertFormat,
    /// What the layer's experts compute around their products, for the CPU lane.
    glu: ExpertGlu,
    table_host: PinnedHostSlice<u64>,
}

impl OffloadLayer {
    /// Whether this offload holds `expert` of the layer.
    fn holds(&self, expert: u32) -> bool {
        self.bank_blocks.get(expert as usize).is_some_and(Option::is_some)
    }

    /// Whether `expert` is another rank's (an expert of the layer this offload does not hold).
    fn is_other_ranks(&self, expert: u32) -> bool {
        matches!(self.bank_blocks.get(expert as usize), Some(None))
    }

    /// The experts this offload holds, in id order.
    fn held(&self) -> impl Iterator<Item = u32> + '_ {
        (0..self.bank_blocks.len() as u32).filter(|&e| self.holds(e))
    }
}

/// What the expert kernels of one layer wait for under offload ([`Offload::prepare_layer`]).
pub struct LayerCopies {
    /// The layer's slot addresses by expert (0 for experts not routed now).
    pub addresses: Vec<u64>,
    /// The routed ids, `[rows * top_k]`, as the host read them.
    pub ids: Vec<i32>,
    /// Recorded on the copy stream before this layer's own copies: every expert resident before them has landed
    /// (a prefetch's copies included).
    pub resident_ready: CudaEvent,
    /// Each expert copied in for this layer, in plan order, with the event recorded after its copy.
    pub fetched: Vec<(u32, CudaEvent)>,
    /// The misses the CPU lane computes, in first-routed order: no slot holds them. The lane has started on them.
    pub host: Vec<u32>,
    /// Per (row, k) pair, its row among the lane's products, or -1 where the GPU computes it (empty when the lane
    /// has nothing). Under expert parallelism a pair on another rank's expert reads the row after the lane's, to
    /// be kept zero.
    pub host_index: Vec<i32>,
}

impl LayerCopies {
    /// The event after the last of this layer's copies (all of them have landed once it fires).
    pub fn all_ready(&self) -> &CudaEvent {
        self.fetched.last().map_or(&self.resident_ready, |(_, event)| event)
    }
}

/// A guess of a later MoE layer's routing, as the model handed it ([`Offload::guess_next`]).
struct RoutingGuess {
    layer: usize,
    routing: CudaRouting,
}

/// A guess read on the host: the distinct guessed experts of `layer` (scored against what the layer routes), and
/// the guessed misses still to copy, the next one last.
struct NextLayerGuess {
    layer: usize,
    experts: Vec<u32>,
    to_copy: Vec<u32>,
}

pub struct Offload {
    /// The CPU lane when the split rule may give it any miss. First, so that it is dropped (its thread joined)
    /// before the bank it reads.
    lane: Option<OffloadLane>,
    ctx: Arc<CudaContext>,
    copy_stream: Arc<CudaStream>,
    slots: usize,
    decode_prefetch: bool,
    bank: Option<HostBank>,
    slab: Option<CudaSlice<u8>>,
    cache: ExpertCache,
    layers: Vec<OffloadLayer>,
    routed_host: Option<PinnedHostSlice<i32>>,
    /// Recorded after the last guessed copy queued: the next one waits until it has fired.
    guess_in_flight: Option<CudaEvent>,
    /// The guess handed over for the next layer, its ids still on the device.
    guess: Option<RoutingGuess>,
    /// The guess read with the last layer's ids, being copied while the host waits for its layer's router.
    next_guess: Option<NextLayerGuess>,
    /// Every counter of [`OffloadStats`] the cache does not keep.
    counters: OffloadStats,
    /// Per row of the batch being run, whether it is a prefill chunk's (a slice of more than one token): what the
    /// cache tells its policy of each expert's use.
    prefill_rows: Vec<bool>,
    /// Who computes the misses.
    split: SplitRule,
    /// Under [`SplitRule::Calibrated`], the rates refined by what each lane costs in the pipeline (made with the
    /// first layer, when the experts' size is known).
    calibration: Option<LaneCalibration>,
    /// Timed events around the last layer's demand copies, read once they have landed (the link's busy time), and
    /// the bytes they copied.
    link_timing: Option<(CudaEvent, CudaEvent, usize)>,
    /// Under [`SplitRule::Calibrated`], how decode steps split their misses (on the calibrated rates, on the
    /// startup ones, or not at all), by what whole steps took each way.
    guard: Option<LaneGuard>,
    /// The decode step being run under the guard: its rows and regime.
    guarded_step: Option<(usize, Regime)>,
}

impl Offload {
    pub(super) fn new(ctx: Arc<CudaContext>, config: OffloadConfig, split: SplitRule) -> Result<Self> {
        let lane = match split {
            SplitRule::Link => None,
            _ => Some(OffloadLane::new()?),
        };
        let slots = u32::try_from(config.slots)
            .map_err(|_| Error::Cuda(format!("{} expert cache slots are too many", config.slots)))?;
        Ok(Offload {
            copy_stream: ctx.new_stream().map_err(cuda_err("creating the copy stream"))?,
            ctx,
            slots: config.slots,
            decode_prefetch: config.decode_prefetch,
            bank: None,
            slab: None,
            cache: ExpertCache::new(slots, config.policy),
            layers: Vec::new(),
            routed_host: None,
            guess_in_flight: None,
            guess: None,
            next_guess: None,
            counters: OffloadStats::default(),
            prefill_rows: Vec::new(),
            split,
            calibration: None,
            lane,
            link_timing: None,
            guard: matches!(split, SplitRule::Calibrated(_)).then(LaneGuard::default),
            guarded_step: None,
        })
    }

    /// See [`CudaBackend::restart_offload`]; the device is idle.
    fn restart(&mut self, policy: Box<dyn EvictionPolicy>, split: SplitRule) -> Result<()> {
        let slots = u32::try_from(self.slots)
            .map_err(|_| Error::Cuda(format!("{} expert cache slots are too many", self.slots)))?;
        if let Some(lane) = self.lane.as_mut() {
            lane.collect()?;
        }
        self.lane = match (split, self.lane.take()) {
            (SplitRule::Link, _) => None,
            (_, Some(lane)) => Some(lane),
            (_, None) => Some(OffloadLane::new()?),
        };
        self.cache = ExpertCache::new(slots, policy);
        self.guess = None;
        self.next_guess = None;
        self.guess_in_flight = None;
        self.link_timing = None;
        self.calibration = match (split, &self.bank) {
            (SplitRule::Calibrated(prior), Some(bank)) => Some(LaneCalibration::new(prior, bank.block_bytes())),
            _ => None,
        };
        self.guard = matches!(split, SplitRule::Calibrated(_)).then(LaneGuard::default);
        self.guarded_step = None;
        self.split = split;
        Ok(())
    }

    /// The step started by the last [`Offload::start_batch`] took `seconds` on the host, its forward pass from start
    /// to end: what the guard weighs each regime by.
    pub fn end_step(&mut self, seconds: f64) {
        if let (Some(guard), Some((rows, regime))) = (self.guard.as_mut(), self.guarded_step.take()) {
            guard.observe(rows, regime, seconds);
        }
    }

    /// Whether the MoE blocks of a step of `rows` rows should guess the next layer's routing: decode steps (at
    /// most `decode_rows` rows), when decode prefetch is on.
    pub fn wants_guess(&self, rows: usize, decode_rows: usize) -> bool {
        // With every miss on the host nothing is copied, guesses included.
        self.decode_prefetch && rows <= decode_rows && self.split != SplitRule::Cpu
    }

    /// Puts a layer's `experts` in the bank: those of the ids `held` marks, in id order (all of them, except for a
    /// rank's share under expert parallelism). The slab is made with the first layer, when the block size is
    /// known. Returns the layer's index.
    pub fn add_layer(
        &mut self,
        stream: &Arc<CudaStream>,
        experts: &[ExpertTensors],
        held: &[bool],
        glu: ExpertGlu,
    ) -> Result<usize> {
        let first = experts
            .first()
            .ok_or_else(|| Error::Config("a MoE layer (or a rank's part of one) without experts".into()))?;
        if held.iter().filter(|&&h| h).count() != experts.len() {
            return Err(Error::Shape(format!(
                "{} experts for {} held ids",
                experts.len(),
                held.iter().filter(|&&h| h).count()
            )));
        }
        let format = ExpertFormat::of(experts)?;
        let block_bytes = format.block_bytes(first.gate.shape[0], first.gate.shape[1], glu.biased());
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
            if let SplitRule::Calibrated(prior) = self.split {
                self.calibration = Some(LaneCalibration::new(prior, block_bytes));
            }
        }
        let Some(bank) = self.bank.as_mut() else {
            return Err(Error::Cuda("no expert bank".into()));
        };
        if block_bytes != bank.block_bytes() {
            return Err(Error::Cuda("MoE layers with experts of different sizes".into()));
        }
        let mut pushed = experts.iter().map(|e| bank.push(&format.block_parts(e)?));
        let bank_blocks = held
            .iter()
            .map(|&held| if held { pushed.next().transpose() } else { Ok(None) })
            .collect::<Result<_>>()?;
        let mut table_host = unsafe { self.ctx.alloc_pinned_with_flags::<u64>(held.len(), 0) }
            .map_err(cuda_err("pinning a slot table"))?;
        table_host.as_mut_slice().map_err(cuda_err("slot table"))?.fill(0);
        self.layers.push(OffloadLayer {
            bank_blocks,
            format,
            glu,
            table_host,
        });
        Ok(self.layers.len() - 1)
    }

    /// Notes which rows of the next batch are prefill rows (see `prefill_rows`).
    pub fn start_batch(&mut self, batch: &[SeqSlice]) {
        self.prefill_rows.clear();
        for slice in batch {
            self.prefill_rows.extend(std::iter::repeat_n(slice.len > 1, slice.len));
        }
        // Decode steps only: a prompt's chunk gains from the lane whatever its cost per step (its rarely used
        // experts), and a mixed step is measured by neither regime.
        let decode = batch.iter().all(|slice| slice.len == 1);
        self.guarded_step = match self.guard.as_mut() {
            Some(guard) if decode && !batch.is_empty() => Some((batch.len(), guard.choose(batch.len()))),
            _ => None,
        };
    }

    /// The device address of `slot`, given the slab's base.
    fn slot_address(slab_base: u64, block_bytes: usize, slot: u32) -> u64 {
        slab_base + slot as u64 * block_bytes as u64
    }

    /// Queues on `stream` the copies of `plan`'s fetches from the layer's bank `blocks` into the slab at
    /// `slab_base`, each followed by an event, then commits the plan to `cache`; returns each fetched expert with its
    /// event. If a copy or event fails to queue, the plan is given up instead, so that the cache never believes an
    /// expert resident whose copy was not queued.
    fn apply(
        cache: &mut ExpertCache,
        bank: &mut HostBank,
        blocks: &[Option<usize>],
        plan: &Plan,
        slab_base: u64,
        stream: &Arc<CudaStream>,
    ) -> Result<Vec<(u32, CudaEvent)>> {
        let mut fetched = Vec::with_capacity(plan.fetch.len());
        for (queued, &(expert, slot)) in plan.fetch.iter().enumerate() {
            let dst = Self::slot_address(slab_base, bank.block_bytes(), slot);
            let copied = match blocks.get(expert as usize) {
                Some(&Some(block)) => bank.copy_to_device(block, dst, stream),
                Some(None) => Err(Error::Cuda(format!("expert {expert} is another rank's"))),
                None => Err(Error::Cuda(format!(
                    "routed to expert {expert} of a layer of {} experts",
                    blocks.len()
                ))),
            };
            if let Err(error) = copied {
                cache.abort(plan, queued)?;
                return Err(error);
            }
            match stream.record_event(None) {
                Ok(event) => fetched.push((expert, event)),
                Err(error) => {
                    cache.abort(plan, queued + 1)?;
                    return Err(cuda_err("copy event")(error));
                }
            }
        }
        cache.commit(plan)?;
        Ok(fetched)
    }

    /// Brings the ids of `routings` (the layer's own, then a guess's) to the host, one after the other: the
    /// layer's one wait for the device (every kernel queued so far has finished after it, so no slot is still being
    /// read). While it waits, the host copies guessed experts whenever the copy stream is idle; those still
    /// uncopied when the ids arrive are dropped.
    fn read_ids(
        &mut self,
        compute: &Arc<CudaStream>,
        routings: &[&CudaRouting],
        rows: Option<&CudaTensor>,
    ) -> Result<Vec<i32>> {
        let len: usize = routings.iter().map(|r| r.rows * r.top_k).sum();
        if let (Some(x), Some(lane)) = (rows, self.lane.as_mut()) {
            // The layer's input is complete before its router ran, so it arrives with the ids.
            lane.read_rows(&self.ctx, compute, x)?;
        }
        if self.routed_host.as_ref().is_none_or(|h| h.len() < len) {
            self.routed_host = Some(
                unsafe { self.ctx.alloc_pinned_with_flags::<i32>(len.next_power_of_two(), 0) }
                    .map_err(cuda_err("pinning the routing buffer"))?,
            );
        }
        {
            let Some(host) = self.routed_host.as_mut() else {
                return Err(Error::Cuda("no routing buffer".into()));
            };
            let mut dst = host.as_mut_slice().map_err(cuda_err("routing buffer"))?;
            for routing in routings {
                let (part, rest) = dst.split_at_mut(routing.rows * routing.top_k);
                let ids_address = routing.ids.device_ptr(compute).0;
                unsafe { cudarc::driver::result::memcpy_dtoh_async(part, ids_address, compute.cu_stream()) }
                    .map_err(cuda_err("routing to the host"))?;
                dst = rest;
            }
        }
        let arrived = compute.record_event(None).map_err(cuda_err("routing event"))?;
        let waiting = Instant::now();
        while !arrived.try_is_complete().map_err(cuda_err("waiting for the router"))? {
            if !self.copy_guesses()? {
                arrived.synchronize().map_err(cuda_err("waiting for the router"))?;
                break;
            }
            std::hint::spin_loop();
        }
        self.counters.router_waits += 1;
        self.counters.router_wait_ns += waiting.elapsed().as_nanos() as u64;
        if let Some(guess) = self.next_guess.as_mut() {
            self.counters.guesses_dropped += guess.to_copy.len() as u64;
            guess.to_copy.clear();
        }
        let Some(host) = self.routed_host.as_ref() else {
            return Err(Error::Cuda("no routing buffer".into()));
        };
        Ok(host.as_slice().map_err(cuda_err("routing buffer"))?[..len].to_vec())
    }

    /// Makes the routed experts of `layer` resident for this step, or leaves them to the CPU lane: reads the routed
    /// ids (and those of a guess handed over for the next layer, and with the lane on the rows of `x`), splits the
    /// misses, plans, starts the CPU lane on its share ([`LayerCopies::host`], experts `inter` wide), queues the
    /// copies of the link's misses, each with its event, and the slot table's upload on `compute`. The caller makes
    /// `compute` wait for the returned events before the kernels that read the experts, and for the lane
    /// ([`Offload::queue_host_products`]) before the products are summed.
    pub fn prepare_layer(
        &mut self,
        compute: &Arc<CudaStream>,
        layer: usize,
        routing: &CudaRouting,
        table: &CudaSlice<u64>,
        (x, inter): (&CudaTensor, usize),
    ) -> Result<LayerCopies> {
        let routed = routing.rows * routing.top_k;
        let guess = self.guess.take();
        let mut routings = vec![routing];
        routings.extend(guess.as_ref().map(|g| &g.routing));
        let rows = self.lane.is_some().then_some(x);
        let all_ids = self.read_ids(compute, &routings, rows)?;
        self.read_link_timing()?;
        // The last layer's lane job is done: the stream passed its host function before this router.
        if let Some(done) = self.lane.as_mut().map(OffloadLane::collect).transpose()?.flatten() {
            self.counters.host_experts += done.experts as u64;
            self.counters.host_pairs += done.pairs as u64;
            self.counters.host_bytes += done.bytes as u64;
            self.counters.host_ns += done.busy.as_nanos() as u64;
            self.counters.host_pipeline_ns += done.pipeline.as_nanos() as u64;
            if let Some(calibration) = self.calibration.as_mut() {
                calibration.observe_cpu(&done.rows, done.pipeline.as_secs_f64());
            }
        }
        let ids: Vec<u32> = all_ids[..routed].iter().map(|&e| e as u32).collect();
        // Rows of a batch that was not started here (an op called on its own) all count as decode rows.
        let prefill_rows = if self.prefill_rows.len() == routing.rows {
            &self.prefill_rows[..]
        } else {
            &[]
        };
        let shard = self.held_pairs(layer, &ids, prefill_rows, routing.top_k)?;
        let (ids, prefill_rows) = match &shard {
            Some((ids, prefill)) => (ids, &prefill[..]),
            None => (&ids, prefill_rows),
        };
        let host = self.split_misses(layer, ids);
        let plan = self
            .cache
            .plan_batch_elsewhere(layer as u32, ids, prefill_rows, |e| host.contains(&e))?;
        // The lane first: nothing it reads waits for the copies or the slot table queued below.
        let host_index = if plan.elsewhere.is_empty() {
            Vec::new()
        } else {
            let layer_state = self.layers.get(layer);
            let experts = layer_state.map_or(0, |l| l.bank_blocks.len());
            let share = host_pairs(&all_ids[..routed], routing.top_k, &plan.elsewhere, experts)?;
            let mut index = share.index;
            // Another rank's pairs read the row after the lane's products, which stays zero.
            let zero_row = share.pairs.len() as i32;
            for (at, &e) in index.iter_mut().zip(&all_ids[..routed]) {
                if layer_state.is_some_and(|l| l.is_other_ranks(e as u32)) {
                    *at = zero_row;
                }
            }
            self.start_on_host(layer, (x.rows, x.cols), inter, &plan.elsewhere, share.pairs)?;
            index
        };
        let routed_experts: Vec<u32> = plan.resident.iter().chain(&plan.fetch).map(|&(e, _)| e).collect();
        if let Some(scored) = self.next_guess.take().filter(|g| g.layer == layer) {
            // A guess is right when its layer routed the expert, whichever lane then computed it.
            let routed_anywhere = |e: &u32| routed_experts.contains(e) || plan.elsewhere.contains(e);
            let hits = scored.experts.iter().filter(|e| routed_anywhere(e)).count();
            self.counters.guessed += scored.experts.len() as u64;
            self.counters.guessed_routed += hits as u64;
            self.counters.routed_after_guess += (routed_experts.len() + plan.elsewhere.len()) as u64;
        }
        self.counters.routed_pairs += ids.len() as u64;
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
        let layer_experts = layer_state.held().count();
        let resident_ready = self.copy_stream.record_event(None).map_err(cuda_err("copy event"))?;
        let link_start = timed_event(&self.ctx, &self.copy_stream, !plan.fetch.is_empty())?;
        let fetched = Self::apply(
            &mut self.cache,
            bank,
            &layer_state.bank_blocks,
            &plan,
            base,
            &self.copy_stream,
        )?;
        self.counters.copies += fetched.len() as u64;
        if let Some(start) = link_start {
            self.link_timing =
                timed_event(&self.ctx, &self.copy_stream, true)?.map(|end| (start, end, fetched.len() * block_bytes));
        }
        let mirror = layer_state.table_host.as_mut_slice().map_err(cuda_err("slot table"))?;
        mirror.fill(0);
        for &(expert, slot) in plan.resident.iter().chain(&plan.fetch) {
            mirror[expert as usize] = Self::slot_address(base, block_bytes, slot);
        }
        // On the compute stream, ahead of the kernels that read it. The pinned mirror is next rewritten at this
        // layer's next step, after the host has waited for a later router, so this upload is done by then.
        let table_address = table.device_ptr(compute).0;
        let mirror = layer_state.table_host.as_slice().map_err(cuda_err("slot table"))?;
        unsafe { cudarc::driver::result::memcpy_htod_async(table_address, mirror, compute.cu_stream()) }
            .map_err(cuda_err("uploading a slot table"))?;
        let addresses = mirror.to_vec();
        // A batch that routes to nearly all of this layer's experts (a prefill chunk) will route to nearly all of
        // the next layer's: copy those now, behind this layer's copies and while this layer computes, instead of
        // after the next router. The next layer's kernels wait for them (its `resident_ready`). Only this layer's
        // experts are still read by a kernel (every earlier one has finished), and the prefetch spares them. Only
        // where this step's split gave the CPU lane nothing (the next layer's experts that few rows use would be
        // the lane's), and never when no expert may cross the link.
        let link_alone = plan.elsewhere.is_empty() && self.split != SplitRule::Cpu;
        if let (Some(next), true) = (self.layers.get(layer + 1), link_alone) {
            if routed_experts.len() * PREFETCH_SHARE.1 >= layer_experts * PREFETCH_SHARE.0
                && routed_experts.len() + next.held().count() <= self.slots
            {
                let all: Vec<u32> = next.held().collect();
                let prefetch = self.cache.plan_prefetch(layer as u32 + 1, &all)?;
                let copied = Self::apply(
                    &mut self.cache,
                    bank,
                    &next.bank_blocks,
                    &prefetch,
                    base,
                    &self.copy_stream,
                )?;
                self.counters.copies += copied.len() as u64;
                self.counters.prefetched += copied.len() as u64;
            }
        }
        self.guess_in_flight = None;
        if let Some(guess) = guess {
            self.keep_guess(guess.layer, &all_ids[routed..]);
            // The first guess right behind this layer's copies: the link has work while the host launches.
            self.copy_guesses()?;
        }
        Ok(LayerCopies {
            addresses,
            ids: all_ids[..routed].to_vec(),
            resident_ready,
            fetched,
            host: plan.elsewhere,
            host_index,
        })
    }

    /// Under expert parallelism, the routed `ids` (`[rows * top_k]`) of `layer` whose experts this offload holds,
    /// each with its row's flag of `prefill_rows` (empty: all decode rows): the pairs it plans, the others being
    /// other ranks'. None when it holds all of the layer's experts.
    #[allow(clippy::type_complexity)]
    fn held_pairs(
        &self,
        layer: usize,
        ids: &[u32],
        prefill_rows: &[bool],
        top_k: usize,
    ) -> Result<Option<(Vec<u32>, Vec<bool>)>> {
        let layer_state = self
            .layers
            .get(layer)
            .ok_or_else(|| Error::Cuda(format!("no MoE layer {layer}")))?;
        if !layer_state.bank_blocks.contains(&None) {
            return Ok(None);
        }
        let pairs: Vec<(usize, &u32)> = ids.iter().enumerate().filter(|&(_, &e)| layer_state.holds(e)).collect();
        let prefill = if prefill_rows.is_empty() {
            Vec::new()
        } else {
            pairs
                .iter()
                .map(|&(pair, _)| prefill_rows[pair / top_k.max(1)])
                .collect()
        };
        Ok(Some((pairs.into_iter().map(|(_, &e)| e).collect(), prefill)))
    }

    /// The misses of `layer` among `ids` that the CPU lane takes, by the split rule.
    fn split_misses(&self, layer: usize, ids: &[u32]) -> Vec<u32> {
        if self.split == SplitRule::Link || matches!(self.guarded_step, Some((_, Regime::LinkOnly))) {
            return Vec::new();
        }
        let (misses, hits): (Vec<_>, Vec<_>) = rows_per_expert(ids)
            .into_iter()
            .partition(|m| self.cache.slot_of((layer as u32, m.expert)).is_none());
        let bytes = self.bank.as_ref().map_or(0, |b| b.block_bytes());
        let rule = match (self.guarded_step, self.split, &self.calibration) {
            (Some((_, Regime::Startup)), SplitRule::Calibrated(prior), _) => SplitRule::Balanced(prior),
            (_, _, Some(calibration)) => SplitRule::Balanced(calibration.rates()),
            _ => self.split,
        };
        plan_split(rule, &misses, hits.len(), bytes).cpu
    }

    /// Adds the link's busy time over the last layer's demand copies, which have landed by the time the next
    /// router's ids are read (the kernels that waited for them ran before that router), and under calibration
    /// feeds it to the link's rate.
    fn read_link_timing(&mut self) -> Result<()> {
        if let Some((start, end, bytes)) = self.link_timing.take() {
            let ms = start.elapsed_ms(&end).map_err(cuda_err("timing the expert copies"))?;
            self.counters.link_ns += (ms as f64 * 1e6) as u64;
            if let Some(calibration) = self.calibration.as_mut() {
                calibration.observe_link(bytes, ms as f64 * 1e-3);
            }
        }
        Ok(())
    }

    /// Starts the CPU lane on `pairs` (row of the layer's input, index into `experts`) of `layer`'s host
    /// `experts` and returns at once; [`Offload::queue_host_products`] queues the stream's wait for it.
    fn start_on_host(
        &mut self,
        layer: usize,
        x_shape: (usize, usize),
        inter: usize,
        experts: &[u32],
        pairs: Vec<(u32, u32)>,
    ) -> Result<()> {
        let (Some(lane), Some(bank)) = (self.lane.as_mut(), self.bank.as_ref()) else {
            return Err(Error::Cuda("the CPU lane is off, or no layer is loaded".into()));
        };
        let layer_state = self
            .layers
            .get(layer)
            .ok_or_else(|| Error::Cuda(format!("no MoE layer {layer}")))?;
        let blocks = experts
            .iter()
            .map(|&e| {
                let block = layer_state
                    .bank_blocks
                    .get(e as usize)
                    .copied()
                    .flatten()
                    .ok_or_else(|| Error::Cuda(format!("no expert {e} of MoE layer {layer} here")))?;
                bank.block(block)
            })
            .collect::<Result<Vec<_>>>()?;
        lane.start(
            &self.ctx,
            x_shape,
            inter,
            &blocks,
            (layer_state.format, layer_state.glu),
            pairs,
        )
    }

    /// Queues on `compute` the wait for the lane's job and the upload of its products into `products`.
    pub fn queue_host_products(&mut self, compute: &Arc<CudaStream>, products: &CudaTensor) -> Result<()> {
        self.lane
            .as_mut()
            .ok_or_else(|| Error::Cuda("the CPU lane is off".into()))?
            .queue_products(compute, products)
    }

    pub fn stats(&self) -> OffloadStats {
        let counts = self.cache.layer_counts();
        let bank = self.bank.as_ref();
        let bytes_per_expert = bank.map_or(0, |b| b.block_bytes());
        OffloadStats {
            slots: self.slots,
            bytes_per_expert,
            bank_bytes: bank.map_or(0, |b| b.bytes()),
            bank_pinned: bank.is_some_and(|b| b.is_pinned()),
            layer_hits: counts.iter().map(|c| c.hits).collect(),
            layer_misses: counts.iter().map(|c| c.misses).collect(),
            bytes_copied: self.counters.copies * bytes_per_expert as u64,
            prefetches_used: self.cache.prefetches_used(),
            calibrated: self.calibration.as_ref().map(LaneCalibration::summary),
            ..self.counters.clone()
        }
    }
}

/// A timed event recorded on `stream` when `wanted` (the offload's other events skip timing).
fn timed_event(ctx: &Arc<CudaContext>, stream: &Arc<CudaStream>, wanted: bool) -> Result<Option<CudaEvent>> {
    if !wanted {
        return Ok(None);
    }
    let event = ctx
        .new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
        .map_err(cuda_err("timing event"))?;
    event.record(stream).map_err(cuda_err("timing event"))?;
    Ok(Some(event))
}

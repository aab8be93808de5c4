//! Expert parallelism: a group of ranks (backends of one kind, one per device) that runs a model together. Every
//! rank holds the whole dense part (embedding, attention, norms, routers, shared experts, head) and computes it in
//! step with the others, each on its own copy of the KV cache; each routed expert has one home rank, the only one
//! that holds (caches, streams) and computes it. A MoE block's routed sum is each rank's share, summed across the
//! ranks by a [`Collective`], after which every rank holds the same activations again. So G devices hold G times
//! the experts and, under offload, stream them over G links.
//!
//! The group is itself a [`Backend`]: models, the executor and the scheduler run on it unchanged, each op issued
//! to every rank in turn from the calling thread (a device backend's ops are asynchronous, so the ranks compute at
//! once). The sum across ranks adds each rank's partial sum (its experts, in router order) in rank order, so a
//! group's results equal one backend's up to the order of f32 additions; a group of one rank runs exactly what
//! its backend runs alone.

use crate::backend::{
    AttentionParams, Backend, DeltaRuleParams, ExpertActivation, ExpertTensors, MlaParams, QkNormWeights, ResidualNorm,
    Rope, Router, RouterKind, SeqSlice,
};
use crate::kv::{BlockAllocator, KvCache, KvSpec, SeqId};
use crate::loader::TensorRef;
use crate::moe::OffloadStats;
use crate::{Error, Result};

/// Sums a tensor across the ranks of a group.
pub trait Collective<B: Backend>: Send + Sync {
    /// Replaces each rank's `xs[r]` (one tensor per rank, all of one shape) with the sum of all of them, the same
    /// on every rank.
    fn all_reduce_sum(&self, ranks: &[B], xs: &mut [B::Tensor]) -> Result<()>;
}

/// The ranks of an expert-parallel group and how they sum.
pub struct ExpertParallel<B: Backend> {
    ranks: Vec<B>,
    collective: Box<dyn Collective<B>>,
}

impl<B: Backend> ExpertParallel<B> {
    pub fn new(ranks: Vec<B>, collective: Box<dyn Collective<B>>) -> Result<Self> {
        if ranks.is_empty() {
            return Err(Error::Config("an expert-parallel group needs at least one rank".into()));
        }
        Ok(ExpertParallel { ranks, collective })
    }

    /// The group's ranks, in rank order.
    pub fn ranks(&self) -> &[B] {
        &self.ranks
    }

    /// `op` on every rank, in rank order.
    fn each<T>(&self, mut op: impl FnMut(usize, &B) -> Result<T>) -> Result<Vec<T>> {
        self.ranks.iter().enumerate().map(|(r, rank)| op(r, rank)).collect()
    }
}

/// The rank of a group of `ranks` that holds and computes routed expert `expert` of every MoE layer: experts are
/// dealt out in turn, so each rank holds an equal share of every layer (to within one) and, under routing that
/// favours no expert by its index, an equal share of each step's work.
pub fn home_rank(expert: usize, ranks: usize) -> usize {
    expert % ranks.max(1)
}

/// How many of a MoE layer's `experts` rank `rank` of a group of `ranks` is home to ([`home_rank`]).
pub fn home_experts(experts: usize, ranks: usize, rank: usize) -> usize {
    (0..experts).filter(|&e| home_rank(e, ranks) == rank).count()
}

/// What a group keeps between forward passes: each rank's own cache, whose block bookkeeping is the first rank's.
/// The scheduler changes the first rank's [`BlockAllocator`] (through [`KvCache::blocks_mut`]); the others copy it
/// before any of their own use, so every rank holds the same sequences in the same blocks.
pub struct RankedKv<K> {
    ranks: Vec<K>,
    /// The first rank's allocator changed since the others last copied it.
    stale: bool,
}

impl<K: KvCache> RankedKv<K> {
    /// Brings the other ranks' block bookkeeping up to the first rank's.
    fn sync(&mut self) {
        if !self.stale {
            return;
        }
        let (first, others) = self.ranks.split_first_mut().expect("a group has a rank");
        for kv in others {
            kv.blocks_mut().clone_from(first.blocks());
        }
        self.stale = false;
    }

    /// Every rank's cache, in step.
    fn synced(&mut self) -> &mut [K] {
        self.sync();
        &mut self.ranks
    }
}

impl<K: KvCache> KvCache for RankedKv<K> {
    fn alloc_seq(&mut self) -> SeqId {
        let ids: Vec<SeqId> = self.synced().iter_mut().map(KvCache::alloc_seq).collect();
        debug_assert!(ids.windows(2).all(|w| w[0] == w[1]), "ranks in step allocate alike");
        ids[0]
    }

    fn free_seq(&mut self, seq: SeqId) {
        self.synced().iter_mut().for_each(|kv| kv.free_seq(seq));
    }

    fn blocks(&self) -> &BlockAllocator {
        self.ranks[0].blocks()
    }

    fn blocks_mut(&mut self) -> &mut BlockAllocator {
        self.sync();
        self.stale = self.ranks.len() > 1;
        self.ranks[0].blocks_mut()
    }

    fn has_recurrent_state(&self) -> bool {
        self.ranks[0].has_recurrent_state()
    }

    fn grow(&mut self, seq: SeqId, tokens: usize) -> bool {
        let grown: Vec<bool> = self.synced().iter_mut().map(|kv| kv.grow(seq, tokens)).collect();
        debug_assert!(grown.windows(2).all(|w| w[0] == w[1]), "ranks in step grow alike");
        grown[0]
    }
}

fn router_at<'a, W>(router: &Router<'a, Vec<W>>, r: usize) -> Router<'a, W> {
    Router {
        kind: router.kind,
        top_k: router.top_k,
        correction_bias: router.correction_bias.map(|b| &b[r]),
    }
}

impl<B: Backend> Backend for ExpertParallel<B> {
    type Tensor = Vec<B::Tensor>;
    type Weight = Vec<B::Weight>;
    type Experts = Vec<B::Experts>;
    type Kv = RankedKv<B::Kv>;
    type Batch = Vec<B::Batch>;
    type Routing = Vec<B::Routing>;
    type RopeTable = Vec<B::RopeTable>;

    fn name(&self) -> String {
        format!(
            "{} ranks of {}, experts parallel",
            self.ranks.len(),
            self.ranks[0].name()
        )
    }

    fn synchronize(&self) -> Result<()> {
        self.each(|_, rank| rank.synchronize()).map(drop)
    }

    /// The ranks' offloads as one (`OffloadStats::of_ranks`): each caches and streams its own experts.
    fn offload_stats(&self) -> Option<OffloadStats> {
        OffloadStats::of_ranks(self.ranks.iter().map(B::offload_stats))
    }

    fn weight(&self, tensor: TensorRef) -> Result<Self::Weight> {
        self.each(|_, rank| rank.weight(tensor.clone()))
    }

    fn check_router(&self, kind: RouterKind) -> Result<()> {
        self.each(|_, rank| rank.check_router(kind)).map(drop)
    }

    /// Each rank's share of the layer: its home experts ([`home_rank`]); a group of one holds them
    /// all, as its backend alone would.
    fn experts(&self, experts: Vec<ExpertTensors>, activation: ExpertActivation) -> Result<Self::Experts> {
        if self.ranks.len() == 1 {
            return Ok(vec![self.ranks[0].experts(experts, activation)?]);
        }
        self.each(|r, rank| {
            let shard = experts
                .iter()
                .enumerate()
                .map(|(e, tensors)| (home_rank(e, self.ranks.len()) == r).then(|| tensors.clone()))
                .collect();
            rank.expert_shard(shard, activation)
        })
    }

    fn rope_table(&self, rope: &Rope) -> Result<Self::RopeTable> {
        self.each(|_, rank| rank.rope_table(rope))
    }

    fn new_kv(&self, spec: KvSpec) -> Result<Self::Kv> {
        Ok(RankedKv {
            ranks: self.each(|_, rank| rank.new_kv(spec.clone()))?,
            stale: false,
        })
    }

    fn prepare_batch(&self, kv: &mut Self::Kv, batch: &[SeqSlice]) -> Result<Self::Batch> {
        let ranks = kv.synced();
        self.each(|r, rank| rank.prepare_batch(&mut ranks[r], batch))
    }

    fn save_state(&self, kv: &mut Self::Kv, seq: SeqId, slot: usize) -> Result<()> {
        let ranks = kv.synced();
        self.each(|r, rank| rank.save_state(&mut ranks[r], seq, slot)).map(drop)
    }

    fn restore_state(&self, kv: &mut Self::Kv, seq: SeqId, slot: usize) -> Result<()> {
        let ranks = kv.synced();
        self.each(|r, rank| rank.restore_state(&mut ranks[r], seq, slot))
            .map(drop)
    }

    fn upload(&self, data: &[f32], rows: usize, cols: usize) -> Result<Self::Tensor> {
        self.each(|_, rank| rank.upload(data, rows, cols))
    }

    /// Every rank holds the same activations: the first rank's.
    fn to_host(&self, x: &Self::Tensor) -> Result<Vec<f32>> {
        self.ranks[0].to_host(&x[0])
    }

    fn argmax_rows(&self, x: &Self::Tensor, cols: usize) -> Result<Vec<u32>> {
        self.ranks[0].argmax_rows(&x[0], cols)
    }

    fn shape(&self, x: &Self::Tensor) -> (usize, usize) {
        self.ranks[0].shape(&x[0])
    }

    fn embed(&self, table: &Self::Weight, ids: &[u32]) -> Result<Self::Tensor> {
        self.each(|r, rank| rank.embed(&table[r], ids))
    }

    fn rms_norm(&self, x: &Self::Tensor, weight: &Self::Weight, group: usize, eps: f32) -> Result<Self::Tensor> {
        self.each(|r, rank| rank.rms_norm(&x[r], &weight[r], group, eps))
    }

    fn linear(&self, x: &Self::Tensor, w: &Self::Weight, bias: Option<&Self::Weight>) -> Result<Self::Tensor> {
        self.each(|r, rank| rank.linear(&x[r], &w[r], bias.map(|b| &b[r])))
    }

    fn add_assign(&self, x: &mut Self::Tensor, y: &Self::Tensor) -> Result<()> {
        self.each(|r, rank| rank.add_assign(&mut x[r], &y[r])).map(drop)
    }

    fn add_rms_norm(
        &self,
        x: &mut Self::Tensor,
        y: &Self::Tensor,
        weight: &Self::Weight,
        eps: f32,
    ) -> Result<Self::Tensor> {
        self.each(|r, rank| rank.add_rms_norm(&mut x[r], &y[r], &weight[r], eps))
    }

    fn linear_add_rms_norm(
        &self,
        x: &Self::Tensor,
        w: &Self::Weight,
        bias: Option<&Self::Weight>,
        into: ResidualNorm<'_, Self::Tensor, Self::Weight>,
    ) -> Result<Self::Tensor> {
        let residual = into.residual;
        self.each(|r, rank| {
            let into = ResidualNorm {
                residual: &mut residual[r],
                weight: &into.weight[r],
                eps: into.eps,
            };
            rank.linear_add_rms_norm(&x[r], &w[r], bias.map(|b| &b[r]), into)
        })
    }

    fn silu_mul(&self, gate: &Self::Tensor, up: &Self::Tensor) -> Result<Self::Tensor> {
        self.each(|r, rank| rank.silu_mul(&gate[r], &up[r]))
    }

    fn sigmoid_gate(&self, x: &mut Self::Tensor, gate: &Self::Tensor) -> Result<()> {
        self.each(|r, rank| rank.sigmoid_gate(&mut x[r], &gate[r])).map(drop)
    }

    fn attention(
        &self,
        qkv: &Self::Tensor,
        qk_norm: Option<QkNormWeights<'_, Self::Weight>>,
        sinks: Option<&Self::Weight>,
        rope: &Self::RopeTable,
        kv: &mut Self::Kv,
        layer: usize,
        batch: &Self::Batch,
        params: &AttentionParams,
    ) -> Result<Self::Tensor> {
        let ranks = kv.synced();
        self.each(|r, rank| {
            let qk_norm = qk_norm.as_ref().map(|n| QkNormWeights {
                q: &n.q[r],
                k: &n.k[r],
                per_head: n.per_head,
                eps: n.eps,
            });
            let sinks = sinks.map(|s| &s[r]);
            rank.attention(
                &qkv[r],
                qk_norm,
                sinks,
                &rope[r],
                &mut ranks[r],
                layer,
                &batch[r],
                params,
            )
        })
    }

    fn mla_attention(
        &self,
        q: &Self::Tensor,
        compressed: &Self::Tensor,
        kv_norm: &Self::Weight,
        kv_b: &Self::Weight,
        rope: &Self::RopeTable,
        kv: &mut Self::Kv,
        layer: usize,
        batch: &Self::Batch,
        params: &MlaParams,
    ) -> Result<Self::Tensor> {
        let ranks = kv.synced();
        self.each(|r, rank| {
            rank.mla_attention(
                &q[r],
                &compressed[r],
                &kv_norm[r],
                &kv_b[r],
                &rope[r],
                &mut ranks[r],
                layer,
                &batch[r],
                params,
            )
        })
    }

    fn causal_conv1d(
        &self,
        x: &Self::Tensor,
        weight: &Self::Weight,
        kv: &mut Self::Kv,
        layer: usize,
        batch: &Self::Batch,
    ) -> Result<Self::Tensor> {
        let ranks = kv.synced();
        self.each(|r, rank| rank.causal_conv1d(&x[r], &weight[r], &mut ranks[r], layer, &batch[r]))
    }

    fn gated_delta_rule(
        &self,
        qkv: &Self::Tensor,
        a: &Self::Tensor,
        b: &Self::Tensor,
        a_log: &Self::Weight,
        dt_bias: &Self::Weight,
        kv: &mut Self::Kv,
        layer: usize,
        batch: &Self::Batch,
        params: &DeltaRuleParams,
    ) -> Result<Self::Tensor> {
        let ranks = kv.synced();
        self.each(|r, rank| {
            rank.gated_delta_rule(
                &qkv[r],
                &a[r],
                &b[r],
                &a_log[r],
                &dt_bias[r],
                &mut ranks[r],
                layer,
                &batch[r],
                params,
            )
        })
    }

    fn route(&self, logits: &Self::Tensor, router: Router<'_, Self::Weight>) -> Result<Self::Routing> {
        self.each(|r, rank| rank.route(&logits[r], router_at(&router, r)))
    }

    fn route_linear(
        &self,
        x: &Self::Tensor,
        w: &Self::Weight,
        bias: Option<&Self::Weight>,
        router: Router<'_, Self::Weight>,
    ) -> Result<Self::Routing> {
        self.each(|r, rank| rank.route_linear(&x[r], &w[r], bias.map(|b| &b[r]), router_at(&router, r)))
    }

    /// Every rank routes alike: the first rank's ids.
    fn routing_to_host(&self, routing: &Self::Routing) -> Result<Vec<u32>> {
        self.ranks[0].routing_to_host(&routing[0])
    }

    fn routing_from_host(&self, ids: &[u32], weights: &[f32], top_k: usize) -> Result<Self::Routing> {
        self.each(|_, rank| rank.routing_from_host(ids, weights, top_k))
    }

    /// Each rank's sum over its own experts (in router order), then the sum of those across the ranks.
    fn moe_experts(&self, x: &Self::Tensor, routing: &Self::Routing, experts: &Self::Experts) -> Result<Self::Tensor> {
        let mut partial = self.each(|r, rank| rank.moe_experts(&x[r], &routing[r], &experts[r]))?;
        if self.ranks.len() > 1 {
            self.collective.all_reduce_sum(&self.ranks, &mut partial)?;
        }
        Ok(partial)
    }

    fn wants_routing_guess(&self, rows: usize) -> bool {
        self.ranks.iter().any(|rank| rank.wants_routing_guess(rows))
    }

    fn guess_routing(&self, experts: &Self::Experts, routing: Self::Routing) -> Result<()> {
        for ((rank, experts), routing) in self.ranks.iter().zip(experts).zip(routing) {
            rank.guess_routing(experts, routing)?;
        }
        Ok(())
    }

    fn guess_routing_now(&self, experts: &Self::Experts, routing: Self::Routing) -> Result<()> {
        for ((rank, experts), routing) in self.ranks.iter().zip(experts).zip(routing) {
            rank.guess_routing_now(experts, routing)?;
        }
        Ok(())
    }

    fn select_rows(&self, x: &Self::Tensor, rows: &[usize]) -> Result<Self::Tensor> {
        self.each(|r, rank| rank.select_rows(&x[r], rows))
    }
}

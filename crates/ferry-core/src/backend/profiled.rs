//! A backend wrapper that times every op: it waits for the device after each one and adds the wall time to the
//! op's total. For finding where a forward pass spends its time (`ferry bench --profile`), never for serving:
//! the waits serialise the host and the device.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::{
    AttentionParams, Backend, DeltaRuleParams, ExpertActivation, ExpertTensors, MlaParams, QkNormWeights, ResidualNorm,
    Rope, Router, RouterKind, SeqSlice,
};
use crate::kv::{KvSpec, SeqId};
use crate::loader::TensorRef;
use crate::Result;

pub struct Profiled<'a, B> {
    inner: &'a B,
    totals: Mutex<BTreeMap<&'static str, (u64, Duration)>>,
}

/// One op's calls and total time.
#[derive(Clone, Debug, serde::Serialize)]
pub struct OpTime {
    pub op: &'static str,
    pub calls: u64,
    pub seconds: f64,
}

impl<'a, B: Backend> Profiled<'a, B> {
    pub fn new(inner: &'a B) -> Self {
        Profiled {
            inner,
            totals: Mutex::new(BTreeMap::new()),
        }
    }

    fn time<T>(&self, op: &'static str, run: impl FnOnce() -> Result<T>) -> Result<T> {
        let started = Instant::now();
        let out = run()?;
        self.inner.synchronize()?;
        let mut totals = self.totals.lock().unwrap_or_else(|e| e.into_inner());
        let entry = totals.entry(op).or_default();
        entry.0 += 1;
        entry.1 += started.elapsed();
        Ok(out)
    }

    /// Every op's calls and time since the last report, the most expensive first; starts counting afresh.
    pub fn take_report(&self) -> Vec<OpTime> {
        let totals = std::mem::take(&mut *self.totals.lock().unwrap_or_else(|e| e.into_inner()));
        let mut ops: Vec<OpTime> = totals
            .iter()
            .map(|(&op, &(calls, time))| OpTime {
                op,
                calls,
                seconds: time.as_secs_f64(),
            })
            .collect();
        ops.sort_by(|a, b| b.seconds.total_cmp(&a.seconds));
        ops
    }
}

/// Implements each listed op as the wrapped backend's, timed under the op's name.
macro_rules! timed_ops {
    ($(fn $op:ident(&self $(, $arg:ident: $ty:ty)* $(,)?) -> $out:ty;)*) => {
        $(
            fn $op(&self $(, $arg: $ty)*) -> Result<$out> {
                self.time(stringify!($op), || self.inner.$op($($arg),*))
            }
        )*
    };
}

impl<B: Backend> Backend for Profiled<'_, B> {
    type Tensor = B::Tensor;
    type Weight = B::Weight;
    type Experts = B::Experts;
    type Kv = B::Kv;
    type Batch = B::Batch;
    type Routing = B::Routing;
    type RopeTable = B::RopeTable;

    fn name(&self) -> String {
        format!("{} (profiled)", self.inner.name())
    }
    fn synchronize(&self) -> Result<()> {
        self.inner.synchronize()
    }
    fn offload_stats(&self) -> Option<crate::moe::OffloadStats> {
        self.inner.offload_stats()
    }
    fn weight(&self, tensor: TensorRef) -> Result<Self::Weight> {
        self.inner.weight(tensor)
    }
    fn check_router(&self, kind: RouterKind) -> Result<()> {
        self.inner.check_router(kind)
    }
    fn experts(&self, experts: Vec<ExpertTensors>, activation: ExpertActivation) -> Result<Self::Experts> {
        self.inner.experts(experts, activation)
    }
    fn expert_shard(&self, experts: Vec<Option<ExpertTensors>>, activation: ExpertActivation) -> Result<Self::Experts> {
        self.inner.expert_shard(experts, activation)
    }
    fn rope_table(&self, rope: &Rope) -> Result<Self::RopeTable> {
        self.inner.rope_table(rope)
    }
    fn new_kv(&self, spec: KvSpec) -> Result<Self::Kv> {
        self.inner.new_kv(spec)
    }
    fn save_state(&self, kv: &mut Self::Kv, seq: SeqId, slot: usize) -> Result<()> {
        self.inner.save_state(kv, seq, slot)
    }
    fn restore_state(&self, kv: &mut Self::Kv, seq: SeqId, slot: usize) -> Result<()> {
        self.inner.restore_state(kv, seq, slot)
    }
    fn upload(&self, data: &[f32], rows: usize, cols: usize) -> Result<Self::Tensor> {
        self.inner.upload(data, rows, cols)
    }
    fn shape(&self, x: &Self::Tensor) -> (usize, usize) {
        self.inner.shape(x)
    }
    fn wants_routing_guess(&self, rows: usize) -> bool {
        self.inner.wants_routing_guess(rows)
    }
    fn guess_routing(&self, experts: &Self::Experts, routing: Self::Routing) -> Result<()> {
        self.inner.guess_routing(experts, routing)
    }
    fn guess_routing_now(&self, experts: &Self::Experts, routing: Self::Routing) -> Result<()> {
        self.inner.guess_routing_now(experts, routing)
    }
    timed_ops! {
        fn prepare_batch(&self, kv: &mut Self::Kv, batch: &[SeqSlice]) -> Self::Batch;
        fn to_host(&self, x: &Self::Tensor) -> Vec<f32>;
        fn argmax_rows(&self, x: &Self::Tensor, cols: usize) -> Vec<u32>;
        fn embed(&self, table: &Self::Weight, ids: &[u32]) -> Self::Tensor;
        fn rms_norm(&self, x: &Self::Tensor, weight: &Self::Weight, group: usize, eps: f32) -> Self::Tensor;
        fn linear(&self, x: &Self::Tensor, w: &Self::Weight, bias: Option<&Self::Weight>) -> Self::Tensor;
        fn add_assign(&self, x: &mut Self::Tensor, y: &Self::Tensor) -> ();
        fn add_rms_norm(&self, x: &mut Self::Tensor, y: &Self::Tensor, weight: &Self::Weight, eps: f32)
            -> Self::Tensor;
        fn linear_add_rms_norm(&self, x: &Self::Tensor, w: &Self::Weight, bias: Option<&Self::Weight>,
            into: ResidualNorm<'_, Self::Tensor, Self::Weight>) -> Self::Tensor;
        fn silu_mul(&self, gate: &Self::Tensor, up: &Self::Tensor) -> Self::Tensor;
        fn sigmoid_gate(&self, x: &mut Self::Tensor, gate: &Self::Tensor) -> ();
        fn attention(&self, qkv: &Self::Tensor, qk_norm: Option<QkNormWeights<'_, Self::Weight>>,
            sinks: Option<&Self::Weight>, rope: &Self::RopeTable, kv: &mut Self::Kv, layer: usize, batch: &Self::Batch, params: &AttentionParams)
            -> Self::Tensor;
        fn mla_attention(&self, q: &Self::Tensor, compressed: &Self::Tensor, kv_norm: &Self::Weight,
            kv_b: &Self::Weight, rope: &Self::RopeTable, kv: &mut Self::Kv, layer: usize, batch: &Self::Batch,
            params: &MlaParams) -> Self::Tensor;
        fn causal_conv1d(&self, x: &Self::Tensor, weight: &Self::Weight, kv: &mut Self::Kv, layer: usize,
            batch: &Self::Batch) -> Self::Tensor;
        fn gated_delta_rule(&self, qkv: &Self::Tensor, a: &Self::Tensor, b: &Self::Tensor, a_log: &Self::Weight,
            dt_bias: &Self::Weight, kv: &mut Self::Kv, layer: usize, batch: &Self::Batch, params: &DeltaRuleParams)
            -> Self::Tensor;
        fn route(&self, logits: &Self::Tensor, router: Router<'_, Self::Weight>) -> Self::Routing;
        fn route_linear(&self, x: &Self::Tensor, w: &Self::Weight, bias: Option<&Self::Weight>,
            router: Router<'_, Self::Weight>) -> Self::Routing;
        fn routing_to_host(&self, routing: &Self::Routing) -> Vec<u32>;
        fn routing_from_host(&self, ids: &[u32], weights: &[f32], top_k: usize) -> Self::Routing;
        fn moe_experts(&self, x: &Self::Tensor, routing: &Self::Routing, experts: &Self::Experts) -> Self::Tensor;
        fn moe_experts_add_rms_norm(&self, x: &Self::Tensor, routing: &Self::Routing, experts: &Self::Experts,
            shared: Option<&Self::Tensor>, into: ResidualNorm<'_, Self::Tensor, Self::Weight>) -> Self::Tensor;
        fn select_rows(&self, x: &Self::Tensor, rows: &[usize]) -> Self::Tensor;
    }
}

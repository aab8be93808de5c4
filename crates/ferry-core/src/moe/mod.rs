//! The expert cache's pure logic: eviction policies, the per-layer planner over one slot pool shared by all MoE
//! layers, and routing traces. The GPU side (host bank, device slab, copy stream) lives in `backend::cuda` and
//! applies the plans made here; nothing in this module touches a device, so all of it is tested on the CPU.

pub mod budget;
pub mod cache;
pub mod policy;
pub mod stats;
pub mod tap;
pub mod trace;

pub use budget::{
    parse_size, plan_memory, workspace_bytes, BudgetRequest, MemoryPlan, OffloadMode, MOE_GROUP_ROWS,
    OFFLOAD_STEP_TOKENS,
};
pub use cache::{ExpertCache, LayerCounts, Plan};
pub use policy::{Belady, EvictionPolicy, ExpertKey, Lru};
pub use stats::OffloadStats;
pub use tap::{RoutingTap, TraceRecorder, TraceReplayer};
pub use trace::{RoutingTrace, RoutingTraceWriter, TraceHeader};

//! The expert cache's pure logic: eviction policies (and their names), the per-layer planner over one slot pool
//! shared by all MoE layers, the split of a layer's misses between the link and a CPU lane, the offload's counters, and routing traces. A backend that offloads experts (host bank, device slots,
//! copies) applies the plans made here; nothing in this module touches a device, so all of it is tested on the
//! CPU. Not here: how a GPU budget is divided (`engine::plan`), which needs the model and the backend.

pub mod cache;
pub mod choice;
pub mod floors;
pub mod lane_calibration;
pub mod lane_guard;
pub mod lrfu;
pub mod policy;
pub mod prefill;
pub mod split;
pub mod stats;
pub mod tap;
pub mod trace;

pub use cache::{ExpertCache, LayerCounts, Plan};
pub use choice::{BaseOrder, PolicyChoice};
pub use floors::LayerFloors;
pub use lane_calibration::{CalibratedRates, LaneCalibration};
pub use lane_guard::{LaneGuard, Regime};
pub use lrfu::Lrfu;
pub use policy::{Access, Belady, EvictionPolicy, ExpertKey, Lru};
pub use prefill::PrefillAware;
pub use split::{fit_cpu_lane, plan_split, rows_per_expert, CpuLaneCost, LanePoint, LaneRates, Miss, Split, SplitRule};
pub use stats::OffloadStats;
pub use tap::{HeldRouting, RoutingTap, TraceRecorder, TraceReplayer};
pub use trace::{RoutingTrace, RoutingTraceWriter, TraceHeader};

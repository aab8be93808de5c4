//! The expert offload's counters, one type for every reader: `ferry bench` reports them, /metrics exports their
//! totals, the GPU tests check them. Whatever backend offloads experts fills it in.

use serde::Serialize;

use super::cache::LayerCounts;
use super::lane_calibration::CalibratedRates;

/// What an expert offload holds and has done so far.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct OffloadStats {
    pub slots: usize,
    pub bytes_per_expert: usize,
    pub bank_bytes: usize,
    pub bank_pinned: bool,
    /// Per MoE layer: hits and misses, counted per distinct expert of each step.
    pub layer_hits: Vec<u64>,
    pub layer_misses: Vec<u64>,
    pub bytes_copied: u64,
    pub copies: u64,
    /// Of `copies`, those made ahead of a layer's router by a prefetch (prefill's next-layer copies and decode's
    /// guessed copies).
    pub prefetched: u64,
    /// Prefetched copies a step then used (each counted as the miss it replaced).
    pub prefetches_used: u64,
    /// (row, k) pairs routed over all planned layers: against hits + misses (distinct experts per layer and step),
    /// how much a batch shares experts, each copied once per step.
    pub routed_pairs: u64,
    /// Decode guesses of the next layer's routing: distinct experts guessed, how many of them that layer then
    /// routed, and the distinct experts those layers routed (precision = guessed_routed / guessed, recall =
    /// guessed_routed / routed_after_guess).
    pub guessed: u64,
    pub guessed_routed: u64,
    pub routed_after_guess: u64,
    /// Guessed misses copied while the copy stream was idle, and those dropped because their layer routed first.
    pub guesses_copied: u64,
    pub guesses_dropped: u64,
    /// The host's waits for a layer's routed ids (one per MoE layer and step), and their total time: the serial
    /// point that copies and compute cannot overlap.
    pub router_waits: u64,
    pub router_wait_ns: u64,
    /// The CPU lane: the misses it computed instead of copying (distinct experts per layer and step), their (row,
    /// expert) pairs, the expert bytes it read and its busy time.
    pub host_experts: u64,
    pub host_pairs: u64,
    pub host_bytes: u64,
    pub host_ns: u64,
    /// What the CPU lane's jobs cost the pipeline, from each job's start until the stream was let go past its wait
    /// (or the job was done, when the stream did not wait): against `host_ns`, what handing the jobs over and their
    /// products back costs beyond their compute.
    pub host_pipeline_ns: u64,
    /// Under `--moe-strategy auto`, the planner's calibrated rates when read.
    pub calibrated: Option<CalibratedRates>,
    /// The link's time over each layer's demand copies (from the first queued to the last landed; a guessed copy
    /// still in flight when they were queued counts in it).
    pub link_ns: u64,
}

impl OffloadStats {
    /// The offloads of an expert-parallel group's ranks as one: slots, banks and every count summed (per MoE layer
    /// for hits and misses), the block size the ranks share. Each rank calibrates its own CPU lane: a group of
    /// several reports no calibrated rates. None for no ranks, or a rank without offload.
    pub fn of_ranks(ranks: impl IntoIterator<Item = Option<OffloadStats>>) -> Option<OffloadStats> {
        let mut ranks = ranks.into_iter();
        let mut group = ranks.next()??;
        for rank in ranks {
            let rank = rank?;
            group.slots += rank.slots;
            group.bank_bytes += rank.bank_bytes;
            group.bank_pinned &= rank.bank_pinned;
            add_per_layer(&mut group.layer_hits, &rank.layer_hits);
            add_per_layer(&mut group.layer_misses, &rank.layer_misses);
            for (sum, part) in [
                (&mut group.bytes_copied, rank.bytes_copied),
                (&mut group.copies, rank.copies),
                (&mut group.prefetched, rank.prefetched),
                (&mut group.prefetches_used, rank.prefetches_used),
                (&mut group.routed_pairs, rank.routed_pairs),
                (&mut group.guessed, rank.guessed),
                (&mut group.guessed_routed, rank.guessed_routed),
                (&mut group.routed_after_guess, rank.routed_after_guess),
                (&mut group.guesses_copied, rank.guesses_copied),
                (&mut group.guesses_dropped, rank.guesses_dropped),
                (&mut group.router_waits, rank.router_waits),
                (&mut group.router_wait_ns, rank.router_wait_ns),
                (&mut group.host_experts, rank.host_experts),
                (&mut group.host_pairs, rank.host_pairs),
                (&mut group.host_bytes, rank.host_bytes),
                (&mut group.host_ns, rank.host_ns),
                (&mut group.host_pipeline_ns, rank.host_pipeline_ns),
                (&mut group.link_ns, rank.link_ns),
            ] {
                *sum += part;
            }
            group.calibrated = None;
        }
        Some(group)
    }

    pub fn hits(&self) -> u64 {
        self.layer_hits.iter().sum()
    }

    pub fn misses(&self) -> u64 {
        self.layer_misses.iter().sum()
    }

    /// Of the experts decode guessed for a layer, the share it routed; 0 before any guess.
    pub fn guess_precision(&self) -> f64 {
        ratio(self.guessed_routed, self.guessed)
    }

    /// Of the experts routed by layers that had a guess, the share guessed; 0 before any guess.
    pub fn guess_recall(&self) -> f64 {
        ratio(self.guessed_routed, self.routed_after_guess)
    }

    /// The CPU lane's achieved rate over the expert bytes it read, GB/s; 0 before it ran.
    pub fn host_gb_s(&self) -> f64 {
        ratio(self.host_bytes, self.host_ns)
    }

    /// The link's achieved rate over the demand copies (prefetches are not timed), GB/s; 0 before any.
    pub fn link_gb_s(&self) -> f64 {
        let demand = self.copies.saturating_sub(self.prefetched) * self.bytes_per_expert as u64;
        ratio(demand, self.link_ns)
    }

    /// Hits over accesses; 0 before any access.
    pub fn hit_rate(&self) -> f64 {
        LayerCounts {
            hits: self.hits(),
            misses: self.misses(),
        }
        .hit_rate()
    }
}

/// `sum[l] += part[l]` for every MoE layer either has.
fn add_per_layer(sum: &mut Vec<u64>, part: &[u64]) {
    if sum.len() < part.len() {
        sum.resize(part.len(), 0);
    }
    sum.iter_mut().zip(part).for_each(|(s, p)| *s += p);
}

fn ratio(part: u64, whole: u64) -> f64 {
    if whole == 0 {
        0.0
    } else {
        part as f64 / whole as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rank(slots: usize, hits: Vec<u64>, copies: u64) -> OffloadStats {
        OffloadStats {
            slots,
            bytes_per_expert: 64,
            bank_bytes: 64 * slots * 2,
            bank_pinned: true,
            layer_misses: vec![1; hits.len()],
            layer_hits: hits,
            copies,
            bytes_copied: 64 * copies,
            router_waits: 3,
            calibrated: Some(CalibratedRates::default()),
            ..OffloadStats::default()
        }
    }

    #[test]
    fn a_group_of_ranks_sums_their_offloads() {
        let one = rank(4, vec![1, 2], 5);
        assert_eq!(OffloadStats::of_ranks([Some(one.clone())]), Some(one.clone()));
        let group = OffloadStats::of_ranks([Some(one.clone()), Some(rank(6, vec![10, 20, 30], 7))]).unwrap();
        assert_eq!(group.slots, 10);
        assert_eq!(group.bank_bytes, 64 * 20);
        assert_eq!(group.layer_hits, vec![11, 22, 30]);
        assert_eq!(group.layer_misses, vec![2, 2, 1]);
        assert_eq!((group.copies, group.bytes_copied, group.router_waits), (12, 64 * 12, 6));
        assert_eq!(group.bytes_per_expert, 64);
        assert_eq!(group.calibrated, None);
        assert_eq!(OffloadStats::of_ranks([Some(one), None]), None);
        assert_eq!(OffloadStats::of_ranks([]), None);
    }
}

//! The eviction policies a user picks by name (`--moe-cache-policy`, `ferry cache-sim --policy`): a base order
//! (`lru`, `lrfu`) with optional wrappers (`+floors`, `+prefill`), e.g. `lrfu+prefill`, and `default`, the one
//! `ferry cache-sim` found best on the uniform and locality traces (docs/perf.md).

use std::fmt;
use std::str::FromStr;

use super::floors::LayerFloors;
use super::lrfu::Lrfu;
use super::policy::{EvictionPolicy, Lru};
use super::prefill::PrefillAware;
use crate::{Error, Result};

/// The base order of a [`PolicyChoice`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BaseOrder {
    Lru,
    Lrfu,
}

/// An eviction policy by name: a base order and the wrappers around it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PolicyChoice {
    pub base: BaseOrder,
    /// Per-layer floors ([`LayerFloors`]) of [`FLOOR_SHARE`] of an even share of the slots.
    pub floors: bool,
    /// Prefill-aware admission ([`PrefillAware`]).
    pub prefill: bool,
}

/// A layer's floor, as a share of the slots an even division among the MoE layers would give it.
pub const FLOOR_SHARE: f64 = 0.25;

/// LRFU's half-life, in tokens: a use counts half as much this many decode tokens later.
pub const LRFU_HALF_LIFE_TOKENS: f64 = 16.0;

impl PolicyChoice {
    /// What `default` is.
    pub const DEFAULT: PolicyChoice = PolicyChoice {
        base: BaseOrder::Lrfu,
        floors: false,
        prefill: true,
    };

    /// Every base order alone and with each wrapper, then `default` if it is none of those: what `ferry cache-sim`
    /// compares.
    pub fn all() -> Vec<PolicyChoice> {
        let mut all = Vec::new();
        for base in [BaseOrder::Lru, BaseOrder::Lrfu] {
            for (floors, prefill) in [(false, false), (true, false), (false, true)] {
                all.push(PolicyChoice { base, floors, prefill });
            }
        }
        if !all.contains(&Self::DEFAULT) {
            all.push(Self::DEFAULT);
        }
        all
    }

    /// The policy for a cache of `slots` slots over a model of `layers` MoE layers routing `top_k` experts per
    /// token.
    pub fn build(self, slots: u32, layers: u32, top_k: u32) -> Box<dyn EvictionPolicy> {
        let floor = (FLOOR_SHARE * f64::from(slots) / f64::from(layers.max(1))) as u32;
        let accesses_per_token = f64::from(layers.max(1)) * f64::from(top_k.max(1));
        match (self.base, self.floors, self.prefill) {
            (BaseOrder::Lru, floors, prefill) => wrap(Lru::new(), floors.then_some(floor), prefill),
            (BaseOrder::Lrfu, floors, prefill) => wrap(
                Lrfu::new(LRFU_HALF_LIFE_TOKENS * accesses_per_token),
                floors.then_some(floor),
                prefill,
            ),
        }
    }
}

/// `base` inside the wrappers asked for: floors innermost, so that probation keys stay the first victims.
fn wrap<P: EvictionPolicy + 'static>(base: P, floor: Option<u32>, prefill: bool) -> Box<dyn EvictionPolicy> {
    match (floor, prefill) {
        (None, false) => Box::new(base),
        (None, true) => Box::new(PrefillAware::new(base)),
        (Some(floor), false) => Box::new(LayerFloors::new(base, floor)),
        (Some(floor), true) => Box::new(PrefillAware::new(LayerFloors::new(base, floor))),
    }
}

impl fmt::Display for PolicyChoice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self.base {
            BaseOrder::Lru => "lru",
            BaseOrder::Lrfu => "lrfu",
        })?;
        if self.floors {
            f.write_str("+floors")?;
        }
        if self.prefill {
            f.write_str("+prefill")?;
        }
        Ok(())
    }
}

impl FromStr for PolicyChoice {
    type Err = Error;

    /// `default`, or a base order (`lru`, `lrfu`) followed by any of `+floors` and `+prefill`.
    fn from_str(name: &str) -> Result<Self> {
        if name == "default" {
            return Ok(Self::DEFAULT);
        }
        let mut parts = name.split('+');
        let base = match parts.next() {
            Some("lru") => BaseOrder::Lru,
            Some("lrfu") => BaseOrder::Lrfu,
            _ => {
                return Err(Error::Request(format!(
                    "unknown cache policy {name:?}: give default, or lru or lrfu followed by any of +floors and \
                     +prefill"
                )))
            }
        };
        let mut choice = PolicyChoice {
            base,
            floors: false,
            prefill: false,
        };
        for part in parts {
            let flag = match part {
                "floors" => &mut choice.floors,
                "prefill" => &mut choice.prefill,
                _ => {
                    return Err(Error::Request(format!(
                        "unknown cache policy part {part:?} in {name:?}"
                    )))
                }
            };
            if std::mem::replace(flag, true) {
                return Err(Error::Request(format!("{part:?} given twice in {name:?}")));
            }
        }
        Ok(choice)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_bad_ones_are_named() {
        for choice in PolicyChoice::all() {
            assert_eq!(choice.to_string().parse::<PolicyChoice>().unwrap(), choice);
        }
        assert_eq!("default".parse::<PolicyChoice>().unwrap(), PolicyChoice::DEFAULT);
        assert_eq!(
            "lrfu+prefill+floors".parse::<PolicyChoice>().unwrap().to_string(),
            "lrfu+floors+prefill"
        );
        for bad in ["fifo", "lru+", "lru+fast", "lru+floors+floors", ""] {
            let error = bad.parse::<PolicyChoice>().unwrap_err().to_string();
            assert!(
                error.contains(&format!("{bad:?}")) || error.contains("\"\""),
                "{bad}: {error}"
            );
        }
    }
}

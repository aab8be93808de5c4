//! The recurrent-state slot of a hybrid model's sequence: for every Gated DeltaNet layer, the causal
//! convolution's last inputs and the delta rule's per-head state matrices. Unlike keys and values it does not
//! grow with the sequence: its size is fixed per sequence, allocated when the sequence starts and freed with it.

use crate::{Error, Result};

/// The shape of one sequence's recurrent state.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RecurrentSpec {
    /// Gated DeltaNet layers.
    pub num_layers: usize,
    /// Channels of the causal convolution (q, k and v together).
    pub conv_channels: usize,
    pub conv_kernel: usize,
    /// Value heads: one `[k_head_dim, v_head_dim]` state matrix each.
    pub num_heads: usize,
    pub k_head_dim: usize,
    pub v_head_dim: usize,
}

impl RecurrentSpec {
    fn conv_len(&self) -> usize {
        (self.conv_kernel - 1) * self.conv_channels
    }

    fn delta_len(&self) -> usize {
        self.num_heads * self.k_head_dim * self.v_head_dim
    }

    /// Bytes of one sequence's state over all layers, kept as f32 (as transformers keeps it).
    pub fn bytes_per_seq(&self) -> usize {
        self.num_layers * (self.conv_len() + self.delta_len()) * 4
    }
}

/// One sequence's state in one Gated DeltaNet layer.
#[derive(Clone, Debug)]
pub struct RecurrentLayer {
    /// The last `conv_kernel - 1` inputs of the convolution, oldest first: `[conv_kernel - 1, conv_channels]`.
    pub conv: Vec<f32>,
    /// Tokens the convolution has seen.
    pub conv_tokens: usize,
    /// Per value head, the `[k_head_dim, v_head_dim]` delta-rule state, row-major.
    pub delta: Vec<f32>,
    /// Tokens the delta rule has seen.
    pub delta_tokens: usize,
}

impl RecurrentLayer {
    pub(super) fn new(spec: &RecurrentSpec) -> Self {
        RecurrentLayer {
            conv: vec![0.0; spec.conv_len()],
            conv_tokens: 0,
            delta: vec![0.0; spec.delta_len()],
            delta_tokens: 0,
        }
    }

    /// Fails unless a state that has seen `seen` tokens is asked to continue at `start_pos`.
    pub fn check_continues(seen: usize, start_pos: usize, what: &str) -> Result<()> {
        if seen != start_pos {
            return Err(Error::Kv(format!(
                "{what} state has seen {seen} tokens, batch starts at position {start_pos}"
            )));
        }
        Ok(())
    }
}

//! Activation checkpointing (recomputation): which blocks keep only their
//! input in the forward pass and run their forward again, with the same
//! kernels on the same input, just before their backward — or, in the
//! selective modes, which of a block's tensors are dropped and recomputed
//! from the tensors it kept. Every family's model reads this one setting.

use serde::{Deserialize, Serialize};

/// Which blocks are recomputed in backward instead of keeping their
/// activations (`train.activation_checkpointing`).
///
/// In a config: `"none"`, `"blocks"` (every block), or `"every_N"` (blocks
/// 0, N, 2N, …: a share 1/N of the blocks, trading less memory saved for
/// less recomputation), `"attention"` or `"selective"` (every block keeps
/// its tensors but drops the ones of the [`Inner`] kinds the mode names,
/// recomputing each from what it kept when its backward first reads it:
/// selective recomputation after Korthikanti et al. 2022, with no matrix
/// multiply run again).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum Checkpointing {
    /// Keep every activation (no recomputation).
    #[default]
    None,
    /// Recompute every block.
    Blocks,
    /// Recompute blocks whose index is a multiple of N (N ≥ 2).
    EveryK(usize),
    /// Drop and recompute the attention core's output (the heads' output,
    /// from the kept q|k|v): the part of attention Korthikanti et al.
    /// recompute. Its T × T scores and probabilities are never kept in any
    /// mode (the attention kernel recomputes them in its backward).
    Attention,
    /// Drop and recompute every tensor made without a matrix multiply: the
    /// attention core's output, the norms' outputs and the MLP's activation.
    Selective,
}

/// What kind of tensor a block keeps, for the selective modes: whether a
/// mode may drop it and recompute it in backward from the tensors kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Inner {
    /// A matrix product (or the block's output): always kept.
    Kept,
    /// The attention core's output, recomputed from q|k|v (attention's
    /// forward run again: O(T²·d) per head, no GEMM).
    AttnCore,
    /// An elementwise or per-row result (a norm's output, an activation),
    /// recomputed from its kept input in one pass.
    Elementwise,
}

impl Checkpointing {
    /// Whether block `idx` is recomputed.
    pub fn recomputes(self, idx: usize) -> bool {
        match self {
            Checkpointing::None => false,
            Checkpointing::Blocks => true,
            Checkpointing::EveryK(k) => idx.is_multiple_of(k.max(1)),
            Checkpointing::Attention | Checkpointing::Selective => false,
        }
    }

    /// Whether any whole block is recomputed.
    pub fn is_on(self) -> bool {
        matches!(self, Checkpointing::Blocks | Checkpointing::EveryK(_))
    }

    /// Whether a block drops (and recomputes) a tensor of kind `kind`.
    pub fn drops(self, kind: Inner) -> bool {
        match self {
            Checkpointing::Attention => kind == Inner::AttnCore,
            Checkpointing::Selective => kind != Inner::Kept,
            _ => false,
        }
    }

    /// Whether blocks drop any of their tensors (a selective mode).
    pub fn is_selective(self) -> bool {
        matches!(self, Checkpointing::Attention | Checkpointing::Selective)
    }
}

impl TryFrom<String> for Checkpointing {
    type Error = String;

    fn try_from(s: String) -> Result<Self, String> {
        let bad = || {
            format!(
                "`{s}`: use \"none\", \"blocks\", \"every_N\" with N >= 2 (e.g. \"every_2\"), \"attention\" or \"selective\""
            )
        };
        match s.as_str() {
            "none" => Ok(Checkpointing::None),
            "attention" => Ok(Checkpointing::Attention),
            "selective" => Ok(Checkpointing::Selective),
            "blocks" | "every_1" => Ok(Checkpointing::Blocks),
            other => match other.strip_prefix("every_").map(str::parse::<usize>) {
                Some(Ok(k)) if k >= 2 => Ok(Checkpointing::EveryK(k)),
                _ => Err(bad()),
            },
        }
    }
}

impl From<Checkpointing> for String {
    fn from(c: Checkpointing) -> String {
        match c {
            Checkpointing::None => "none".into(),
            Checkpointing::Blocks => "blocks".into(),
            Checkpointing::EveryK(k) => format!("every_{k}"),
            Checkpointing::Attention => "attention".into(),
            Checkpointing::Selective => "selective".into(),
        }
    }
}

impl std::fmt::Display for Checkpointing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&String::from(*self))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_select_blocks() {
        let all = [
            Checkpointing::None,
            Checkpointing::Blocks,
            Checkpointing::EveryK(3),
            Checkpointing::Attention,
            Checkpointing::Selective,
        ];
        for c in all {
            assert_eq!(Checkpointing::try_from(String::from(c)), Ok(c));
        }
        let every3: Vec<usize> = (0..7).filter(|&i| Checkpointing::EveryK(3).recomputes(i)).collect();
        assert_eq!(every3, [0, 3, 6]);
        assert!((0..4).all(|i| Checkpointing::Blocks.recomputes(i) && !Checkpointing::None.recomputes(i)));
        for bad in ["every_0", "every_x", "all", "every_"] {
            assert!(Checkpointing::try_from(bad.to_string()).is_err(), "{bad}");
        }
        // The selective modes recompute no whole block and drop what they name.
        for c in [Checkpointing::Attention, Checkpointing::Selective] {
            assert!(!c.is_on() && c.is_selective() && !(0..4).any(|i| c.recomputes(i)));
            assert!(c.drops(Inner::AttnCore) && !c.drops(Inner::Kept));
        }
        assert!(
            !Checkpointing::Attention.drops(Inner::Elementwise) && Checkpointing::Selective.drops(Inner::Elementwise)
        );
        assert!(all[..3].iter().all(|c| !c.is_selective() && !c.drops(Inner::AttnCore)));
    }
}

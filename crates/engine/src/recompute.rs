//! Activation checkpointing (recomputation): which blocks keep only their
//! input in the forward pass and run their forward again, with the same
//! kernels on the same input, just before their backward. Every family's
//! model reads this one setting.

use serde::{Deserialize, Serialize};

/// Which blocks are recomputed in backward instead of keeping their
/// activations (`train.activation_checkpointing`).
///
/// In a config: `"none"`, `"blocks"` (every block), or `"every_N"` (blocks
/// 0, N, 2N, …: a share 1/N of the blocks, trading less memory saved for
/// less recomputation).
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
}

impl Checkpointing {
    /// Whether block `idx` is recomputed.
    pub fn recomputes(self, idx: usize) -> bool {
        match self {
            Checkpointing::None => false,
            Checkpointing::Blocks => true,
            Checkpointing::EveryK(k) => idx.is_multiple_of(k.max(1)),
        }
    }

    /// Whether any block is recomputed.
    pub fn is_on(self) -> bool {
        self != Checkpointing::None
    }
}

impl TryFrom<String> for Checkpointing {
    type Error = String;

    fn try_from(s: String) -> Result<Self, String> {
        let bad = || format!("`{s}`: use \"none\", \"blocks\" or \"every_N\" with N >= 2 (e.g. \"every_2\")");
        match s.as_str() {
            "none" => Ok(Checkpointing::None),
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
        for c in [Checkpointing::None, Checkpointing::Blocks, Checkpointing::EveryK(3)] {
            assert_eq!(Checkpointing::try_from(String::from(c)), Ok(c));
        }
        let every3: Vec<usize> = (0..7).filter(|&i| Checkpointing::EveryK(3).recomputes(i)).collect();
        assert_eq!(every3, [0, 3, 6]);
        assert!((0..4).all(|i| Checkpointing::Blocks.recomputes(i) && !Checkpointing::None.recomputes(i)));
        for bad in ["every_0", "every_x", "all", "every_"] {
            assert!(Checkpointing::try_from(bad.to_string()).is_err(), "{bad}");
        }
    }
}

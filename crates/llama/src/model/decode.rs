//! Generation with a key/value cache: the prompt runs once, filling every
//! layer's keys and values, then each step runs the new token's row only
//! through the same layers (norms, projections with their biases and LoRA,
//! rotation, MLP, head), rotated by its own position and attending over
//! the cache with grouped-query heads ([`nn::kv::KvCache::attend`]).

use super::Llama;
use crate::error::LlamaError;
use nn::kv::KvCache;
use nn::rope::Rope;

impl Llama {
    /// Keeps a key/value cache of up to `positions` positions (at most the
    /// context, `max_position_embeddings`) for [`Llama::next_token_logits`]:
    /// a call whose tokens start with the previous call's runs only the
    /// tokens after them. `0` drops the cache. It holds
    /// `2 · n_layer · positions · kv_dim` f32 (see [`KvCache::bytes_for`]).
    pub fn set_kv_cache(&mut self, positions: usize) -> Result<(), LlamaError> {
        let positions = positions.min(self.cfg.max_position_embeddings);
        self.shell.kv = match positions {
            0 => None,
            _ => {
                let windows: Vec<_> = (0..self.cfg.n_layer).map(|i| self.cfg.window_of(i)).collect();
                let kv = KvCache::new(self.cfg.n_layer, positions, self.cfg.kv_dim())?;
                Some(kv.layer_windows(&windows).scored(self.cfg.scores()))
            }
        };
        Ok(())
    }

    /// Rotary tables for the `n` rows at positions `first..first + n`.
    pub(super) fn rope_for(&self, first: usize, n: usize) -> Rope {
        let cfg = &self.cfg;
        Rope::for_positions(first..first + n, cfg.head_dim, cfg.rope_theta, cfg.llama3_scaling().as_ref())
    }
}

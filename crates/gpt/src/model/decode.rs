//! Generation with a key/value cache: the prompt runs once, filling every
//! block's keys and values, then each step runs the new token's row only
//! through the same blocks (norms, projections, MLP, head), its learned
//! position the next one and its attention over the cache
//! ([`nn::kv::KvCache::attend`]).

use super::Gpt;
use crate::error::GptError;
use nn::kv::KvCache;

impl Gpt {
    /// Keeps a key/value cache of up to `positions` positions (at most the
    /// context, `block_size`) for [`Gpt::next_token_logits`]: a call whose
    /// tokens start with the previous call's runs only the tokens after
    /// them. `0` drops the cache. It holds `2 · n_layer · positions · C`
    /// f32 (see [`KvCache::bytes_for`]).
    pub fn set_kv_cache(&mut self, positions: usize) -> Result<(), GptError> {
        let positions = positions.min(self.cfg.block_size);
        let heads = self.cfg.n_head / self.tp.size;
        self.shell.kv = match positions {
            0 => None,
            _ => Some(KvCache::new(self.cfg.n_layer, positions, heads * self.cfg.head_dim())?),
        };
        Ok(())
    }
}

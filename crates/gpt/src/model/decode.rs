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
        self.kv = match positions {
            0 => None,
            _ => Some(KvCache::new(self.cfg.n_layer, positions, heads * self.cfg.head_dim())?),
        };
        Ok(())
    }

    /// [`Gpt::next_token_logits`] with the cache `kv` (taken out of the
    /// model for the call and put back): [`KvCache::pass`].
    pub(super) fn cached_next_token_logits(
        &mut self,
        params: &[f32],
        tokens: &[u32],
        mut kv: KvCache,
    ) -> Result<Vec<f32>, GptError> {
        let logits = kv.pass(tokens, |rows, attn| self.last_logits(params, rows, attn));
        self.kv = Some(kv);
        logits
    }
}

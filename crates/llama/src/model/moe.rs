//! A mixture of experts' router losses over a pass: the load-balancing
//! loss's coefficients from the micro-batch's own routing or from the
//! step's global-batch counts ([`engine::Model::set_step_stats`]), and the
//! z-loss's, handed to the layers' backward; and what a mixture is not
//! implemented with yet.

use super::Llama;
use crate::config::{LoadBalancing, MoeBlock};
use crate::error::LlamaError;
use crate::layout::{Adapters, Proj};
use nn::moe::{RouterLoss, Tally};

impl Llama {
    /// What a mixture is not implemented with yet, refused by name before
    /// a layout exists: LoRA on its MLP, a packed frozen base, tensor parallelism.
    pub(super) fn moe_refusals(
        cfg: &crate::LlamaConfig,
        adapters: Option<Adapters>,
        packed: bool,
        tp: engine::TpRank,
    ) -> Result<(), LlamaError> {
        if cfg.moe.is_none() {
            return Ok(());
        }
        if adapters.is_some_and(|a| a.targets[Proj::Gate as usize..].iter().any(|&t| t)) {
            return Err(LlamaError::lora(
                "target_modules",
                "on the MLP (gate_proj, up_proj, down_proj) of a mixture of experts is not supported yet: target the attention (q_proj, k_proj, v_proj, o_proj)",
            ));
        }
        if packed {
            return Err(LlamaError::config(
                "train.frozen_dtype",
                "a packed frozen base is not implemented for a mixture of experts: set train.frozen_dtype = \"f32\"",
            ));
        }
        if tp.is_split() {
            return Err(LlamaError::config(
                "dist.tensor_parallel",
                format!("({}) is not implemented for a mixture of experts: set dist.tensor_parallel = 1", tp.size),
            ));
        }
        Ok(())
    }

    /// The global-batch routing pass over `batch`: a forward-only pass,
    /// its choices per expert, routed (layer, row) pairs and targets added
    /// into `into` ([`engine::Model::collect_step_stats`]).
    pub(super) fn routing_counts(
        &mut self,
        store: &mut dyn engine::ParamStore,
        batch: &crate::TokenBatch,
        into: &mut [f64],
    ) -> Result<(), LlamaError> {
        let targets = nn::shell::loss(self, store, batch)?.n_targets;
        let st = crate::block::state(&self.shell.acts.extra.moe);
        let t = &st.tally;
        let e = into.len() - 2;
        into[..e].iter_mut().zip(&t.chosen).for_each(|(a, b)| *a += b);
        into[e] += t.rows;
        into[e + 1] += targets as f64;
        Ok(())
    }

    /// The mixture, when its load-balancing loss counts the global batch.
    pub(super) fn global_balance(&self) -> Option<&MoeBlock> {
        let m = self.cfg.moe.as_ref()?;
        (m.load_balancing == LoadBalancing::GlobalBatch && m.router_aux_loss_coef > 0.0).then_some(m)
    }

    /// Errors where a mixture runs in a split it does not implement yet.
    pub(super) fn moe_supported(&self) -> Result<(), LlamaError> {
        let what =
            "a mixture of experts (pipeline stages are not implemented for it yet: set dist.pipeline_parallel = 1)";
        self.shell.whole_model_for(what).map_err(LlamaError::InvalidBatch)?;
        if self.shell.ends.cp.is_split() {
            return Err(LlamaError::config(
                "dist.context_parallel",
                format!(
                    "({}) is not implemented for a mixture of experts yet: set dist.context_parallel = 1",
                    self.shell.ends.cp
                ),
            ));
        }
        Ok(())
    }

    /// After a forward over `targets` targets: the router losses' sum over
    /// the pass (for `aux_sum`) and, for a training pass (`seed`), their
    /// coefficients for the backward. The global-batch form needs this
    /// step's counts; a forward-only pass weighs its own routing.
    pub(super) fn router_losses(&mut self, targets: u64, seed: Option<f32>) -> Result<f64, LlamaError> {
        let Some(m) = self.cfg.moe.as_ref() else { return Ok(0.0) };
        let mut st = crate::block::state(&self.shell.acts.extra.moe);
        let (t, alpha) = (&st.tally, m.router_aux_loss_coef);
        let balance = match (m.load_balancing, seed) {
            _ if alpha == 0.0 => Vec::new(),
            (LoadBalancing::GlobalBatch, Some(_)) => match &self.step_stats {
                Some((step, s)) if *step == self.step => {
                    let e = m.n_experts;
                    Tally::coefficients(alpha, &s[..e], s[e], s[e + 1])
                }
                _ => {
                    return Err(LlamaError::config(
                        "model.load_balancing",
                        "\"global_batch\" needs the step's routing counts before its first backward, which this trainer path does not gather; set model.load_balancing = \"micro_batch\" (or router_aux_loss_coef = 0)",
                    ))
                }
            },
            _ => Tally::coefficients(alpha, &t.chosen, t.rows, targets as f64),
        };
        let z = m.router_z_loss_coef / self.cfg.n_layer as f64;
        let sum = t.balance_sum(&balance) + z * t.lse2;
        st.loss = RouterLoss { balance, z };
        st.seed = seed.unwrap_or(0.0);
        Ok(sum)
    }
}

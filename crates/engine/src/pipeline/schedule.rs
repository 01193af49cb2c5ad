//! The schedule of one optimizer step through a pipeline: GPipe or 1F1B
//! written out as each stage's list of operations, with the ideal
//! timeline (forward 1 tick, backward 2), activation slots and the bubble.

use crate::error::EngineError;
use std::fmt;

/// `dist.pipeline_schedule`: the order in which a stage runs its
/// micro-batches' forward and backward passes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub enum ScheduleKind {
    /// One forward, one backward (PipeDream-flush, Megatron-LM's default):
    /// stage s runs P − s − 1 warm-up forwards, then alternates; at most
    /// P − s micro-batches' activations are alive on stage s.
    #[default]
    #[serde(rename = "1f1b")]
    OneFOneB,
    /// Every forward, then every backward: K micro-batches' activations alive on every stage.
    #[serde(rename = "gpipe")]
    GPipe,
}

impl fmt::Display for ScheduleKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ScheduleKind::OneFOneB => "1f1b",
            ScheduleKind::GPipe => "gpipe",
        })
    }
}

/// One operation of a stage's schedule; `k` is the micro-batch (0-based).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// Receive micro-batch k's activations from the previous stage.
    RecvAct(usize),
    /// Forward of micro-batch k through this stage (the last stage adds
    /// the loss and the head's backward).
    Forward(usize),
    /// Send micro-batch k's output activations to the next stage.
    SendAct(usize),
    /// Receive the gradient of micro-batch k's output from the next stage.
    RecvGrad(usize),
    /// Backward of micro-batch k through this stage's blocks (and the embedding on the first).
    Backward(usize),
    /// Send the gradient of micro-batch k's input to the previous stage.
    SendGrad(usize),
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Op::RecvAct(k) => write!(f, "recv-act {k}"),
            Op::Forward(k) => write!(f, "F{k}"),
            Op::SendAct(k) => write!(f, "send-act {k}"),
            Op::RecvGrad(k) => write!(f, "recv-grad {k}"),
            Op::Backward(k) => write!(f, "B{k}"),
            Op::SendGrad(k) => write!(f, "send-grad {k}"),
        }
    }
}

/// Ticks a forward takes in the schedule's timeline.
pub const FORWARD_TICKS: u64 = 1;
/// Ticks a backward takes (about twice a forward's work).
pub const BACKWARD_TICKS: u64 = 2;

/// One stage's part of a [`Schedule`]: its operations in execution order,
/// the tick each compute operation starts at in the ideal timeline
/// (forward [`FORWARD_TICKS`], backward [`BACKWARD_TICKS`], messages free),
/// and the activation slot each micro-batch occupies from its forward to
/// its backward.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StagePlan {
    /// Operations in the order the stage executes them.
    pub ops: Vec<Op>,
    /// Start tick of each compute operation, in `ops` order (`None` for messages).
    pub ticks: Vec<Option<u64>>,
    /// Slot of micro-batch k's activations.
    pub slot: Vec<usize>,
    /// Activation slots the stage needs: the most micro-batches between
    /// their forward and their backward at once.
    pub in_flight: usize,
    /// Ticks the stage computes.
    pub busy_ticks: u64,
}

/// The schedule of one optimizer step: K micro-batches through P stages.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Schedule {
    /// GPipe or 1F1B.
    pub kind: ScheduleKind,
    /// Number of stages P.
    pub n_stages: usize,
    /// Number of micro-batches K.
    pub n_micro: usize,
    /// Per stage: its operations.
    pub stages: Vec<StagePlan>,
    /// Ticks from the first forward to the last backward.
    pub makespan: u64,
}

impl Schedule {
    /// The schedule of `kind` for `n_stages` stages and `n_micro` micro-batches.
    /// Backward passes run in ascending micro-batch order on every stage
    /// under both schedules, so each parameter's gradient accumulates in
    /// the same order as without a pipeline.
    pub fn new(kind: ScheduleKind, n_stages: usize, n_micro: usize) -> Result<Self, EngineError> {
        if n_stages == 0 || n_micro == 0 {
            return Err(EngineError::Pipeline(format!(
                "a schedule needs at least one stage and one micro-batch (got P = {n_stages}, K = {n_micro})"
            )));
        }
        let (p, k) = (n_stages, n_micro);
        // Compute order per stage.
        let compute: Vec<Vec<Op>> = (0..p)
            .map(|s| match kind {
                ScheduleKind::GPipe => (0..k).map(Op::Forward).chain((0..k).map(Op::Backward)).collect(),
                ScheduleKind::OneFOneB => {
                    let warm = (p - s - 1).min(k);
                    let mut v: Vec<Op> = (0..warm).map(Op::Forward).collect();
                    for i in 0..k - warm {
                        v.push(Op::Forward(warm + i));
                        v.push(Op::Backward(i));
                    }
                    v.extend((k - warm..k).map(Op::Backward));
                    v
                }
            })
            .collect();
        // The ideal timeline: each compute op starts when its stage is free
        // and its input exists (the previous stage's forward, the next
        // stage's backward, both of the same micro-batch).
        let mut f_end = vec![vec![None::<u64>; k]; p];
        let mut b_end = vec![vec![None::<u64>; k]; p];
        let mut start = vec![vec![None::<u64>; 0]; p];
        let mut next = vec![0usize; p];
        let mut free_at = vec![0u64; p];
        let total: usize = compute.iter().map(Vec::len).sum();
        let mut placed = 0;
        while placed < total {
            let mut progressed = false;
            for s in 0..p {
                while let Some(&op) = compute[s].get(next[s]) {
                    let ready = match op {
                        Op::Forward(_) if s == 0 => Some(0),
                        Op::Forward(m) => f_end[s - 1][m],
                        Op::Backward(m) if s == p - 1 => f_end[s][m],
                        Op::Backward(m) => b_end[s + 1][m],
                        _ => unreachable!("compute operations only"),
                    };
                    let Some(ready) = ready else { break };
                    let t0 = ready.max(free_at[s]);
                    let (end, slot) = match op {
                        Op::Forward(m) => (t0 + FORWARD_TICKS, &mut f_end[s][m]),
                        Op::Backward(m) => (t0 + BACKWARD_TICKS, &mut b_end[s][m]),
                        _ => unreachable!("compute operations only"),
                    };
                    *slot = Some(end);
                    free_at[s] = end;
                    start[s].push(Some(t0));
                    next[s] += 1;
                    placed += 1;
                    progressed = true;
                }
            }
            if !progressed {
                return Err(EngineError::Pipeline(format!("the {kind} schedule for P = {p}, K = {k} deadlocks")));
            }
        }
        let makespan = free_at.iter().copied().max().unwrap_or(0);
        let stages = (0..p)
            .map(|s| {
                let mut ops = Vec::with_capacity(3 * compute[s].len());
                let mut ticks = Vec::with_capacity(ops.capacity());
                for (op, &t) in compute[s].iter().zip(&start[s]) {
                    match *op {
                        Op::Forward(m) => {
                            if s > 0 {
                                ops.push(Op::RecvAct(m));
                                ticks.push(None);
                            }
                            ops.push(*op);
                            ticks.push(t);
                            if s + 1 < p {
                                ops.push(Op::SendAct(m));
                                ticks.push(None);
                            }
                        }
                        Op::Backward(m) => {
                            if s + 1 < p {
                                ops.push(Op::RecvGrad(m));
                                ticks.push(None);
                            }
                            ops.push(*op);
                            ticks.push(t);
                            if s > 0 {
                                ops.push(Op::SendGrad(m));
                                ticks.push(None);
                            }
                        }
                        _ => unreachable!("compute operations only"),
                    }
                }
                let (slot, in_flight) = assign_slots(&compute[s], k);
                let busy_ticks = k as u64 * (FORWARD_TICKS + BACKWARD_TICKS);
                StagePlan { ops, ticks, slot, in_flight, busy_ticks }
            })
            .collect();
        Ok(Schedule { kind, n_stages: p, n_micro: k, stages, makespan })
    }

    /// Idle ticks of stage `s` in the ideal timeline.
    pub fn idle_ticks(&self, s: usize) -> u64 {
        self.makespan - self.stages[s].busy_ticks
    }

    /// The bubble: idle ticks over all stages' ticks, (P−1)/(K+P−1) for
    /// both schedules when a backward is a fixed multiple of a forward.
    pub fn bubble_fraction(&self) -> f64 {
        let idle: u64 = (0..self.n_stages).map(|s| self.idle_ticks(s)).sum();
        idle as f64 / (self.makespan * self.n_stages as u64) as f64
    }

    /// Most activation slots any stage needs (stage 0's).
    pub fn max_in_flight(&self) -> usize {
        self.stages.iter().map(|s| s.in_flight).max().unwrap_or(0)
    }
}

/// Slots for the micro-batches in `compute` order: the lowest free slot at
/// each forward, released at the backward.
fn assign_slots(compute: &[Op], k: usize) -> (Vec<usize>, usize) {
    let mut slot = vec![0; k];
    let mut busy: Vec<bool> = Vec::new();
    for op in compute {
        match *op {
            Op::Forward(m) => {
                let free = busy.iter().position(|b| !b).unwrap_or(busy.len());
                if free == busy.len() {
                    busy.push(false);
                }
                busy[free] = true;
                slot[m] = free;
            }
            Op::Backward(m) => busy[slot[m]] = false,
            _ => {}
        }
    }
    (slot, busy.len())
}

impl fmt::Display for Schedule {
    /// One line per stage: its compute operations at their ticks, `.` where
    /// the stage idles in the ideal timeline (forward 1 tick, backward 2).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "{} schedule, P = {}, K = {}: {} ticks, bubble {:.3} (= (P-1)/(K+P-1) = {:.3})",
            self.kind,
            self.n_stages,
            self.n_micro,
            self.makespan,
            self.bubble_fraction(),
            (self.n_stages - 1) as f64 / (self.n_micro + self.n_stages - 1) as f64
        )?;
        for (s, plan) in self.stages.iter().enumerate() {
            let mut line = vec![".".to_string(); self.makespan as usize];
            for (op, t) in plan.ops.iter().zip(&plan.ticks) {
                let Some(t) = t else { continue };
                let (len, txt) = match op {
                    Op::Forward(k) => (FORWARD_TICKS, format!("F{k}")),
                    Op::Backward(k) => (BACKWARD_TICKS, format!("B{k}")),
                    _ => continue,
                };
                line[*t as usize] = txt;
                for i in 1..len {
                    line[(*t + i) as usize] = "~".into();
                }
            }
            writeln!(f, "stage {s} (slots {}): {}", plan.in_flight, line.join(" "))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bubble_is_p_minus_1_over_k_plus_p_minus_1() {
        for kind in [ScheduleKind::OneFOneB, ScheduleKind::GPipe] {
            for p in 1..=6 {
                for k in 1..=12 {
                    let s = Schedule::new(kind, p, k).unwrap();
                    let want = (p - 1) as f64 / (k + p - 1) as f64;
                    assert!((s.bubble_fraction() - want).abs() < 1e-12, "{kind} P={p} K={k}: {s}");
                    // Every stage idles the same (P−1)(t_f + t_b) ticks.
                    for st in 0..p {
                        assert_eq!(s.idle_ticks(st), (p as u64 - 1) * (FORWARD_TICKS + BACKWARD_TICKS));
                    }
                }
            }
        }
    }

    #[test]
    fn one_f_one_b_keeps_p_minus_s_in_flight_gpipe_k() {
        let (p, k) = (4, 8);
        let f = Schedule::new(ScheduleKind::OneFOneB, p, k).unwrap();
        let g = Schedule::new(ScheduleKind::GPipe, p, k).unwrap();
        for s in 0..p {
            assert_eq!(f.stages[s].in_flight, p - s);
            assert_eq!(g.stages[s].in_flight, k);
        }
        // Fewer micro-batches than stages: at most K in flight.
        let f = Schedule::new(ScheduleKind::OneFOneB, 4, 2).unwrap();
        assert_eq!(f.stages[0].in_flight, 2);
    }

    #[test]
    fn every_stage_runs_each_micro_batch_once_backwards_ascending_and_messages_pair_up() {
        for kind in [ScheduleKind::OneFOneB, ScheduleKind::GPipe] {
            let (p, k) = (4, 6);
            let s = Schedule::new(kind, p, k).unwrap();
            for (st, plan) in s.stages.iter().enumerate() {
                let fw: Vec<usize> =
                    plan.ops.iter().filter_map(|o| if let Op::Forward(m) = o { Some(*m) } else { None }).collect();
                let bw: Vec<usize> =
                    plan.ops.iter().filter_map(|o| if let Op::Backward(m) = o { Some(*m) } else { None }).collect();
                assert_eq!(fw, (0..k).collect::<Vec<_>>());
                assert_eq!(bw, (0..k).collect::<Vec<_>>());
                let count = |f: fn(&Op) -> bool| plan.ops.iter().filter(|o| f(o)).count();
                assert_eq!(count(|o| matches!(o, Op::SendAct(_))), if st + 1 < p { k } else { 0 });
                assert_eq!(count(|o| matches!(o, Op::RecvAct(_))), if st > 0 { k } else { 0 });
                assert_eq!(count(|o| matches!(o, Op::SendGrad(_))), if st > 0 { k } else { 0 });
                // A slot is never reused while its micro-batch is alive.
                for (i, op) in plan.ops.iter().enumerate() {
                    if let Op::Forward(m) = op {
                        let end = plan.ops.iter().position(|o| *o == Op::Backward(*m)).unwrap();
                        for o in &plan.ops[i + 1..end] {
                            if let Op::Forward(n) = o {
                                assert_ne!(plan.slot[*n], plan.slot[*m], "{kind} stage {st}: slot reused");
                            }
                        }
                    }
                }
            }
        }
    }
}

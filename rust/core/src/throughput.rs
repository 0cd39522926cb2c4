//! SGLang's `throughput_aware` strategy (PR #28045; `throughput_aware_spec_params.py` and
//! `throughput_aware_controller.py`), restated:
//!
//! - One current steps value for the whole engine (not per slot); each slot only names the
//!   candidates for its batch sizes, all > 0.
//! - Acceptance per draft position `k` (0-based): the share of a batch's requests with more than
//!   `k` accepted drafts, kept over the last `window_size` batches per position and shared by all
//!   batch sizes. A position without data is extrapolated geometrically from the known ones.
//!   `E[tokens | S] = 1 + sum_{k<S} p_k`.
//! - Cost: a table `(batch size, steps) -> seconds` measured at start on the real decode path (the
//!   engine runs it, [`crate::config::ProfileConfig`]); a batch size is looked up at the first
//!   profiled size >= it (the largest when above all); no context axis.
//! - Every `update_interval` batches, once every position below the current steps has a full
//!   window and the table is not empty, the slot's candidates are scored `E / cost` and the best
//!   replaces the current steps if it scores more than `current * (1 + switch_hysteresis)`
//!   (always when the current steps have no score). Shrinking clears the windows above.
//!
//! specdial difference, said here: `decide` must return a candidate of the routed slot, so when
//! the current steps are not one of its candidates the slot's best is taken at once (the candidate
//! nearest the current steps while nothing can be scored).

use std::collections::{BTreeMap, VecDeque};

use crate::config::ThroughputAwareConfig;

/// The strategy's state (see the module docs).
#[derive(Debug, Clone, PartialEq)]
pub struct ThroughputAwarePolicy {
    cfg: ThroughputAwareConfig,
    windows: Vec<VecDeque<f64>>,
    table: BTreeMap<(u32, u32), f64>,
    current: u32,
    batch_count: u64,
    switches: u64,
    /// The current steps changed since the last report.
    switched: bool,
}

impl ThroughputAwarePolicy {
    /// Starts at `initial_steps` if it is a candidate of any slot, else at the middle candidate of
    /// the first slot (SGLang's rule). `max_steps`: the largest candidate.
    pub fn new(cfg: ThroughputAwareConfig, initial_steps: u32, first_slot: &[u32], union: &[u32]) -> Self {
        let max_steps = union.last().copied().unwrap_or(1) as usize;
        let current = if union.contains(&initial_steps) { initial_steps } else { first_slot[first_slot.len() / 2] };
        ThroughputAwarePolicy {
            windows: vec![VecDeque::with_capacity(cfg.window_size as usize); max_steps],
            cfg,
            table: BTreeMap::new(),
            current,
            batch_count: 0,
            switches: 0,
            switched: false,
        }
    }

    /// The current steps (a pure read).
    pub fn current_steps(&self) -> u32 {
        self.current
    }

    /// Batches observed.
    pub fn batch_count(&self) -> u64 {
        self.batch_count
    }

    /// Switches so far.
    pub fn switches(&self) -> u64 {
        self.switches
    }

    /// Sets one cost-table entry (seconds > 0, checked by the caller).
    pub fn set_cost(&mut self, batch_size: u32, steps: u32, seconds: f64) {
        self.table.insert((batch_size, steps), seconds);
    }

    /// The cost table, `(batch size, steps, seconds)` ascending.
    pub fn cost_table(&self) -> Vec<(u32, u32, f64)> {
        self.table.iter().map(|(&(b, k), &t)| (b, k, t)).collect()
    }

    /// Ceiling lookup over the profiled batch sizes (the largest when above all).
    pub fn lookup(&self, batch_size: u32, steps: u32) -> Option<f64> {
        let sizes: Vec<u32> = {
            let mut v: Vec<u32> = self.table.keys().map(|&(b, _)| b).collect();
            v.dedup();
            v
        };
        let b = *sizes.get(sizes.partition_point(|&s| s < batch_size)).or(sizes.last())?;
        self.table.get(&(b, steps)).copied()
    }

    fn rate(&self, k: usize, known: &[f64]) -> Option<f64> {
        let w = &self.windows[k];
        if !w.is_empty() {
            return Some(w.iter().sum::<f64>() / w.len() as f64);
        }
        match known {
            [] => None,
            [p] => Some(*p),
            [p0, .., pn] => {
                if *p0 <= 0.0 {
                    return Some(0.0);
                }
                let alpha = (pn / p0).powf(1.0 / (known.len() - 1) as f64);
                Some((pn * alpha).clamp(0.0, *pn))
            }
        }
    }

    /// Per-position rates `p_0..p_{n-1}` (window mean or extrapolated; None at cold start).
    pub fn position_rates(&self, n: usize) -> Vec<Option<f64>> {
        let mut known = Vec::new();
        (0..n.min(self.windows.len()))
            .map(|k| {
                let r = self.rate(k, &known);
                if let Some(r) = r {
                    known.push(r);
                }
                r
            })
            .collect()
    }

    /// `1 + sum_{k<steps} p_k`, or None at cold start.
    pub fn expected_tokens(&self, steps: u32) -> Option<f64> {
        if steps == 0 {
            return None;
        }
        let rates = self.position_rates(steps as usize);
        if rates.len() < steps as usize {
            return None;
        }
        rates.into_iter().sum::<Option<f64>>().map(|s| 1.0 + s)
    }

    fn score(&self, batch_size: u32, steps: u32) -> Option<f64> {
        let e = self.expected_tokens(steps)?;
        let c = self.lookup(batch_size, steps)?;
        (c > 0.0).then(|| e / c)
    }

    fn warmed(&self) -> bool {
        let n = (self.current as usize).min(self.windows.len());
        self.windows[..n].iter().all(|w| w.len() >= self.cfg.window_size as usize)
    }

    /// The steps for a batch of `batch_size` requests (padded) whose slot offers `candidates`.
    pub fn decide(&mut self, batch_size: u32, candidates: &[u32]) -> u32 {
        let due = self.batch_count > 0
            && self.batch_count % u64::from(self.cfg.update_interval) == 0
            && self.warmed()
            && !self.table.is_empty();
        let outside = !candidates.contains(&self.current);
        if due || outside {
            let scored: Vec<(u32, Option<f64>)> = candidates.iter().map(|&k| (k, self.score(batch_size, k))).collect();
            let best = scored
                .iter()
                .filter_map(|&(k, s)| s.map(|s| (k, s)))
                .fold(None, |a: Option<(u32, f64)>, (k, s)| match a {
                    Some((_, bs)) if bs >= s => a,
                    _ => Some((k, s)),
                });
            let current_score = scored.iter().find(|r| r.0 == self.current).and_then(|r| r.1);
            let target = match (best, current_score) {
                (Some((k, _)), _) if k == self.current => None,
                (Some((k, _)), None) => Some(k),
                (Some((k, s)), Some(c)) if c <= 0.0 || s > c * (1.0 + self.cfg.switch_hysteresis) => Some(k),
                _ => None,
            };
            let target = target.or_else(|| {
                outside.then(|| {
                    *candidates
                        .iter()
                        .min_by_key(|&&k| (k as i64 - self.current as i64).abs())
                        .expect("a slot has candidates")
                })
            });
            if let Some(k) = target {
                if k < self.current {
                    for w in &mut self.windows[k as usize..] {
                        w.clear();
                    }
                }
                self.current = k;
                self.switches += 1;
                self.switched = true;
            }
        }
        self.current
    }

    /// Records one verify at `steps` (`accepted` in `0..=steps`, checked by the caller). Returns
    /// the new current steps if they changed since the last report.
    pub fn observe(&mut self, steps: u32, accepted: &[i64]) -> Option<u32> {
        if !accepted.is_empty() {
            let s = (steps as usize).min(self.windows.len());
            let n = accepted.len() as f64;
            let window = self.cfg.window_size as usize;
            for k in 0..s {
                let more = accepted.iter().filter(|&&a| a > k as i64).count() as f64;
                let w = &mut self.windows[k];
                if w.len() == window {
                    w.pop_front();
                }
                w.push_back(more / n);
            }
            self.batch_count += 1;
        }
        std::mem::take(&mut self.switched).then_some(self.current)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> ThroughputAwareConfig {
        ThroughputAwareConfig { window_size: 2, update_interval: 2, ..Default::default() }
    }

    #[test]
    fn scores_with_hysteresis_and_clears_windows_on_shrink() {
        let mut p = ThroughputAwarePolicy::new(cfg(), 3, &[1, 3], &[1, 3]);
        // Costs: steps 1 = 10 ms, steps 3 = 30 ms at bs 8.
        p.set_cost(8, 1, 0.010);
        p.set_cost(8, 3, 0.030);
        assert_eq!(p.decide(5, &[1, 3]), 3); // nothing observed yet
        // Acceptance 0.5 per position: E(1) = 1.5 -> 150/s, E(3) = 2.5 -> 83/s.
        for _ in 0..2 {
            p.observe(3, &[0, 1, 2, 3]);
        }
        assert_eq!(p.expected_tokens(3), Some(1.0 + 0.75 + 0.5 + 0.25));
        assert_eq!(p.decide(5, &[1, 3]), 1);
        assert!(p.windows[1].is_empty() && p.windows[2].is_empty()); // cleared above the new steps
        assert_eq!(p.position_rates(3)[1], Some(0.75)); // now extrapolated from position 0
        assert_eq!(p.observe(1, &[1, 0]), Some(1));
    }

    #[test]
    fn ceiling_lookup_and_geometric_extrapolation() {
        let mut p = ThroughputAwarePolicy::new(cfg(), 1, &[1], &[1, 2, 4]);
        p.set_cost(4, 1, 1.0);
        p.set_cost(16, 1, 2.0);
        assert_eq!(p.lookup(1, 1), Some(1.0));
        assert_eq!(p.lookup(5, 1), Some(2.0));
        assert_eq!(p.lookup(100, 1), Some(2.0));
        assert_eq!(p.lookup(4, 2), None);
        p.windows[0].push_back(0.8);
        p.windows[1].push_back(0.4);
        let r = p.position_rates(4);
        assert_eq!(r[2], Some(0.2)); // 0.4 * (0.4 / 0.8)
        assert!((r[3].unwrap() - 0.1).abs() < 1e-12);
    }
}

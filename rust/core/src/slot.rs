//! One slot's adaptive state machine: the `ema` strategy.
//!
//! The rules are SGLang's adaptive speculative decoding (PR #21599, per-batch-size slots in
//! #24055, steps 0 with a warm drafter in #23994), restated in the foundation issue:
//!
//! - `ema_accept_len` is an EMA of **accepted drafts** per request (bonus token excluded), not of
//!   the acceptance length (= accepted drafts + 1). The name is SGLang's and is kept on purpose.
//! - Each verify with `current > 0` moves the EMA toward the batch mean; at `current == 0` there
//!   are no drafts, so observations leave the EMA alone.
//! - After `warmup_batches` verifies, every `update_interval`-th verify recomputes the steps:
//!   from 0, probe the next higher candidate; otherwise walk down (several rungs at once) while the
//!   EMA is at or below the lower rung's threshold plus `down_hysteresis`, else walk up while it is
//!   strictly above the current rung's threshold plus `up_hysteresis`; then apply the optional
//!   ceiling `max(1, ceil(ema * ceiling_coeff))`.

use crate::config::SlotConfig;
use crate::error::PolicyError;

/// Per-batch-size-range adaptive state: candidate steps, the EMA, and verify counters.
#[derive(Debug, Clone, PartialEq)]
pub struct AdaptiveStepSlot {
    config: SlotConfig,
    /// Index of the current steps in `config.candidate_steps`.
    index: usize,
    /// EMA of accepted drafts per request (bonus excluded).
    ema: f64,
    /// Verifies observed (non-empty inputs only).
    count: u64,
}

/// Threshold of a lower rung when deciding to step down to it: 0.5 for steps 0, else `prev - 0.5`.
fn down_threshold(prev: u32) -> f64 {
    if prev == 0 {
        0.5
    } else {
        prev as f64 - 0.5
    }
}

impl AdaptiveStepSlot {
    /// Starts at `initial_steps` if it is a candidate, else at `candidates[len / 2]`, with the EMA
    /// neutral for that rung (`current - 1`) and no verifies counted.
    ///
    /// `config.candidate_steps` must be non-empty, sorted and unique (as [`SlotConfig`] from a
    /// validated [`crate::AdaptiveConfig`] always is).
    pub fn new(initial_steps: u32, config: SlotConfig) -> Self {
        assert!(!config.candidate_steps.is_empty(), "a slot needs at least one candidate");
        let c = &config.candidate_steps;
        let index = c.iter().position(|&s| s == initial_steps).unwrap_or(c.len() / 2);
        let ema = c[index] as f64 - 1.0;
        AdaptiveStepSlot { config, index, ema, count: 0 }
    }

    /// The steps this slot currently chooses.
    pub fn current_steps(&self) -> u32 {
        self.config.candidate_steps[self.index]
    }

    /// EMA of accepted drafts per request (bonus token excluded; SGLang's `ema_accept_len`).
    pub fn ema_accept_len(&self) -> f64 {
        self.ema
    }

    /// Verifies observed so far (empty observations are not counted).
    pub fn verify_count(&self) -> u64 {
        self.count
    }

    /// The slot's settings (candidates sorted ascending).
    pub fn config(&self) -> &SlotConfig {
        &self.config
    }

    /// Feeds one verify's accepted drafts per request (each in `0..=current_steps`).
    ///
    /// Returns `Ok(Some(new_steps))` when the steps changed, `Ok(None)` otherwise (and for an
    /// empty input, which changes nothing). A value outside `0..=current_steps` is an error and
    /// leaves the slot unchanged.
    pub fn update<I>(&mut self, accepted: I) -> Result<Option<u32>, PolicyError>
    where
        I: IntoIterator<Item = i64>,
    {
        let steps = self.current_steps();
        let (mut sum, mut n) = (0i64, 0usize);
        for (index, value) in accepted.into_iter().enumerate() {
            if value < 0 || value > steps as i64 {
                return Err(PolicyError::Accepted { index, value, steps });
            }
            sum += value;
            n += 1;
        }
        if n == 0 {
            return Ok(None);
        }
        Ok(self.observe_mean(sum as f64 / n as f64))
    }

    /// The state transition for one non-empty verify whose mean accepted drafts is `mean`.
    pub(crate) fn observe_mean(&mut self, mean: f64) -> Option<u32> {
        if self.current_steps() > 0 {
            let a = self.config.ema_alpha;
            self.ema = (1.0 - a) * self.ema + a * mean;
        }
        self.count += 1;
        let warmup = self.config.warmup_batches as u64;
        if self.count > warmup && (self.count - warmup) % self.config.update_interval as u64 == 0 {
            self.recompute()
        } else {
            None
        }
    }

    fn recompute(&mut self) -> Option<u32> {
        let c = &self.config.candidate_steps;
        let old = self.index;
        let old_steps = c[old];
        let mut i = old;
        if old_steps == 0 {
            // Probe upward from plain decoding; a negative EMA would stall the probe, so it is
            // reset to neutral for the target rung (the only EMA change at steps 0).
            if i + 1 < c.len() {
                i += 1;
                if c[i] > 0 && self.ema < 0.0 {
                    self.ema = c[i] as f64 - 1.0;
                }
            }
        } else {
            while i > 0 && self.ema <= down_threshold(c[i - 1]) + self.config.down_hysteresis {
                i -= 1;
            }
            if i == old {
                while i + 1 < c.len() && self.ema > c[i] as f64 - 0.5 + self.config.up_hysteresis {
                    i += 1;
                }
            }
            if self.config.ceiling_coeff > 0.0 {
                let ceiling = (self.ema * self.config.ceiling_coeff).ceil().max(1.0);
                if c[i] as f64 > ceiling && c[i] <= old_steps {
                    while i > 0 && c[i] as f64 > ceiling {
                        i -= 1;
                    }
                }
            }
        }
        self.index = i;
        (c[i] != old_steps).then_some(c[i])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A slot with no warm-up, recomputing every verify, no hysteresis and alpha 1 (EMA = last mean).
    fn eager(c: &[u32], initial: u32) -> AdaptiveStepSlot {
        let cfg = SlotConfig {
            ema_alpha: 1.0,
            update_interval: 1,
            warmup_batches: 0,
            down_hysteresis: 0.0,
            ..SlotConfig::with_candidates(c)
        };
        AdaptiveStepSlot::new(initial, cfg)
    }

    #[test]
    fn starts_at_initial_or_middle_with_neutral_ema() {
        let s = AdaptiveStepSlot::new(5, SlotConfig::with_candidates(&[1, 3, 5, 7]));
        assert_eq!((s.current_steps(), s.ema_accept_len()), (5, 4.0));
        let s = AdaptiveStepSlot::new(4, SlotConfig::with_candidates(&[1, 3, 5, 7]));
        assert_eq!((s.current_steps(), s.ema_accept_len()), (5, 4.0));
        let s = AdaptiveStepSlot::new(9, SlotConfig::with_candidates(&[0, 1]));
        assert_eq!((s.current_steps(), s.ema_accept_len()), (1, 0.0));
        let s = AdaptiveStepSlot::new(0, SlotConfig::with_candidates(&[0, 1]));
        assert_eq!((s.current_steps(), s.ema_accept_len()), (0, -1.0));
    }

    #[test]
    fn empty_input_changes_nothing() {
        let mut s = eager(&[1, 3], 3);
        let before = s.clone();
        assert_eq!(s.update(std::iter::empty()), Ok(None));
        assert_eq!(s, before);
    }

    #[test]
    fn out_of_range_accepted_is_an_error_and_changes_nothing() {
        let mut s = eager(&[1, 3], 3);
        let before = s.clone();
        assert_eq!(s.update([1, 4]), Err(PolicyError::Accepted { index: 1, value: 4, steps: 3 }));
        assert_eq!(s.update([-1]), Err(PolicyError::Accepted { index: 0, value: -1, steps: 3 }));
        assert_eq!(s, before);
    }

    #[test]
    fn ema_formula() {
        let cfg = SlotConfig { ema_alpha: 0.25, warmup_batches: 100, ..SlotConfig::with_candidates(&[3]) };
        let mut s = AdaptiveStepSlot::new(3, cfg);
        s.update([3, 1]).unwrap(); // mean 2: 0.75 * 2 + 0.25 * 2
        assert!((s.ema_accept_len() - 2.0).abs() < 1e-12);
        s.update([0]).unwrap();
        assert!((s.ema_accept_len() - 1.5).abs() < 1e-12);
        assert_eq!(s.verify_count(), 2);
    }

    #[test]
    fn several_rungs_down_at_once() {
        let mut s = eager(&[1, 3, 5, 7], 7);
        assert_eq!(s.update([0]), Ok(Some(1)));
    }

    #[test]
    fn drop_is_inclusive_at_the_threshold() {
        // Lower rung 3: threshold 2.5 (+ down 0). EMA exactly 2.5 drops; just above stays.
        let cfg = SlotConfig { ema_alpha: 0.5, update_interval: 1, warmup_batches: 0, down_hysteresis: 0.0, ..SlotConfig::with_candidates(&[3, 5]) };
        let mut s = AdaptiveStepSlot::new(5, cfg.clone()); // ema 4
        assert_eq!(s.update([1]), Ok(Some(3))); // ema 2.5
        let mut s = AdaptiveStepSlot::new(5, cfg);
        assert_eq!(s.update([2]), Ok(None)); // ema 3.0 > 2.5: stays (and 3.0 <= 4.5: no rise)
        assert_eq!(s.current_steps(), 5);
    }

    #[test]
    fn drop_to_zero_uses_half_threshold() {
        let mut s = eager(&[0, 1], 1);
        assert_eq!(s.update([1]), Ok(None)); // ema 1 > 0.5
        let mut s = eager(&[0, 1], 1);
        let cfg = SlotConfig { ema_alpha: 0.5, ..s.config().clone() };
        s = AdaptiveStepSlot::new(1, cfg); // ema 0
        assert_eq!(s.update([1]), Ok(Some(0))); // ema 0.5 <= 0.5
    }

    #[test]
    fn rise_is_strict() {
        // Current 3: rises when ema > 2.5 (+ up). ema 2.5 exactly stays.
        let cfg = SlotConfig { ema_alpha: 0.5, update_interval: 1, warmup_batches: 0, ..SlotConfig::with_candidates(&[1, 3, 5]) };
        let mut s = AdaptiveStepSlot::new(3, cfg.clone()); // ema 2
        assert_eq!(s.update([3]), Ok(None)); // ema 2.5
        let mut s = AdaptiveStepSlot::new(3, cfg);
        assert_eq!(s.update([3]), Ok(None)); // ema 2.5
        assert_eq!(s.update([3]), Ok(Some(5))); // ema 2.75 > 2.5
    }

    #[test]
    fn up_hysteresis_shifts_the_rise() {
        let cfg = SlotConfig { ema_alpha: 1.0, update_interval: 1, warmup_batches: 0, up_hysteresis: 0.4, ..SlotConfig::with_candidates(&[3, 5]) };
        let mut s = AdaptiveStepSlot::new(3, cfg);
        assert_eq!(s.update([3, 3, 3, 2, 3]), Ok(None)); // 2.8 <= 2.9
        assert_eq!(s.update([3]), Ok(Some(5)));
    }

    #[test]
    fn walks_up_several_rungs_when_saturated() {
        let mut s = eager(&[1, 2, 3], 1);
        // ema 1 > 0.5 -> 2; 1 > 1.5? no. One rung, since accepted <= current steps bounds the EMA.
        assert_eq!(s.update([1]), Ok(Some(2)));
    }

    #[test]
    fn zero_step_probe_with_neutral_ema() {
        let cfg = SlotConfig { update_interval: 1, warmup_batches: 0, ..SlotConfig::with_candidates(&[0, 3]) };
        let mut s = AdaptiveStepSlot::new(0, cfg);
        assert_eq!(s.ema_accept_len(), -1.0);
        assert_eq!(s.update([0, 0]), Ok(Some(3)));
        assert_eq!(s.ema_accept_len(), 2.0); // reset to target - 1
    }

    #[test]
    fn zero_step_probe_keeps_a_non_negative_ema() {
        let cfg = SlotConfig { ema_alpha: 1.0, update_interval: 1, warmup_batches: 0, down_hysteresis: 0.0, ..SlotConfig::with_candidates(&[0, 3]) };
        let mut s = AdaptiveStepSlot::new(3, cfg);
        assert_eq!(s.update([0]), Ok(Some(0))); // ema 0 <= 0.5
        assert_eq!(s.update([0]), Ok(Some(3))); // probe
        assert_eq!(s.ema_accept_len(), 0.0); // not reset: it was not negative
    }

    #[test]
    fn observations_at_zero_leave_the_ema() {
        let cfg = SlotConfig { warmup_batches: 1000, ..SlotConfig::with_candidates(&[0, 3]) };
        let mut s = AdaptiveStepSlot::new(0, cfg);
        for _ in 0..50 {
            s.update([0, 0, 0]).unwrap();
        }
        assert_eq!(s.ema_accept_len(), -1.0);
        assert_eq!(s.verify_count(), 50);
    }

    #[test]
    fn top_zero_only_slot_stays() {
        let mut s = eager(&[0], 0);
        assert_eq!(s.update([0]), Ok(None));
        assert_eq!(s.current_steps(), 0);
    }

    #[test]
    fn ceiling_caps_a_rise_only_when_not_above_old_steps() {
        // Ceiling applies to a target at or below the old steps: staying at 7 with ema 1.0 and
        // coeff 2 -> ceiling 2 -> walk down to the largest candidate <= 2 (here 1).
        let cfg = SlotConfig { ema_alpha: 1.0, update_interval: 1, warmup_batches: 0, down_hysteresis: -10.0, ceiling_coeff: 2.0, ..SlotConfig::with_candidates(&[1, 3, 5, 7]) };
        let mut s = AdaptiveStepSlot::new(7, cfg.clone());
        assert_eq!(s.update([1]), Ok(Some(1)));
        // A rise above the old steps is not capped: at 3 with ema 3.0 -> 5 (> ceiling 3? no: ceil(3*1)=3).
        let cfg_up = SlotConfig { ceiling_coeff: 1.0, ..cfg };
        let mut s = AdaptiveStepSlot::new(3, cfg_up);
        assert_eq!(s.update([3]), Ok(Some(5))); // target 5 > ceiling 3 but above old 3: kept
    }

    #[test]
    fn ceiling_never_below_one_and_may_end_on_lowest() {
        let cfg = SlotConfig { ema_alpha: 1.0, update_interval: 1, warmup_batches: 0, down_hysteresis: -10.0, ceiling_coeff: 0.1, ..SlotConfig::with_candidates(&[3, 5]) };
        let mut s = AdaptiveStepSlot::new(5, cfg);
        // ema 0 -> ceiling max(1, 0) = 1; 5 > 1 -> walk to index 0 (3), the lowest, although 3 > 1.
        assert_eq!(s.update([0]), Ok(Some(3)));
    }

    #[test]
    fn warmup_and_interval_counting() {
        let cfg = SlotConfig { ema_alpha: 1.0, update_interval: 3, warmup_batches: 2, down_hysteresis: 0.0, ..SlotConfig::with_candidates(&[1, 3]) };
        let mut s = AdaptiveStepSlot::new(3, cfg);
        // Recomputes at counts 5, 8, 11 (count > 2 and (count - 2) % 3 == 0).
        let mut changed_at = Vec::new();
        for count in 1..=11u64 {
            let steps = s.current_steps() as i64;
            let accepted = if steps == 3 { 0 } else { 1 };
            if s.update([accepted]).unwrap().is_some() {
                changed_at.push(count);
            }
        }
        assert_eq!(changed_at, vec![5, 8, 11]);
    }
}

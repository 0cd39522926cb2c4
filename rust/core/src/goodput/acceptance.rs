//! Per-position conditional acceptance estimates: `alpha[j]` = P(draft `j + 1` accepted | drafts
//! `1..=j` accepted), one shared estimate for every slot (acceptance is a property of the content
//! and the drafter, not of the batch size; SGLang's throughput-aware tracker shares it the same way).
//!
//! From one verify at steps `k` where request `r` accepted `a_r` drafts, position `j` (1-based) was
//! *reached* by every request with `a_r >= j - 1` and *accepted* by those with `a_r >= j`, for
//! `j <= k`. Conditional rates combine verifies of different depths without bias, and for a
//! mixture of requests their product telescopes to the pooled unconditional rate, so
//! `E(k) = 1 + sum_{i<=k} prod_{j<=i} alpha_j` (Leviathan et al. 2023, with position-dependent
//! rates) is the expected acceptance length of the population.
//!
//! Two estimates per position:
//! - *recent* counts, discounted by `1 - 1/window` per decode iteration (any steps, applied lazily),
//!   so after a stretch at steps 0 or at lower depth they fade;
//! - *long-run* counts, discounted only when the position is observed (by `1 - 1/(8 window)`),
//!   which keep the shape across depths: the ratio `alpha_j / alpha_{j-1}`, both measured on the
//!   verifies that reached position `j`.
//!
//! The estimate shrinks the recent rate toward a prior with `PRIOR_WEIGHT` pseudo-requests: the
//! long-run rate for position 1, and `alpha_{j-1} * (long-run ratio j / j-1)` deeper. A position
//! not observed lately (beyond the current depth, or at steps 0) therefore follows the positions
//! before it with the depth profile seen earlier: "an estimate kept from earlier depths".

use serde::{Deserialize, Serialize};

/// Pseudo-requests of the prior in each position's estimate.
const PRIOR_WEIGHT: f64 = 4.0;
/// Rate assumed before anything was observed (only the first decisions see it).
const INITIAL_RATE: f64 = 0.6;

#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
struct Counts {
    reached: f64,
    accepted: f64,
}

impl Counts {
    /// The rate shrunk toward `prior` by `PRIOR_WEIGHT` pseudo-requests (so a handful of
    /// observations cannot pin it to 0 or 1).
    fn shrunk(&self, prior: f64) -> f64 {
        (self.accepted + PRIOR_WEIGHT * prior) / (self.reached + PRIOR_WEIGHT)
    }
}

/// What an [`AcceptanceModel`] keeps across runs ([`AcceptanceModel::state`]): the long-run
/// counts per position, i.e. the prior a position's estimate starts from and the depth profile.
/// The recent counts are left out: they describe the content of one run, and a restored model
/// follows the new content as fast as a fresh one (the prior weighs `PRIOR_WEIGHT` requests).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AcceptanceState {
    long_run: Vec<Counts>,
    long_prev: Vec<Counts>,
    observed: u64,
}

/// The shared acceptance estimator (see the module docs).
#[derive(Debug, Clone, PartialEq)]
pub struct AcceptanceModel {
    recent: Vec<Counts>,
    long_run: Vec<Counts>,
    /// `long_prev[j]`: long-run counts of position `j - 1` over the verifies that also observed
    /// position `j`, so `rate(long_run[j]) / rate(long_prev[j])` compares the same verifies.
    long_prev: Vec<Counts>,
    /// Per decode iteration.
    decay: f64,
    long_decay: f64,
    /// Decode iteration at which `recent` was last brought up to date.
    synced_at: u64,
    /// Verifies with drafts observed.
    observed: u64,
}

impl AcceptanceModel {
    /// An estimator for positions `1..=max_steps` with a window of `window` decode iterations.
    pub fn new(max_steps: u32, window: u32) -> Self {
        let n = max_steps as usize;
        let w = f64::from(window.max(1));
        AcceptanceModel {
            recent: vec![Counts::default(); n],
            long_run: vec![Counts::default(); n],
            long_prev: vec![Counts::default(); n],
            decay: 1.0 - 1.0 / w,
            long_decay: 1.0 - 1.0 / (8.0 * w),
            synced_at: 0,
            observed: 0,
        }
    }

    /// Positions tracked (`max_steps`).
    pub fn max_steps(&self) -> usize {
        self.recent.len()
    }

    /// Verifies with drafts observed so far.
    pub fn observed(&self) -> u64 {
        self.observed
    }

    /// The long-run counts (see [`AcceptanceState`]).
    pub fn state(&self) -> AcceptanceState {
        AcceptanceState { long_run: self.long_run.clone(), long_prev: self.long_prev.clone(), observed: self.observed }
    }

    /// Takes the long-run counts of `state` for the positions both models track (positions
    /// beyond the saved ones keep no counts). Errors (nothing changes) on counts that are
    /// negative, not finite, or accepted above reached.
    pub fn restore(&mut self, state: &AcceptanceState) -> Result<(), String> {
        let ok = |c: &Counts| c.reached.is_finite() && c.accepted >= 0.0 && c.accepted <= c.reached * (1.0 + 1e-9) + 1e-9;
        if state.long_run.len() != state.long_prev.len() || !state.long_run.iter().chain(&state.long_prev).all(ok) {
            return Err("acceptance: counts that are negative, not finite or inconsistent".into());
        }
        let n = self.long_run.len();
        for (dst, src) in [(&mut self.long_run, &state.long_run), (&mut self.long_prev, &state.long_prev)] {
            *dst = src.iter().copied().chain(std::iter::repeat(Counts::default())).take(n).collect();
        }
        self.observed = state.observed;
        Ok(())
    }

    fn sync(&mut self, iteration: u64) {
        let dt = iteration.saturating_sub(self.synced_at);
        if dt > 0 {
            let f = self.decay.powf(dt as f64);
            for c in &mut self.recent {
                c.reached *= f;
                c.accepted *= f;
            }
            self.synced_at = iteration;
        }
    }

    /// Records one verify at `steps` (> 0) made at decode iteration `iteration` (a counter that
    /// never decreases), `accepted[r]` in `0..=steps` (checked by the caller).
    pub fn observe(&mut self, iteration: u64, steps: u32, accepted: &[i64]) {
        let k = (steps as usize).min(self.recent.len());
        if k == 0 || accepted.is_empty() {
            return;
        }
        self.sync(iteration);
        // hist[c] = requests that accepted exactly c drafts (c capped at k).
        let mut hist = vec![0u32; k + 1];
        for &a in accepted {
            hist[(a.max(0) as usize).min(k)] += 1;
        }
        let mut reached = accepted.len() as f64;
        let mut prev = Counts::default();
        for j in 0..k {
            let acc = reached - f64::from(hist[j]);
            if j > 0 {
                let lp = &mut self.long_prev[j];
                lp.reached = lp.reached * self.long_decay + prev.reached;
                lp.accepted = lp.accepted * self.long_decay + prev.accepted;
            }
            prev = Counts { reached, accepted: acc };
            let r = &mut self.recent[j];
            r.reached += reached;
            r.accepted += acc;
            let l = &mut self.long_run[j];
            l.reached = l.reached * self.long_decay + reached;
            l.accepted = l.accepted * self.long_decay + acc;
            // Deeper positions add zero counts when nobody reached them, but their long-run
            // ratios still see this verify (leaving it out would bias them by selection).
            reached = acc;
        }
        self.observed += 1;
    }

    /// Conditional rates `alpha_1..alpha_max` at decode iteration `iteration` (module docs).
    pub fn rates(&mut self, iteration: u64) -> Vec<f64> {
        self.sync(iteration);
        let mut out = Vec::with_capacity(self.recent.len());
        let mut prev: Option<f64> = None; // estimate of position j - 1
        for j in 0..self.recent.len() {
            let prior = match prev {
                None => self.long_run[j].shrunk(INITIAL_RATE),
                // The depth profile: position j's long-run rate over position j - 1's on the
                // same verifies, both shrunk alike (a ratio of 1 without data).
                Some(est) => est * self.long_run[j].shrunk(INITIAL_RATE) / self.long_prev[j].shrunk(INITIAL_RATE),
            }
            .clamp(0.0, 1.0);
            let r = &self.recent[j];
            let est = ((r.accepted + PRIOR_WEIGHT * prior) / (r.reached + PRIOR_WEIGHT)).clamp(0.0, 1.0);
            out.push(est);
            prev = Some(est);
        }
        out
    }
}

/// Expected tokens emitted per request by a verify at `steps`: `1 + sum_{i<=steps} prod_{j<=i}
/// alpha_j` (the acceptance length; `alpha` beyond its end counts as 0).
pub fn expected_tokens(alpha: &[f64], steps: u32) -> f64 {
    let mut total = 1.0;
    let mut p = 1.0;
    for &a in alpha.iter().take(steps as usize) {
        p *= a;
        total += p;
    }
    total
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_unlucky_verify_does_not_pin_the_estimate_to_zero() {
        let mut m = AcceptanceModel::new(4, 16);
        m.observe(1, 4, &[0]);
        let r = m.rates(1);
        assert!(r.iter().all(|&a| a > 0.3), "{r:?}");
    }

    #[test]
    fn conditional_rates_from_truncated_verifies() {
        let mut m = AcceptanceModel::new(4, 1_000_000);
        // 10 requests at steps 2: 5 accept 0, 3 accept 1, 2 accept 2.
        let acc = [0, 0, 0, 0, 0, 1, 1, 1, 2, 2];
        for i in 0..200 {
            m.observe(i, 2, &acc);
        }
        let r = m.rates(200);
        assert!((r[0] - 0.5).abs() < 0.01, "{r:?}"); // 5 of 10 reach and accept position 1
        assert!((r[1] - 0.4).abs() < 0.01, "{r:?}"); // 2 of the 5 that reached position 2
        // Unobserved positions follow the last one (no long-run shape there).
        assert!((r[2] - r[1]).abs() < 0.02 && (r[3] - r[1]).abs() < 0.03, "{r:?}");
        assert!((expected_tokens(&r, 2) - (1.0 + 0.5 + 0.2)).abs() < 0.02);
        assert_eq!(expected_tokens(&r, 0), 1.0);
    }

    #[test]
    fn long_run_counts_round_trip_and_seed_a_fresh_model() {
        let mut m = AcceptanceModel::new(4, 16);
        let acc: Vec<i64> = [vec![0; 10], vec![4; 30]].concat();
        for i in 0..50 {
            m.observe(i, 4, &acc);
        }
        let text = serde_json::to_string(&m.state()).unwrap();
        let state: AcceptanceState = serde_json::from_str(&text).unwrap();
        let mut fresh = AcceptanceModel::new(6, 16);
        assert!(fresh.rates(0).iter().all(|&a| (a - INITIAL_RATE).abs() < 1e-12));
        fresh.restore(&state).unwrap();
        let r = fresh.rates(0);
        assert!((r[0] - 0.75).abs() < 0.01, "{r:?}"); // the saved long-run rate, not 0.6
        assert_eq!(fresh.state().long_run[..4], m.state().long_run[..]);
        let mut bad = state.clone();
        bad.long_run[0].accepted = -1.0;
        assert!(fresh.restore(&bad).is_err());
    }

    #[test]
    fn recent_counts_fade_with_iterations_and_depth_shape_is_kept() {
        let mut m = AcceptanceModel::new(3, 10);
        // Phase 1 at steps 3: alpha = (0.8, 0.5, 0.5) exactly in expectation.
        let acc: Vec<i64> = [vec![0; 20], vec![1; 40], vec![2; 20], vec![3; 20]].concat();
        for i in 0..100 {
            m.observe(i, 3, &acc);
        }
        let r = m.rates(100);
        assert!((r[0] - 0.8).abs() < 0.01 && (r[1] - 0.5).abs() < 0.01 && (r[2] - 0.5).abs() < 0.01);
        // Phase 2 at steps 1 only, with alpha_1 = 0.4: position 2 follows 0.4 * (0.5 / 0.8).
        let acc2: Vec<i64> = [vec![0; 60], vec![1; 40]].concat();
        for i in 100..300 {
            m.observe(i, 1, &acc2);
        }
        let r = m.rates(300);
        assert!((r[0] - 0.4).abs() < 0.03, "{r:?}");
        assert!((r[1] - r[0] * 0.5 / 0.8).abs() < 0.05, "{r:?}");
        // Long after the last observation, the recent counts are gone: the long-run rate rules.
        let before = m.rates(300)[0];
        let after = m.rates(10_000)[0];
        assert!(after > before, "the long-run rate remembers phase 1: {before} -> {after}");
    }
}

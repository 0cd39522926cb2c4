//! Cost cells of shortened iterations (issue 28: "the cost model learns in tokens").
//!
//! A shortened iteration drafts depth `D` for every request and verifies fewer tokens: the
//! confidence stop cuts each request's drafts after drafting ([`super::confidence`]), so the
//! target verifies `b + V` tokens, `V = sum_r v_r < b D`. Its seconds used to be priced from the
//! uniform cells only: the uniform iteration with as many verify tokens (the cost model's
//! prediction interpolated at the verify depth `V / b`) plus the drafter's two terms fitted over
//! every shortened iteration ([`super::per_request::DraftCost`]). Neither is measured where the
//! stop runs: the uniform cells learn uniform iterations only ([`super::report`]), the drafter's
//! fit is one line through every batch size and depth, and rows predicted 1-5 % better than the
//! batch-level one lost when run (BENCHMARKS.md, "Issue 28: the rest of the stop's fixes").
//!
//! Here every shortened iteration in which every request drafted teaches a cell of its own, keyed
//! by `(batch-size bucket, drafted depth D, verify depth V / b in bins of VERIFY_BIN tokens per
//! request)`: the decayed mean log ratio of its measured seconds to that price at the time
//! (`base`), so the cell holds what the interpolation gets wrong there. The price of a shortened
//! row is the interpolation times `exp` of a kernel mean of the cells of its `(bucket, D)` near
//! its verify depth (weight `w e^{-KERNEL |v - v_cell|}`, each cell's weight fading by the cost
//! model's idle decay per iteration since it was measured), shrunk toward 0 (the interpolation
//! as it stands) by `PRIOR` pseudo-measurements. A ratio, not seconds: the context grows between
//! the stop's iterations, and the uniform cells the price is interpolated from carry that.
//! Learned only on the machine's usual pace, once the cost model has a few uniform measurements
//! (the caller checks, as for the drafter's fit).

use std::collections::BTreeMap;

/// Width of a cell in verify tokens per request (`V / b`).
pub const VERIFY_BIN: f64 = 0.25;
/// Fall of a cell's weight per verify token per request between its mean verify depth and the
/// one priced (`e^{-KERNEL}` one token away).
const KERNEL: f64 = 2.0;
/// Pseudo-measurements at ratio 1 (the interpolation) every correction is shrunk toward.
const PRIOR: f64 = 1.0;
/// Largest log ratio one measurement teaches (a stall counts as 2x).
const CLIP: f64 = std::f64::consts::LN_2;

#[derive(Debug, Clone, Default, PartialEq)]
struct Cell {
    /// Decayed weight (saturates at the window).
    w: f64,
    /// Decayed mean of `ln(seconds / base)`.
    log_ratio: f64,
    /// Decayed mean verify depth (`V / b`) of its measurements.
    mean_v: f64,
    /// The clock at its last measurement.
    last: u64,
    /// Measurements ever taken.
    count: u64,
}

/// The shortened iterations' cells (see the module docs).
#[derive(Debug, Clone, PartialEq)]
pub struct ShortenedCells {
    cells: BTreeMap<(u32, u32, u32), Cell>,
    /// Decay of a cell's weight per measurement of it.
    decay: f64,
    /// Decay of a cell's weight per iteration it is not measured.
    idle_decay: f64,
    /// Decode iterations seen ([`Self::tick`]).
    clock: u64,
}

impl ShortenedCells {
    /// Cells that average over about `window` measurements each and fade by `e` over `4 *
    /// window` iterations without one (the cost model's windows, [`super::cost::CostModel::new`]).
    pub fn new(window: u32) -> Self {
        let w = f64::from(window.max(1));
        ShortenedCells { cells: BTreeMap::new(), decay: 1.0 - 1.0 / w, idle_decay: 1.0 - 1.0 / (4.0 * w), clock: 0 }
    }

    /// Counts one decode iteration (every report, shortened or not).
    pub fn tick(&mut self) {
        self.clock += 1;
    }

    /// Learns one shortened iteration at bucket `bucket` that drafted `depth` and verified
    /// `verify_depth` (`V / b`, `< depth`) tokens per request in `seconds`, which the uniform
    /// interpolation and the drafter's terms priced at `base` seconds (both > 0, finite; others
    /// are ignored).
    pub fn observe(&mut self, bucket: u32, depth: u32, verify_depth: f64, seconds: f64, base: f64) {
        if !(seconds > 0.0 && base > 0.0 && seconds.is_finite() && base.is_finite() && verify_depth >= 0.0) {
            return;
        }
        let r = (seconds / base).ln().clamp(-CLIP, CLIP);
        let key = (bucket, depth, (verify_depth / VERIFY_BIN).round() as u32);
        let (decay, idle, clock) = (self.decay, self.idle_decay, self.clock);
        let c = self.cells.entry(key).or_default();
        let gap = clock.saturating_sub(c.last);
        c.w = c.w * decay * idle.powf(gap.saturating_sub(1) as f64) + 1.0;
        let a = 1.0 / c.w;
        c.log_ratio += a * (r - c.log_ratio);
        c.mean_v += a * (verify_depth - c.mean_v);
        c.last = clock;
        c.count += 1;
    }

    /// The factor on the interpolated price of a shortened iteration at `(bucket, depth)` with
    /// `verify_depth` tokens verified per request (1 where no cell of that bucket and depth was
    /// measured; see the module docs).
    pub fn factor(&self, bucket: u32, depth: u32, verify_depth: f64) -> f64 {
        let (mut num, mut den) = (0.0, PRIOR);
        for c in self.cells.range((bucket, depth, 0)..=(bucket, depth, u32::MAX)).map(|(_, c)| c) {
            let age = self.clock.saturating_sub(c.last) as f64;
            let w = c.w * self.idle_decay.powf(age) * (-KERNEL * (c.mean_v - verify_depth).abs()).exp();
            num += w * c.log_ratio;
            den += w;
        }
        (num / den).exp()
    }

    /// Measurements of the cell holding verify depth `verify_depth` at `(bucket, depth)`.
    pub fn count(&self, bucket: u32, depth: u32, verify_depth: f64) -> u64 {
        self.cells.get(&(bucket, depth, (verify_depth / VERIFY_BIN).round() as u32)).map_or(0, |c| c.count)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A shortened iteration that costs 20 % more than its interpolated price teaches its cell:
    /// the price there approaches the measurement (shrunk by one pseudo-measurement), a verify
    /// depth one token away follows less, other depths and buckets keep the interpolation, and a
    /// cell left unmeasured fades back to it.
    #[test]
    fn a_shortened_iteration_teaches_its_own_cell_and_its_neighbours_less() {
        let mut s = ShortenedCells::new(64);
        assert_eq!(s.factor(64, 4, 2.0), 1.0);
        for _ in 0..100 {
            s.tick();
            s.observe(64, 4, 2.0, 0.012, 0.010);
        }
        assert_eq!(s.count(64, 4, 2.1), 100);
        let here = s.factor(64, 4, 2.0);
        assert!((here / 1.2 - 1.0).abs() < 0.01, "{here}");
        let near = s.factor(64, 4, 3.0);
        assert!(near > 1.05 && near < here, "{near} vs {here}");
        assert_eq!(s.factor(64, 5, 2.0), 1.0);
        assert_eq!(s.factor(32, 4, 2.0), 1.0);
        for _ in 0..2000 {
            s.tick();
        }
        assert!(s.factor(64, 4, 2.0) < 1.01, "{}", s.factor(64, 4, 2.0));
    }

    /// A stall (10x the price) teaches at most a factor 2, and bad numbers teach nothing.
    #[test]
    fn a_stall_is_clipped_and_bad_numbers_are_ignored() {
        let mut s = ShortenedCells::new(1);
        s.observe(8, 3, 1.0, 0.1, 0.01);
        assert!((s.factor(8, 3, 1.0) - 2f64.sqrt()).abs() < 1e-9, "{}", s.factor(8, 3, 1.0));
        let before = s.clone();
        for (t, base) in [(f64::NAN, 0.01), (0.01, 0.0), (-1.0, 0.01), (0.01, f64::INFINITY)] {
            s.observe(8, 3, 1.0, t, base);
        }
        assert_eq!(s, before);
    }
}

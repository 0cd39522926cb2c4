//! The online cost model of the `goodput` strategy: the wall time of one decode iteration as a
//! function of batch size `b` (the padded CUDA-graph size where a graph replays), steps `k`, the
//! batch's context tokens `C` and the drafter's catch-up tokens after a steps-0 stretch.
//!
//! Two layers, both learned from measured iterations only (no startup profiling needed):
//!
//! 1. A *plane*, the structure every device shares to first order: `t = t0 + t1 k + (t2 + t3 k) b
//!    + (t4 + t5 k) C + t6 catch_up` (fixed cost per forward, per draft step, per request and per
//!    context token, each with a per-draft-step part). It is an exponentially weighted ridge
//!    least-squares fit over every observation, pulled toward a prior in which each draft step
//!    adds `PRIOR_STEP_SHARE` of the iteration (a memory-bound accelerator's shape), scaled by the
//!    first measurement. On a CPU the plane alone is close; on an accelerator the roofline's knee
//!    bends it. The fixed cost `t0` is held `>= 0` (`CostModel::solve`, private, says why).
//! 2. *Cells* `(bucket of b, k)`: per cell the weighted mean of the measured seconds and of its
//!    features. A cell's residual (its mean minus the plane at its mean features) corrects the
//!    plane there; a cell not measured yet borrows the residuals of measured neighbours (nearby
//!    buckets and steps), so the knee learned at one batch size carries to the next. A cell's own
//!    residual takes over as it is measured (shrinkage with one pseudo-observation).
//!
//! Measurements more than `OUTLIER` times away from a well-measured cell's mean are clipped, so a
//! stall of the machine does not poison a cell.
//!
//! 3. A *pace check*. Other work on a shared machine (a compile, another process on the same
//!    cache) slows every iteration 2x to 4x for tens to hundreds of iterations (measured on the
//!    development VM, BENCHMARKS.md section 10). A cell measured in such a stretch would make its
//!    steps look that much dearer, and a policy does not go back to steps it believes expensive,
//!    so the error would stay. The pace is the median of the last `PACE_WINDOW` log ratios of
//!    measured to predicted seconds at the steps the policy settled on, in a cell measured in a
//!    row (robust to a single stall; a sustained change shows within 3 iterations). While it is
//!    off by more than `OFF_PACE` (or `MEDIAN_SPREADS` times the machine's usual timing noise,
//!    if larger), and for a settled measurement itself that far off (`OWN_SPREADS`: a stall, or
//!    the first iterations of a slow stretch), the model learns nothing; the policy then runs no
//!    probes and earns no probe credit ([`super`]). After `OFF_PACE_ACCEPT` such iterations in a
//!    row the new pace is taken as the machine's and learning resumes.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// Features: 1, k, b, k b, C, k C, catch-up tokens (normalised to order 1).
const F: usize = 7;
const K_SCALE: f64 = 8.0;
const B_SCALE: f64 = 64.0;
const C_SCALE: f64 = 1_048_576.0;
const CATCH_SCALE: f64 = 4096.0;
/// Prior: each draft step adds this share of a plain decode iteration.
pub const PRIOR_STEP_SHARE: f64 = 0.1;
/// Ridge weight of the prior (features are order 1): enough to hold directions the data has not
/// excited yet at the prior, small enough that a few measurements override it.
const RIDGE: f64 = 1e-3;
const OUTLIER: f64 = 3.0;
/// Measurements in a row a cell needs before its predictions serve to judge the pace.
const REFERENCE_COUNT: u64 = 8;
/// Iterations since a cell's last measurement within which it can serve as the reference.
const REFERENCE_RECENT: u64 = 4;
/// Reference measurements whose median ratio is the pace (a sustained change shows within 3, a
/// single stall never).
const PACE_WINDOW: usize = 5;
/// Log of the pace beyond which the machine counts as disturbed (30 % slower or faster).
const OFF_PACE: f64 = 0.262;
/// The thresholds grow with the machine's usual timing noise: `OWN_SPREADS` (one measurement) and
/// `MEDIAN_SPREADS` (the median) times the mean absolute log ratio of settled measurements.
const OWN_SPREADS: f64 = 3.0;
const MEDIAN_SPREADS: f64 = 2.5;
/// Gain of that mean per settled measurement.
const SPREAD_GAIN: f64 = 1.0 / 32.0;
/// Largest log ratio one measurement adds to the spread (a stall counts as 1.5x).
const SPREAD_CAP: f64 = 0.4;
/// Disturbed iterations in a row after which the new pace is accepted as the machine's.
const OFF_PACE_ACCEPT: u32 = 128;

/// Batch-size buckets without CUDA graphs: powers of two and 1.5x between them.
pub fn bucket_of(b: u32) -> u32 {
    if b <= 2 {
        return b.max(1);
    }
    let p = 31 - b.leading_zeros(); // 2^p <= b < 2^(p+1)
    let lo = 1u32 << p;
    let mid = lo + lo / 2;
    if b >= mid {
        mid
    } else {
        lo
    }
}

fn features(b: f64, k: u32, ctx: f64, catch_up: f64) -> [f64; F] {
    let k = f64::from(k) / K_SCALE;
    let b = b / B_SCALE;
    let c = ctx / C_SCALE;
    [1.0, k, b, k * b, c, k * c, catch_up / CATCH_SCALE]
}

fn plane_at(theta: &[f64; F], b: f64, k: u32, ctx: f64, catch_up: f64) -> f64 {
    let x = features(b, k, ctx, catch_up);
    x.iter().zip(theta).map(|(x, t)| x * t).sum()
}

#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
struct Cell {
    /// Decayed weight (saturates at the window).
    w: f64,
    mean_t: f64,
    mean_b: f64,
    mean_c: f64,
    mean_catch: f64,
    /// Measurements ever taken.
    count: u64,
    /// The model's clock at the last measurement (not saved: a restored cell starts a new run).
    #[serde(skip)]
    last: u64,
    /// Measurements in a row with gaps of at most `REFERENCE_RECENT` iterations (not saved).
    #[serde(skip)]
    streak: u64,
    /// `mean_t` minus the plane at the mean features (refreshed whenever the plane changes).
    residual: f64,
    /// Decayed variance of the context tokens of its measurements and their covariance with
    /// the seconds (the cell's own context slope, [`CostModel::predict`]); 0 in a state saved
    /// before they existed.
    #[serde(default)]
    var_c: f64,
    #[serde(default)]
    cov_ct: f64,
}

/// Pseudo-variance of a cell's context slope, as a share of its mean context: a cell whose
/// measurements spread less than about this share around their mean context follows the plane's
/// context slope; one measured over a wider range (contexts that grow) follows its own. 0.5 was
/// chosen among 0.2, 0.3, 0.4, 0.5, 0.8 on the simulator's context-growth and mixed-128 regimes
/// (issue 28's floors; BENCHMARKS.md "Issue 28: the request classes against the measured
/// spreads; the context-growth floor met"): at 0.2 per-request mixed-128 fell to 0.969-0.977 of
/// batch-level on three curves, at 0.3, 0.4 and 0.8 context-growth read 0.983-0.990 of the best
/// fixed depth on one curve; 0.5 met both floors with the widest margin (one seed).
const CELL_SLOPE_PRIOR: f64 = 0.5;

/// What a [`CostModel`] learned, as [`CostModel::state`] saves it and [`CostModel::restore`]
/// reads it back: the plane's sufficient statistics and fit, the prior (scaled to the device by the
/// first measurement) and every cell. The pace check's run state (recent ratios, the clock) is
/// left out: it describes the machine of one run, and a restored model judges the pace afresh.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CostState {
    /// `(bucket, steps, cell)` per measured cell.
    cells: Vec<(u32, u32, Cell)>,
    xtx: [[f64; F]; F],
    xty: [f64; F],
    prior: [f64; F],
    theta: [f64; F],
    observations: u64,
    /// The machine's usual timing noise (mean absolute log ratio), kept: it is the machine's.
    pace_spread: f64,
}

/// The cost model (see the module docs). Units: seconds, tokens, requests.
#[derive(Debug, Clone, PartialEq)]
pub struct CostModel {
    cells: BTreeMap<(u32, u32), Cell>,
    cell_decay: f64,
    /// Decay of a cell's weight per iteration it is not measured.
    idle_decay: f64,
    xtx: [[f64; F]; F],
    xty: [f64; F],
    plane_decay: f64,
    prior: [f64; F],
    theta: [f64; F],
    observations: u64,
    /// Log ratios of measured to predicted seconds of the last reference measurements, oldest
    /// first (see the module docs, layer 3).
    recent_pace: std::collections::VecDeque<f64>,
    /// Their median.
    log_pace: f64,
    /// Mean absolute log ratio of settled, on-pace measurements (the usual timing noise).
    pace_spread: f64,
    /// Iterations in a row with the pace off.
    off_pace_run: u32,
    /// Measurements not learned because the pace was off.
    skipped: u64,
    /// Measurements offered, learned or not.
    clock: u64,
    /// Whether a cell's prediction follows its own context slope ([`Self::use_cell_context_slopes`]).
    cell_slopes: bool,
}

impl CostModel {
    /// A model whose cells average over about `window` measurements each (the plane over
    /// `4 * window`).
    pub fn new(window: u32) -> Self {
        let w = f64::from(window.max(1));
        let mut prior = [0.0; F];
        prior[0] = 1.0;
        prior[1] = PRIOR_STEP_SHARE * K_SCALE;
        CostModel {
            cells: BTreeMap::new(),
            cell_decay: 1.0 - 1.0 / w,
            idle_decay: 1.0 - 1.0 / (4.0 * w),
            xtx: [[0.0; F]; F],
            xty: [0.0; F],
            plane_decay: 1.0 - 1.0 / (4.0 * w),
            prior,
            theta: prior,
            observations: 0,
            recent_pace: std::collections::VecDeque::with_capacity(PACE_WINDOW),
            log_pace: 0.0,
            pace_spread: 0.15,
            off_pace_run: 0,
            skipped: 0,
            clock: 0,
            cell_slopes: false,
        }
    }

    /// From now on a cell's prediction follows the cell's own context slope, shrunk toward the
    /// plane's (`context_correction`); off by default. The `goodput` strategy turns it on with
    /// `"verify": "per_request"` only: there shortened iterations teach no cell (`super::report`)
    /// and a cell is refreshed by a uniform iteration at most about once per
    /// `super::decide::STALE_AFTER` iterations, so the cells a decision is priced from were
    /// measured at older contexts than under the batch-level decision, whose current depth's cell
    /// learns every iteration; with contexts growing, extrapolating them with the plane's one
    /// slope read steps 7 5-10 % high on the a100 and h200 curves (BENCHMARKS.md, "Issue 28:
    /// shortened iterations teach no cell"). The batch-level strategy keeps the plane's slope:
    /// with it on, its context-growth figures fell on two of five curves (h200 1.000 -> 0.982,
    /// a100 1.009 -> 0.994 of the best fixed depth, same section).
    pub fn use_cell_context_slopes(&mut self) {
        self.cell_slopes = true;
    }

    /// What the model learned (see [`CostState`]).
    pub fn state(&self) -> CostState {
        CostState {
            // each cell's weight as it stands now (aged since its last measurement): a restored
            // cell's age starts at 0, so it predicts what this one predicts
            cells: self.cells.iter().map(|(&(b, k), c)| (b, k, Cell { w: self.weight_now(c), ..c.clone() })).collect(),
            xtx: self.xtx,
            xty: self.xty,
            prior: self.prior,
            theta: self.theta,
            observations: self.observations,
            pace_spread: self.pace_spread,
        }
    }

    /// Replaces what the model learned by `state` (from [`Self::state`] of a model of the same
    /// device), keeping this model's windows; the pace check starts afresh. Errors (nothing
    /// changes) on a value that is not finite, a cell weight or a prior unit that is not > 0:
    /// a file edited by hand or written by another build.
    pub fn restore(&mut self, state: CostState) -> Result<(), String> {
        let finite = |xs: &[f64]| xs.iter().all(|x| x.is_finite());
        if !(finite(&state.xty) && finite(&state.prior) && finite(&state.theta))
            || !state.xtx.iter().all(|row| finite(row))
            || !(state.pace_spread.is_finite() && state.pace_spread >= 0.0)
            || !(state.prior[0] > 0.0)
        {
            return Err("cost model: a value is not finite, or the prior is not > 0".into());
        }
        for (b, k, c) in &state.cells {
            if !(c.w > 0.0 && finite(&[c.mean_t, c.mean_b, c.mean_c, c.mean_catch, c.residual, c.var_c, c.cov_ct]) && c.mean_t > 0.0 && c.var_c >= 0.0) {
                return Err(format!("cost model: cell (batch-size bucket {b}, steps {k}) is not valid"));
            }
        }
        self.cells = state.cells.into_iter().map(|(b, k, c)| ((b, k), Cell { last: 0, streak: 0, ..c })).collect();
        self.xtx = state.xtx;
        self.xty = state.xty;
        self.prior = state.prior;
        self.theta = state.theta;
        self.observations = state.observations;
        self.pace_spread = state.pace_spread;
        self.recent_pace.clear();
        self.log_pace = 0.0;
        self.off_pace_run = 0;
        self.clock = 0;
        Ok(())
    }

    /// Measurements taken so far.
    pub fn observations(&self) -> u64 {
        self.observations
    }

    /// Measurements of cell `(bucket, k)` so far.
    pub fn cell_count(&self, bucket: u32, k: u32) -> u64 {
        self.cells.get(&(bucket, k)).map_or(0, |c| c.count)
    }

    /// Records one iteration of `seconds` (finite, > 0; checked by the caller) at bucket `bucket`
    /// with `b` requests (padded), `k` steps, `ctx` context tokens and `catch_up` tokens the
    /// drafter caught up on before drafting. `reference`: the iteration ran the steps the policy
    /// settled on (not a probe), so a well-measured cell's deviation from its prediction is taken
    /// as the machine's pace (layer 3); a probe's deviation is the cell's own.
    #[allow(clippy::too_many_arguments)]
    pub fn observe(&mut self, bucket: u32, b: u32, k: u32, ctx: f64, catch_up: f64, seconds: f64, reference: bool) {
        if self.observations == 0 {
            // Scale the prior to the device: the first measurement fixes the unit.
            let unit = seconds / (1.0 + PRIOR_STEP_SHARE * f64::from(k));
            for p in &mut self.prior {
                *p *= unit;
            }
            self.theta = self.prior;
        }
        self.clock += 1;
        let mut own_off = false;
        let mut settled_ratio = None;
        if reference && self.is_reference(bucket, k) {
            let r = (seconds / self.predict(bucket, b, k, ctx, catch_up)).ln();
            own_off = r.abs() > OFF_PACE.max(OWN_SPREADS * self.pace_spread);
            settled_ratio = Some(r);
            if self.recent_pace.len() == PACE_WINDOW {
                self.recent_pace.pop_front();
            }
            self.recent_pace.push_back(r);
            let mut sorted = [0.0; PACE_WINDOW];
            let n = self.recent_pace.len();
            for (dst, src) in sorted.iter_mut().zip(&self.recent_pace) {
                *dst = *src;
            }
            sorted[..n].sort_by(f64::total_cmp);
            self.log_pace = sorted[n / 2];
        }
        if self.log_pace.abs() > OFF_PACE.max(MEDIAN_SPREADS * self.pace_spread) {
            self.off_pace_run = self.off_pace_run.saturating_add(1);
        } else {
            self.off_pace_run = 0;
        }
        if let Some(r) = settled_ratio.filter(|_| self.off_pace_run == 0) {
            self.pace_spread += SPREAD_GAIN * (r.abs().min(SPREAD_CAP) - self.pace_spread);
        }
        let accepted_pace = self.off_pace_run > OFF_PACE_ACCEPT;
        if (self.off_pace_run > 0 || own_off) && !accepted_pace {
            self.skipped += 1;
            return;
        }
        let t = self.learn_cell(bucket, b, k, ctx, catch_up, seconds);
        let b = f64::from(b);
        let x = features(b, k, ctx, catch_up);
        for i in 0..F {
            self.xty[i] = self.xty[i] * self.plane_decay + x[i] * t;
            for j in 0..F {
                self.xtx[i][j] = self.xtx[i][j] * self.plane_decay + x[i] * x[j];
            }
        }
        self.observations += 1;
        self.theta = self.solve();
        let theta = self.theta;
        for (&(_, k), c) in self.cells.iter_mut() {
            c.residual = c.mean_t - plane_at(&theta, c.mean_b, k, c.mean_c, c.mean_catch);
        }
    }

    /// Counts an iteration whose seconds no cell learns (a shortened one under per-request
    /// verify lengths), so cell ages ([`Self::cell_age`]) and idle decay keep counting iterations.
    pub fn tick(&mut self) {
        self.clock += 1;
    }

    /// Iterations since cell `(bucket, k)` was last measured (`None`: never).
    pub fn cell_age(&self, bucket: u32, k: u32) -> Option<u64> {
        self.cells.get(&(bucket, k)).map(|c| self.clock - c.last)
    }

    /// The cell part of a measurement: the cell's decayed means move toward it (clipped at
    /// `OUTLIER` times a well-measured cell's mean). Returns the seconds learned.
    fn learn_cell(&mut self, bucket: u32, b: u32, k: u32, ctx: f64, catch_up: f64, seconds: f64) -> f64 {
        let cell = self.cells.entry((bucket, k)).or_default();
        let t = if cell.count >= 3 {
            seconds.clamp(cell.mean_t / OUTLIER, cell.mean_t * OUTLIER)
        } else {
            seconds
        };
        // Weight decays per measurement of the cell and, more slowly, with the iterations since its
        // last one: a cell measured long ago (at another context, on a machine in another state)
        // gives way to a fresh measurement.
        let gap = self.clock - cell.last;
        cell.w = cell.w * self.cell_decay * self.idle_decay.powf(gap.saturating_sub(1) as f64) + 1.0;
        cell.streak = if cell.count > 0 && gap <= REFERENCE_RECENT { cell.streak + 1 } else { 1 };
        cell.last = self.clock;
        let a = 1.0 / cell.w;
        let b = f64::from(b);
        let (dc, dt) = (ctx - cell.mean_c, t - cell.mean_t);
        cell.var_c = (1.0 - a) * (cell.var_c + a * dc * dc);
        cell.cov_ct = (1.0 - a) * (cell.cov_ct + a * dc * dt);
        cell.mean_t += a * (t - cell.mean_t);
        cell.mean_b += a * (b - cell.mean_b);
        cell.mean_c += a * (ctx - cell.mean_c);
        cell.mean_catch += a * (catch_up - cell.mean_catch);
        cell.count += 1;
        t
    }

    /// Ridge solution `(X'X + RIDGE I) theta = X'y + RIDGE prior`, refitted with the fixed cost
    /// per iteration `theta[0]` held at 0 if it comes out negative. Nothing runs in less than no
    /// time, but a fit over data that covers a corner of the space (a load ramp moves batch size
    /// and context together; drafting rarely visits steps 0; per-step costs that grow with the
    /// steps) can trade the intercept against the slopes and extrapolate half the true seconds to
    /// steps 0 (measured on engine traces: BENCHMARKS.md section 10). The other coefficients may
    /// stay negative: a GPU's roofline bends the plane, and there a linear term below zero is a
    /// fair local fit (the simulator's rooflines lose with all of them held >= 0).
    fn solve(&self) -> [f64; F] {
        let theta = self.solve_with(false);
        if theta[0] < 0.0 {
            self.solve_with(true)
        } else {
            theta
        }
    }

    /// The ridge solution by Cholesky, with `theta[0]` held at 0 if `no_intercept`.
    fn solve_with(&self, no_intercept: bool) -> [f64; F] {
        let mut a = self.xtx;
        let mut y = self.xty;
        for i in 0..F {
            a[i][i] += RIDGE;
            y[i] += RIDGE * self.prior[i];
        }
        if no_intercept {
            for j in 0..F {
                a[0][j] = 0.0;
                a[j][0] = 0.0;
            }
            a[0][0] = 1.0;
            y[0] = 0.0;
        }
        // In-place Cholesky: a = L L'.
        for j in 0..F {
            let mut d = a[j][j];
            for k in 0..j {
                d -= a[j][k] * a[j][k];
            }
            if d <= 1e-12 {
                return self.prior;
            }
            let d = d.sqrt();
            a[j][j] = d;
            for i in j + 1..F {
                let mut s = a[i][j];
                for k in 0..j {
                    s -= a[i][k] * a[j][k];
                }
                a[i][j] = s / d;
            }
        }
        for i in 0..F {
            let mut s = y[i];
            for k in 0..i {
                s -= a[i][k] * y[k];
            }
            y[i] = s / a[i][i];
        }
        for i in (0..F).rev() {
            let mut s = y[i];
            for k in i + 1..F {
                s -= a[k][i] * y[k];
            }
            y[i] = s / a[i][i];
        }
        y
    }

    fn plane(&self, b: f64, k: u32, ctx: f64, catch_up: f64) -> f64 {
        plane_at(&self.theta, b, k, ctx, catch_up)
    }

    /// Residual borrowed from measured cells near `(bucket, k)`: weights fall by `e^-1.5` per
    /// doubling of the bucket and per two steps.
    fn neighbour_residual(&self, bucket: u32, k: u32) -> f64 {
        let (mut num, mut den) = (0.0, 0.0);
        let lb = f64::from(bucket).log2();
        for (&(cb, ck), cell) in &self.cells {
            let d = (f64::from(cb).log2() - lb).abs() + 0.5 * (f64::from(ck) - f64::from(k)).abs();
            if d > 4.0 || (cb, ck) == (bucket, k) {
                continue;
            }
            let cw = self.weight_now(cell);
            let w = (-1.5 * d).exp() * cw / (cw + 1.0);
            num += w * cell.residual;
            den += w;
        }
        if den > 0.0 {
            num / den
        } else {
            0.0
        }
    }

    /// A cell's weight now: its decayed weight at its last measurement, decayed further by
    /// `idle_decay` per iteration since (what [`Self::learn_cell`] applies when it is measured
    /// next). So a cell measured long ago gives way to the plane and its neighbours in
    /// predictions too, not only to its next measurement: a depth measured a few times early
    /// (the cold first iterations of a fresh engine, a stall) and never again, because probes
    /// visit only the neighbours of the current depth, kept its early seconds for the whole run
    /// (BENCHMARKS.md, "Issue 29 at batch 1: why the adaptive depth moves from run to run").
    fn weight_now(&self, c: &Cell) -> f64 {
        let gap = self.clock.saturating_sub(c.last).saturating_sub(1);
        if gap == 0 {
            c.w
        } else {
            c.w * self.idle_decay.powf(gap as f64)
        }
    }

    /// Whether cell `(bucket, k)` has been measured `REFERENCE_COUNT` times in a row, each within
    /// `REFERENCE_RECENT` iterations of the last (so its prediction is current enough to judge the
    /// machine's pace).
    fn is_reference(&self, bucket: u32, k: u32) -> bool {
        self.cells.get(&(bucket, k)).is_some_and(|c| c.streak >= REFERENCE_COUNT && self.clock - c.last <= REFERENCE_RECENT)
    }

    /// Whether measurements are being left out now because the machine is off its usual pace.
    pub fn off_pace(&self) -> bool {
        self.off_pace_run > 0 && self.off_pace_run <= OFF_PACE_ACCEPT
    }

    /// Measurements left out because the machine was off its pace (module docs, layer 3).
    pub fn skipped(&self) -> u64 {
        self.skipped
    }

    /// A cell's own context slope against the plane's, applied from its mean context to `ctx`:
    /// the plane's context terms are one fit over every depth and batch size, and where a
    /// roofline bends with context (the verify turns from compute- to memory-bound as contexts
    /// grow) a cell measured at other contexts (a neighbour probed now and then while contexts
    /// grow) is extrapolated with the wrong slope (BENCHMARKS.md, issue 28 floors: steps 7 read
    /// 5-10 % high on a100 and h200 context-growth). The cell's slope is its least-squares slope
    /// of seconds on context, shrunk toward the plane's by a pseudo-variance of
    /// `(CELL_SLOPE_PRIOR * mean context)^2`.
    fn context_correction(&self, c: &Cell, k: u32, ctx: f64) -> f64 {
        let plane_slope = (self.theta[4] + self.theta[5] * f64::from(k) / K_SCALE) / C_SCALE;
        let prior = (CELL_SLOPE_PRIOR * c.mean_c).powi(2).max(1.0);
        let slope = (c.cov_ct + prior * plane_slope) / (c.var_c + prior);
        (slope - plane_slope) * (ctx - c.mean_c)
    }

    /// Predicted seconds of one iteration (always > 0).
    pub fn predict(&self, bucket: u32, b: u32, k: u32, ctx: f64, catch_up: f64) -> f64 {
        let base = self.plane(f64::from(b), k, ctx, catch_up);
        let nb = self.neighbour_residual(bucket, k);
        let resid = match self.cells.get(&(bucket, k)) {
            Some(c) => {
                let w = self.weight_now(c);
                let own = w / (w + 1.0);
                let slope = if self.cell_slopes { self.context_correction(c, k, ctx) } else { 0.0 };
                own * (c.residual + slope) + (1.0 - own) * nb
            }
            None => nb,
        };
        let floor = 1e-3 * self.prior[0].abs().max(1e-12);
        (base + resid).max(floor)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets() {
        let got: Vec<u32> = [1, 2, 3, 4, 5, 6, 7, 8, 11, 12, 17, 24, 33, 48, 63, 64, 100, 200, 256].iter().map(|&b| bucket_of(b)).collect();
        assert_eq!(got, vec![1, 2, 3, 4, 4, 6, 6, 8, 8, 12, 16, 24, 32, 48, 48, 64, 96, 192, 256]);
    }

    #[test]
    fn learns_a_linear_device_and_extrapolates_unmeasured_cells() {
        // t = 2 ms + 0.5 ms per draft step + 0.1 ms per request-token.
        let truth = |b: u32, k: u32| 0.002 + 0.0005 * f64::from(k) + 1e-4 * f64::from(b * (k + 1));
        let mut m = CostModel::new(64);
        for i in 0..400u32 {
            let b = [4, 16, 40][(i % 3) as usize];
            let k = [0, 2, 3][(i / 3 % 3) as usize];
            m.observe(bucket_of(b), b, k, 0.0, 0.0, truth(b, k), true);
        }
        for (b, k) in [(64, 5), (8, 7), (100, 1), (2, 0)] {
            let p = m.predict(bucket_of(b), b, k, 0.0, 0.0);
            assert!((p / truth(b, k) - 1.0).abs() < 0.05, "b {b} k {k}: {p} vs {}", truth(b, k));
        }
    }

    /// A depth whose seconds grow with context faster than the plane's one slope says (the
    /// verify of many tokens turning memory-bound), measured every other iteration while
    /// contexts grew from 1k to 64k, predicted at 96k: with cell slopes the cell's own slope
    /// (shrunk toward the plane's, `CELL_SLOPE_PRIOR`) moves the prediction toward the truth;
    /// without (the default, the batch-level strategy) the plane's slope alone extrapolates. The
    /// shrinkage is strong: the error falls from about 19 % to 17 % here.
    #[test]
    fn a_cell_follows_its_own_context_slope_only_when_turned_on() {
        let truth = |k: u32, ctx: f64| 0.010 + 0.001 * f64::from(k) + if k == 7 { 2e-6 * ctx } else { 1e-7 * ctx };
        let train = |m: &mut CostModel| {
            for i in 0..300u32 {
                let ctx = 1000.0 + 63000.0 * f64::from(i) / 300.0;
                for k in [0, 1, 2, 3] {
                    m.observe(64, 64, k, ctx, 0.0, truth(k, ctx), true);
                }
                if i % 2 == 0 {
                    m.observe(64, 64, 7, ctx, 0.0, truth(7, ctx), true);
                }
            }
        };
        let (mut off, mut on) = (CostModel::new(64), CostModel::new(64));
        on.use_cell_context_slopes();
        train(&mut off);
        train(&mut on);
        let err = |m: &CostModel| (m.predict(64, 64, 7, 96000.0, 0.0) / truth(7, 96000.0) - 1.0).abs();
        assert!(err(&on) + 0.01 < err(&off), "error with cell slopes {:.4}, without {:.4}", err(&on), err(&off));
        // where the cell was measured, both agree
        let here = |m: &CostModel| m.predict(64, 64, 7, 55000.0, 0.0);
        assert!((here(&on) / here(&off) - 1.0).abs() < 0.05);
    }

    #[test]
    fn a_measured_cell_overrides_the_plane_and_informs_its_neighbours() {
        let mut m = CostModel::new(64);
        // A knee: k = 0..2 cost 10 ms at bucket 64, k = 3 costs 30 ms.
        for _ in 0..50 {
            for k in 0..3 {
                m.observe(64, 64, k, 0.0, 0.0, 0.010, true);
            }
            m.observe(64, 64, 3, 0.0, 0.0, 0.030, true);
        }
        assert!((m.predict(64, 64, 3, 0.0, 0.0) - 0.030).abs() < 0.002);
        assert!((m.predict(64, 64, 1, 0.0, 0.0) - 0.010).abs() < 0.002);
        // Bucket 48 was never measured: it borrows the knee.
        assert!(m.predict(48, 48, 3, 0.0, 0.0) > 1.8 * m.predict(48, 48, 1, 0.0, 0.0));
    }

    /// A depth measured once early at 3x its cost (the first iterations of a fresh engine at
    /// batch 1 on the CPU read 2-3x slow: BENCHMARKS.md, "Issue 29 at batch 1: why the adaptive
    /// depth moves from run to run"), then never again while the neighbours of the depth the
    /// slot settled on are measured on a linear device: the stale cell gives way to the plane
    /// as it ages, as a fresh measurement of it would (`learn_cell`'s idle decay). Before, a
    /// cell kept its full weight however old, and predicted the depth at ~2x for the whole run.
    #[test]
    fn a_stale_cell_gives_way_to_the_plane_as_it_ages() {
        let truth = |k: u32| 0.010 + 0.002 * f64::from(k);
        let mut m = CostModel::new(64);
        m.observe(1, 1, 5, 20.0, 0.0, 3.0 * truth(5), false);
        for i in 0..1500u32 {
            let k = [1, 2, 3][(i % 3) as usize];
            m.observe(1, 1, k, 20.0, 0.0, truth(k), true);
        }
        let p = m.predict(1, 1, 5, 20.0, 0.0);
        assert!((p / truth(5) - 1.0).abs() < 0.05, "steps 5: {p} vs {}", truth(5));
        // a cell measured lately keeps its own residual (a knee the plane does not have)
        for _ in 0..40 {
            m.observe(1, 1, 4, 20.0, 0.0, 2.0 * truth(4), true);
        }
        assert!(m.predict(1, 1, 4, 20.0, 0.0) > 1.7 * truth(4));
    }

    #[test]
    fn outliers_are_clipped_and_prior_scales_to_the_first_measurement() {
        let mut m = CostModel::new(16);
        m.observe(8, 8, 2, 0.0, 0.0, 0.012, true);
        // Before a second measurement, other steps follow the prior shape (+10 % per step).
        let p4 = m.predict(8, 8, 4, 0.0, 0.0);
        assert!((p4 / 0.012 - 1.4 / 1.2).abs() < 0.05, "{p4}");
        for _ in 0..10 {
            m.observe(8, 8, 2, 0.0, 0.0, 0.012, true);
        }
        m.observe(8, 8, 2, 0.0, 0.0, 10.0, true); // a 10 s stall
        assert!(m.predict(8, 8, 2, 0.0, 0.0) < 0.02);
    }

    #[test]
    fn steps_zero_is_not_extrapolated_below_zero_fixed_cost() {
        // A ramp's data: context grows with the batch (300 tokens per request), drafting at steps
        // 4-7 only, per-step costs that grow a little with the steps (this CPU's fit plus a
        // convex term). Fitted freely, the plane's intercept goes below zero and steps 0, never
        // measured, is predicted at a small fraction of its seconds.
        let truth = |b: u32, k: u32| {
            let (b, k) = (f64::from(b), f64::from(k));
            0.005 + 0.0008 * k + 0.00085 * b + 0.00033 * b * k + 0.0004 * k * k
        };
        let mut m = CostModel::new(64);
        for i in 0..300u32 {
            let b = [4, 8, 12, 16, 24, 32, 48][(i % 7) as usize];
            let k = 4 + (i / 7 % 4);
            m.observe(bucket_of(b), b, k, f64::from(300 * b), 0.0, truth(b, k), true);
        }
        for b in [4, 8, 16] {
            let p = m.predict(bucket_of(b), b, 0, f64::from(300 * b), 0.0);
            // Free: 0.2 % (the floor), 2 % and 38 % of the truth at b = 4, 8, 16; with the
            // intercept held at 0: 20 %, 37 %, 53 %. Still far off (steps 0 is four steps below
            // anything measured), but no longer a cost that makes steps 0 look free; the cell
            // corrects it once measured.
            assert!(p > 0.15 * truth(b, 0), "b {b}: {p} vs {}", truth(b, 0));
        }
    }

    #[test]
    fn a_slow_stretch_of_the_machine_does_not_poison_a_probed_cell() {
        let mut m = CostModel::new(64);
        for _ in 0..40 {
            for _ in 0..4 {
                m.observe(64, 64, 1, 0.0, 0.0, 0.010, true);
            }
            m.observe(64, 64, 2, 0.0, 0.0, 0.012, false);
        }
        // Other work slows everything 3x for 60 iterations; a probe of steps 2 runs in it.
        for i in 0..60 {
            m.observe(64, 64, 1, 0.0, 0.0, 0.030, true);
            if i == 30 {
                m.observe(64, 64, 2, 0.0, 0.0, 0.036, false);
            }
        }
        assert!(m.skipped() >= 55, "{}", m.skipped());
        for _ in 0..10 {
            m.observe(64, 64, 1, 0.0, 0.0, 0.010, true);
        }
        assert!((m.predict(64, 64, 1, 0.0, 0.0) / 0.010 - 1.0).abs() < 0.05);
        assert!((m.predict(64, 64, 2, 0.0, 0.0) / 0.012 - 1.0).abs() < 0.05, "{}", m.predict(64, 64, 2, 0.0, 0.0));
    }

    #[test]
    fn state_round_trips_through_json_and_predicts_alike() {
        let mut m = CostModel::new(64);
        for i in 0..60u32 {
            let k = i % 4;
            m.observe(1, 1, k, 100.0, 0.0, 0.01 + 0.002 * f64::from(k), i % 5 != 0);
        }
        let text = serde_json::to_string(&m.state()).unwrap();
        let mut fresh = CostModel::new(64);
        fresh.restore(serde_json::from_str(&text).unwrap()).unwrap();
        assert_eq!(fresh.state(), {
            let mut s = m.state();
            for (_, _, c) in &mut s.cells {
                c.last = 0;
                c.streak = 0;
            }
            s
        });
        for k in 0..8 {
            assert_eq!(fresh.predict(1, 1, k, 100.0, 0.0), m.predict(1, 1, k, 100.0, 0.0), "k {k}");
        }
        assert_eq!(fresh.cell_count(1, 2), m.cell_count(1, 2));
        // A corrupt state is refused and changes nothing.
        let mut bad = m.state();
        bad.theta[2] = f64::NAN;
        let before = CostModel::new(64);
        let mut target = before.clone();
        assert!(target.restore(bad).is_err());
        assert_eq!(target, before);
    }

    #[test]
    fn a_lasting_change_of_pace_is_learned() {
        let mut m = CostModel::new(32);
        for _ in 0..50 {
            m.observe(8, 8, 3, 0.0, 0.0, 0.010, true);
        }
        for _ in 0..(OFF_PACE_ACCEPT + 200) {
            m.observe(8, 8, 3, 0.0, 0.0, 0.020, true);
        }
        assert!((m.predict(8, 8, 3, 0.0, 0.0) / 0.020 - 1.0).abs() < 0.05);
    }
}

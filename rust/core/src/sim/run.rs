//! Running one contender (a fixed steps value, an adaptive policy, or the clairvoyant oracle) over
//! a generated workload and a cost curve.
//!
//! A contender runs decode iterations through the workload's segments ([`super::workload`]): an
//! iteration in segment `i` at steps `k` moves on by `E_i(k) / b_i` segments. Each iteration draws
//! its noise and acceptance uniforms from a generator seeded by `(seed, segment)`, the same for
//! every contender (common random numbers), so differences come from the decisions alone. A
//! policy sees what an engine sees: the batch size, the context tokens, then the accepted drafts
//! per request and the *noisy* measured seconds. It is scored by what its decisions are worth:
//! the expected tokens of the chosen steps (from the requests' true acceptance) over their
//! noise-free seconds, summed over the run.

use rand::rngs::SmallRng;
use rand::{RngExt, SeedableRng};
use serde::Serialize;

use super::confidence::{apply_stop, tokens_given, Confidences, DraftConfidence};
use super::curve::{CostCurve, Shape};
use super::workload::{normal, Workload, MAX_STEPS};
use crate::config::AdaptiveConfig;
use crate::decision::VerifyShape;
use crate::policy::{AdaptiveSpeculativeParams, Observation};
use crate::strategies::RequestVerify;

/// Measurement noise of the simulated device.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Noise {
    /// Standard deviation of the lognormal factor on each iteration's seconds.
    pub sigma: f64,
    /// Probability that an iteration is a stall, 1.5x to 3x slower.
    pub spike_probability: f64,
    /// Standard deviation of a slow drift of the device's speed (the log of a factor that moves
    /// over hundreds to thousands of segments, as other work on a shared machine comes and goes).
    pub drift: f64,
    /// Share of the run during which other work shares the machine: windows of
    /// [`INTERFERENCE_WINDOW`] segments, each slowed 2x to 4x with this probability (measured on
    /// the 2-core development VM: a compile or a test suite on the other core slowed the engine's
    /// iterations by up to 4x for tens to hundreds of iterations, BENCHMARKS.md section 10).
    pub interference: f64,
}

impl Default for Noise {
    fn default() -> Self {
        Noise { sigma: 0.1, spike_probability: 0.01, drift: 0.0, interference: 0.0 }
    }
}

/// Segments per window of [`Noise::interference`] (about 40 to 150 iterations).
pub const INTERFERENCE_WINDOW: usize = 150;

/// The slowdown at segment `i` from other work on the machine (see [`Noise::interference`]).
fn interference_factor(seed: u64, i: usize, share: f64) -> f64 {
    if share == 0.0 {
        return 1.0;
    }
    let window = (i / INTERFERENCE_WINDOW) as u64;
    let mut rng = SmallRng::seed_from_u64(seed ^ 0x1A7E_7F3E ^ window.wrapping_mul(0x9E37_79B9_7F4A_7C15));
    if rng.random::<f64>() < share {
        2.0 + 2.0 * rng.random::<f64>()
    } else {
        1.0
    }
}

/// The slow speed factor at segment `i` (see [`Noise::drift`]): three sinusoids of periods 700,
/// 1900 and 4300 segments with phases drawn from `seed`.
fn drift_factor(seed: u64, i: usize, drift: f64) -> f64 {
    if drift == 0.0 {
        return 1.0;
    }
    let mut rng = SmallRng::seed_from_u64(seed ^ 0xD81F7);
    let x: f64 = [700.0, 1900.0, 4300.0]
        .iter()
        .map(|period| (std::f64::consts::TAU * (i as f64 / period + rng.random::<f64>())).sin())
        .sum();
    (drift * x / 1.5f64.sqrt()).exp()
}

/// Options shared by every contender of a run.
#[derive(Debug, Clone, PartialEq)]
pub struct RunOptions {
    pub seed: u64,
    pub noise: Noise,
    /// Steps 0 skip the drafter's extend (it catches up when drafting resumes).
    pub skip_zero_step_draft_extend: bool,
    /// The draft-confidence model ([`super::confidence`]).
    pub confidence: DraftConfidence,
}

/// What one contender achieved.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RunResult {
    pub name: String,
    /// Expected emitted tokens of the chosen steps, summed.
    pub tokens: f64,
    /// Noise-free seconds of the chosen steps, summed.
    pub seconds: f64,
    /// `tokens / seconds`.
    pub goodput: f64,
    /// Iterations whose steps differ from the previous iteration's (probes included).
    pub steps_changes: u64,
    /// Probes (the `goodput` strategy), else 0.
    pub probes: u64,
    /// Iterations per steps value `0..=max`.
    pub steps_histogram: Vec<u64>,
    /// Requests' verify lengths `0..=max` over the run (per-request decisions; empty otherwise).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub verify_histogram: Vec<u64>,
}

/// One iteration's decision as the simulator runs it: the batch's depth and, for a per-request
/// decision, each request's verify length (in batch order).
#[derive(Debug, Clone, PartialEq)]
pub struct Choice {
    pub steps: u32,
    pub lengths: Option<Vec<u32>>,
    /// The confidence stop (`min_survival`) applied after drafting, if any; [`walk`] resolves it
    /// into `lengths` from the iteration's draft probabilities.
    pub min_survival: Option<f64>,
}

impl Choice {
    /// Every request at `steps`.
    pub fn uniform(steps: u32) -> Self {
        Choice { steps, lengths: None, min_survival: None }
    }

    /// Request `r` verifies `lengths[r]`.
    pub fn lengths(steps: u32, lengths: Vec<u32>) -> Self {
        Choice { steps, lengths: Some(lengths), min_survival: None }
    }
}

/// The per-iteration random draws: the noise factor, `MAX_STEPS` uniforms per request and, for
/// per-request decisions, the draft confidences.
struct Draws {
    factor: f64,
    uniforms: Vec<[f64; MAX_STEPS]>,
    conf: Option<Confidences>,
}

fn draws(seed: u64, i: usize, b: usize, noise: Noise) -> Draws {
    let mut rng = SmallRng::seed_from_u64(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ (i as u64).wrapping_mul(0xD1B5_4A32_D192_ED03));
    let mut factor = (noise.sigma * normal(&mut rng) - 0.5 * noise.sigma * noise.sigma).exp();
    if rng.random::<f64>() < noise.spike_probability {
        factor *= 1.5 + 1.5 * rng.random::<f64>();
    }
    let uniforms = (0..b).map(|_| std::array::from_fn(|_| rng.random::<f64>())).collect();
    let slow = drift_factor(seed, i, noise.drift) * interference_factor(seed, i, noise.interference);
    Draws { factor: factor * slow, uniforms, conf: None }
}

/// Seconds of iteration `i` at steps `k` on `curve` (the batch padded to the curve's graph
/// sizes), with `catch_up` tokens for a skipped drafter.
pub fn iteration_seconds(curve: &CostCurve, w: &Workload, i: usize, k: u32, catch_up: f64, skip: bool) -> f64 {
    choice_seconds(curve, w, i, &Choice::uniform(k), catch_up, skip)
}

/// [`iteration_seconds`] of a [`Choice`] (per-request lengths: packed verify, requests at 0 not
/// drafting; padded graph rows verify one token each).
pub fn choice_seconds(curve: &CostCurve, w: &Workload, i: usize, c: &Choice, catch_up: f64, skip: bool) -> f64 {
    let b = padded(curve, w.batch(i).len() as u32);
    let ctx = w.context(i);
    let k = c.steps;
    let t = match &c.lengths {
        None => curve.seconds(b, k, ctx, catch_up),
        Some(l) => curve.seconds_shape(b, k, Shape::of(l), ctx, catch_up),
    };
    if skip && k == 0 {
        t - curve.zero_step_extend(b, ctx)
    } else {
        t
    }
}

/// Expected tokens of a [`Choice`] given the iteration's acceptance probabilities `pi` (one row
/// per request of the batch, [`super::confidence`]).
pub fn choice_tokens_given(c: &Choice, pi: &[[f64; MAX_STEPS]]) -> f64 {
    pi.iter().enumerate().map(|(r, p)| tokens_given(p, c.lengths.as_ref().map_or(c.steps, |l| l[r]))).sum()
}

/// Expected tokens of a [`Choice`] in segment `i` (true acceptance).
pub fn choice_tokens(w: &Workload, i: usize, c: &Choice) -> f64 {
    match &c.lengths {
        None => w.expected_tokens(i, c.steps),
        Some(l) => w.batch(i).iter().zip(l).map(|(&r, &v)| w.requests[r as usize].expected_at(i as u32)[(v as usize).min(MAX_STEPS)]).sum(),
    }
}

/// The batch size `b` padded to the curve's graph sizes.
pub(crate) fn padded(curve: &CostCurve, b: u32) -> u32 {
    match curve.graph_sizes() {
        Some(g) => g.get(g.partition_point(|&s| s < b)).copied().unwrap_or(b),
        None => b,
    }
}

struct Tally {
    name: String,
    tokens: f64,
    seconds: f64,
    prev: Option<u32>,
    changes: u64,
    histogram: Vec<u64>,
    verify_histogram: Vec<u64>,
}

impl Tally {
    fn new(name: &str) -> Self {
        Tally {
            name: name.into(),
            tokens: 0.0,
            seconds: 0.0,
            prev: None,
            changes: 0,
            histogram: vec![0; MAX_STEPS + 1],
            verify_histogram: Vec::new(),
        }
    }

    fn add(&mut self, c: &Choice, tokens: f64, seconds: f64) {
        let k = c.steps;
        if let Some(l) = &c.lengths {
            self.verify_histogram.resize(MAX_STEPS + 1, 0);
            for &v in l {
                self.verify_histogram[(v as usize).min(MAX_STEPS)] += 1;
            }
        }
        self.tokens += tokens;
        self.seconds += seconds;
        if self.prev.is_some_and(|p| p != k) {
            self.changes += 1;
        }
        self.prev = Some(k);
        self.histogram[(k as usize).min(MAX_STEPS)] += 1;
    }

    fn finish(self, probes: u64) -> RunResult {
        RunResult {
            goodput: self.tokens / self.seconds,
            name: self.name,
            tokens: self.tokens,
            seconds: self.seconds,
            steps_changes: self.changes,
            probes,
            steps_histogram: self.histogram,
            verify_histogram: self.verify_histogram,
        }
    }
}

/// Runs `choose(segment, params)` through the workload (see the module docs) and tallies it. The
/// adaptive contenders report each iteration to their policy inside `choose`'s companion
/// `report`.
fn walk(
    w: &Workload,
    curve: &CostCurve,
    name: &str,
    opts: &RunOptions,
    mut choose: impl FnMut(usize) -> Choice,
    mut report: impl FnMut(usize, &Choice, f64, &Draws),
) -> Tally {
    let mut tally = Tally::new(name);
    let skip = opts.skip_zero_step_draft_extend;
    let mut zero_tokens = 0.0;
    let mut x = 0.0f64;
    while (x as usize) < w.len() {
        let i = x as usize;
        let b = w.batch(i).len();
        let mut c = choose(i);
        let mut d = draws(opts.seed, i, b, opts.noise);
        // draft confidences where a decision is per request (the others keep the rate model's
        // expectations and draws, exactly as before confidences existed)
        let conf = (c.lengths.is_some() || c.min_survival.is_some()).then(|| opts.confidence.draw(w, i, opts.seed));
        if let (Some(tau), Some(conf)) = (c.min_survival, &conf) {
            let budgets = c.lengths.take().unwrap_or_else(|| vec![c.steps; b]);
            c.lengths = Some(apply_stop(&budgets, &conf.q, tau));
        }
        let k = c.steps;
        let catch = if skip && k > 0 { std::mem::take(&mut zero_tokens) } else { 0.0 };
        if skip && k == 0 {
            zero_tokens += b as f64;
        }
        // a stop leaves every request drafting (the rule is applied after drafting)
        let t = match (&c.lengths, c.min_survival) {
            (Some(l), Some(_)) => {
                let shape = Shape { verified: l.iter().map(|&v| f64::from(v)).sum(), drafting: if k > 0 { b as f64 } else { 0.0 } };
                let (bp, ctx) = (padded(curve, b as u32), w.context(i));
                let extra = if skip && k == 0 { curve.zero_step_extend(bp, ctx) } else { 0.0 };
                curve.seconds_shape(bp, k, shape, ctx, catch) - extra
            }
            _ => choice_seconds(curve, w, i, &c, catch, skip),
        };
        // per-request lengths may depend on this iteration's confidences (a stop, the confidence
        // oracle): tokens given them (unbiased for the others too: pi has the rates for mean)
        let e = match &conf {
            Some(conf) => choice_tokens_given(&c, &conf.pi),
            None => choice_tokens(w, i, &c),
        };
        d.conf = conf;
        report(i, &c, t, &d);
        tally.add(&c, e, t);
        x += e / b as f64;
    }
    tally
}

/// Runs a contender that only chooses (no report) and tallies it (the oracles).
pub fn walk_choices(w: &Workload, curve: &CostCurve, name: &str, opts: &RunOptions, choose: impl FnMut(usize) -> Choice) -> RunResult {
    walk(w, curve, name, opts, choose, |_, _, _, _| {}).finish(0)
}

/// A fixed steps value for the whole run.
pub fn run_fixed(w: &Workload, curve: &CostCurve, k: u32, opts: &RunOptions) -> RunResult {
    walk(w, curve, &format!("fixed-{k}"), opts, |_| Choice::uniform(k), |_, _, _, _| {}).finish(0)
}

/// Iterations at the start of each profiled point that run cold (twice as slow: first-touch
/// allocations, autotuning, caches), which `profile_run_n_warmup` exists to skip.
const COLD_ITERATIONS: u32 = 3;

/// The startup profiling run of a config that asks for one: per (steps, batch size),
/// `profile_run_n_warmup` untimed then `profile_run_n_measure` timed noisy iterations at
/// `profile_run_seq_len` (default 2048) tokens per request; the mean is fed to the policy.
fn profile(params: &mut AdaptiveSpeculativeParams, curve: &CostCurve, opts: &RunOptions) {
    let Some(p) = params.config().profile().cloned() else { return };
    let sizes: Vec<u32> = p
        .profile_run_batch_sizes
        .clone()
        .or_else(|| curve.graph_sizes())
        .unwrap_or_else(|| vec![1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256])
        .into_iter()
        .filter(|&b| p.max_profile_run_batch_size.is_none_or(|m| b <= m))
        .collect();
    let seq = f64::from(p.profile_run_seq_len.unwrap_or(2048));
    let steps = params.candidate_steps().to_vec();
    let mut n = 0usize;
    for &k in &steps {
        for &b in &sizes {
            let reachable = params.cuda_graph_bs_for_step(k).is_none_or(|g| g.contains(&b));
            if !reachable {
                continue;
            }
            let mut total = 0.0;
            for j in 0..p.profile_run_n_warmup + p.profile_run_n_measure {
                n += 1;
                let f = draws(opts.seed ^ 0xF00D, n, 0, opts.noise).factor;
                let cold = if j < COLD_ITERATIONS { 2.0 } else { 1.0 };
                if j >= p.profile_run_n_warmup {
                    total += curve.seconds(padded(curve, b), k, f64::from(b) * seq, 0.0) * f * cold;
                }
            }
            params
                .set_profiled_cost(b, k, total / f64::from(p.profile_run_n_measure), (f64::from(b) * seq) as u64)
                .expect("positive seconds");
        }
    }
}

/// An adaptive policy built from `config`, started as the engine starts it (the middle of the
/// candidates' union), with the curve's graph sizes and the config's startup profiling.
pub fn run_adaptive(w: &Workload, curve: &CostCurve, name: &str, config: &AdaptiveConfig, opts: &RunOptions) -> RunResult {
    let union = config.candidate_union();
    let mut params = AdaptiveSpeculativeParams::new(union[union.len() / 2], config.clone());
    let graphs: Option<Vec<i64>> = curve.graph_sizes().map(|g| g.iter().map(|&x| i64::from(x)).collect());
    params.set_cuda_graph_bs(graphs.as_deref()).expect("graph sizes >= 1");
    profile(&mut params, curve, opts);
    let params = std::cell::RefCell::new(params);
    let per_request = matches!(&config.strategy, crate::config::Strategy::Goodput(g) if g.verify == crate::config::VerifyMode::PerRequest);
    let tally = walk(
        w,
        curve,
        name,
        opts,
        |i| {
            let ids: Vec<u64> = w.batch(i).iter().map(|&r| u64::from(r)).collect();
            let d = params
                .borrow_mut()
                .decide_requests(ids.len() as i64, Some(w.context(i) as u64), None, Some(&ids))
                .expect("batch >= 1");
            // a per-request strategy is told each request's verify (the engine's report path)
            let mut c = match d.verify {
                VerifyShape::PerRequest(l) => Choice::lengths(d.steps, l),
                VerifyShape::Uniform if per_request => Choice::lengths(d.steps, vec![d.steps; ids.len()]),
                VerifyShape::Uniform => Choice::uniform(d.steps),
            };
            c.min_survival = d.confidence_stop.map(|s| f64::from(s.min_survival));
            c
        },
        |i, c, t, r| {
            let batch = w.batch(i);
            let len = |j: usize| c.lengths.as_ref().map_or(c.steps, |l| l[j]);
            let accepted: Vec<i64> = batch
                .iter()
                .zip(&r.uniforms)
                .enumerate()
                .map(|(j, (&id, u))| {
                    let pi = r.conf.as_ref().map_or(w.requests[id as usize].alpha_at(i as u32), |c| &c.pi[j]);
                    (0..len(j) as usize).take_while(|&p| u[p] < pi[p]).count() as i64
                })
                .collect();
            let obs = Observation { seconds: Some(t * r.factor), context_tokens: Some(w.context(i) as u64), steps: Some(c.steps), catch_up_tokens: None };
            let mut p = params.borrow_mut();
            match &c.lengths {
                None => p.on_verify_complete_with(accepted, batch.len() as i64, obs),
                Some(l) => {
                    let q = &r.conf.as_ref().expect("per-request iterations draw confidences").q;
                    let probs: Vec<f64> = l.iter().zip(q).flat_map(|(&v, q)| q[..v as usize].iter().copied()).collect();
                    let mut at = 0;
                    let requests: Vec<RequestVerify<'_>> = (0..batch.len())
                        .map(|j| {
                            let n = l[j] as usize;
                            at += n;
                            RequestVerify { id: u64::from(batch[j]), steps: l[j], accepted: accepted[j], draft_probs: Some(&probs[at - n..at]) }
                        })
                        .collect();
                    p.on_verify_complete_requests(&requests, obs)
                }
            }
            .expect("valid report");
        },
    );
    let probes = params.borrow().goodput().map_or(0, |g| g.probes());
    tally.finish(probes)
}

/// The clairvoyant oracle: knows every request's true acceptance and the noise-free cost, and
/// maximises total tokens / total seconds over the run, choosing from `0..=max_steps`. With the
/// work fixed (every request's tokens must be emitted, [`super::workload`]), total seconds are
/// `sum_i b_i t_i(k_i) / E_i(k_i)` over the segments, so the maximum is reached by the steps of
/// highest `E_i(k) / t_i(k)` in each segment, which is what it runs. Returns its result and its
/// choice per segment.
pub fn run_oracle(w: &Workload, curve: &CostCurve, max_steps: u32, opts: &RunOptions) -> (RunResult, Vec<u32>) {
    let skip = opts.skip_zero_step_draft_extend;
    let best = |i: usize| {
        (0..=max_steps)
            .map(|k| (k, w.expected_tokens(i, k) / iteration_seconds(curve, w, i, k, 0.0, skip)))
            .max_by(|a, b| a.1.total_cmp(&b.1))
            .expect("steps 0 at least")
            .0
    };
    let choice: Vec<u32> = (0..w.len()).map(best).collect();
    let tally = walk(w, curve, "oracle", opts, |i| Choice::uniform(choice[i]), |_, _, _, _| {});
    (tally.finish(0), choice)
}

//! Issue 29's simulator figures: the `goodput` strategy with draft trees against the best fixed
//! shape (every chain `0..=7` and every tree shape the policy may choose, run for the whole
//! workload) and against the same strategy drafting chains only, at concurrency 1, 4, 16, 64
//! and 256 (the mixed request classes of issue 28, [`super::workload::MIXED`]), on each named
//! cost curve ([`super::tree`] says how trees are modelled).

use serde::Serialize;

use super::curve::CostCurve;
use super::tree::{run_tree_contender, Contender, Plan, TreeRunResult, TreeTruth};
use super::workload::Regime;
use crate::config::tree::TreeConfig;
use crate::config::{AdaptiveConfig, Strategy};
use crate::goodput::tree::candidate_shapes;

/// Concurrencies of the figures.
pub const CONCURRENCY: [u32; 5] = [1, 4, 16, 64, 256];
/// The tree bounds of the adaptive contender (SGLang's flagship EAGLE settings: top-k 8, up to
/// 64 draft tokens).
pub const TREE_BOUNDS: TreeConfig = TreeConfig { max_topk: 8, max_num_draft_tokens: 64 };

/// The mixed regime at `concurrency` (one of [`CONCURRENCY`]).
pub fn regime_at(concurrency: u32) -> Regime {
    let name = match concurrency {
        1 => "mixed-1",
        4 => "mixed-4",
        16 => "mixed-16",
        64 => "mixed-64",
        256 => "mixed-256",
        other => panic!("no mixed regime at concurrency {other}; one of {CONCURRENCY:?}"),
    };
    Regime { name, steady: true, description: "mixed request classes by arrival" }
}

/// specdial's default `goodput` config with the `tree` bounds `bounds`.
pub fn tree_config(bounds: TreeConfig) -> AdaptiveConfig {
    let mut c = AdaptiveConfig::default_config();
    if let Strategy::Goodput(g) = &mut c.strategy {
        g.tree = Some(bounds);
    }
    c
}

/// Every fixed plan compared: chains `0..=7` and the tree shapes of depths `1..=7` within
/// [`TREE_BOUNDS`] (the adaptive contender's choices).
pub fn fixed_plans() -> Vec<Plan> {
    fixed_plans_within(TREE_BOUNDS)
}

/// [`fixed_plans`] within `bounds`.
pub fn fixed_plans_within(bounds: TreeConfig) -> Vec<Plan> {
    let depths: Vec<u32> = (1..=7).collect();
    let trees = candidate_shapes(&depths, bounds.max_topk, bounds.max_num_draft_tokens);
    (0..=7).map(Plan::Chain).chain(trees.into_iter().map(Plan::Tree)).collect()
}

/// The tree bounds of a `goodput` config's `tree` key (None: another strategy, or no key).
pub fn tree_bounds(config: &AdaptiveConfig) -> Option<TreeConfig> {
    match &config.strategy {
        Strategy::Goodput(g) => g.tree,
        _ => None,
    }
}

/// `config` drafting chains only (its `tree` key removed).
pub fn without_trees(config: &AdaptiveConfig) -> AdaptiveConfig {
    let mut c = config.clone();
    if let Strategy::Goodput(g) = &mut c.strategy {
        g.tree = None;
    }
    c
}

/// One (concurrency, curve) cell.
#[derive(Debug, Clone, Serialize)]
pub struct TreeCase {
    pub concurrency: u32,
    pub curve: String,
    /// `goodput` with trees, and drafting chains only.
    pub trees: TreeRunResult,
    pub chains: TreeRunResult,
    /// The best fixed plan (chain or tree) and the best fixed chain.
    pub best_fixed: TreeRunResult,
    pub best_fixed_chain: TreeRunResult,
}

impl TreeCase {
    /// Adaptive trees over the best fixed plan.
    pub fn trees_over_best_fixed(&self) -> f64 {
        self.trees.goodput / self.best_fixed.goodput
    }

    /// Adaptive trees over adaptive chains.
    pub fn trees_over_chains(&self) -> f64 {
        self.trees.goodput / self.chains.goodput
    }

    /// One line of the report table.
    pub fn line(&self) -> String {
        format!(
            "{:16} c={:3} trees/best-fixed {:.3} trees/chains {:.3} best fixed {:14} ({:.3} of it by the best chain) trees ran {:.0}% tree iterations, mostly {}",
            self.curve,
            self.concurrency,
            self.trees_over_best_fixed(),
            self.trees_over_chains(),
            self.best_fixed.name,
            self.best_fixed_chain.goodput / self.best_fixed.goodput,
            100.0 * self.trees.tree_iterations as f64 / self.trees.iterations.max(1) as f64,
            self.trees.most_run,
        )
    }
}

/// Runs the cell at `concurrency` on `curve` over `segments` segments, with specdial's default
/// `goodput` config and [`TREE_BOUNDS`].
pub fn run_tree_case(concurrency: u32, curve_name: &str, curve: &CostCurve, segments: u32, seed: u64) -> TreeCase {
    run_tree_case_with(concurrency, curve_name, curve, segments, seed, &tree_config(TREE_BOUNDS))
}

/// [`run_tree_case`] with the adaptive config `config` (a `goodput` config with a `tree` key:
/// the trees contender; the same config without the key: the chains contender; the fixed plans
/// within its bounds). Panics without a `tree` key or at a concurrency not in [`CONCURRENCY`]
/// (callers check: `specdial policy simulate` names the allowed values).
pub fn run_tree_case_with(concurrency: u32, curve_name: &str, curve: &CostCurve, segments: u32, seed: u64, config: &AdaptiveConfig) -> TreeCase {
    let bounds = tree_bounds(config).expect("a goodput config with a tree key");
    let w = regime_at(concurrency).generate(segments, seed);
    let mut truth = TreeTruth::default();
    let trees = run_tree_contender(&w, curve, &Contender::Adaptive("goodput-trees".into(), config.clone()), &mut truth, seed);
    let chains = run_tree_contender(&w, curve, &Contender::Adaptive("goodput".into(), without_trees(config)), &mut truth, seed);
    let fixed: Vec<TreeRunResult> = fixed_plans_within(bounds).into_iter().map(|p| run_tree_contender(&w, curve, &Contender::Fixed(p), &mut truth, seed)).collect();
    let best = |chain_only: bool| {
        fixed
            .iter()
            .filter(|r| !chain_only || r.name.starts_with("chain-"))
            .max_by(|a, b| a.goodput.total_cmp(&b.goodput))
            .expect("fixed plans")
            .clone()
    };
    TreeCase { concurrency, curve: curve_name.into(), trees, chains, best_fixed: best(false), best_fixed_chain: best(true) }
}

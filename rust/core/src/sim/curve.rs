//! Cost curves of the simulator: the noise-free seconds of one decode iteration as a function of
//! the batch size `b` (padded to the CUDA-graph size where graphs replay), steps `k`, the batch's
//! context tokens `C` and the drafter's catch-up tokens.
//!
//! - **Roofline** of a named accelerator and model: every forward costs
//!   `max(flops / (0.7 peak), bytes / (0.8 bandwidth)) + launch overhead`: the target verify over
//!   `b (k + 1)` tokens (weights read once, the KV cache of `C` tokens read once, attention flops
//!   for `k + 1` queries per request), `k` EAGLE-head draft forwards over `b` tokens (one decoder
//!   layer and the LM head; its own one-layer KV), and the head's draft extend over the verified
//!   tokens (KV only). So drafting is nearly free at small batch (memory-bound), costs in
//!   proportion to tokens at large batch (compute-bound), and pays again at long context, where
//!   reading the KV cache dominates whatever `k` is (MagicDec, arXiv 2408.11049).
//! - **Linear**: a CPU-like curve, affine in tokens everywhere.
//! - **Table**: seconds the engine measured, read from the cost-table JSON file
//!   ([`CostTable`]), interpolated linearly in batch size and context and in steps.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// An accelerator: dense bf16 peak, memory bandwidth, per-forward launch overhead.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Gpu {
    pub name: &'static str,
    /// FLOP/s.
    pub flops: f64,
    /// Bytes/s.
    pub bandwidth: f64,
    /// Seconds per forward pass (graph replay, sampling kernels).
    pub overhead: f64,
}

/// A Llama-shaped target (bf16).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Model {
    pub name: &'static str,
    pub params: f64,
    pub layers: f64,
    pub hidden: f64,
    pub kv_heads: f64,
    pub head_dim: f64,
    pub vocab: f64,
    pub intermediate: f64,
}

pub const H200: Gpu = Gpu { name: "h200", flops: 989e12, bandwidth: 4.8e12, overhead: 60e-6 };
pub const A100: Gpu = Gpu { name: "a100", flops: 312e12, bandwidth: 2.0e12, overhead: 60e-6 };
pub const L40S: Gpu = Gpu { name: "l40s", flops: 362e12, bandwidth: 0.864e12, overhead: 60e-6 };

pub const LLAMA_8B: Model = Model {
    name: "llama3-8b",
    params: 8.03e9,
    layers: 32.0,
    hidden: 4096.0,
    kv_heads: 8.0,
    head_dim: 128.0,
    vocab: 128_256.0,
    intermediate: 14_336.0,
};
pub const LLAMA_70B: Model = Model {
    name: "llama3-70b",
    params: 70.6e9,
    layers: 80.0,
    hidden: 8192.0,
    kv_heads: 8.0,
    head_dim: 128.0,
    vocab: 128_256.0,
    intermediate: 28_672.0,
};

/// A roofline cost curve: `model` on `tp` copies of `gpu` (tensor parallel: flops and
/// bandwidth add up, one all-reduce pair per layer adds `tp_layer_overhead` seconds).
#[derive(Debug, Clone, PartialEq)]
pub struct Roofline {
    pub gpu: Gpu,
    pub tp: u32,
    pub model: Model,
}

impl Roofline {
    fn forward(&self, flops: f64, bytes: f64, extra: f64) -> f64 {
        let tp = f64::from(self.tp);
        let compute = flops / (0.7 * self.gpu.flops * tp);
        let memory = bytes / (0.8 * self.gpu.bandwidth * tp);
        compute.max(memory) + self.gpu.overhead + extra
    }

    fn allreduce(&self, layers: f64) -> f64 {
        if self.tp > 1 {
            layers * 2.0 * 8e-6
        } else {
            0.0
        }
    }

    /// Seconds of the draft extend a steps-0 iteration runs to keep the drafter warm.
    pub fn zero_step_extend(&self, b: f64, ctx: f64) -> f64 {
        let m = &self.model;
        let layer = 4.0 * m.hidden * m.hidden * 0.75 + 3.0 * m.hidden * m.intermediate;
        let kv = 2.0 * m.kv_heads * m.head_dim * 2.0;
        self.forward(2.0 * layer * b + 4.0 * m.hidden * ctx, 2.0 * layer + ctx * kv, 0.0)
    }

    /// Seconds of one iteration (see the module docs).
    pub fn seconds(&self, b: f64, k: u32, ctx: f64, catch_up: f64) -> f64 {
        self.seconds_shape(b, k, Shape::uniform(b, k), ctx, catch_up)
    }

    /// Seconds of one iteration at draft depth `k` whose requests verify and draft `shape`
    /// (issue 28: packed verify over `b + verified` tokens, `k` draft forwards over the drafting
    /// requests).
    pub fn seconds_shape(&self, b: f64, k: u32, shape: Shape, ctx: f64, catch_up: f64) -> f64 {
        let m = &self.model;
        let kf = f64::from(k);
        let kv_bytes_per_token_layer = 2.0 * m.kv_heads * m.head_dim * 2.0;
        // Target verify over b + verified tokens; KV of `ctx` tokens read once; attention flops
        // for the queries of each request.
        let n = b + shape.verified;
        let attn = 4.0 * m.hidden * m.layers * (n / b) * ctx;
        let verify = self.forward(
            2.0 * m.params * n + attn,
            2.0 * m.params + ctx * m.layers * kv_bytes_per_token_layer,
            self.allreduce(m.layers),
        );
        // EAGLE head: one decoder layer (+ the LM head when drafting).
        let layer = 4.0 * m.hidden * m.hidden * 0.75 + 3.0 * m.hidden * m.intermediate;
        let head = m.hidden * m.vocab;
        let drafting = shape.drafting / b;
        let draft_step = self.forward(
            2.0 * (layer + head) * shape.drafting + 4.0 * m.hidden * ctx * drafting,
            2.0 * (layer + head) + ctx * drafting * kv_bytes_per_token_layer,
            self.allreduce(1.0),
        );
        let extend_tokens = if k > 0 { n } else { b };
        let extend = |tokens: f64| {
            self.forward(2.0 * layer * tokens + 4.0 * m.hidden * ctx, 2.0 * layer + ctx * kv_bytes_per_token_layer, 0.0)
        };
        let catch = if catch_up > 0.0 { extend(catch_up) } else { 0.0 };
        verify + kf * draft_step + extend(extend_tokens) + catch
    }
}

/// What the requests of one iteration verify and draft: `verified` draft tokens in all (`b k`
/// for a uniform batch) and `drafting` requests that run the drafter (`b` when `k > 0`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Shape {
    pub verified: f64,
    pub drafting: f64,
}

impl Shape {
    /// Every request of `b` verifying `k`.
    pub fn uniform(b: f64, k: u32) -> Self {
        Shape { verified: b * f64::from(k), drafting: if k > 0 { b } else { 0.0 } }
    }

    /// Verify lengths `lengths` (a request at 0 does not draft).
    pub fn of(lengths: &[u32]) -> Self {
        Shape {
            verified: lengths.iter().map(|&v| f64::from(v)).sum(),
            drafting: lengths.iter().filter(|&&v| v > 0).count() as f64,
        }
    }
}

/// A CPU-like curve, affine in tokens: every forward costs `base` plus `per_token` per token,
/// attention `per_context_token` per query and context token.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Linear {
    pub target_base: f64,
    pub target_per_token: f64,
    pub draft_base: f64,
    pub draft_per_token: f64,
    pub per_context_token: f64,
}

/// Shaped after the 7M built-in target on the 2-core development VM (BENCHMARKS.md: ~30 ms per
/// batch-1 decode, ~2.1x for a 4-token verify at batch 64).
pub const CPU_LIKE: Linear = Linear {
    target_base: 0.040,
    target_per_token: 0.0004,
    draft_base: 0.002,
    draft_per_token: 0.00005,
    per_context_token: 2e-8,
};

impl Linear {
    /// Seconds of one iteration.
    pub fn seconds(&self, b: f64, k: u32, ctx: f64, catch_up: f64) -> f64 {
        self.seconds_shape(b, k, Shape::uniform(b, k), ctx, catch_up)
    }

    /// Seconds of one iteration of `shape` (see [`Roofline::seconds_shape`]).
    pub fn seconds_shape(&self, b: f64, k: u32, shape: Shape, ctx: f64, catch_up: f64) -> f64 {
        let kf = f64::from(k);
        let n = b + shape.verified;
        let verify = self.target_base + self.target_per_token * n + self.per_context_token * (n / b) * ctx;
        let draft = kf * (self.draft_base + self.draft_per_token * shape.drafting);
        let extend_tokens = if k > 0 { n } else { b } + catch_up;
        verify + draft + self.draft_base + self.draft_per_token * extend_tokens
    }
}

/// One measured entry of a cost table.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct CostEntry {
    /// Requests in the batch (the padded graph size where graphs replay).
    pub batch_size: u32,
    /// `speculative_num_steps`.
    pub steps: u32,
    /// KV tokens per request before the iteration (0 when not measured).
    #[serde(default)]
    pub context_per_request: f64,
    /// Mean seconds of one decode iteration.
    pub seconds: f64,
}

/// The cost-table file the engine writes and `specdial policy simulate` / `policy replay` read:
///
/// ```json
/// {"device": "cpu (2 cores)", "model": "specdial-default (7M) + EAGLE head",
///  "graph_bs": null,
///  "entries": [{"batch_size": 1, "steps": 0, "context_per_request": 128, "seconds": 0.031}, ...]}
/// ```
///
/// `graph_bs`: the CUDA-graph batch sizes the measurements were padded to (null: none).
/// Lookups interpolate linearly in batch size and in context per request (extrapolating from the
/// nearest two points, never below 1 % of the smallest entry) and in steps between measured
/// values.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CostTable {
    #[serde(default)]
    pub device: String,
    #[serde(default)]
    pub model: String,
    #[serde(default)]
    pub graph_bs: Option<Vec<u32>>,
    pub entries: Vec<CostEntry>,
}

fn lerp(points: &[(f64, f64)], x: f64) -> f64 {
    match points {
        [] => f64::NAN,
        [(_, y)] => *y,
        _ => {
            let i = points.partition_point(|p| p.0 < x).clamp(1, points.len() - 1);
            let (x0, y0) = points[i - 1];
            let (x1, y1) = points[i];
            if (x1 - x0).abs() < 1e-12 {
                y0
            } else {
                y0 + (y1 - y0) * (x - x0) / (x1 - x0)
            }
        }
    }
}

impl CostTable {
    /// Parses and checks the JSON file's text. Errors name the entry and the field.
    pub fn from_json(text: &str) -> Result<Self, String> {
        let t: CostTable = serde_json::from_str(text).map_err(|e| format!("cost table is not valid: {e}"))?;
        if t.entries.is_empty() {
            return Err("cost table has no entries".into());
        }
        for (i, e) in t.entries.iter().enumerate() {
            if e.batch_size < 1 {
                return Err(format!("entries[{i}].batch_size must be >= 1, got {}", e.batch_size));
            }
            if !(e.seconds.is_finite() && e.seconds > 0.0) {
                return Err(format!("entries[{i}].seconds must be a finite number > 0, got {}", e.seconds));
            }
            if !(e.context_per_request.is_finite() && e.context_per_request >= 0.0) {
                return Err(format!("entries[{i}].context_per_request must be >= 0, got {}", e.context_per_request));
            }
        }
        Ok(t)
    }

    /// Steps values present, ascending.
    pub fn steps(&self) -> Vec<u32> {
        let mut s: Vec<u32> = self.entries.iter().map(|e| e.steps).collect();
        s.sort_unstable();
        s.dedup();
        s
    }

    fn at_steps(&self, k: u32, b: f64, ctx_per_request: f64) -> f64 {
        // context -> [(b, seconds)]
        let mut by_ctx: BTreeMap<u64, Vec<(f64, f64)>> = BTreeMap::new();
        for e in self.entries.iter().filter(|e| e.steps == k) {
            by_ctx.entry(e.context_per_request.to_bits()).or_default().push((f64::from(e.batch_size), e.seconds));
        }
        let mut ctx_points: Vec<(f64, f64)> = by_ctx
            .into_iter()
            .map(|(c, mut pts)| {
                pts.sort_by(|a, b| a.0.total_cmp(&b.0));
                (f64::from_bits(c), lerp(&pts, b))
            })
            .collect();
        ctx_points.sort_by(|a, b| a.0.total_cmp(&b.0));
        lerp(&ctx_points, ctx_per_request)
    }

    /// Seconds at `(b, k)` with `ctx` context tokens in all (catch-up is not measured: 0).
    pub fn seconds(&self, b: f64, k: u32, ctx: f64) -> f64 {
        self.seconds_at(b, f64::from(k), ctx)
    }

    /// [`Self::seconds`] at a fractional depth `k` (interpolated between measured steps): a
    /// per-request iteration is read as the uniform one with as many verify tokens (the table
    /// has no draft-only measurements).
    pub fn seconds_at(&self, b: f64, k: f64, ctx: f64) -> f64 {
        let per_request = if b > 0.0 { ctx / b } else { 0.0 };
        let steps = self.steps();
        let t = if k.fract() == 0.0 && steps.contains(&(k as u32)) {
            self.at_steps(k as u32, b, per_request)
        } else {
            let pts: Vec<(f64, f64)> =
                steps.iter().map(|&s| (f64::from(s), self.at_steps(s, b, per_request))).collect();
            lerp(&pts, k)
        };
        let floor = 0.01 * self.entries.iter().map(|e| e.seconds).fold(f64::INFINITY, f64::min);
        t.max(floor)
    }
}

/// A named cost curve.
#[derive(Debug, Clone, PartialEq)]
pub enum CostCurve {
    Roofline(Roofline),
    Linear(Linear),
    Table(CostTable),
}

/// The CUDA-graph batch sizes an engine with 256 running requests captures by default.
pub fn default_graph_sizes() -> Vec<u32> {
    let mut v = vec![1, 2, 4, 8];
    v.extend((16..=256).step_by(8));
    v
}

impl CostCurve {
    /// The named curves: `h200-llama8b`, `a100-llama8b`, `l40s-llama8b`, `h200x4-llama70b`
    /// (rooflines with an EAGLE head) and `cpu-like` (linear).
    pub fn named(name: &str) -> Option<CostCurve> {
        let roof = |gpu, tp, model| Some(CostCurve::Roofline(Roofline { gpu, tp, model }));
        match name {
            "h200-llama8b" => roof(H200, 1, LLAMA_8B),
            "a100-llama8b" => roof(A100, 1, LLAMA_8B),
            "l40s-llama8b" => roof(L40S, 1, LLAMA_8B),
            "h200x4-llama70b" => roof(H200, 4, LLAMA_70B),
            "cpu-like" => Some(CostCurve::Linear(CPU_LIKE)),
            _ => None,
        }
    }

    /// Names accepted by [`CostCurve::named`].
    pub const NAMES: [&'static str; 5] = ["h200-llama8b", "a100-llama8b", "l40s-llama8b", "h200x4-llama70b", "cpu-like"];

    /// CUDA-graph sizes the batch is padded to (accelerators: [`default_graph_sizes`]; a table:
    /// its `graph_bs`; CPU: none).
    pub fn graph_sizes(&self) -> Option<Vec<u32>> {
        match self {
            CostCurve::Roofline(_) => Some(default_graph_sizes()),
            CostCurve::Linear(_) => None,
            CostCurve::Table(t) => t.graph_bs.clone(),
        }
    }

    /// The part of a steps-0 iteration spent on the drafter's extend (0 for a table, which
    /// measured whatever the engine ran).
    pub fn zero_step_extend(&self, b: u32, ctx: f64) -> f64 {
        let b = f64::from(b);
        match self {
            CostCurve::Roofline(r) => r.zero_step_extend(b, ctx),
            CostCurve::Linear(l) => l.draft_base + l.draft_per_token * b,
            CostCurve::Table(_) => 0.0,
        }
    }

    /// Noise-free seconds of one decode iteration at depth `k` whose requests verify and draft
    /// `shape` (a table: the uniform iteration at depth `verified / b`).
    pub fn seconds_shape(&self, b: u32, k: u32, shape: Shape, ctx: f64, catch_up: f64) -> f64 {
        let b = f64::from(b);
        match self {
            CostCurve::Roofline(r) => r.seconds_shape(b, k, shape, ctx, catch_up),
            CostCurve::Linear(l) => l.seconds_shape(b, k, shape, ctx, catch_up),
            CostCurve::Table(t) => t.seconds_at(b, shape.verified / b, ctx),
        }
    }

    /// Noise-free seconds of one decode iteration (see the module docs).
    pub fn seconds(&self, b: u32, k: u32, ctx: f64, catch_up: f64) -> f64 {
        let b = f64::from(b);
        match self {
            CostCurve::Roofline(r) => r.seconds(b, k, ctx, catch_up),
            CostCurve::Linear(l) => l.seconds(b, k, ctx, catch_up),
            CostCurve::Table(t) => t.seconds(b, k, ctx),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roofline_has_the_known_shape() {
        let c = CostCurve::named("h200-llama8b").unwrap();
        let t = |b, k, ctx| c.seconds(b, k, ctx, 0.0);
        // Batch 1, short context: memory-bound, ~4 ms; a draft step (the head and its LM head)
        // adds about a tenth.
        let t10 = t(1, 0, 1000.0);
        assert!((0.003..0.007).contains(&t10), "{t10}");
        assert!(t(1, 7, 1000.0) < 1.9 * t10);
        // Batch 256, short context: compute-bound, k = 3 costs several times k = 0.
        assert!(t(256, 3, 256.0 * 256.0) > 2.5 * t(256, 0, 256.0 * 256.0));
        // Long context at batch 64: KV reads dominate, drafting is relatively cheap again.
        let short = t(64, 3, 64.0 * 512.0) / t(64, 0, 64.0 * 512.0);
        let long = t(64, 3, 64.0 * 32768.0) / t(64, 0, 64.0 * 32768.0);
        assert!(long < 0.8 * short, "{short} {long}");
    }

    #[test]
    fn table_interpolates_and_checks_its_entries() {
        let text = r#"{"graph_bs": null, "entries": [
            {"batch_size": 1, "steps": 0, "seconds": 0.01}, {"batch_size": 9, "steps": 0, "seconds": 0.02},
            {"batch_size": 1, "steps": 2, "seconds": 0.02}, {"batch_size": 9, "steps": 2, "seconds": 0.06}]}"#;
        let t = CostTable::from_json(text).unwrap();
        assert!((t.seconds(5.0, 0, 0.0) - 0.015).abs() < 1e-12);
        assert!((t.seconds(5.0, 1, 0.0) - 0.0275).abs() < 1e-12); // between steps 0 and 2
        assert!((t.seconds(17.0, 2, 0.0) - 0.10).abs() < 1e-12); // extrapolated
        assert!(CostTable::from_json(r#"{"entries": []}"#).unwrap_err().contains("no entries"));
        assert!(CostTable::from_json(r#"{"entries": [{"batch_size": 1, "steps": 0, "seconds": -1}]}"#)
            .unwrap_err()
            .contains("entries[0].seconds"));
    }
}

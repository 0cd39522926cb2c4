//! One decode iteration's decision: route the batch size, choose the steps, feed the verify's
//! accepted drafts back (`decide` + `on_verify_complete`), at batch sizes 1, 8, 64 and 256, for
//! the `ema` strategy (SGLang's default config) and the `goodput` strategy (the default config,
//! fed measured seconds and context; its cost model first warmed over every graph size so the
//! decision sees a populated model, as in a server that has run a while), `goodput-trees`,
//! the same with draft trees up to top-k 8 and 64 draft tokens (issue 29: the shapes' scores on
//! top of the chains'; compare it with `goodput` at each batch size). `goodput-per-request`
//! and `goodput-per-request-auto` (issue 28: `"verify": "per_request"`, `"min_survival"` null and
//! `"auto"`) decide with the batch's request ids and are told each request's verify with its
//! draft probabilities, at 64 and 256.

use criterion::{black_box, criterion_group, criterion_main, BenchmarkId, Criterion};
use specdial_core::sim::tree_report::{tree_config, TREE_BOUNDS};
use specdial_core::strategies::RequestVerify;
use specdial_core::{AdaptiveConfig, AdaptiveSpeculativeParams, Observation, VerifyShape};

const GRAPHS: [i64; 15] = [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256];

fn params(config: AdaptiveConfig) -> AdaptiveSpeculativeParams {
    let mut p = AdaptiveSpeculativeParams::new(3, config);
    p.set_cuda_graph_bs(Some(&GRAPHS)).unwrap();
    p
}

/// One iteration at batch size `bs`: decide, then report `pattern` capped at the steps.
fn iteration(p: &mut AdaptiveSpeculativeParams, bs: usize, pattern: &[i64], accepted: &mut [i64], seconds: Option<f64>) {
    let ctx = Some(1000 * bs as u64);
    let d = p.decide(black_box(bs as i64), ctx).unwrap();
    for (a, q) in accepted.iter_mut().zip(pattern) {
        *a = q % (i64::from(d.steps) + 1);
    }
    let obs = Observation { seconds, context_tokens: ctx, steps: None, catch_up_tokens: None };
    black_box(p.on_verify_complete_with(accepted.iter().copied(), bs as i64, obs).unwrap());
}

fn decision(c: &mut Criterion) {
    let mut group = c.benchmark_group("decision");
    for (name, config, seconds) in [
        ("ema", AdaptiveConfig::ema_default(), None),
        ("goodput", AdaptiveConfig::default_config(), Some(0.01)),
        ("goodput-trees", tree_config(TREE_BOUNDS), Some(0.01)),
    ] {
        for bs in [1usize, 8, 64, 256] {
            let mut p = params(config.clone());
            // Deterministic accepted counts, always within the chosen steps.
            let pattern: Vec<i64> = (0..256).map(|i| (i * 7 + 3) % 8).collect();
            let mut accepted = vec![0i64; 256];
            for _ in 0..20 {
                for &g in &GRAPHS {
                    let g = g as usize;
                    iteration(&mut p, g, &pattern[..g], &mut accepted[..g], seconds.map(|s| s * (1.0 + g as f64 / 64.0)));
                }
            }
            group.bench_with_input(BenchmarkId::new(name, bs), &bs, |b, &bs| {
                b.iter(|| iteration(&mut p, bs, &pattern[..bs], &mut accepted[..bs], seconds))
            });
        }
    }
    group.finish();
}

/// One per-request iteration at batch size `bs`: decide with ids, then report each request's
/// verify (its length, `pattern` capped at it, draft probabilities `probs`).
fn iteration_requests(p: &mut AdaptiveSpeculativeParams, ids: &[u64], pattern: &[i64], probs: &[f64]) {
    let bs = ids.len();
    let ctx = Some(1000 * bs as u64);
    let d = p.decide_requests(black_box(bs as i64), ctx, None, Some(ids)).unwrap();
    let requests: Vec<RequestVerify<'_>> = (0..bs)
        .map(|i| {
            let v = match &d.verify {
                VerifyShape::PerRequest(l) => l[i],
                VerifyShape::Uniform => d.steps,
            };
            // a confidence stop cuts the weaker half of the requests after one draft
            let v = if d.confidence_stop.is_some() && i % 2 == 1 { v.min(1) } else { v };
            RequestVerify { id: ids[i], steps: v, accepted: pattern[i] % (i64::from(v) + 1), draft_probs: Some(&probs[..v as usize]) }
        })
        .collect();
    let obs = Observation { seconds: Some(0.01 * (1.0 + bs as f64 / 64.0)), context_tokens: ctx, steps: Some(d.steps), catch_up_tokens: None };
    black_box(p.on_verify_complete_requests(&requests, obs).unwrap());
}

fn decision_per_request(c: &mut Criterion) {
    let mut group = c.benchmark_group("decision");
    let auto = r#"{"strategy": "goodput", "candidate_steps": [0, 1, 2, 3, 4, 5, 6, 7], "verify": "per_request", "min_survival": "auto"}"#;
    let rates = r#"{"strategy": "goodput", "candidate_steps": [0, 1, 2, 3, 4, 5, 6, 7], "verify": "per_request"}"#;
    for (name, config) in [("goodput-per-request", rates), ("goodput-per-request-auto", auto)] {
        for bs in [64usize, 256] {
            let mut p = params(AdaptiveConfig::from_json(config).unwrap());
            let pattern: Vec<i64> = (0..256).map(|i| (i * 7 + 3) % 8).collect();
            let probs: Vec<f64> = (0..32).map(|j| 0.95 - 0.04 * f64::from(j % 8)).collect();
            let ids: Vec<u64> = (0..bs as u64).collect();
            for _ in 0..50 {
                iteration_requests(&mut p, &ids, &pattern, &probs);
            }
            group.bench_with_input(BenchmarkId::new(name, bs), &bs, |b, _| b.iter(|| iteration_requests(&mut p, &ids, &pattern, &probs)));
        }
    }
    group.finish();
}

criterion_group!(benches, decision, decision_per_request);
criterion_main!(benches);

//! One decode iteration's decision: route the batch size, choose the steps, feed the verify's
//! accepted drafts back (`decide` + `on_verify_complete`), at batch sizes 1, 8, 64 and 256, for
//! the `ema` strategy (SGLang's default config) and the `goodput` strategy (the default config,
//! fed measured seconds and context; its cost model first warmed over every graph size so the
//! decision sees a populated model, as in a server that has run a while), and `goodput-trees`,
//! the same with draft trees up to top-k 8 and 64 draft tokens (issue 29: the shapes' scores on
//! top of the chains'; compare it with `goodput` at each batch size).

use criterion::{black_box, criterion_group, criterion_main, BenchmarkId, Criterion};
use specdial_core::sim::tree_report::{tree_config, TREE_BOUNDS};
use specdial_core::{AdaptiveConfig, AdaptiveSpeculativeParams, Observation};

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

criterion_group!(benches, decision);
criterion_main!(benches);

//! One decode iteration's decision: route the batch size, choose the steps, feed the verify's
//! accepted drafts back (`decide` + `on_verify_complete`), at batch sizes 1, 8, 64 and 256.

use criterion::{black_box, criterion_group, criterion_main, BenchmarkId, Criterion};
use specdial_core::{AdaptiveConfig, AdaptiveSpeculativeParams};

fn decision(c: &mut Criterion) {
    let mut group = c.benchmark_group("decision");
    for bs in [1usize, 8, 64, 256] {
        let mut params = AdaptiveSpeculativeParams::new(3, AdaptiveConfig::default_config());
        params
            .set_cuda_graph_bs(Some(&[1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256]))
            .unwrap();
        // Deterministic accepted counts, always within the chosen steps.
        let pattern: Vec<i64> = (0..bs as i64).map(|i| (i * 7 + 3) % 8).collect();
        let mut accepted = vec![0i64; bs];
        group.bench_with_input(BenchmarkId::from_parameter(bs), &bs, |b, &bs| {
            b.iter(|| {
                let d = params.decide(black_box(bs as i64)).unwrap();
                for (a, p) in accepted.iter_mut().zip(&pattern) {
                    *a = p % (d.steps as i64 + 1);
                }
                black_box(params.on_verify_complete(accepted.iter().copied(), bs as i64).unwrap())
            })
        });
    }
    group.finish();
}

criterion_group!(benches, decision);
criterion_main!(benches);

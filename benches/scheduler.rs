//! Scheduler hot path: one decode iteration's `schedule()` plus its `report()` (which also
//! returns the stats and slot states after it), with 256 running requests.
//!
//! - `plan_report/256/steps=K`, K in 0, 3, 7: the plan the engine asks for (rows, no
//!   per-token context arrays); requests hold 1..512 prompt tokens (about 256 on average),
//!   page size 16; the report accepts a varying
//!   number of drafts per request. Every 8 iterations the state restarts from a clone (not
//!   measured), so contexts grow by at most 8 * (steps + 1) tokens.
//! - `plan_only/256/steps=K`: `schedule()` alone, to split the cost.
//! - `plan_report_kv_layout/256/steps=3`: with `plan_kv_layout` on, as for a backend that plans
//!   from the scheduler's page tables (`kv_indices` then has ~66k entries).
//! - `plan_report_tree/256/depth=D,topk=K,nodes=N` (issue 29): a draft-tree iteration, which
//!   also reserves `N` scratch KV slots per request (`scratch_loc`, `256 * N` slots from the page
//!   pool) and frees them at the report; (3, 4, 8) against `steps=3` is the cost of the scratch
//!   slots, (7, 8, 64) the largest tree.

use std::time::{Duration, Instant};

use criterion::measurement::WallTime;
use criterion::{black_box, criterion_group, criterion_main, BenchmarkGroup, Criterion, Throughput};
use specdial_core::scheduler::{PlanKind, Scheduler, SchedulerConfig, StepsSource};

const BATCH: usize = 256;

/// 256 running requests, prefilled and one decode iteration in, at fixed `steps`.
fn running_state(steps: u32, kv_layout: bool) -> Scheduler {
    let cfg = SchedulerConfig {
        max_running_requests: BATCH as u32,
        max_queued_requests: BATCH as u32,
        max_prefill_tokens: 1 << 20,
        context_length: 4096,
        num_pages: 16_384,
        page_size: 16,
        eos_token_ids: vec![2],
        record_trace: false,
        chunked_prefill_size: None,
        skip_zero_step_draft_extend: true,
        enable_prefix_caching: false,
    };
    let mut s = Scheduler::new(cfg, StepsSource::Fixed(steps)).unwrap();
    s.set_plan_kv_layout(kv_layout);
    for i in 0..BATCH {
        let prompt: Vec<i64> = (0..1 + (i * 37) % 512)
            .map(|t| 10 + t as i64 % 1000)
            .collect();
        s.add_request(prompt, 1 << 20, vec![], true).unwrap();
    }
    for _ in 0..3 {
        let plan = s.schedule().unwrap().unwrap();
        let (tokens, offsets, accepted) = results(&plan);
        let acc = (plan.kind == PlanKind::Decode).then_some(&accepted[..]);
        s.report(&tokens, &offsets, acc).unwrap();
    }
    assert_eq!(s.num_running(), BATCH);
    s
}

/// Fake results for `plan`: request `b` accepts `b % (steps + 1)` drafts.
fn results(plan: &specdial_core::Plan) -> (Vec<i64>, Vec<i64>, Vec<i64>) {
    let (mut tokens, mut offsets, mut accepted) = (vec![], vec![0], vec![]);
    for b in 0..plan.batch_size() {
        match plan.kind {
            PlanKind::Prefill => {
                tokens.extend(std::iter::repeat(7).take(plan.sample_first[b] as usize))
            }
            PlanKind::Decode => {
                let a = b as i64 % (plan.steps_per_request[b] + 1);
                tokens.extend((0..=a).map(|t| 11 + t));
                accepted.push(a);
            }
        }
        offsets.push(tokens.len() as i64);
    }
    (tokens, offsets, accepted)
}

/// Times `iters` iterations of `body`, restarting from a warmed clone of `base` every
/// `CHUNK` iterations (untimed), so contexts grow by at most `CHUNK * (steps + 1)` tokens.
fn timed(base: &Scheduler, iters: u64, mut body: impl FnMut(&mut Scheduler)) -> Duration {
    const CHUNK: u64 = 8;
    let mut total = Duration::ZERO;
    let mut s = base.clone();
    for i in 0..iters {
        if i % CHUNK == 0 {
            s = base.clone();
            body(&mut s); // untimed: the clone's first pushes reallocate
        }
        let t = Instant::now();
        body(&mut s);
        total += t.elapsed();
    }
    total
}

/// `schedule()` + `report()` of one steady decode iteration from `base` (`plan`: its plan, whose
/// emitted tokens and accepted drafts are reported).
fn bench_plan_report(group: &mut BenchmarkGroup<'_, WallTime>, name: String, base: &Scheduler, plan: &specdial_core::Plan) {
    let (tokens, offsets, accepted) = results(plan);
    group.bench_function(name, |b| {
        b.iter_custom(|iters| {
            timed(base, iters, |s| {
                let plan = s.schedule().unwrap().unwrap();
                let out = s.report(black_box(&tokens), &offsets, Some(&accepted)).unwrap();
                black_box((plan, out));
            })
        })
    });
}

fn bench(c: &mut Criterion) {
    let mut group = c.benchmark_group("scheduler");
    group.throughput(Throughput::Elements(BATCH as u64));
    for steps in [0u32, 3, 7] {
        let base = running_state(steps, false);
        let plan = base.clone().schedule().unwrap().unwrap();
        assert_eq!(
            (plan.kind, plan.steps, plan.batch_size()),
            (PlanKind::Decode, steps, BATCH)
        );
        assert!(plan
            .steps_per_request
            .iter()
            .all(|&s| s == i64::from(steps)));
        let (tokens, offsets, accepted) = results(&plan);
        bench_plan_report(&mut group, format!("plan_report/{BATCH}/steps={steps}"), &base, &plan);
        group.bench_function(format!("plan_only/{BATCH}/steps={steps}"), |b| {
            // The report is untimed here: only schedule() is measured.
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                let mut s = base.clone();
                for i in 0..iters {
                    if i % 8 == 0 {
                        s = base.clone();
                        s.schedule().unwrap();
                        s.report(&tokens, &offsets, Some(&accepted)).unwrap();
                    }
                    let t = Instant::now();
                    let plan = black_box(s.schedule().unwrap().unwrap());
                    total += t.elapsed();
                    drop(plan);
                    s.report(&tokens, &offsets, Some(&accepted)).unwrap();
                }
                total
            })
        });
    }
    let base = running_state(3, true);
    let plan = base.clone().schedule().unwrap().unwrap();
    assert!(plan.kv_indices.len() > 60_000);
    bench_plan_report(&mut group, format!("plan_report_kv_layout/{BATCH}/steps=3"), &base, &plan);
    for (depth, topk, count) in [(3u32, 4u32, 9u32), (7, 8, 65)] {
        let mut base = running_state(depth, false);
        base.set_draft_tree(topk, Some(count)).unwrap();
        let plan = base.clone().schedule().unwrap().unwrap();
        let nodes = count - 1;
        assert_eq!((plan.steps, plan.tree_topk, plan.num_draft_tokens), (depth, topk, nodes));
        assert_eq!(plan.scratch_loc.len(), BATCH * nodes as usize);
        let name = format!("plan_report_tree/{BATCH}/depth={depth},topk={topk},nodes={nodes}");
        bench_plan_report(&mut group, name, &base, &plan);
    }
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2))
        .sample_size(30);
    targets = bench
}
criterion_main!(benches);

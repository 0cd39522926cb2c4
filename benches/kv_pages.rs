//! KV page allocator throughput.
//!
//! - `decode_iteration/256`: one speculative decode iteration of 256 live requests: each
//!   reserves `steps + 1` slots (1..8 tokens) into one batch-wide slot array, then truncates the
//!   rejected tail. Requests that reach 512 tokens are freed and re-admitted, so the pool stays
//!   in a steady state with pages crossing page boundaries every few iterations.
//! - `decode_iteration_vec/256`: the same with `reserve` returning a fresh `Vec` per request
//!   (what the Python binding does).
//! - `admit_prefill_free/256`: add 256 requests, reserve a 100-token prefill each, free them all.

use std::time::Duration;

use criterion::{black_box, criterion_group, criterion_main, Criterion, Throughput};
use specdial_core::kv::PagePool;

const BATCH: u64 = 256;
const PAGE_SIZE: u32 = 16;
const NUM_PAGES: u32 = 16_384;
const MAX_LEN: u64 = 512;

/// Deterministic (steps + 1, accepted) pattern per request and iteration: 1..=8 tokens
/// reserved, 0..steps drafts accepted.
fn pattern(id: u64, iter: u64) -> (u64, u64) {
    let x = id.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ iter.wrapping_mul(0xD1B5_4A32_D192_ED03);
    let x = x ^ (x >> 29);
    let n = 1 + x % 8;
    let accepted = (x >> 8) % n; // drafts accepted, 0..steps
    (n, accepted)
}

fn live_pool() -> PagePool {
    let mut pool = PagePool::new(NUM_PAGES, PAGE_SIZE).unwrap();
    for id in 0..BATCH {
        pool.add_request(id).unwrap();
        pool.reserve(id, 1 + id % 100).unwrap();
    }
    pool
}

/// One decode iteration; `into` selects the batch-buffer path or the Vec-per-request path.
fn iteration(pool: &mut PagePool, iter: u64, batch_slots: &mut Vec<i64>, into: bool) {
    batch_slots.clear();
    for id in 0..BATCH {
        let (n, accepted) = pattern(id, iter);
        let len = pool.len(id).unwrap();
        if into {
            pool.reserve_into(id, n, batch_slots).unwrap();
        } else {
            black_box(pool.reserve(id, n).unwrap());
        }
        // Keep the last accepted token plus the accepted drafts; drop the rejected tail.
        let new_len = len + accepted + 1;
        pool.truncate(id, new_len).unwrap();
        if new_len >= MAX_LEN {
            pool.free_request(id).unwrap();
            pool.add_request(id).unwrap();
            pool.reserve(id, 1 + iter % 100).unwrap();
        }
    }
    black_box(&*batch_slots);
}

fn kv_pages(c: &mut Criterion) {
    let mut group = c.benchmark_group("kv_pages");
    group.throughput(Throughput::Elements(BATCH));

    for (name, into) in [
        ("decode_iteration/256", true),
        ("decode_iteration_vec/256", false),
    ] {
        let mut pool = live_pool();
        let mut batch_slots = Vec::with_capacity(8 * BATCH as usize);
        let mut iter = 0u64;
        group.bench_function(name, |b| {
            b.iter(|| {
                iteration(&mut pool, iter, &mut batch_slots, into);
                iter += 1;
            })
        });
        // Nothing leaked after the whole run.
        for id in 0..BATCH {
            pool.free_request(id).unwrap();
        }
        assert_eq!(pool.num_free_pages(), NUM_PAGES);
    }

    let mut pool = PagePool::new(NUM_PAGES, PAGE_SIZE).unwrap();
    group.bench_function("admit_prefill_free/256", |b| {
        b.iter(|| {
            for id in 0..BATCH {
                pool.add_request(id).unwrap();
                black_box(pool.reserve(id, 100).unwrap());
            }
            for id in 0..BATCH {
                pool.free_request(id).unwrap();
            }
        })
    });
    assert_eq!(pool.num_free_pages(), NUM_PAGES);
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2))
        .sample_size(30);
    targets = kv_pages
}
criterion_main!(benches);
